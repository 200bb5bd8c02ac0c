"""`jaccum.pipeline` on 8 simulated CPU devices: (4 stages) and (2 data × 4 stages).

The reference is the sequential model on the whole batch, on one device:
`for s in range(S): x = stage_fn(params[s], x)`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, max_rel_error
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaccum
import jaccum.inspect

NUM_STAGES = 4
WIDTH = 8
ROWS_PER_SHARD = 104  # Divisible by K = 1, S, 2S and 3S + 1 = 13.
SCHEDULES = {
  "gpipe": {},
  "gpipe+remat": {"remat": True},
  "1f1b": {"schedule": "1f1b"},
  "1f1b+remat": {"schedule": "1f1b", "remat": True},
}
RTOL = {jnp.float32: 1e-5, jnp.float64: 1e-12}


def stage_fn(params, x):
  """A residual MLP block; its params are a nested dict with a scalar leaf."""
  hidden = jnp.tanh(x @ params["mlp"]["w_in"] + params["mlp"]["b"])
  return x + params["scale"] * (hidden @ params["w_out"])


def init_params(key, dtype):
  k_in, k_b, k_out, k_scale = jax.random.split(key, 4)
  shape = (NUM_STAGES,)
  return {
    "mlp": {
      "w_in": jax.random.normal(k_in, (*shape, WIDTH, 2 * WIDTH), dtype) / 3,
      "b": jax.random.normal(k_b, (*shape, 2 * WIDTH), dtype),
    },
    "w_out": jax.random.normal(k_out, (*shape, 2 * WIDTH, WIDTH), dtype) / 4,
    "scale": 1 + jax.random.uniform(k_scale, shape, dtype),
  }


def sequential(params, x):
  for s in range(NUM_STAGES):
    x = stage_fn(jax.tree.map(lambda p, s=s: p[s], params), x)
  return x


def loss_and_output(apply):
  """A loss around the model, returning the model's output as aux."""

  def loss(params, x):
    y = apply(params, x)
    weights = jnp.arange(1, WIDTH + 1, dtype=y.dtype) / WIDTH
    return jnp.mean(jnp.sin(y) @ weights), y

  return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def make_mesh(name, axis_type=AxisType.Auto):
  if name == "stage":
    return jax.make_mesh(
      (NUM_STAGES,),
      ("stage",),
      devices=jax.devices()[:NUM_STAGES],
      axis_types=(axis_type,),
    )
  return jax.make_mesh((2, NUM_STAGES), ("data", "stage"), axis_types=(axis_type,) * 2)


def make_problem(mesh, dtype):
  num_shards = mesh.size // NUM_STAGES
  params = init_params(jax.random.key(0), dtype)
  x = jax.random.normal(jax.random.key(1), (ROWS_PER_SHARD * num_shards, WIDTH), dtype)
  return params, x


@functools.cache
def reference(mesh_name, dtype):
  """The sequential model's loss, output and gradients, on one device."""
  params, x = make_problem(make_mesh(mesh_name), dtype)
  return jax.device_get(jax.jit(loss_and_output(sequential))(params, x))


def check_against_sequential(
  mesh_name, dtype, num_microbatches, options, *, jit=True, axis_type=AxisType.Auto
):
  mesh = make_mesh(mesh_name, axis_type)
  params, x = make_problem(mesh, dtype)
  (loss, y), grads = reference(mesh_name, dtype)
  pipe = jaccum.pipeline(stage_fn, num_microbatches, mesh=mesh, **options)
  step = loss_and_output(pipe)
  (pipe_loss, pipe_y), pipe_grads = (jax.jit(step) if jit else step)(params, x)
  rtol = RTOL[dtype]
  assert pipe_y.shape == x.shape
  assert_trees_close(pipe_y, y, rtol)
  assert_trees_close(pipe_loss, loss, rtol)
  assert_trees_close(pipe_grads, grads, rtol)
  return max_rel_error((pipe_y, pipe_grads), (y, grads))


# GPipe and 1F1B with K in {1, S, 2S, 3S + 1} on the (data × stage) mesh in
# float64, their remat variants with two of those K, GPipe on the (stage)
# mesh too; float32 for each schedule. (Each case compiles a step: a second
# or two of CPU.)
KS = (1, NUM_STAGES, 2 * NUM_STAGES, 3 * NUM_STAGES + 1)
FLOAT64_CASES = [
  *[("stage", k, "gpipe") for k in (1, 3 * NUM_STAGES + 1)],
  *[("data×stage", k, "gpipe") for k in KS],
  *[("data×stage", k, "gpipe+remat") for k in (NUM_STAGES, 3 * NUM_STAGES + 1)],
  *[("data×stage", k, "1f1b") for k in KS],
  *[("data×stage", k, "1f1b+remat") for k in (NUM_STAGES, 3 * NUM_STAGES + 1)],
]
FLOAT32_CASES = [
  ("stage", 3 * NUM_STAGES + 1, "gpipe"),
  *[("data×stage", 2 * NUM_STAGES, schedule) for schedule in SCHEDULES],
]


@pytest.mark.parametrize(("mesh_name", "num_microbatches", "schedule"), FLOAT64_CASES)
def test_matches_sequential_model_float64(mesh_name, num_microbatches, schedule):
  with jax.enable_x64(True):
    check_against_sequential(
      mesh_name, jnp.float64, num_microbatches, SCHEDULES[schedule]
    )


@pytest.mark.parametrize(("mesh_name", "num_microbatches", "schedule"), FLOAT32_CASES)
def test_matches_sequential_model_float32(mesh_name, num_microbatches, schedule):
  check_against_sequential(
    mesh_name, jnp.float32, num_microbatches, SCHEDULES[schedule]
  )


def test_without_jit():
  check_against_sequential("stage", jnp.float32, NUM_STAGES, {}, jit=False)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_explicit_mesh_axes(schedule):
  check_against_sequential(
    "data×stage",
    jnp.float32,
    2 * NUM_STAGES,
    SCHEDULES[schedule],
    axis_type=AxisType.Explicit,
  )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b+remat"])
def test_pytree_activations(schedule):
  """x may be a pytree, integer leaves included; every leaf flows through."""

  def two_stream_stage(params, x):
    h = stage_fn(params, x["h"]) * (x["ids"] % 3 > 0)[:, None]
    return {"h": h, "total": x["total"] + h.sum(-1), "ids": x["ids"] + 1}

  def sequential_streams(params, x):
    for s in range(NUM_STAGES):
      x = two_stream_stage(jax.tree.map(lambda p, s=s: p[s], params), x)
    return x

  mesh = make_mesh("data×stage")
  params, h = make_problem(mesh, jnp.float32)
  x = {"h": h, "total": h[:, 0], "ids": jnp.arange(h.shape[0])}

  def loss(apply):
    def loss(params, h, total):
      y = apply(params, {"h": h, "total": total, "ids": x["ids"]})
      return jnp.sum(jnp.cos(y["total"]) + jnp.sin(y["h"][:, 0])), y["ids"]

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

  pipe = jaccum.pipeline(two_stream_stage, NUM_STAGES, mesh=mesh, **SCHEDULES[schedule])
  expected = loss(sequential_streams)(params, h, x["total"])
  actual = loss(pipe)(params, h, x["total"])
  np.testing.assert_array_equal(actual[0][1], x["ids"] + NUM_STAGES)
  assert_trees_close(actual, expected, 1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stage_fn_traces_per_compilation(schedule):
  """GPipe traces `stage_fn` once; 1F1B also for its backward loop; none retraces."""
  traces = []

  def counted(params, x):
    traces.append(None)
    return stage_fn(params, x)

  mesh = make_mesh("stage")
  params, x = make_problem(mesh, jnp.float32)
  pipe = jaccum.pipeline(counted, NUM_STAGES, mesh=mesh, **SCHEDULES[schedule])
  step = jax.jit(jax.grad(lambda p, x: jnp.sum(pipe(p, x) ** 2)))
  step(params, x)
  # 1F1B: the forward loop; the backward loop's forward and its backward
  # (remat), or its forward and two to find the residuals that do not depend
  # on the micro-batch.
  expected = {"gpipe": 1, "gpipe+remat": 1, "1f1b": 4, "1f1b+remat": 3}[schedule]
  assert len(traces) == expected
  step(params, x)
  assert len(traces) == expected


# --- what the compiled step communicates --------------------------------------


def collectives(mesh, num_microbatches, options):
  params, x = make_problem(mesh, jnp.float32)
  pipe = jaccum.pipeline(stage_fn, num_microbatches, mesh=mesh, **options)
  return jaccum.inspect.collectives(jax.jit(loss_and_output(pipe)), params, x)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_collectives(schedule):
  """On (data × stage): only ppermutes in the loops, one data reduction per step."""
  mesh = make_mesh("data×stage")
  counts = collectives(mesh, NUM_STAGES, SCHEDULES[schedule])
  print(counts)
  # Stage parameters are never gathered, nothing else moves between devices.
  assert counts.all_gather[:2] == (0, 0)
  assert counts.reduce_scatter[:2] == (0, 0)
  assert counts.all_to_all[:2] == (0, 0)
  # Inside the loops, activations (forward) and their cotangents (backward)
  # pass between neighbouring stages, and nothing else.
  assert counts.all_reduce.inside_loops == 0
  assert counts.collective_permute.outside_loops == 0
  # GPipe: one ppermute in the forward loop, its transpose in the backward
  # loop. 1F1B: the forward loop's, then two in its backward loop (the
  # recomputed forward's and the cotangents').
  assert counts.collective_permute.inside_loops == (
    3 if schedule.startswith("1f1b") else 2
  )
  # After the loops: the output's psum over the stages, the input cotangent's
  # psum over the stages, and one over "data" for the parameter gradients
  # (XLA may combine the loss's own mean over "data" with it). The same
  # program for twice as many micro-batches: the reduction over
  # "data" happens once per step, not once per micro-batch.
  assert 1 <= counts.all_reduce.outside_loops <= 4
  twice = collectives(mesh, 2 * NUM_STAGES, SCHEDULES[schedule])
  assert [c[:2] for c in twice] == [c[:2] for c in counts]


def test_stage_parameters_and_gradients_stay_on_their_stage():
  mesh = make_mesh("data×stage")
  params, x = make_problem(mesh, jnp.float32)
  stage_sharding = NamedSharding(mesh, P("stage"))
  params = jax.device_put(params, stage_sharding)
  x = jax.device_put(x, NamedSharding(mesh, P("data")))
  pipe = jaccum.pipeline(stage_fn, NUM_STAGES, mesh=mesh)
  (_, y), (grads, _) = jax.jit(loss_and_output(pipe))(params, x)
  for leaf in jax.tree.leaves(grads):
    assert leaf.sharding.is_equivalent_to(stage_sharding, leaf.ndim), leaf.sharding
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), y.ndim)


# --- memory -------------------------------------------------------------------


def test_1f1b_stored_activations_do_not_grow_with_k():
  """Per extra micro-batch, 1F1B's temporaries grow by its batch-sized buffers
  only (output, cotangents); GPipe's by a stage's whole activations."""
  width, hidden, rows = 16, 512, 8

  def wide_stage(params, x):
    return x + jax.nn.gelu(x @ params["w_in"]) @ params["w_out"]

  params = {
    "w_in": jax.ShapeDtypeStruct((NUM_STAGES, width, hidden), jnp.float32),
    "w_out": jax.ShapeDtypeStruct((NUM_STAGES, hidden, width), jnp.float32),
  }
  mesh = make_mesh("stage")

  def temp_bytes(num_microbatches, schedule):
    pipe = jaccum.pipeline(wide_stage, num_microbatches, mesh=mesh, schedule=schedule)
    step = jax.grad(lambda p, x: jnp.sum(jnp.sin(pipe(p, x))), argnums=(0, 1))
    x = jax.ShapeDtypeStruct((num_microbatches * rows, width), jnp.float32)
    return jaccum.inspect.memory(step, params, x).temp_bytes

  extra = 3 * NUM_STAGES  # micro-batches added
  input_bytes = rows * width * 4
  activation_bytes = rows * hidden * 4
  growth = {
    s: temp_bytes(NUM_STAGES + extra, s) - temp_bytes(NUM_STAGES, s)
    for s in ("gpipe", "1f1b")
  }
  # y, its cotangent and x's cotangent: three micro-batch inputs each.
  assert growth["1f1b"] <= extra * 3 * input_bytes
  assert growth["gpipe"] >= extra * activation_bytes


# --- errors ---------------------------------------------------------------------


def test_error_stage_params_leading_size():
  mesh = make_mesh("stage")
  params, x = make_problem(mesh, jnp.float32)
  params["mlp"]["b"] = params["mlp"]["b"][:3]
  pipe = jaccum.pipeline(stage_fn, 2, mesh=mesh)
  with pytest.raises(
    ValueError,
    match=r"stage_params\['mlp'\]\['b'\] has shape \(3, 16\): its leading size 3 "
    r"must be the number of stages, the size 4 of mesh axis 'stage'",
  ):
    pipe(params, x)


def test_error_stage_params_scalar_leaf():
  mesh = make_mesh("stage")
  params, x = make_problem(mesh, jnp.float32)
  params["scale"] = jnp.float32(1.0)
  with pytest.raises(ValueError, match=r"stage_params\['scale'\] has shape \(\)"):
    jaccum.pipeline(stage_fn, 2, mesh=mesh)(params, x)


def test_error_axis_not_in_mesh():
  with pytest.raises(
    ValueError,
    match=r"axis='layers' is not an axis of the mesh, whose axes are "
    r"\('data', 'stage'\)",
  ):
    jaccum.pipeline(stage_fn, 2, mesh=make_mesh("data×stage"), axis="layers")


def test_error_num_microbatches_does_not_divide_batch():
  mesh = make_mesh("data×stage")
  params, x = make_problem(mesh, jnp.float32)
  with pytest.raises(
    ValueError,
    match=r"batch_size=208 \(of x\) must be divisible by data shards × "
    r"num_microbatches = 2 × 3 = 6 \(the data shards are the mesh axes \('data',\)\)",
  ):
    jaccum.pipeline(stage_fn, 3, mesh=mesh)(params, x)


@pytest.mark.parametrize(
  ("bad_stage", "received"),
  [
    (lambda p, x: stage_fn(p, x)[:, :4], r"float32\[26, 4\]"),
    (lambda p, x: stage_fn(p, x).astype(jnp.bfloat16), r"bfloat16\[26, 8\]"),
  ],
  ids=["shape", "dtype"],
)
def test_error_stage_fn_changes_its_input(bad_stage, received):
  mesh = make_mesh("stage")
  params, x = make_problem(mesh, jnp.float32)
  pipe = jaccum.pipeline(bad_stage, 4, mesh=mesh)
  with pytest.raises(
    ValueError,
    match=r"stage_fn must return its input's shape and dtype.*input x is "
    r"float32\[26, 8\] but stage_fn returns " + received,
  ):
    pipe(params, x)


def test_error_stage_fn_changes_its_structure():
  mesh = make_mesh("stage")
  params, x = make_problem(mesh, jnp.float32)
  pipe = jaccum.pipeline(lambda p, x: (stage_fn(p, x), x), 4, mesh=mesh)
  with pytest.raises(ValueError, match=r"stage_fn must return a tree like its input"):
    pipe(params, x)


def test_error_batch_leaves_disagree():
  mesh = make_mesh("stage")
  params, x = make_problem(mesh, jnp.float32)
  pipe = jaccum.pipeline(lambda p, x: x, 4, mesh=mesh)
  with pytest.raises(ValueError, match=r"x\['a'\] has 104 rows but x\['b'\] has 8"):
    pipe(params, {"a": x, "b": x[:8]})


@pytest.mark.parametrize(
  ("options", "message"),
  [
    ({"schedule": "interleaved"}, r"schedule must be one of \('gpipe', '1f1b'\)"),
  ],
)
def test_error_options(options, message):
  with pytest.raises(ValueError, match=message):
    jaccum.pipeline(stage_fn, 2, mesh=make_mesh("stage"), **options)


@pytest.mark.parametrize("num_microbatches", [0, 2.5])
def test_error_num_microbatches(num_microbatches):
  with pytest.raises(
    (TypeError, ValueError), match=r"num_microbatches must be a positive int"
  ):
    jaccum.pipeline(stage_fn, num_microbatches, mesh=make_mesh("stage"))

"""The one reduction after the loop: overlapped, lighter on the wire, or replaced.

On 8 simulated CPU devices: `overlap_reduction` (the last micro-batch after
the loop, so each gradient's all-reduce waits for that gradient alone),
`reduce_dtype` (the accumulators cross the wire narrower) and `reduce_fn`
(the gradients' reduction replaced, with threaded state: `jaccum.PowerSGD`).
"""

import itertools
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaccum
import jaccum.inspect

DEVICES, K = 8, 4
# Layers of different shapes, so each gradient's all-reduce is known by shape.
WIDTHS = (32, 40, 48, 56, 8)


def init(seed=0):
  rng = np.random.default_rng(seed)
  return {
    f"w{i}": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32)
    for i, (a, b) in enumerate(itertools.pairwise(WIDTHS))
  }


def loss(params, x):
  for i in range(len(WIDTHS) - 1):
    x = jnp.tanh(x @ params[f"w{i}"])
  return jnp.mean(x**2)


def batch(mesh, seed=1, rows=DEVICES * K * 4):
  x = np.random.default_rng(seed).normal(size=(rows, WIDTHS[0])).astype(np.float32)
  return x, jax.device_put(x, NamedSharding(mesh, P("data")))


def mesh_of(kind=AxisType.Auto):
  return jax.make_mesh((DEVICES,), ("data",), axis_types=(kind,))


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_overlap_on_and_off_are_equal(kind):
  mesh = mesh_of(kind)
  params = init()
  x, x_sharded = batch(mesh)
  results = []
  for overlap in (False, True):
    step = jax.jit(
      jaccum.data_parallel(
        jax.value_and_grad(loss), K, mesh=mesh, overlap_reduction=overlap
      )
    )
    results.append(step(params, x_sharded))
    counts = jaccum.inspect.collectives(step, params, x_sharded)
    assert counts.inside_loops == 0, counts
  assert_trees_close(results[1], results[0], rtol=1e-6, atol=1e-9)
  assert_trees_close(results[0], jax.value_and_grad(loss)(params, x), rtol=1e-5)
  # Inside the user's shard_map, with axis_name, too.
  inner = jax.jit(
    jax.shard_map(
      jaccum.accumulate(jax.grad(loss), K, axis_name="data", overlap_reduction=True),
      mesh=mesh,
      in_specs=(P(), P("data")),
      out_specs=P(),
    )
  )
  assert_trees_close(inner(params, x_sharded), results[0][1], rtol=1e-5)


DEPENDENCY_SCRIPT = textwrap.dedent(
  """
  import json, sys
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  sys.path.insert(0, sys.argv[1])
  from test_reduction import init, loss, batch, mesh_of, K, WIDTHS
  import jaccum
  from jaccum.inspect import _instructions

  found = {}
  for overlap in (False, True):
    mesh = mesh_of()
    params = init()
    _, x = batch(mesh)
    step = jax.jit(jaccum.data_parallel(
        jax.grad(loss), K, mesh=mesh, overlap_reduction=overlap))
    text = step.lower(params, x).compile().as_text()
    found[str(overlap)] = text
  print(json.dumps(found))
  """
)


def ancestors(text, start):
  """Names of the instructions `start` depends on, in the entry computation."""
  import re

  operands, kinds = {}, {}
  entry = text[text.index("ENTRY") :]
  for line in entry.splitlines()[1:]:
    if line.startswith("}"):
      break
    if "=" not in line:
      continue
    name, rest = line.split("=", 1)
    name = name.replace("ROOT", "").strip().lstrip("%")
    opcode = re.search(r"\s([a-z][a-z0-9\-]*)\(", " " + rest)
    kinds[name] = (rest.split(opcode.group(1))[0].strip(), opcode.group(1))
    inner = rest[opcode.end() - 1 :].split(")", 1)[0]
    operands[name] = re.findall(r"%([\w.\-]+)", inner)
  seen, stack = set(), [start]
  while stack:
    name = stack.pop()
    for operand in operands.get(name, []):
      if operand not in seen:
        seen.add(operand)
        stack.append(operand)
  return seen, kinds


def test_with_overlap_the_last_layers_all_reduce_waits_for_nothing_of_the_first():
  """The compiled HLO's data dependencies, XLA's all-reduce combiner off.

  The combiner merges independent all-reduces into one (on CPU always; on GPU
  up to `--xla_gpu_all_reduce_combine_threshold_bytes`), which would make the
  question moot, so this compiles in a process without it. With overlap, the
  last micro-batch runs after the loop: the all-reduce of the last layer's
  gradient (made first by the backward pass) does not depend on the first
  layer's gradient in that micro-batch (made last). Without, both come out
  of the loop together.
  """
  env = {**os.environ, "XLA_FLAGS": "--xla_disable_hlo_passes=cpu-all-reduce-combiner"}
  done = subprocess.run(
    [sys.executable, "-c", DEPENDENCY_SCRIPT, str(pathlib.Path(__file__).parent)],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
    check=True,
  )
  texts = json.loads(done.stdout.strip().splitlines()[-1])
  last_shape = f"f32[{WIDTHS[-2]},{WIDTHS[-1]}]"
  first_shape = f"f32[{WIDTHS[0]},{WIDTHS[1]}]"
  for overlap, text in texts.items():
    _, kinds = ancestors(text, "")
    all_reduces = [n for n, (_, op) in kinds.items() if op == "all-reduce"]
    assert len(all_reduces) >= len(WIDTHS) - 1, kinds  # not combined
    last = next(n for n in all_reduces if kinds[n][0].startswith(last_shape))
    depends_on, _ = ancestors(text, last)
    # The first layer's gradient, computed outside the loop: the last step's.
    first_outside = [
      n
      for n, (shape, op) in kinds.items()
      if shape.startswith(first_shape) and op in ("dot", "convolution")
    ]
    if overlap == "True":
      assert first_outside, "the last micro-batch's backward is outside the loop"
      assert not set(first_outside) & depends_on
      assert any(kinds[n][1] == "while" for n in depends_on)  # and the loop's sum
    else:
      assert not first_outside  # every micro-batch is in the loop


def test_bf16_on_the_wire_halves_the_bytes_and_rounds_only_the_mean():
  """What jaccum sends (the program before XLA:CPU widens bf16 collectives)."""
  mesh = mesh_of()
  params = init()
  x, x_sharded = batch(mesh)
  exact = jax.grad(loss)(params, x)
  sent, grads = {}, {}
  for dtype in (None, jnp.bfloat16):
    step = jax.jit(
      jaccum.data_parallel(jax.grad(loss), K, mesh=mesh, reduce_dtype=dtype)
    )
    lowered = step.lower(params, x_sharded).as_text(dialect="hlo")
    sent[dtype] = jaccum.inspect._count_collectives(lowered).all_reduce
    grads[dtype] = step(params, x_sharded)
  assert sent[jnp.bfloat16].bytes_outside_loops * 2 == sent[None].bytes_outside_loops
  assert jax.tree.map(lambda g: g.dtype, grads[jnp.bfloat16]) == jax.tree.map(
    lambda g: g.dtype, exact
  )
  # bf16 has 8 bits of mantissa: each device's share rounds to 2^-9 of itself,
  # the sum of 8 in bf16 adds a few more roundings. Documented: <= 2^-6.
  for name in exact:
    error = np.max(np.abs(np.asarray(grads[jnp.bfloat16][name]) - exact[name]))
    assert error <= 2**-6 * np.max(np.abs(exact[name])), name


def test_reduce_fn_is_called_once_per_step_with_nothing_in_the_loop():
  mesh = mesh_of()
  params = init()
  x, x_sharded = batch(mesh)
  calls = []

  def psum_and_count(grads, axes, state):
    calls.append(axes)
    return jax.lax.psum(grads, axes), {"steps": state["steps"] + 1}

  step = jax.jit(
    jaccum.data_parallel(
      jax.value_and_grad(loss), K, mesh=mesh, reduce_fn=psum_and_count
    )
  )
  state = {"steps": jnp.zeros((DEVICES,), jnp.int32)}
  step.lower(params, x_sharded, reduce_state=state)
  assert calls == [("data",)]  # one step's program: one reduction
  (value, grads), state = step(params, x_sharded, reduce_state=state)
  (_, _), state = step(params, x_sharded, reduce_state=state)
  np.testing.assert_array_equal(state["steps"], np.full(DEVICES, 2))
  assert_trees_close((value, grads), jax.value_and_grad(loss)(params, x), rtol=1e-5)
  counts = jaccum.inspect.collectives(step, params, x_sharded, reduce_state=state)
  assert counts.inside_loops == 0, counts


def test_reduce_fn_gets_shares_that_sum_to_the_weighted_mean():
  """With weight_fn, each device's share is its weighted sum over the total.

  The shares leave the step through `reduce_state` (one row per device), and
  each is checked against the gradient of that device's rows' token-weighted
  loss divided by the whole batch's tokens, computed here without jaccum.
  """
  mesh = mesh_of()
  params = init()
  x, x_sharded = batch(mesh, seed=3)
  tokens = np.random.default_rng(4).integers(0, 6, size=len(x)).astype(np.float32)

  def per_row(params, x):
    return jax.vmap(lambda r: loss(params, r[None]))(x)

  def token_loss(params, x, t):
    return jnp.sum(per_row(params, x) * t) / jnp.maximum(jnp.sum(t), 1)

  def psum(grads, axes, state):
    return jax.lax.psum(grads, axes), {"share": grads}

  step = jax.jit(
    jaccum.data_parallel(
      jax.grad(token_loss),
      K,
      mesh=mesh,
      batch_argnums=(1, 2),
      weight_fn=lambda p, x, t: jnp.sum(t),
      reduce_fn=psum,
    )
  )
  t_sharded = jax.device_put(tokens, NamedSharding(mesh, P("data")))
  zeros = {"share": jax.tree.map(lambda p: jnp.zeros((DEVICES, *p.shape)), params)}
  grads, state = step(params, x_sharded, t_sharded, reduce_state=zeros)
  exact = jax.grad(token_loss)(params, x, tokens)
  assert_trees_close(grads, exact, rtol=1e-5)
  # Device d holds rows d·R..(d+1)·R-1 (the batch is split over "data").
  rows = len(x) // DEVICES
  for d in range(DEVICES):
    mine = slice(d * rows, (d + 1) * rows)
    want = jax.grad(
      lambda p, mine=mine: jnp.sum(per_row(p, x[mine]) * tokens[mine]) / tokens.sum()
    )(params)
    got = jax.tree.map(lambda s, d=d: s[d], state["share"])
    assert_trees_close(got, want, rtol=1e-5, atol=1e-8)
  # And they sum to the weighted mean (in float64 here, then compared as float32).
  summed = jax.tree.map(
    lambda s: np.sum(np.asarray(s, np.float64), 0).astype(np.float32), state["share"]
  )
  assert_trees_close(summed, exact, rtol=1e-5)


def test_overlap_and_a_count_of_real_micro_batches_are_refused_together():
  """With a count, which micro-batch is last is known only when the step runs.

  overlap_reduction runs the last of the K micro-batches after the loop, so
  with num_real_microbatches it cannot overlap anything: it is refused when
  traced, on every route, rather than silently left out.
  """
  mesh = mesh_of()
  params = init()
  x, x_sharded = batch(mesh)
  count = jnp.int32(K - 1)
  refused = "overlap_reduction=True and num_real_microbatches do not combine"
  step = jax.jit(
    jaccum.data_parallel(
      jax.grad(loss), K, mesh=mesh, overlap_reduction=True, split="strided"
    )
  )
  with pytest.raises(ValueError, match=refused):
    step.lower(params, x_sharded, num_real_microbatches=count)
  inner = jaccum.accumulate(
    jax.grad(loss), K, axis_name="data", overlap_reduction=True, split="strided"
  )
  in_shard_map = jax.jit(
    jax.shard_map(
      lambda p, x, n: inner(p, x, num_real_microbatches=n),
      mesh=mesh,
      in_specs=(P(), P("data"), P()),
      out_specs=P(),
    )
  )
  with pytest.raises(ValueError, match=refused):
    in_shard_map.lower(params, x_sharded, count)
  one_device = jaccum.accumulate(
    jax.grad(loss), K, overlap_reduction=True, split="strided"
  )
  with pytest.raises(ValueError, match=refused):
    one_device(params, x, num_real_microbatches=K)
  # Either option alone still runs.
  counted = jax.jit(jaccum.data_parallel(jax.grad(loss), K, mesh=mesh, split="strided"))
  assert_trees_close(
    counted(params, x_sharded, num_real_microbatches=jnp.int32(K)),
    step(params, x_sharded),
    rtol=1e-5,
  )


def test_powersgd_compresses_and_its_error_feedback_survives_a_checkpoint(tmp_path):
  import orbax.checkpoint as ocp

  mesh = mesh_of()
  params = {"w": jnp.asarray(np.random.default_rng(5).normal(size=(64, 48)) / 8)}
  params["w"] = params["w"].astype(jnp.float32)
  x = np.random.default_rng(6).normal(size=(DEVICES * K * 4, 64)).astype(np.float32)
  x_sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
  mlp_loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
  powersgd = jaccum.PowerSGD(rank=2)
  step = jax.jit(
    jaccum.data_parallel(jax.grad(mlp_loss), K, mesh=mesh, reduce_fn=powersgd)
  )
  exact = jax.jit(jaccum.data_parallel(jax.grad(mlp_loss), K, mesh=mesh))
  state = powersgd.init(params, DEVICES)
  grads, state = step(params, x_sharded, reduce_state=state)
  sent = jaccum.inspect.collectives(step, params, x_sharded, reduce_state=state)
  whole = jaccum.inspect.collectives(exact, params, x_sharded)
  # (64 + 48) x 2 numbers for the matrix against 64 x 48: 13.7x fewer bytes.
  assert whole.bytes_per_step >= 8 * sent.bytes_per_step, (whole, sent)
  assert sent.inside_loops == 0
  # A rank-2 estimate plus what it left out is the exact sum, on every device.
  full = exact(params, x_sharded)["w"]
  left_out = state.error["w"].sum(axis=0)
  np.testing.assert_allclose(grads["w"] + left_out, full, rtol=1e-4, atol=1e-6)
  # The state round-trips through a checkpoint, and the next step is the same.
  checkpointer = ocp.PyTreeCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  restored = checkpointer.restore(tmp_path / "state", item=state)
  assert_trees_close(restored, state, rtol=0)
  after, _ = step(params, x_sharded, reduce_state=restored)
  again, _ = step(params, x_sharded, reduce_state=state)
  assert_trees_close(after, again, rtol=0)


def test_powersgd_trains_as_the_exact_reduction_does():
  """300 steps of SGD with momentum (as the paper trains) on an MLP.

  The rank-4 estimate delays part of each gradient (error feedback) rather
  than losing it: training follows the exact reduction, a little behind
  (measured: a loss of 0.0073 against 0.0068, from 0.90 at the start). The
  issue's 1% goal is measured on the digits CNN by `examples/powersgd.py`.
  """
  mesh = mesh_of()
  rng = np.random.default_rng(7)
  params = {
    "w1": jnp.asarray(rng.normal(size=(32, 64)) / 6, jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(64, 4)) / 8, jnp.float32),
  }
  x = rng.normal(size=(DEVICES * K * 8, 32)).astype(np.float32)
  y = (x[:, :4] > 0).astype(np.float32)
  batch_ = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y)]

  def mlp_loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

  optimizer = optax.sgd(0.1, momentum=0.9)
  powersgd = jaccum.PowerSGD(rank=4)
  losses = {}
  for name, options in (("exact", {}), ("powersgd", {"reduce_fn": powersgd})):
    step = jax.jit(
      jaccum.data_parallel(
        jax.grad(mlp_loss), K, mesh=mesh, batch_argnums=(1, 2), **options
      )
    )
    p, opt_state = params, optimizer.init(params)
    state = powersgd.init(params, DEVICES)
    for _ in range(300):
      if options:
        grads, state = step(p, *batch_, reduce_state=state)
      else:
        grads = step(p, *batch_)
      updates, opt_state = optimizer.update(grads, opt_state)
      p = optax.apply_updates(p, updates)
    losses[name] = float(mlp_loss(p, x, y))
  start = float(mlp_loss(params, x, y))
  assert losses["exact"] < 0.05 * start, (start, losses)
  assert losses["powersgd"] <= 1.15 * losses["exact"], losses


# Meshes with an axis besides the data axes: each reduction runs in a
# `shard_map` manual over the data axes only. name: mesh shape and axes, the
# data axes, the params' specs (None: replicated), fsdp_mode.
COLUMN, ROW = P(None, "model"), P("model", None)
TP_SPECS = {"w0": COLUMN, "w1": ROW, "w2": COLUMN, "w3": ROW}
FSDP_SPECS = {"w0": P("data"), "w1": P("data"), "w2": P("data"), "w3": P("data")}
FSDP_TP_SPECS = {
  "w0": P("data", "model"),
  "w1": P("model", "data"),
  "w2": P("data", "model"),
  "w3": P("model", "data"),
}
HSDP_SPECS = {
  k: P("fsdp", s[1]) if s[0] is None else P(s[0], "fsdp") for k, s in TP_SPECS.items()
}
WIRE_MESHES = {
  "data8_model1": ((8, 1), ("data", "model"), "data", None, "gather_once"),
  "data4_model2_tp": ((4, 2), ("data", "model"), "data", TP_SPECS, "gather_once"),
  **{
    f"data4_model2_fsdp_{mode}": ((4, 2), ("data", "model"), "data", FSDP_SPECS, mode)
    for mode in ("gather_once", "shard_grads", "shard_all")
  },
  **{
    f"data4_model2_fsdp_tp_{mode}": (
      (4, 2),
      ("data", "model"),
      "data",
      FSDP_TP_SPECS,
      mode,
    )
    for mode in ("gather_once", "shard_grads", "shard_all")
  },
  "hsdp_2x2x2_shard_grads": (
    (2, 2, 2),
    ("data", "fsdp", "model"),
    ("data", "fsdp"),
    HSDP_SPECS,
    "shard_grads",
  ),
}


def wire_step(name, reduce_dtype):
  """The case's step, its params and batch placed on its mesh."""
  shape, names, axis, specs, mode = WIRE_MESHES[name]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
  params = init()
  if specs is not None:
    params = {
      k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()
    }
  x = np.random.default_rng(5).normal(size=(DEVICES * K * 2, WIDTHS[0]))
  x = jnp.asarray(x, jnp.float32)
  step = jaccum.data_parallel(
    jax.grad(loss),
    K,
    mesh=mesh,
    axis=axis,
    param_specs=specs,
    fsdp_mode=mode,
    reduce_dtype=reduce_dtype,
  )
  return jax.jit(step), params, x, jax.device_put(x, NamedSharding(mesh, P(axis)))


APART_SCRIPT = textwrap.dedent(
  """
  import json, sys
  import jax
  import numpy as np
  jax.config.update("jax_num_cpu_devices", 8)
  sys.path.insert(0, sys.argv[1])
  import test_reduction

  for name, result in getattr(test_reduction, sys.argv[2])():
    as_lists = jax.tree.map(lambda v: np.asarray(v, np.float32).tolist(), result)
    print(json.dumps({name: as_lists}), flush=True)
  """
)


def run_apart(cases):
  """`cases()`'s results, computed in a process an abort cannot take down."""
  done = subprocess.run(
    [sys.executable, "-c", APART_SCRIPT, str(pathlib.Path(__file__).parent), cases],
    capture_output=True,
    text=True,
    timeout=600,
  )
  lines = done.stdout.strip().splitlines()
  assert done.returncode == 0, (done.returncode, lines[-1:], done.stderr[:300])
  found = {}
  for line in lines:
    found.update(json.loads(line))
  return found


def narrowed_on_every_mesh():
  for name in WIRE_MESHES:
    step, params, _, x = wire_step(name, jnp.bfloat16)
    yield name, step(params, x)


def test_bf16_on_the_wire_runs_on_every_mesh_with_a_second_axis():
  """XLA:CPU aborted the process (exit 134, "Invalid binary instruction opcode
  copy", in its all-reduce promotion) compiling a bf16 reduction in a
  `shard_map` manual over some of the mesh's axes: every mesh with an axis
  besides the data axes. Run where an abort cannot take the test run with it."""
  found = run_apart("narrowed_on_every_mesh")
  assert set(found) == set(WIRE_MESHES)
  for name, narrowed in found.items():
    step, params, x, x_placed = wire_step(name, None)
    exact = step(params, x_placed)  # float32 on the wire
    assert_trees_close(exact, jax.grad(loss)(params, x), rtol=1e-5)
    # bf16 rounds each device's share and the sum: <= 2^-6, as on one axis.
    for leaf, value in exact.items():
      error = np.max(np.abs(np.asarray(narrowed[leaf]) - np.asarray(value)))
      assert error <= 2**-6 * np.max(np.abs(value)), (name, leaf, error)
      assert error > 0, (name, leaf)  # narrowed: not the float32 wire


def bf16_leaves_on_a_model_axis():
  """bf16 leaves reduced in bf16 (the same abort): gradients with
  `accum_dtype=None`, also through PowerSGD's leaves summed whole, and a bf16
  `"max"`."""
  _, params, _, x = wire_step("data4_model2_tp", None)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  options = {"mesh": x.sharding.mesh, "accum_dtype": None}

  def grads_and_max(params, x):
    return jax.grad(loss)(params, x), jnp.max(x.astype(jnp.bfloat16))

  both = jaccum.data_parallel(grads_and_max, K, reduce=("mean", "max"), **options)
  yield "grads_and_max", jax.jit(both)(params, x)
  whole = jaccum.PowerSGD(rank=1, min_compression=1e9)  # no leaf compressed
  step = jaccum.data_parallel(jax.grad(loss), K, reduce_fn=whole, **options)
  state = whole.init(params, num_devices=4)
  yield "powersgd", jax.jit(step)(params, x, reduce_state=state)[0]


def test_bf16_leaves_are_reduced_on_a_mesh_with_a_second_axis():
  """The same abort without `reduce_dtype`: bf16 leaves summed in bf16."""
  found = run_apart("bf16_leaves_on_a_model_axis")
  _, params, x, _ = wire_step("data4_model2_tp", None)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  exact = jax.grad(loss)(
    jax.tree.map(lambda p: p.astype(jnp.float32), params), x.astype(jnp.bfloat16)
  )
  grads, largest = found["grads_and_max"]
  assert largest == float(jnp.max(x.astype(jnp.bfloat16)))
  # A bf16 forward and backward, summed over micro-batches and devices in bf16.
  for got in (grads, found["powersgd"]):
    got = {k: np.asarray(v, np.float32) for k, v in got.items()}
    assert_trees_close(got, exact, rtol=0.05)


def test_on_a_mesh_with_a_second_axis_gpus_and_tpus_get_the_bf16_wire():
  """XLA:CPU gets float32 of bf16-rounded shares (what it makes of a bf16
  reduction); the program lowered for a GPU or a TPU sends bf16 as asked."""
  step, params, _, x = wire_step("data4_model2_fsdp_tp_gather_once", jnp.bfloat16)
  wide, _, _, _ = wire_step("data4_model2_fsdp_tp_gather_once", None)
  sent = {}
  for name, platform, fn in [
    ("float32", "cpu", wide),
    ("cpu", "cpu", step),
    ("cuda", "cuda", step),
    ("tpu", "tpu", step),
  ]:
    lowered = fn.trace(params, x).lower(lowering_platforms=(platform,))
    counts = jaccum.inspect._count_collectives(lowered.as_text(dialect="hlo"))
    sent[name] = (
      counts.all_reduce.bytes_outside_loops + counts.reduce_scatter.bytes_outside_loops
    )
  assert sent["float32"] > 0, sent
  assert sent["cuda"] * 2 == sent["tpu"] * 2 == sent["float32"] == sent["cpu"], sent

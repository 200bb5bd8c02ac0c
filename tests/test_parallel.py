"""Distributed accumulation on 8 simulated CPU devices: exact, one reduction a step."""

import warnings

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

DEVICES = 8
BATCH = 128


def loss(params, x, y):
  hidden = jnp.tanh(x @ params["w"] + params["b"])
  return jnp.mean((hidden @ params["v"] - y) ** 2)


@pytest.fixture(scope="module")
def problem():
  kw, kv, kx, ky = jax.random.split(jax.random.key(0), 4)
  params = {
    "w": jax.random.normal(kw, (8, 16)),
    "b": jnp.zeros(16),
    "v": jax.random.normal(kv, (16,)),
  }
  x = jax.random.normal(kx, (BATCH, 8))
  y = jax.random.normal(ky, (BATCH,))
  return params, x, y


GRAD_FN = jax.value_and_grad(loss)


def mesh_of(kind):
  return jax.make_mesh((DEVICES,), ("data",), axis_types=(kind,))


def shard_batch(mesh, *arrays):
  return [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in arrays]


def data_parallel_step(kind, num_microbatches):
  mesh = mesh_of(kind)
  step = jax.jit(
    jaccum.data_parallel(GRAD_FN, num_microbatches, mesh=mesh, batch_argnums=(1, 2))
  )
  return step, lambda params, x, y: (params, *shard_batch(mesh, x, y))


def shard_map_step(kind, num_microbatches):
  mesh = mesh_of(kind)
  accumulated = jaccum.accumulate(
    GRAD_FN, num_microbatches, batch_argnums=(1, 2), axis_name="data"
  )
  step = jax.jit(
    jax.shard_map(
      accumulated, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P()
    )
  )
  return step, lambda params, x, y: (params, *shard_batch(mesh, x, y))


def pmap_step(kind, num_microbatches):
  del kind
  accumulated = jaccum.accumulate(
    GRAD_FN, num_microbatches, batch_argnums=(1, 2), axis_name="devices"
  )
  pmapped = jax.pmap(accumulated, axis_name="devices", in_axes=(None, 0, 0))

  def place(params, x, y):
    return params, x.reshape(DEVICES, -1, *x.shape[1:]), y.reshape(DEVICES, -1)

  return pmapped, place


def explicit_jit_step(kind, num_microbatches):
  """Plain jit: the batch's explicit sharding is read at trace time."""
  del kind
  mesh = mesh_of(AxisType.Explicit)
  return (
    jax.jit(jaccum.accumulate(GRAD_FN, num_microbatches, batch_argnums=(1, 2))),
    lambda params, x, y: (params, *shard_batch(mesh, x, y)),
  )


FSDP_SPECS = {"w": P(None, "data"), "b": P("data"), "v": P("data")}


def fsdp_step(kind, num_microbatches):
  mesh = mesh_of(kind)
  step = jax.jit(
    jaccum.data_parallel(
      GRAD_FN, num_microbatches, mesh=mesh, batch_argnums=(1, 2), param_specs=FSDP_SPECS
    )
  )

  def place(params, x, y):
    params = {
      k: jax.device_put(v, NamedSharding(mesh, FSDP_SPECS[k]))
      for k, v in params.items()
    }
    return (params, *shard_batch(mesh, x, y))

  return step, place


PATHS = {
  "data_parallel-auto": (data_parallel_step, AxisType.Auto),
  "data_parallel-explicit": (data_parallel_step, AxisType.Explicit),
  "shard_map-auto": (shard_map_step, AxisType.Auto),
  "shard_map-explicit": (shard_map_step, AxisType.Explicit),
  "pmap": (pmap_step, None),
  "explicit-jit": (explicit_jit_step, None),
  "fsdp-auto": (fsdp_step, AxisType.Auto),
  "fsdp-explicit": (fsdp_step, AxisType.Explicit),
}


def first_device(path, tree):
  """pmap returns one copy per device; every other path a global array."""
  return jax.tree.map(lambda leaf: leaf[0], tree) if path == "pmap" else tree


@pytest.mark.parametrize("num_microbatches", [1, 2, 8])
@pytest.mark.parametrize("path", list(PATHS))
def test_matches_single_device_whole_batch(path, num_microbatches, problem):
  make_step, kind = PATHS[path]
  step, place = make_step(kind, num_microbatches)
  got = first_device(path, step(*place(*problem)))
  assert_trees_close(jax.device_get(got), GRAD_FN(*problem), rtol=1e-5)


def _collectives(path, num_microbatches, problem):
  make_step, kind = PATHS[path]
  step, place = make_step(kind, num_microbatches)
  return jaccum.inspect.collectives(step, *place(*problem))


@pytest.mark.parametrize("path", list(PATHS))
def test_no_collective_inside_the_loop(path, problem):
  small, large = (_collectives(path, k, problem) for k in (2, 8))
  assert small.inside_loops == large.inside_loops == 0, (small, large)
  assert small.outside_loops == large.outside_loops >= 1, (small, large)
  if path.startswith("fsdp"):
    # Params gathered once before the loop, gradients reduce-scattered after;
    # the one all-reduce left carries the loss value.
    assert small.all_gather.outside_loops >= 1
    assert small.reduce_scatter.outside_loops >= 1
    assert small.all_reduce.outside_loops <= 1
  else:
    assert small.all_reduce.outside_loops == 1  # one fused reduction per step


def test_the_checker_sees_the_naive_per_micro_step_psum(problem):
  """Without axis_name, JAX puts a psum into every micro-step's backward pass."""
  mesh = mesh_of(AxisType.Auto)

  def naive(params, x, y):
    value, grads = jaccum.accumulate(GRAD_FN, 8, batch_argnums=(1, 2))(params, x, y)
    # Invariant params: JAX already summed every micro-step's gradient over
    # devices (the psum in the loop), so only the mean remains to take.
    return jax.lax.pmean(value, "data"), jax.tree.map(lambda g: g / DEVICES, grads)

  step = jax.jit(
    jax.shard_map(naive, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
  )
  params, x, y = problem
  counts = jaccum.inspect.collectives(step, params, *shard_batch(mesh, x, y))
  assert counts.all_reduce.inside_loops >= 1
  assert_trees_close(step(params, x, y), GRAD_FN(params, x, y), rtol=1e-5)


def test_fsdp_gradients_stay_sharded_like_params(problem):
  step, place = fsdp_step(AxisType.Explicit, 2)
  _, grads = step(*place(*problem))
  for name, spec in FSDP_SPECS.items():
    assert grads[name].sharding.spec == spec, (name, grads[name].sharding)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_multi_axis_mesh_only_data_is_manual(kind, problem):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
  params, x, y = problem
  params = jax.device_put(params, NamedSharding(mesh, P()))
  params["w"] = jax.device_put(params["w"], NamedSharding(mesh, P(None, "model")))
  x, y = shard_batch(mesh, x, y)
  step = jax.jit(jaccum.data_parallel(GRAD_FN, 2, mesh=mesh, batch_argnums=(1, 2)))
  value, grads = step(params, x, y)
  assert grads["w"].sharding.spec == P(None, "model")
  assert_trees_close(jax.device_get((value, grads)), GRAD_FN(*problem), rtol=1e-5)
  # A model-sharded w makes the model itself communicate over "model" in
  # every micro-step (its row-parallel matmul); with params replicated over
  # "model", all that remains is the one all-reduce over "data".
  params = jax.device_put(problem[0], NamedSharding(mesh, P()))
  counts = jaccum.inspect.collectives(step, params, x, y)
  assert counts.inside_loops == 0, counts
  assert counts.all_reduce.outside_loops == 1, counts


SEQ = 12


def test_token_weighting_across_devices(problem):
  """Device d holds sequences of very different lengths from device d+1."""
  rows = 32  # 4 per device, 2 per micro-batch
  lengths = np.where(np.arange(rows) // (rows // DEVICES) % 2 == 0, SEQ, 1)
  mask = jnp.asarray(np.arange(SEQ)[None] < lengths[:, None], jnp.float32)
  x = jax.random.normal(jax.random.key(1), (rows, SEQ, 8))

  def token_loss(params, x, mask):
    per_token = jnp.tanh(x @ params["w"]).sum(-1)
    return jnp.sum(per_token**2 * mask) / jnp.sum(mask)

  grad_fn = jax.value_and_grad(token_loss)
  mesh = mesh_of(AxisType.Explicit)
  x, mask_sharded = shard_batch(mesh, x, mask)

  def step(num_tokens):
    return jax.jit(
      jaccum.data_parallel(
        grad_fn, 2, mesh=mesh, batch_argnums=(1, 2), weight_fn=num_tokens
      )
    )(problem[0], x, mask_sharded)

  expected = grad_fn(problem[0], np.asarray(x), np.asarray(mask))
  exact = step(lambda params, x, mask: mask.sum())
  assert_trees_close(jax.device_get(exact), expected, rtol=1e-5)
  naive = jax.device_get(step(None))
  assert abs(naive[0] - expected[0]) > 0.05 * abs(expected[0])


def test_concat_and_state_and_keys_across_devices(problem):
  """Per-example outputs come back in row order; state is averaged; keys differ."""
  mesh = mesh_of(AxisType.Explicit)
  num_microbatches = 2

  def fn(params, state, x, key):
    noise = jax.random.normal(key, ())
    per_example = jnp.tanh(x @ params["w"]).sum(-1)
    new_state = 0.5 * state + 0.5 * jnp.mean(x)
    return {
      "per_example": per_example,
      "noise": jnp.full(x.shape[:1], noise),
    }, new_state

  step = jax.jit(
    jaccum.data_parallel(
      fn,
      num_microbatches,
      mesh=mesh,
      batch_argnums=2,
      state_argnum=1,
      rng_argnum=3,
      reduce="concat",
    )
  )
  params, x, _ = problem
  out, state = step(params, jnp.float32(1.0), *shard_batch(mesh, x), jax.random.key(7))
  np.testing.assert_allclose(
    out["per_example"],
    fn(params, 0.0, x, jax.random.key(0))[0]["per_example"],
    rtol=1e-5,  # float32 rounding: the reference's products are whole-batch ones
    atol=1e-6,
  )
  # One key per device and micro-batch: 16 distinct noise values, each shared
  # by the rows of its micro-batch.
  assert len(np.unique(np.asarray(out["noise"]))) == DEVICES * num_microbatches
  # Reference for the state: each device threads its own micro-batches
  # (strided within its rows), then the devices are averaged.
  local = np.asarray(x).reshape(DEVICES, -1, x.shape[1])
  finals = []
  for rows in local:
    s = 1.0
    for k in range(num_microbatches):
      s = 0.5 * s + 0.5 * rows[k::num_microbatches].mean()
    finals.append(s)
  np.testing.assert_allclose(state, np.mean(finals), rtol=1e-6)


def test_errors_name_the_problem(problem):
  params, x, y = problem
  mesh = mesh_of(AxisType.Auto)
  with pytest.raises(
    ValueError, match=r"axis=\('batch',\) names \['batch'\], not axes"
  ):
    jaccum.data_parallel(GRAD_FN, 2, mesh=mesh, axis="batch", batch_argnums=(1, 2))(
      params, x, y
    )
  with pytest.raises(
    ValueError, match=r"batch_size=128 must be divisible by devices × "
  ):
    jaccum.data_parallel(GRAD_FN, 32, mesh=mesh, batch_argnums=(1, 2))(params, x, y)
  with pytest.raises(TypeError, match=r"takes `axis`, not `axis_name`"):
    jaccum.data_parallel(GRAD_FN, 2, axis_name="data")
  with pytest.raises(
    ValueError, match=r"names \['x'\], which are not axes of the mesh"
  ):
    jaccum.data_parallel(
      GRAD_FN,
      2,
      mesh=mesh,
      batch_argnums=(1, 2),
      param_specs={"w": P(("data", "x")), "b": P(), "v": P()},
    )(params, x, y)


def _no_data_axis_fronts():
  """Each front that takes `mesh=`, given one whose batch axis is "batch"."""
  from flax import linen, nnx

  import jaccum.linen
  import jaccum.nnx

  mesh = jax.make_mesh((DEVICES,), ("batch",), axis_types=(AxisType.Auto,))
  w, x = jnp.ones(4), jnp.ones((2 * DEVICES, 4))
  loss = lambda w, x: jnp.mean((x @ w) ** 2)
  model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
  dense = linen.Dense(1)
  params = dense.init(jax.random.key(0), x)["params"]
  linen_loss = lambda params, stats, x: jnp.mean(dense.apply({"params": params}, x))
  return {
    "data_parallel": lambda: jaccum.data_parallel(jax.grad(loss), 2, mesh=mesh)(w, x),
    "accumulate_coupled": lambda: jaccum.accumulate_coupled(
      lambda w, x: x @ w, lambda reps: jnp.mean(reps**2), 2, mesh=mesh
    )(w, x),
    "nnx": lambda: jaccum.nnx.value_and_grad(
      lambda m, x: jnp.mean(m(x) ** 2), 2, mesh=mesh
    )(model, x),
    "linen": lambda: jaccum.linen.value_and_grad(linen_loss, 2, mesh=mesh)(
      params, {}, x
    ),
    "fit_microbatches": lambda: jaccum.fit_microbatches(
      jax.grad(loss), w, x, memory_budget=1 << 30, mesh=mesh
    ),
  }


@pytest.mark.parametrize(
  "front",
  ["data_parallel", "accumulate_coupled", "nnx", "linen", "fit_microbatches"],
)
def test_a_mesh_without_a_data_axis_says_axis_defaulted_to_data(front):
  with pytest.raises(
    ValueError,
    match=r"\['data'\], not axes of the mesh .*'batch'.*axis defaults to 'data': "
    r"pass axis= naming the mesh axes the batch is split over, e.g. axis='batch'",
  ):
    _no_data_axis_fronts()[front]()


# Code that names the data axis, under data_parallel: each device runs its own
# rows under shard_map, so collectives over the axis mean "across devices".


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_synchronised_batchnorm_by_pmean_is_the_unsharded_accumulation(kind, problem):
  """pmean over "data" averages each micro-batch's statistics over its devices.

  With the strided split, micro-batch k of every device together is the
  unsharded micro-batch k: synchronised statistics are those of the
  one-device accumulation, at one all-reduce per micro-batch.
  """
  _, x, _ = problem
  w = jnp.linspace(-1, 1, 8)

  def normalised(w, x, mean_over_devices):
    h = jnp.tanh(x * w)
    mean = mean_over_devices(jnp.mean(h, axis=0))
    return jnp.mean((h - mean) ** 2)

  sync = lambda w, x: normalised(w, x, lambda m: jax.lax.pmean(m, "data"))
  local = lambda w, x: normalised(w, x, lambda m: m)
  mesh = mesh_of(kind)
  step = jax.jit(jaccum.data_parallel(jax.value_and_grad(sync), 2, mesh=mesh))
  x_sharded = shard_batch(mesh, x)[0]
  expected = jax.jit(jaccum.accumulate(jax.value_and_grad(local), 2))(w, x)
  assert_trees_close(step(w, x_sharded), expected, rtol=1e-5)
  counts = jaccum.inspect.collectives(step, w, x_sharded)
  assert counts.all_reduce.inside_loops >= 1  # asked for: the statistics' pmean
  assert counts.all_reduce.outside_loops == 1


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_axis_index_names_each_device(kind, problem):
  _, x, _ = problem
  mesh = mesh_of(kind)
  index = lambda w, x: jnp.full(x.shape[:1], jax.lax.axis_index("data"))
  step = jax.jit(jaccum.data_parallel(index, 2, mesh=mesh, reduce="concat"))
  got = step(jnp.ones(8), shard_batch(mesh, x)[0])
  np.testing.assert_array_equal(got, np.repeat(np.arange(DEVICES), BATCH // DEVICES))


def test_sharding_constraints_on_activations_drop_the_data_axis(problem):
  """MaxText-style constraints naming "data" run per device, with no collective.

  On a ("data", "model") mesh the constraint keeps its "model" part: the
  hidden layer is split over "model" inside the loop, and its row-parallel
  matmul all-reduces over "model" as the whole batch's does, while nothing
  crosses "data" until the one reduction after the loop.
  """
  params, x, y = problem
  for shape, spec in (((8,), P("data", None)), ((4, 2), P("data", "model"))):
    names = ("data", "model")[: len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))

    def constrained(params, x, y, mesh=mesh, spec=spec):
      hidden = jnp.tanh(x @ params["w"] + params["b"])
      hidden = jax.lax.with_sharding_constraint(hidden, NamedSharding(mesh, spec))
      return jnp.mean((hidden @ params["v"] - y) ** 2)

    step = jax.jit(
      jaccum.data_parallel(jax.grad(constrained), 2, mesh=mesh, batch_argnums=(1, 2))
    )
    batch = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y)]
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # runs per device: no fallback, no warning
      got = step(params, *batch)
    assert_trees_close(got, jax.grad(loss)(params, x, y), rtol=1e-5)
    counts = jaccum.inspect.collectives(step, params, *batch)
    # Inside the loop: only what the model axis needs, as in the whole batch.
    model_parallel = len(shape) == 2
    assert counts.all_reduce.inside_loops == int(model_parallel), counts


def test_reshard_of_an_activation_on_an_explicit_mesh_runs_per_device(problem):
  """shard_map refuses it inside the loop ("data" is manual there): jaccum
  traces grad_fn outside and runs its program per device with "data" taken
  out of the reshard, as it does for sharding constraints. Before, the loop
  ran as the whole batch's step, with a warning."""
  params, x, y = problem
  mesh = mesh_of(AxisType.Explicit)

  def resharded(params, x, y):
    hidden = jnp.tanh(x @ params["w"] + params["b"])
    hidden = jax.sharding.reshard(hidden, NamedSharding(mesh, P("data")))
    return jnp.mean((hidden @ params["v"] - y) ** 2)

  placed = jax.device_put(params, NamedSharding(mesh, P()))
  step = jax.jit(
    jaccum.data_parallel(jax.grad(resharded), 2, mesh=mesh, batch_argnums=(1, 2))
  )
  batch = shard_batch(mesh, x, y)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = step(placed, *batch)
  assert_trees_close(got, jax.grad(loss)(params, x, y), rtol=1e-5)
  assert jaccum.inspect.collectives(step, placed, *batch).inside_loops == 0


@pytest.mark.parametrize("route", ["data_parallel", "explicit-jit", "shard_map"])
def test_a_key_threaded_as_state_comes_back_as_one_device_leaves_it(route, problem):
  """Device 0 draws as one device would; the others fold in their index.

  Before, the key came back as device 0's key folded with its index, while
  the data-parallel guide said keys advance exactly as unsharded.
  """
  _, x, _ = problem
  w = jnp.linspace(-1, 1, 8)

  def grad_fn(w, key, x):
    key, sub = jax.random.split(key)
    noise = jax.random.normal(sub, x.shape[:1])
    return (jax.grad(lambda w: jnp.mean(jnp.tanh(x * w) ** 2))(w), noise), key

  options = dict(batch_argnums=2, state_argnum=1, reduce=("mean", "concat"))
  key = jax.random.key(7)
  one_device = jax.jit(jaccum.accumulate(grad_fn, 2, **options))
  (grads_one, _), key_one = one_device(w, key, x)
  mesh = mesh_of(AxisType.Explicit)
  x_sharded = shard_batch(mesh, x)[0]
  if route == "data_parallel":
    step = jax.jit(jaccum.data_parallel(grad_fn, 2, mesh=mesh, **options))
  elif route == "explicit-jit":
    step = jax.jit(jaccum.accumulate(grad_fn, 2, **options))
  else:
    step = jax.jit(
      jax.shard_map(
        jaccum.accumulate(grad_fn, 2, axis_name="data", **options),
        mesh=mesh,
        in_specs=(P(), P(), P("data")),
        out_specs=((P(), P("data")), P()),
      )
    )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the explicit route's per-device state note
    (grads, noise), new_key = step(w, key, x_sharded)
  np.testing.assert_array_equal(
    jax.random.key_data(new_key), jax.random.key_data(key_one)
  )
  assert_trees_close(grads, grads_one, rtol=1e-5)
  # Every device drew its own numbers: no two devices' rows repeat.
  per_device = np.asarray(noise).reshape(DEVICES, -1)
  assert len({tuple(np.round(rows, 6)) for rows in per_device}) == DEVICES


# --- arrays grad_fn closes over, on an explicit mesh (issue 36, item 3) ---------


def scaled_loss(params, x, y, scale):
  return loss(params, x * scale, y)


def closure_steps(mode, traces, num_microbatches=2, fsdp=True, **options):
  """The same step twice on a (data=4, model=2) explicit mesh, params FSDP
  or replicated: `grad_fn` closing over `scale` (placed on the mesh), and
  taking it as an argument, which always ran per device. Returns both, a
  function that places the inputs, `scale` and its host copy."""
  specs = FSDP_SPECS if fsdp else {k: P() for k in FSDP_SPECS}
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  host_scale = np.linspace(0.5, 1.5, 8, dtype=np.float32)
  scale = jax.device_put(host_scale, NamedSharding(mesh, P()))

  def closing(params, x, y):
    traces.append(1)
    return scaled_loss(params, x, y, scale)

  def make(fn):
    return jax.jit(
      jaccum.data_parallel(
        jax.grad(fn),
        num_microbatches,
        mesh=mesh,
        batch_argnums=(1, 2),
        param_specs=specs if fsdp else None,
        fsdp_mode=mode,
        **options,
      )
    )

  def place(params, x, y):
    params = {
      k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()
    }
    return (params, *shard_batch(mesh, x, y))

  return make(closing), make(scaled_loss), place, scale, host_scale


@pytest.mark.parametrize("mode", ["gather_once", "shard_grads", "shard_all"])
def test_a_closure_over_an_explicit_mesh_array_runs_per_device(mode, problem):
  """JAX refuses a shard_map closing over it; jaccum traces grad_fn outside
  the loop and runs its program there with the array as an input: no
  warning, the whole batch's gradient, the collectives of the step that
  takes the array as an argument (none inside the loop with "gather_once"),
  and grad_fn traced at most twice. Before, the loop ran as the whole
  batch's step, with a warning."""
  traces = []
  closing, taking, place, scale, host_scale = closure_steps(mode, traces)
  params, x, y = problem
  inputs = place(params, x, y)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    grads = closing(*inputs)
  assert len(traces) <= 2, len(traces)
  whole = jax.grad(scaled_loss)(params, x, y, host_scale)
  assert_trees_close(jax.device_get(grads), whole, rtol=1e-5)
  # The same micro-batches as the argument's step: the same bits.
  want = jax.device_get(taking(*inputs, scale))
  for name, grad in jax.device_get(grads).items():
    np.testing.assert_array_equal(grad.view(np.uint32), want[name].view(np.uint32))
  for name, grad in grads.items():
    assert grad.sharding.spec == FSDP_SPECS[name], (name, grad.sharding)
  counts = jaccum.inspect.collectives(closing, *inputs)
  assert counts == jaccum.inspect.collectives(taking, *inputs, scale), counts
  if mode == "gather_once":
    assert counts.inside_loops == 0, counts


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_closure_over_an_explicit_mesh_array_keeps_the_deterministic_bits(
  num_microbatches, problem
):
  """With deterministic=True the closure's step gives the per-device route's
  bits (D × K micro-batches); before, the fallback summed K micro-batches of
  all devices' rows, off by up to 0.4 of the bits of K × D."""
  closing, taking, place, scale, _ = closure_steps(
    "gather_once", [], num_microbatches, fsdp=False, deterministic=True
  )
  inputs = place(*problem)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = jax.device_get(closing(*inputs))
  want = jax.device_get(taking(*inputs, scale))
  for name in want:
    np.testing.assert_array_equal(got[name].view(np.uint32), want[name].view(np.uint32))


def test_a_closure_keeps_the_per_device_noise_scale(problem):
  """return_stats measures the per-device micro-batch (BATCH / (4 × 2) rows);
  before, the fallback measured micro-batches of all devices' rows (32 for 4
  in the issue), and K = 1 raised a one-device message on 4 devices."""
  for num_microbatches in (1, 2):
    closing, taking, place, scale, _ = closure_steps(
      "gather_once", [], num_microbatches, fsdp=False, return_stats=True
    )
    inputs = place(*problem)
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      (_, stats) = closing(*inputs)
    (_, want) = taking(*inputs, scale)
    assert stats.microbatch_weight == BATCH / (4 * num_microbatches)
    assert_trees_close(stats, want, rtol=1e-5)


# --- what still runs as the whole batch: the same micro-batches, or refused -----


def fallback_steps(num_microbatches, **options):
  """`grad_fn` resharding its activation over "data", on an explicit mesh:
  each device's micro-batch of BATCH / (8 K) rows does not split over 8
  devices for K = 4, so only the whole batch's step runs it. Returns that
  step, the step of the same function without the reshard (per device), and
  a function that places the inputs."""
  mesh = mesh_of(AxisType.Explicit)

  def outputs(resharded):
    def grad_fn(params, x, y):
      def per_example(params):
        hidden = jnp.tanh(x @ params["w"] + params["b"])
        if resharded:
          hidden = jax.sharding.reshard(hidden, NamedSharding(mesh, P("data")))
        return (hidden @ params["v"] - y) ** 2

      errors = per_example(params)
      grads = jax.grad(lambda p: jnp.mean(per_example(p)))(params)
      return grads, errors, errors

    return grad_fn

  def make(resharded):
    return jax.jit(
      jaccum.data_parallel(
        outputs(resharded),
        num_microbatches,
        mesh=mesh,
        batch_argnums=(1, 2),
        reduce=("mean", "concat", "last"),
        **options,
      )
    )

  def place(params, x, y):
    return (jax.device_put(params, NamedSharding(mesh, P())), *shard_batch(mesh, x, y))

  return make(True), make(False), place


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_the_whole_batch_route_cuts_the_per_device_micro_batches(split, problem):
  """Micro-batch k of the whole batch's route is every device's micro-batch
  k: the last one's rows are the per-device route's, concatenated rows come
  back in the batch's order, means are the same. Before, the contiguous
  split cut K micro-batches of the global batch (the last one on the last
  devices alone)."""
  whole_route, per_device, place = fallback_steps(4, split=split)
  inputs = place(*problem)
  with pytest.warns(UserWarning, match=r"micro-batch k is every device's"):
    grads, errors, last = whole_route(*inputs)
  want_grads, want_errors, want_last = per_device(*inputs)
  np.testing.assert_allclose(last, want_last, rtol=1e-6)
  np.testing.assert_allclose(errors, want_errors, rtol=1e-6)
  assert_trees_close(grads, want_grads, rtol=1e-5)


@pytest.mark.parametrize(
  ("num_microbatches", "rows", "options", "named"),
  [
    (4, BATCH, {"deterministic": True}, "deterministic=True"),
    (4, BATCH, {"return_stats": True}, "return_stats=True"),
    (1, 32, {"return_stats": True}, "return_stats=True"),
  ],
)
def test_the_whole_batch_route_refuses_what_only_each_devices_loop_gives(
  num_microbatches, rows, options, named, problem
):
  """Its bits, its noise scale would be of other micro-batches: refused by
  name, with the cause and the fix. Before, deterministic=True returned other
  bits, return_stats measured micro-batches of all devices' rows, and K = 1
  (4 rows per device) raised a one-device message on 8 devices."""
  whole_route, _, place = fallback_steps(num_microbatches, **options)
  params, x, y = problem
  with pytest.raises(ValueError, match=rf"{named} needs the per-device loop.*devices"):
    whole_route(*place(params, x[:rows], y[:rows]))


def test_the_whole_batch_route_refuses_per_device_state(problem):
  params, x, y = problem
  mesh = mesh_of(AxisType.Explicit)

  def grad_fn(params, count, x, y):
    hidden = jnp.tanh(x @ params["w"] + params["b"])
    hidden = jax.sharding.reshard(hidden, NamedSharding(mesh, P("data")))
    return jnp.mean((hidden @ params["v"] - y) ** 2), count + 1

  step = jax.jit(
    jaccum.data_parallel(grad_fn, 4, mesh=mesh, batch_argnums=(2, 3), state_argnum=1)
  )
  with pytest.raises(ValueError, match=r"state_argnum needs the per-device loop"):
    step(params, jnp.int32(0), *shard_batch(mesh, x, y))


def test_the_whole_batch_route_says_what_differs_for_a_mean_over_tokens(problem):
  """A mean over tokens: with weight_fn counting them, the whole batch's
  route gives the per-device route's gradient; without, the warning says the
  mean is over other micro-batches (0.37 apart in the issue)."""
  params, x, y = problem
  mask = (np.arange(BATCH) % 5 != 0) & (np.arange(BATCH) < 100)
  mesh = mesh_of(AxisType.Explicit)

  def token_loss(resharded):
    def loss_fn(params, x, y, mask):
      hidden = jnp.tanh(x @ params["w"] + params["b"])
      if resharded:
        hidden = jax.sharding.reshard(hidden, NamedSharding(mesh, P("data")))
      errors = (hidden @ params["v"] - y) ** 2
      return jnp.sum(errors * mask) / jnp.maximum(jnp.sum(mask), 1)

    return jax.grad(loss_fn)

  inputs = (
    jax.device_put(params, NamedSharding(mesh, P())),
    *shard_batch(mesh, x, y, jnp.asarray(mask, jnp.float32)),
  )
  step = lambda resharded, **options: jax.jit(
    jaccum.data_parallel(
      token_loss(resharded), 4, mesh=mesh, batch_argnums=(1, 2, 3), **options
    )
  )(*inputs)
  count = lambda params, x, y, mask: jnp.sum(mask)
  with pytest.warns(UserWarning, match=r"a mean over tokens without weight_fn"):
    weighted = step(True, weight_fn=count)
    step(True)
  assert_trees_close(weighted, step(False, weight_fn=count), rtol=1e-5)
  # The same token mean as one device gives, to float32 rounding.
  whole = token_loss(False)(params, x, y, jnp.asarray(mask, jnp.float32))
  assert_trees_close(weighted, whole, rtol=1e-5)


@jax.custom_vjp
def _clipped(x):
  return x


_clipped.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


def _embedding(params, batch, scale):
  hidden = (params["table"] * scale[0])[batch["ids"]] @ params["out"]
  labels = batch["ids"][:, 0] % 3
  return optax.softmax_cross_entropy_with_integer_labels(hidden[:, 0], labels).mean()


def _convolution(params, batch, scale):
  out = jax.lax.conv_general_dilated(
    batch["images"] * scale[0],
    params["kernel"],
    (1, 1),
    "SAME",
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
  )
  return jnp.mean(out**2)


def _control_flow(params, batch, scale):
  def layer(h, w):
    return jnp.tanh(h @ w) * scale[0], None

  h, _ = jax.lax.scan(jax.checkpoint(layer), batch["x"], params["layers"])
  h = jax.lax.cond(jnp.sum(h) > 0, lambda h: h * scale[1], lambda h: h / scale[1], h)
  h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.sin(h) + scale[i], h)
  return jnp.mean(jnp.sort(_clipped(h), axis=-1) ** 2)


MODELS = {
  "embedding": (
    _embedding,
    lambda rng: {"table": rng.normal(size=(20, 8)), "out": rng.normal(size=(8, 3))},
    lambda rng: {"ids": rng.integers(0, 20, (64, 5), dtype=np.int32)},
  ),
  "convolution": (
    _convolution,
    lambda rng: {"kernel": rng.normal(size=(3, 3, 2, 4)) / 3},
    lambda rng: {"images": rng.normal(size=(64, 6, 6, 2))},
  ),
  "scan_remat_cond_custom_vjp": (
    _control_flow,
    lambda rng: {"layers": rng.normal(size=(3, 8, 8)) / 3},
    lambda rng: {"x": rng.normal(size=(64, 8))},
  ),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_a_closure_runs_per_device_whatever_the_model(model):
  """The program traced outside the loop runs retyped inside it: gathers
  (whose dimension numbers are a NamedTuple), convolutions, scans, remat,
  cond, fori_loop and custom VJPs give the bits of the step that takes the
  closed-over array as an argument, with no warning."""
  loss_fn, make_params, make_batch = MODELS[model]
  rng = np.random.default_rng(5)
  as_f32 = lambda tree: jax.tree.map(
    lambda a: a.astype(np.float32) if a.dtype == np.float64 else a, tree
  )
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  params = jax.device_put(as_f32(make_params(rng)), NamedSharding(mesh, P()))
  batch = jax.device_put(as_f32(make_batch(rng)), NamedSharding(mesh, P("data")))
  scale = jax.device_put(
    np.linspace(0.5, 1.5, 8, dtype=np.float32), NamedSharding(mesh, P())
  )
  closing = jax.jit(
    jaccum.data_parallel(jax.grad(lambda p, b: loss_fn(p, b, scale)), 2, mesh=mesh)
  )
  taking = jax.jit(jaccum.data_parallel(jax.grad(loss_fn), 2, mesh=mesh))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = jax.device_get(closing(params, batch))
  want = jax.device_get(taking(params, batch, scale))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))

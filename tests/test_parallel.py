"""Distributed accumulation on 8 simulated CPU devices: exact, one reduction a step."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
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


def test_reshard_of_an_activation_on_an_explicit_mesh_runs_as_the_whole_batch(problem):
  """shard_map refuses it per device: the loop runs as the whole batch's, warned."""
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
  with pytest.warns(UserWarning, match="runs the loop as the whole batch's step runs"):
    got = step(placed, *shard_batch(mesh, x, y))
  assert_trees_close(got, jax.grad(loss)(params, x, y), rtol=1e-5)


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

"""`jaccum.MultiSteps` on sharded params (8 simulated devices): FSDP layouts on
explicit and auto meshes, with and without donation, against `optax.MultiSteps`."""

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

K = 4  # mini-steps per window
WINDOWS = 2
MESHES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
# FSDP layouts: params split by rows or by columns over the 8 devices.
SPECS = {"rows": P("data"), "cols": P(None, "data")}
WRAPPERS = {"jaccum": jaccum.MultiSteps, "optax": optax.MultiSteps}


def loss(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)


def sharded_params(mesh, spec):
  kw, kv = jax.random.split(jax.random.key(0))
  params = {"w": jax.random.normal(kw, (64, 32)), "v": jax.random.normal(kv, (32, 16))}
  return jax.device_put(params, NamedSharding(mesh, spec))


def mini_batches():
  kx, ky = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (WINDOWS * K, 16, 64))
  y = jax.random.normal(ky, (WINDOWS * K, 16, 16))
  return x, y


def params_shaped_leaves(state, params):
  """(path, leaf, param) for every leaf of `state` shaped like a param."""
  by_shape = {p.shape: p for p in jax.tree.leaves(params)}
  return [
    (jax.tree_util.keystr(path), leaf, by_shape[leaf.shape])
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    if leaf.shape in by_shape
  ]


def bytes_per_device(tree):
  return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("mesh_kind", list(MESHES))
def test_init_gives_the_state_the_params_sharding(mesh_kind, spec):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(MESHES[mesh_kind],))
  with jax.set_mesh(mesh):
    params = sharded_params(mesh, SPECS[spec])
    states = {name: w(optax.adam(1e-3), K).init(params) for name, w in WRAPPERS.items()}
  leaves = params_shaped_leaves(states["jaccum"], params)
  # the accumulator and Adam's two moments, for each of the two params
  assert len(leaves) == 3 * 2, [path for path, _, _ in leaves]
  for path, leaf, param in leaves:
    assert leaf.sharding.is_equivalent_to(param.sharding, leaf.ndim), (path, leaf)
    shard_shape = param.addressable_shards[0].data.shape
    assert shard_shape[0] * shard_shape[1] * 8 == param.size  # really split
    assert leaf.addressable_shards[0].data.shape == shard_shape, path
  # Per device, the same bytes as optax's state, but for three scalars.
  extra = bytes_per_device(states["jaccum"]) - bytes_per_device(states["optax"])
  assert 0 <= extra <= 16, extra


def test_init_puts_the_state_on_the_params_device():
  device = jax.devices()[3]
  params = jax.device_put({"w": jnp.ones((4, 3)), "b": jnp.ones(3)}, device)
  opt = jaccum.MultiSteps(optax.sgd(1.0, momentum=0.9), 2)
  state = opt.init(params)
  for path, leaf, _ in params_shaped_leaves(state, params):
    assert leaf.devices() == {device}, path
  for _ in range(2):
    updates, state = opt.update(jax.tree.map(jnp.ones_like, params), state, params)
  assert bool(opt.has_updated(state))
  np.testing.assert_array_equal(updates["w"], -np.ones((4, 3)))
  assert updates["w"].devices() == {device}
  for path, leaf, _ in params_shaped_leaves(state, params):
    assert leaf.devices() == {device}, path


def train(opt, mesh, params, state, donate):
  """WINDOWS windows of K mini-steps of `opt` in a jitted step, as in the issue."""

  def step(params, state, x, y):
    updates, state = opt.update(jax.grad(loss)(params, x, y), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1) if donate else ())
  donated = []
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("error")  # "Some donated buffers were not usable"
    for x, y in zip(*mini_batches(), strict=True):
      donated = jax.tree.leaves((params, state))
      params, state = step(params, state, x, y)
  if donate:  # the last call's inputs were donated, not copied
    assert all(leaf.is_deleted() for leaf in donated if leaf.ndim)
  return params, state


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("mesh_kind", list(MESHES))
def test_sharded_training_matches_optax_and_keeps_the_layout(mesh_kind, spec, donate):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(MESHES[mesh_kind],))
  results = {}
  for name, wrapper in WRAPPERS.items():
    opt = wrapper(optax.adam(1e-2), K)
    with jax.set_mesh(mesh):
      params = sharded_params(mesh, SPECS[spec])
      state = opt.init(params)
    results[name] = train(opt, mesh, params, state, donate)
  (params, state), (optax_params, optax_state) = results["jaccum"], results["optax"]
  assert int(state.gradient_step) == WINDOWS and int(state.mini_step) == 0
  assert_trees_close(params, optax_params, rtol=1e-5)
  assert_trees_close(state.inner_opt_state, optax_state.inner_opt_state, rtol=1e-5)
  moved = jax.tree.map(
    lambda a, b: float(jnp.abs(a - b).max()), params, sharded_params(mesh, SPECS[spec])
  )
  assert min(jax.tree.leaves(moved)) > 1e-3  # both windows stepped
  for path, leaf, param in params_shaped_leaves((params, state), params):
    want = NamedSharding(mesh, SPECS[spec])
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (path, leaf.sharding)
    assert param.sharding.is_equivalent_to(want, param.ndim)


def test_a_replicated_accumulator_keeps_its_layout_on_an_explicit_mesh():
  """A state whose accumulator is laid out unlike the gradients (as `init` made
  it before it followed the params, or as a user may want it) still trains, to
  the same numbers; optax's cond refuses such a state."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  opt = jaccum.MultiSteps(optax.adam(1e-2), K)
  results = []
  for replicated in (False, True):
    with jax.set_mesh(mesh):
      params = sharded_params(mesh, SPECS["rows"])
      state = opt.init(params)
      if replicated:
        state = state._replace(
          acc_grads=jax.tree.map(
            lambda p: jax.device_put(jnp.zeros(p.shape), NamedSharding(mesh, P())),
            params,
          )
        )
    results.append(train(opt, mesh, params, state, donate=False))
  (params, state), (replicated_params, replicated_state) = results
  assert_trees_close(replicated_params, params, rtol=1e-6)
  for leaf in jax.tree.leaves(replicated_state.acc_grads):
    assert leaf.sharding.is_fully_replicated
  for leaf in jax.tree.leaves(state.acc_grads):
    assert not leaf.sharding.is_fully_replicated

"""MaxText's DiLoCo trainer, ported onto plain JAX, against `jaccum.DiLoCo`.

The outside code is MaxText's (github.com/AI-Hypercomputer/maxtext, snapshot
e591f30cbbf217ed67ef71263ec0538239f9c3b8; the DiLoCo files last changed in
c660f58ee96fdbc512fa41b52ef7198d84a5cc6b, "Streaming diloco with vmap (SPMD
Version)"):

- src/maxtext/trainers/diloco/diloco.py: `build_diloco_state`,
  `build_vanilla_diloco_train_step`, `build_streaming_diloco_train_step`;
- src/maxtext/trainers/diloco/utils/spmd_diloco_sync.py:
  `synchronize_full_state`, `synchronize_fragment_state`,
  `apply_fragment_to_inner_state`;
- src/maxtext/trainers/diloco/utils/fragmenter.py:
  `FragmentedTreeManipulator` (the path taken for trees of the params'
  structure) and `get_streaming_schedule`;
- src/maxtext/trainers/diloco/utils/nnx_state_utils.py:
  `replace_nnx_model_params(_frag)`.

Transcribed line by line below, with two substitutions that change no
arithmetic: the NNX train state is a flax struct of the params, the optimizer
state and the step (what `nnx.split(..., nnx.Param, ...)` and
`nnx.Optimizer.update` read and write), and drjax's four primitives are
written out as drjax 0.2.1 computes them on a mesh without a "diloco" axis
(drjax/_src/impls.py: `broadcast` is `jnp.broadcast_to` with a leading
replica axis, `reduce_mean` is `jnp.mean` over it, `map_fn` is `jax.vmap`
over it, unpacking a tuple argument).
`test_the_drjax_stand_in_is_drjax` runs the same port on drjax itself. The
rest of MaxText (its config system, models, checkpointing) is not needed:
the trainer takes a `train_step(state, batch, key)` and a config's fields.

MaxText's defaults (src/maxtext/configs/base.yml) are used: outer Nesterov
SGD of rate 0.3 and momentum 0.9 (jaccum's default is the paper's 0.7), and
the mixing α = 0 (`communication_overlapping_alpha`; jaccum's only value).
MaxText's fragment 0 is the params that are not stacked over layers and
fragment f ≥ 1 a slice of the layers of each stacked param; jaccum's
fragments are consecutive leaves, so jaccum gets the same model with its
layers unstacked into a list, which puts the same params in the same
fragments. MaxText's own integration test (tests/integration/diloco_test.py)
works one case out by hand; `test_maxtexts_own_worked_example` checks
jaccum against its numbers.
"""

import dataclasses
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct

import jaccum

AXIS = "replica"
ROWS, WIDTH, HIDDEN, OUT = 4, 3, 4, 2


# --- drjax 0.2.1's primitives, as drjax/_src/impls.py computes them without a
# mesh axis for the placement (the sharding constraints it adds on a mesh
# change no values).


class StandInDrJax:
  """`drjax.program`, `broadcast`, `reduce_mean` and `map_fn`."""

  def __init__(self):
    self.size = None

  def program(self, placements):
    (self.size,) = placements.values()
    return lambda fn: fn

  def broadcast(self, tree, mesh=None):
    del mesh
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (self.size, *x.shape)), tree)

  def reduce_mean(self, tree):
    return jax.tree.map(lambda x: jnp.mean(x, axis=[0]), tree)

  def map_fn(self, fn, arg, mesh=None):
    del mesh
    return jax.vmap(lambda a: fn(*a) if isinstance(a, tuple) else fn(a))(arg)


# --- MaxText's trainer, transcribed: names, order and arithmetic are
# MaxText's; the drjax module and the config are arguments.


class InnerState(struct.PyTreeNode):
  """Stands for MaxText's TrainStateNNX: the model's params, and the
  optimizer's state and step count (`state.optimizer.step`)."""

  params: Any
  opt_state: Any
  step: Any


class DiLoCoTrainState(struct.PyTreeNode):
  inner_state: Any
  params: Any
  outer_opt_state: Any
  step: Any


def outer_optimizer_of(config):
  return optax.sgd(
    config.diloco_outer_lr, momentum=config.diloco_outer_momentum, nesterov=True
  )


def build_diloco_state(drjax, config, initialize_state):
  outer_optimizer = outer_optimizer_of(config)

  @drjax.program(placements={"diloco": config.num_diloco_replicas})
  def init_diloco_state():
    state = initialize_state()
    inner_state = drjax.broadcast(state)
    outer_params = state.params
    outer_opt_state = outer_optimizer.init(outer_params)
    return DiLoCoTrainState(
      inner_state=inner_state,
      params=outer_params,
      outer_opt_state=outer_opt_state,
      step=state.step,
    )

  return init_diloco_state()


def replace_model_params(s, new_params):
  return s.replace(params=new_params)


def replace_model_params_frag(s, manipulator, frag_idx, outer_frag_replica, alpha):
  full_params_dict = s.params
  if alpha > 0.0:
    inner_frag = manipulator.get_flat_fragment(full_params_dict, frag_idx)
    merged_frag = jax.tree.map(
      lambda i, o: alpha * i + (1 - alpha) * o, inner_frag, outer_frag_replica
    )
  else:
    merged_frag = outer_frag_replica
  new_full_params = manipulator.apply_flat_fragment(
    full_params_dict, frag_idx, merged_frag
  )
  return s.replace(params=new_full_params)


def synchronize_full_state(drjax, state, outer_optimizer):
  broadcast_outer_params = drjax.broadcast(state.params)
  inner_model_params = state.inner_state.params
  model_delta = jax.tree.map(
    lambda x, y: y - x, inner_model_params, broadcast_outer_params
  )
  averaged_pseudo_grad = drjax.reduce_mean(model_delta)
  updates, new_opt_state = outer_optimizer.update(
    averaged_pseudo_grad, state.outer_opt_state, state.params
  )
  new_outer_params = optax.apply_updates(state.params, updates)
  new_inner_state = drjax.map_fn(
    lambda s: replace_model_params(s, new_outer_params), state.inner_state
  )
  return state.replace(
    params=new_outer_params, outer_opt_state=new_opt_state, inner_state=new_inner_state
  )


def synchronize_fragment_state(drjax, state, manipulator, frag_idx, outer_optimizer):
  outer_params_frag = manipulator.get_flat_fragment(state.params, frag_idx)
  inner_model_params = state.inner_state.params
  inner_params_frag = manipulator.get_flat_fragment(
    inner_model_params, frag_idx, has_replica_dim=True
  )
  broadcast_outer_frag = drjax.broadcast(outer_params_frag)
  unreduced_grads = jax.tree.map(
    lambda x, y: x - y, broadcast_outer_frag, inner_params_frag
  )
  averaged_pseudo_grad = drjax.reduce_mean(unreduced_grads)
  trace_frag = manipulator.get_flat_fragment(state.outer_opt_state[0].trace, frag_idx)
  opt_state_frag = (optax.TraceState(trace=trace_frag), optax.EmptyState())
  updates_frag, new_opt_state_frag = outer_optimizer.update(
    averaged_pseudo_grad, opt_state_frag, params=outer_params_frag
  )
  new_outer_params_frag = optax.apply_updates(outer_params_frag, updates_frag)
  new_params = manipulator.apply_flat_fragment(
    state.params, frag_idx, new_outer_params_frag
  )
  new_trace = manipulator.apply_flat_fragment(
    state.outer_opt_state[0].trace, frag_idx, new_opt_state_frag[0].trace
  )
  new_outer_opt_state = (optax.TraceState(trace=new_trace), state.outer_opt_state[1])
  return state.replace(params=new_params, outer_opt_state=new_outer_opt_state)


def apply_fragment_to_inner_state(drjax, state, manipulator, frag_idx, alpha):
  outer_params_frag = manipulator.get_flat_fragment(state.params, frag_idx)
  broadcast_outer_frag = drjax.broadcast(outer_params_frag)
  new_inner_state = drjax.map_fn(
    lambda s, frag: replace_model_params_frag(s, manipulator, frag_idx, frag, alpha),
    (state.inner_state, broadcast_outer_frag),
  )
  return state.replace(inner_state=new_inner_state)


@dataclasses.dataclass
class FragmentedTreeManipulator:
  """fragmenter.py's, on the path its trainer takes: every tree it is given
  has the params' leaves, fragment 0 the params not stacked over layers,
  fragment f ≥ 1 the layers `fragment_to_layer_indices[f]` of the others."""

  keypath_to_is_scanned: dict
  fragment_to_layer_indices: dict
  num_fragments: int
  param_scan_axis: int
  leaf_keystrs: list
  fragment_to_leaf_indices: dict

  @classmethod
  def create(cls, params_tree, config):
    kvs, _ = jax.tree_util.tree_flatten_with_path(params_tree)
    num_layers = config.num_decoder_layers
    num_fragments = config.num_diloco_fragments
    num_transformer_fragments = num_fragments - 1
    assert num_transformer_fragments > 0 and num_layers % num_transformer_fragments == 0
    num_synced = num_layers // num_transformer_fragments
    fragment_to_layer_indices = {}
    for i in range(1, num_fragments):
      sync_id = i - 1
      if config.use_sequential_layers:
        indices = list(range(sync_id * num_synced, (sync_id + 1) * num_synced))
      else:
        indices = list(range(sync_id, num_layers, num_transformer_fragments))
      fragment_to_layer_indices[i] = tuple(indices)
    keypath_to_is_scanned, leaf_keystrs = {}, []
    for keypath, v in kvs:
      keystr = jax.tree_util.keystr(keypath)
      leaf_keystrs.append(keystr)
      # MaxText: the path matches /(layers|blocks|...)(/|$) and the scan axis
      # has num_layers entries; here the stacked params live under "layers".
      keypath_to_is_scanned[keystr] = (
        "'layers'" in keystr and v.ndim > 0 and v.shape[0] == num_layers
      )
    fragment_to_leaf_indices = {
      f: [i for i, k in enumerate(leaf_keystrs) if keypath_to_is_scanned[k] == (f != 0)]
      for f in range(num_fragments)
    }
    return cls(
      keypath_to_is_scanned, fragment_to_layer_indices, num_fragments, 0,
      leaf_keystrs, fragment_to_leaf_indices,
    )  # fmt: skip

  def _axis(self, v, has_replica_dim):
    scan = self.param_scan_axis
    return scan + 1 if has_replica_dim and v.ndim > scan + 1 else scan

  def _layers(self, fragment_idx):
    layer_indices = self.fragment_to_layer_indices[fragment_idx]
    assert list(layer_indices) == list(range(layer_indices[0], layer_indices[-1] + 1))
    return slice(layer_indices[0], layer_indices[-1] + 1)

  def get_flat_fragment(self, tree, fragment_idx, has_replica_dim=False):
    leaves = jax.tree_util.tree_leaves(tree)
    assert len(leaves) == len(self.leaf_keystrs)
    flat_frag = {}
    for idx in self.fragment_to_leaf_indices[fragment_idx]:
      v = leaves[idx]
      if fragment_idx == 0:
        flat_frag[self.leaf_keystrs[idx]] = v
        continue
      slc = [slice(None)] * v.ndim
      slc[self._axis(v, has_replica_dim)] = self._layers(fragment_idx)
      flat_frag[self.leaf_keystrs[idx]] = v[tuple(slc)]
    return flat_frag

  def apply_flat_fragment(
    self, tree, fragment_idx, flat_fragment, has_replica_dim=False
  ):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    new_leaves = list(leaves)
    for idx in self.fragment_to_leaf_indices[fragment_idx]:
      keystr, v = self.leaf_keystrs[idx], leaves[idx]
      if fragment_idx == 0:
        new_leaves[idx] = flat_fragment[keystr]
        continue
      slc = [slice(None)] * v.ndim
      slc[self._axis(v, has_replica_dim)] = self._layers(fragment_idx)
      new_leaves[idx] = v.at[tuple(slc)].set(flat_fragment[keystr])
    return jax.tree_util.tree_unflatten(treedef, new_leaves)


def get_streaming_schedule(config):
  num_fragments = config.num_diloco_fragments
  steps_between_syncs = int(round(config.diloco_sync_period / num_fragments))  # noqa: RUF046
  steps_between_syncs = max(1, steps_between_syncs)
  period = num_fragments * steps_between_syncs
  return steps_between_syncs, period


def build_vanilla_diloco_train_step(drjax, config, train_step):
  outer_optimizer = outer_optimizer_of(config)

  @drjax.program(placements={"diloco": config.num_diloco_replicas})
  def vanilla_diloco_train_step(state, batch, prng):
    keys = (
      jax.random.split(prng, config.num_diloco_replicas) if prng is not None else None
    )
    inner_state, metrics = drjax.map_fn(train_step, (state.inner_state, batch, keys))
    new_step = inner_state.step[0]
    state = state.replace(inner_state=inner_state, step=new_step)
    state = jax.lax.cond(
      new_step % config.diloco_sync_period == 0,
      lambda s: synchronize_full_state(drjax, s, outer_optimizer),
      lambda x: x,
      state,
    )
    return state, metrics

  return vanilla_diloco_train_step


def build_streaming_diloco_train_step(drjax, config, train_step):
  outer_optimizer = outer_optimizer_of(config)
  num_fragments = config.num_diloco_fragments
  steps_between_syncs, period = get_streaming_schedule(config)
  delay_v = config.num_communication_overlapping_steps
  alpha = config.communication_overlapping_alpha

  @drjax.program(placements={"diloco": config.num_diloco_replicas})
  def streaming_diloco_train_step(state, batch, prng):
    keys = (
      jax.random.split(prng, config.num_diloco_replicas) if prng is not None else None
    )
    inner_state, metrics = drjax.map_fn(train_step, (state.inner_state, batch, keys))
    new_step = inner_state.step[0]
    state = state.replace(inner_state=inner_state, step=new_step)
    manipulator = FragmentedTreeManipulator.create(state.params, config)

    is_sync_step = (new_step > 0) & (new_step % steps_between_syncs == 0)

    def do_sync(s):
      frag_idx = (new_step % period) // steps_between_syncs
      return jax.lax.switch(
        frag_idx,
        [lambda s_arg, idx=i: synchronize_fragment_state(
            drjax, s_arg, manipulator, idx, outer_optimizer)
         for i in range(num_fragments)],
        s,
      )  # fmt: skip

    state = jax.lax.cond(is_sync_step, do_sync, lambda s: s, state)

    is_apply_step = (new_step - delay_v > 0) & (
      (new_step - delay_v) % steps_between_syncs == 0
    )

    def do_apply(s):
      frag_idx = ((new_step - delay_v) % period) // steps_between_syncs
      return jax.lax.switch(
        frag_idx,
        [lambda s_arg, idx=i: apply_fragment_to_inner_state(
            drjax, s_arg, manipulator, idx, alpha)
         for i in range(num_fragments)],
        s,
      )  # fmt: skip

    state = jax.lax.cond(is_apply_step, do_apply, lambda s: s, state)
    return state, metrics

  return streaming_diloco_train_step


def build_diloco_train_step(drjax, config, train_step):
  if config.enable_streaming_diloco:
    return build_streaming_diloco_train_step(drjax, config, train_step)
  return build_vanilla_diloco_train_step(drjax, config, train_step)


# --- The model: an input and an output matrix (MaxText's fragment 0) around
# residual layers, whose params MaxText stacks over the layers.


def model(params_in, params_out, layers, x):
  h = jnp.tanh(x @ params_in)
  for b, w in layers:
    h = h + jnp.tanh(h @ w + b)
  return h @ params_out


def maxtext_loss(params, x, y):
  """The stacked form MaxText fragments: `layers` holds [L, …] arrays."""
  stacked = params["layers"]
  layers = [(stacked["b"][i], stacked["w"][i]) for i in range(stacked["b"].shape[0])]
  return jnp.mean((model(params["embed"], params["head"], layers, x) - y) ** 2)


def jaccum_loss(params, x, y):
  """The same model, its layers a list: jaccum's consecutive leaves."""
  layers = [(layer["b"], layer["w"]) for layer in params["layers"]]
  return jnp.mean((model(params["embed"], params["head"], layers, x) - y) ** 2)


def stacked_params(num_layers, dtype):
  rng = np.random.default_rng(0)
  normal = lambda *shape: (rng.normal(size=shape) * 0.5).astype(dtype)
  return {
    "embed": normal(WIDTH, HIDDEN),
    "head": normal(HIDDEN, OUT),
    "layers": {
      "b": normal(num_layers, HIDDEN),
      "w": normal(num_layers, HIDDEN, HIDDEN),
    },
  }


def unstacked(params):
  """jaccum's tree: leaves embed, head, then layer by layer its b and w."""
  stacked = params["layers"]
  layers = [
    {"b": stacked["b"][i], "w": stacked["w"][i]} for i in range(len(stacked["b"]))
  ]
  return {"embed": params["embed"], "head": params["head"], "layers": layers}


def batches(steps, replicas, dtype, seed=1):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(steps, replicas * ROWS, WIDTH)).astype(dtype)
  y = rng.normal(size=(steps, replicas * ROWS, OUT)).astype(dtype)
  return x, y


def config_of(replicas, sync_every, fragments, delay, num_layers, outer_lr=0.3):
  return types.SimpleNamespace(
    num_diloco_replicas=replicas,
    diloco_sync_period=sync_every,
    diloco_outer_lr=outer_lr,
    diloco_outer_momentum=0.9,
    enable_streaming_diloco=fragments > 1,
    num_diloco_fragments=fragments,
    num_communication_overlapping_steps=delay,
    communication_overlapping_alpha=0.0,
    num_decoder_layers=num_layers,
    use_sequential_layers=True,
    param_scan_axis=0,
  )


def run_maxtext(drjax, config, inner, params, xs, ys):
  """Every replica's params (stacked form) after each step."""

  def train_step(state, batch, prng_key):  # MaxText's train step, one replica
    del prng_key
    loss, grads = jax.value_and_grad(maxtext_loss)(state.params, *batch)
    updates, opt_state = inner.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), loss

  state = build_diloco_state(
    drjax,
    config,
    lambda: InnerState(
      params=params, opt_state=inner.init(params), step=jnp.zeros([], jnp.int32)
    ),
  )
  step = jax.jit(build_diloco_train_step(drjax, config, train_step))
  history = []
  for x, y in zip(xs, ys, strict=True):
    rows = lambda a: a.reshape(config.num_diloco_replicas, ROWS, *a.shape[1:])
    state, _ = step(state, (rows(x), rows(y)), None)
    history.append((jax.device_get(state.inner_state.params), state))
  return history


def run_jaccum(config, inner, params, xs, ys):
  """Every replica's params (jaccum's tree) after each step, and the snapshot:
  `DiLoCo.update` in a `shard_map` over the replicas, one per device."""
  replicas = config.num_diloco_replicas
  mesh = jax.make_mesh((replicas,), (AXIS,), devices=jax.devices()[:replicas])
  diloco = jaccum.DiLoCo(
    inner,
    config.diloco_sync_period,
    outer=outer_optimizer_of(config),
    axis_name=AXIS,
    num_fragments=config.num_diloco_fragments,
    delay=config.num_communication_overlapping_steps,
  )

  def one_step(params, state, x, y):
    params, state = jax.tree.map(lambda a: a[0], (params, state))
    grads = jax.grad(jaccum_loss)(params, x, y)
    updates, state = diloco.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return jax.tree.map(lambda a: a[None], (params, state))

  spec = jax.P(AXIS)
  step = jax.jit(jax.shard_map(one_step, mesh=mesh, in_specs=spec, out_specs=spec))
  rows = jax.NamedSharding(mesh, spec)
  start = unstacked(params)
  both = jax.tree.map(  # one copy per replica
    lambda a: jax.device_put(np.broadcast_to(a, (replicas, *a.shape)), rows),
    (start, diloco.init(start)),
  )
  history = []
  for x, y in zip(xs, ys, strict=True):
    both = step(*both, jax.device_put(x, rows), jax.device_put(y, rows))
    history.append(jax.device_get((both[0], both[1].snapshot)))
  return history


def replica_leaves(tree, r, unstack):
  """Replica r's leaves, in jaccum's order."""
  tree = jax.tree.map(lambda a: a[r], tree)
  return jax.tree.leaves(unstacked(tree) if unstack else tree)


def assert_same(theirs, ours, replicas, rtol, atol):
  """Every replica's params after every step."""
  for t, ((mine, _), (their, _)) in enumerate(zip(ours, theirs, strict=True)):
    for r in range(replicas):
      pairs = zip(
        replica_leaves(mine, r, False), replica_leaves(their, r, True), strict=True
      )
      for got, want in pairs:
        np.testing.assert_allclose(
          got, want, rtol=rtol, atol=atol, err_msg=f"step {t + 1}, replica {r}"
        )


# (inner, replicas, H, fragments, delay, layers): vanilla DiLoCo, and
# Streaming DiLoCo with two and three fragments and a delay (a delay of 0 is
# vanilla's path in each fragment's sync).
CASES = [
  ("adamw", 4, 4, 1, 0, 2),
  ("sgd", 4, 4, 2, 1, 1),
  ("adamw", 2, 6, 3, 1, 2),
]
INNER = {
  "adamw": lambda: optax.adamw(0.05, weight_decay=0.1),
  "sgd": lambda: optax.sgd(0.1, momentum=0.5),
}


def run_both(case, dtype, drjax=None):
  inner, replicas, sync_every, fragments, delay, layers = case
  config = config_of(replicas, sync_every, fragments, delay, layers)
  steps = 2 * sync_every + delay  # two rounds, and the last sync's landing
  params = stacked_params(layers, dtype)
  xs, ys = batches(steps, replicas, dtype)
  drjax = drjax or StandInDrJax()
  theirs = run_maxtext(drjax, config, INNER[inner](), params, xs, ys)
  ours = run_jaccum(config, INNER[inner](), params, xs, ys)
  return params, theirs, ours


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_maxtexts_trainer_and_jaccum_agree_in_float64(case):
  """From the same start on the same rows, every replica's params after every
  step agree to float64 rounding, and the shared params too: MaxText's outer
  params after step t are jaccum's snapshot after step t + delay (MaxText
  steps them at the sync, jaccum where the update lands)."""
  replicas, delay = case[1], case[4]
  with jax.enable_x64(True):
    params, theirs, ours = run_both(case, np.float64)
  assert_same(theirs, ours, replicas, rtol=1e-12, atol=1e-14)
  for t in range(len(theirs) - delay):
    outer = jax.tree.leaves(unstacked(jax.device_get(theirs[t][1].params)))
    snapshot = ours[t + delay][1]
    for r in range(replicas):
      for got, want in zip(replica_leaves(snapshot, r, False), outer, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
  # Not a trivial agreement: the replicas moved apart, and the syncs moved
  # the shared params.
  assert any(not np.allclose(p["embed"][0], p["embed"][1]) for p, _ in theirs)
  assert not np.allclose(theirs[-1][1].params["embed"], params["embed"])


def test_in_float32_both_are_as_close_to_float64_as_to_each_other():
  """Float32: the two differ from the first step on (the replicas' gradients
  compile differently: `vmap` there, `shard_map` here), by float32 rounding:
  within 1e-6 of the largest param of each other and of float64's params.
  With inner SGD: Adam's step of a gradient near 0 amplifies its rounding."""
  case = CASES[1]
  with jax.enable_x64(True):
    _, theirs64, ours64 = run_both(case, np.float64)
  _, theirs, ours = run_both(case, np.float32)
  replicas = case[1]
  scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(theirs64[-1][0]))
  assert_same(theirs, ours, replicas, rtol=0, atol=1e-6 * scale)
  assert_same(theirs64, ours, replicas, rtol=0, atol=1e-6 * scale)
  assert_same(theirs, ours64, replicas, rtol=0, atol=1e-6 * scale)


@pytest.mark.filterwarnings("ignore:jax.interpreters.pxla.thread_resources")
def test_the_drjax_stand_in_is_drjax():
  """The port on drjax itself (the `test` extra installs it) gives the
  stand-in's bits."""
  import drjax

  case = CASES[1]
  _, theirs, _ = run_both(case, np.float32)
  _, real, _ = run_both(case, np.float32, drjax=drjax)
  for (a, _), (b, _) in zip(theirs, real, strict=True):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      np.testing.assert_array_equal(x, y)


def test_maxtexts_own_worked_example():
  """tests/integration/diloco_test.py in MaxText works two replicas of a
  linear model out by hand (inner SGD 0.1, H = 3, outer Nesterov of rate 1
  and momentum 0.9): jaccum gives its losses and its synced params."""
  inputs = np.array([[[0.0, 1.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]], np.float32)
  labels = np.array([[[1.0], [2.0]], [[2.0], [3.0]]], np.float32)
  params = {
    "kernel": np.array([[2.0], [1.0]], np.float32),
    "bias": np.ones(1, np.float32),
  }

  def loss(p, x, y):
    return jnp.mean((x @ p["kernel"] + p["bias"] - y) ** 2)

  mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2])
  outer = optax.sgd(1.0, momentum=0.9, nesterov=True)
  diloco = jaccum.DiLoCo(optax.sgd(0.1), 3, outer=outer, axis_name=AXIS)
  step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh, batch_argnums=(1, 2))
  replicas, state = step.init(params)
  x, y = inputs.reshape(4, 2), labels.reshape(4, 1)
  losses = []
  for t in range(4):
    replicas, state, value = jax.block_until_ready(step(replicas, state, x, y))
    losses.append(value)
    if t == 2:  # synced: the params MaxText's comments give, on both replicas
      np.testing.assert_allclose(
        replicas["kernel"][:, :, 0], [[1.5345, 1.0494]] * 2, atol=6e-5
      )
      np.testing.assert_allclose(replicas["bias"][:, 0], [0.5839] * 2, atol=6e-5)
  # Each replica's loss before each step: MaxText's comments (step 4 to the
  # digits they give).
  np.testing.assert_allclose(
    losses[:3], [[1.0, 1.0], [0.49, 0.81], [0.2401, 0.6561]], rtol=1e-5
  )
  np.testing.assert_allclose(losses[3], [0.2075, 0.94], atol=1e-3)

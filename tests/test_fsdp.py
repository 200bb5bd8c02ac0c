"""FSDP modes on 8 simulated devices: exact, sharded, and what each keeps per device.

`data_parallel(..., param_specs=..., fsdp_mode=...)`: `"gather_once"` gathers
the params before the loop and reduce-scatters after it; `"shard_grads"`
(ZeRO-2) reduce-scatters every micro-batch's gradients into a sharded
accumulator; `"shard_all"` (ZeRO-3) keeps the params sharded and gathers each
where it is used, one layer per iteration where a `lax.scan` slices a stack.
Every mode gives the whole-batch gradient, sharded like the params.
"""

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
MODES = ["gather_once", "shard_grads", "shard_all"]
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")


def stacked_mlp(layers=8, width=128, batch=64, seed=0):
  """Layers stacked on a leading axis and run by a remat'd lax.scan, a head."""
  rng = np.random.default_rng(seed)
  params = {
    "stack": jnp.asarray(
      rng.normal(size=(layers, width, width)) / np.sqrt(width), jnp.float32
    ),
    "head": jnp.asarray(rng.normal(size=(width, 8)) / np.sqrt(width), jnp.float32),
  }
  x = jnp.asarray(rng.normal(size=(batch, width)), jnp.float32)

  def loss(params, x):
    def block(h, w):
      return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(jax.checkpoint(block), x, params["stack"])
    return jnp.mean((h @ params["head"]) ** 2)

  specs = {"stack": P(None, None, "data"), "head": P("data")}
  return params, x, loss, specs


def dense_mlp(seed=1):
  """Separate layers, as a dict: each weight gathered right before each use."""
  rng = np.random.default_rng(seed)
  params = {
    "w1": jnp.asarray(rng.normal(size=(16, 64)) / 4, jnp.float32),
    "b1": jnp.zeros(64, jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(64, 32)) / 8, jnp.float32),
    "w3": jnp.asarray(rng.normal(size=(32, 4)) / 6, jnp.float32),
  }
  x = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)

  def loss(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"])
    return jnp.mean((h @ params["w3"]) ** 2) + 1e-3 * jnp.sum(params["w2"] ** 2)

  # w3 (32, 4): its first dimension is split; b1 replicated.
  specs = {"w1": P(None, "data"), "b1": P(), "w2": P("data"), "w3": P("data")}
  return params, x, loss, specs


def mesh_of(kind):
  return jax.make_mesh((DEVICES,), ("data",), axis_types=(kind,))


def placed(mesh, params, specs, x):
  params = {
    k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()
  }
  return params, jax.device_put(x, NamedSharding(mesh, P("data")))


def step_of(loss, mesh, specs, mode, **options):
  return jax.jit(
    jaccum.data_parallel(
      jax.value_and_grad(loss),
      K,
      mesh=mesh,
      param_specs=specs,
      fsdp_mode=mode,
      **options,
    )
  )


@pytest.mark.parametrize("model", [stacked_mlp, dense_mlp])
@pytest.mark.parametrize(
  "kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_the_whole_batch_gradient_sharded_like_the_params(
  mode, kind, model
):
  params, x, loss, specs = model()
  mesh = mesh_of(kind)
  value, grads = step_of(loss, mesh, specs, mode)(*placed(mesh, params, specs, x))
  want_value, want_grads = jax.jit(jax.value_and_grad(loss))(params, x)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  assert_trees_close(grads, want_grads, rtol=2e-5, atol=1e-7)
  for name, grad in grads.items():
    like = NamedSharding(mesh, specs[name])
    assert grad.sharding.is_equivalent_to(like, grad.ndim), (name, grad.sharding)


def split_off_the_leading_axis(seed=2):
  """float64 params each split along an axis other than their first: a stack
  split along its middle axis, sliced by a scan; a 3-D weight split along
  its last, and a matrix along its second, each used whole outside it."""
  rng = np.random.default_rng(seed)
  shapes = {"stack": (3, 16, 16), "cube": (2, 16, 24), "out": (24, 16)}
  params = {
    k: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-2]), jnp.float64)
    for k, s in shapes.items()
  }
  x = jnp.asarray(rng.normal(size=(64, 16)), jnp.float64)

  def loss(params, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["stack"])
    h = jnp.tanh(jnp.einsum("bi,cij->bj", h, params["cube"]))
    return jnp.mean(jnp.sin(h @ params["out"]))

  specs = {
    "stack": P(None, "data", None),
    "cube": P(None, None, "data"),
    "out": P(None, "data"),
  }
  return params, x, loss, specs


@pytest.mark.parametrize("mode", MODES)
def test_params_split_off_the_leading_axis_give_the_float64_whole_batch_gradient(
  mode,
):
  """Issue 39, item 4: shard_all gathers and scatters each param along its
  leading axis, whichever `param_specs` splits, moving the axis there and
  back. Against the whole batch's float64 gradient to 1e-12, sharded like
  the params; and every gather and reduce-scatter jaccum asks for is along
  axis 0."""
  with jax.enable_x64(True):
    params, x, loss, specs = split_off_the_leading_axis()
    mesh = mesh_of(AxisType.Auto)
    args = placed(mesh, params, specs, x)
    step = step_of(loss, mesh, specs, mode)
    value, grads = step(*args)
    want_value, want_grads = jax.value_and_grad(loss)(params, x)
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    for name, grad in grads.items():
      assert grad.dtype == jnp.float64, name
      np.testing.assert_allclose(grad, want_grads[name], rtol=1e-12, atol=1e-14)
      like = NamedSharding(mesh, specs[name])
      assert grad.sharding.is_equivalent_to(like, grad.ndim), (name, grad.sharding)
    if mode == "shard_all":
      found = collectives_in(jax.make_jaxpr(step)(*args).jaxpr)
      gathers = [p["all_gather_dimension"] for n, p in found if n == "all_gather"]
      scatters = [p["scatter_dimension"] for n, p in found if n == "reduce_scatter"]
      assert gathers and set(gathers) == {0}, found
      assert scatters and set(scatters) == {0}, found


def collectives_in(jaxpr):
  """`(name, params)` of every gather and reduce-scatter, nested jaxprs too."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("all_gather", "reduce_scatter"):
      found.append((eqn.primitive.name, eqn.params))
    for value in eqn.params.values():
      for inner in value if isinstance(value, (list, tuple)) else [value]:
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          found += collectives_in(inner)
  return found


def test_what_each_mode_keeps_per_device_and_where_it_communicates():
  """Temporaries per device from XLA, and the collectives inside the loop.

  For 2.0 MiB of params P (8 layers of 256x256 float32 and a head):
  shard_all keeps at most a quarter of gather_once's temporaries, and
  shard_grads at least 0.6P less than gather_once (its accumulator is
  sharded). The measured figures are in the data-parallel guide
  (`python -m benchmarks --parts fsdp`).
  """
  params, x, loss, specs = stacked_mlp(layers=8, width=256)
  params_bytes = sum(v.nbytes for v in params.values())
  mesh = mesh_of(AxisType.Auto)
  args = placed(mesh, params, specs, x)
  temps, counts = {}, {}
  for mode in MODES:
    step = step_of(loss, mesh, specs, mode)
    temps[mode] = jaccum.inspect.memory(step, *args).temp_bytes
    counts[mode] = jaccum.inspect.collectives(step, *args)
  assert temps["shard_all"] <= temps["gather_once"] / 4, temps
  assert temps["gather_once"] - temps["shard_grads"] >= 0.6 * params_bytes, temps
  # gather_once: nothing in the loop. shard_grads: a reduce-scatter per
  # micro-batch. shard_all: gathers and reduce-scatters in the loop (one
  # layer per iteration of the model's own scan); never an all-reduce there.
  assert counts["gather_once"].inside_loops == 0, counts["gather_once"]
  assert counts["shard_grads"].reduce_scatter.inside_loops >= 1
  assert counts["shard_grads"].all_gather.inside_loops == 0
  assert counts["shard_all"].all_gather.inside_loops >= 1
  assert counts["shard_all"].reduce_scatter.inside_loops >= 1
  for mode in MODES:
    assert counts[mode].all_reduce.inside_loops == 0, (mode, counts[mode])


def test_separate_layers_are_gathered_per_use_and_freed_between():
  """A dict of weights, no scan: each gathered right before each of its uses.

  XLA would hoist a loop-invariant gather out of the loop and merge a
  weight's forward and backward gathers; each gather is tied to its use, so
  the whole weights never all live at once. Measured on 6 layers of 512x512
  float32: 0.48P of temporaries for shard_all, 2.17P for gather_once.
  """
  rng = np.random.default_rng(5)
  params = {
    f"w{i}": jnp.asarray(rng.normal(size=(256, 256)) / 16, jnp.float32)
    for i in range(6)
  }
  specs = {name: P(None, "data") for name in params}
  x = jnp.asarray(rng.normal(size=(64, 256)), jnp.float32)

  def loss(params, x):
    for i in range(6):
      x = jnp.tanh(x @ params[f"w{i}"])
    return jnp.mean(x**2)

  size = sum(v.nbytes for v in params.values())
  mesh = mesh_of(AxisType.Auto)
  args = placed(mesh, params, specs, x)
  every = step_of(loss, mesh, specs, "shard_all")
  once = step_of(loss, mesh, specs, "gather_once")
  assert_trees_close(every(*args)[1], jax.grad(loss)(params, x), rtol=2e-5)
  temps = {
    name: jaccum.inspect.memory(step, *args).temp_bytes
    for name, step in (("shard_all", every), ("gather_once", once))
  }
  assert temps["shard_all"] <= temps["gather_once"] / 4, (temps, size)
  counts = jaccum.inspect.collectives(every, *args)
  # w0 is used once (the input needs no gradient), w1..w5 twice.
  assert counts.all_gather.inside_loops == 11, counts
  assert counts.all_gather.outside_loops == 0, counts


def _zero3_by_hand(layer, mesh, specs, remat):
  """A hand-written ZeRO-3 step: each layer all-gathered inside its scan step,
  its gradient reduce-scattered by JAX's transpose of the gather, K
  micro-batches summed in a `lax.scan` under `shard_map`."""

  def per_device(params, x):
    def local_loss(params, rows):
      def block(h, shard):
        return layer(h, jax.lax.all_gather(shard, "data", axis=1, tiled=True))

      h, _ = jax.lax.scan(
        jax.checkpoint(block) if remat else block, rows, params["stack"]
      )
      head = jax.lax.all_gather(params["head"], "data", axis=0, tiled=True)
      return jnp.mean((h @ head) ** 2) / DEVICES

    def micro(acc, rows):
      grads = jax.grad(local_loss)(params, rows)
      return jax.tree.map(lambda a, g: a + g / K, acc, grads), None

    rows = x.reshape(K, -1, x.shape[-1])
    return jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), rows)[0]

  return jax.jit(
    jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs)
  )


@pytest.mark.parametrize(
  ("rows", "remat", "bound"), [(64, False, 0.2), (256, True, 0.25), (64, True, 0.2)]
)
def test_shard_all_keeps_a_fifth_of_gather_once_and_no_more_than_zero3_by_hand(
  rows, remat, bound
):
  """Issues 28 (item 11) and 39 (item 4): 8 layers of 1024² float32 in a
  `lax.scan`, K = 4, `rows` per micro-batch per device. shard_all holds at
  most `bound` times gather_once's temporaries (0.18 at 64 rows without
  remat, 0.26 before each layer was gathered and scattered along its
  leading axis and the stack tied per slice), and never more than a
  hand-written ZeRO-3 loop of the same model (which, without remat, keeps
  every gathered layer for the backward pass: 50 MiB)."""
  params = {
    "stack": jax.ShapeDtypeStruct((8, 1024, 1024), jnp.float32),
    "head": jax.ShapeDtypeStruct((1024, 8), jnp.float32),
  }
  specs = {"stack": P(None, None, "data"), "head": P("data")}

  def layer(h, w):
    return jnp.tanh(h @ w), None

  def loss(params, x):
    block = jax.checkpoint(layer) if remat else layer
    h, _ = jax.lax.scan(block, x, params["stack"])
    return jnp.mean((h @ params["head"]) ** 2)

  mesh = mesh_of(AxisType.Auto)
  sharded = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
    for k, v in params.items()
  }
  x = jax.ShapeDtypeStruct(
    (DEVICES * K * rows, 1024), jnp.float32, sharding=NamedSharding(mesh, P("data"))
  )
  temps = {
    mode: jaccum.inspect.memory(
      jax.jit(
        jaccum.data_parallel(
          jax.grad(loss), K, mesh=mesh, param_specs=specs, fsdp_mode=mode
        )
      ),
      sharded,
      x,
    ).temp_bytes
    for mode in ("gather_once", "shard_all")
  }
  by_hand = _zero3_by_hand(layer, mesh, specs, remat)
  temps["by_hand"] = jaccum.inspect.memory(by_hand, sharded, x).temp_bytes
  assert temps["shard_all"] <= bound * temps["gather_once"], temps
  assert temps["shard_all"] <= temps["by_hand"], temps


def device_groups(text):
  """The groups of devices a collective in compiled HLO text runs over, as a
  set of frozensets of positions in the mesh (jaccum.inspect reads the forms)."""
  groups = jaccum.inspect._device_groups(text, DEVICES)
  assert groups is not None, f"replica groups in a form not read: {text[:300]}"
  return {frozenset(group) for group in groups}


@pytest.mark.parametrize("mode", MODES)
def test_hybrid_scatters_over_fsdp_in_the_loop_and_sums_replicas_once_after(mode):
  """HSDP: axis=("replica", "fsdp"), params split over "fsdp" only.

  Read from the compiled program: every collective inside the loop runs
  within a replica (the devices of one row of the mesh), and the one
  all-reduce after it across replicas (one column); nothing else crosses
  "replica".
  """
  params, x, loss, _ = stacked_mlp(layers=4, width=32)
  mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), axis_types=(AxisType.Auto,) * 2)
  specs = {"stack": P(None, "fsdp", None), "head": P("fsdp")}
  step = jax.jit(
    jaccum.data_parallel(
      jax.grad(loss),
      2,
      mesh=mesh,
      axis=("replica", "fsdp"),
      param_specs=specs,
      fsdp_mode=mode,
    )
  )
  placed_params = {
    k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()
  }
  x_sharded = jax.device_put(x, NamedSharding(mesh, P(("replica", "fsdp"))))
  grads = step(placed_params, x_sharded)
  assert_trees_close(grads, jax.grad(loss)(params, x), rtol=2e-5, atol=1e-7)
  counts = jaccum.inspect.collectives(step, placed_params, x_sharded)
  assert counts.all_reduce.inside_loops == 0, counts
  assert counts.all_reduce.outside_loops == 1, counts  # over "replica", once
  if mode != "gather_once":
    assert counts.reduce_scatter.inside_loops >= 1, counts
  ids = np.arange(DEVICES).reshape(mesh.devices.shape)  # how the HLO numbers them
  within_replicas = {frozenset(row.tolist()) for row in ids}  # over "fsdp"
  across_replicas = {frozenset(column.tolist()) for column in ids.T}
  text = step.lower(placed_params, x_sharded).compile().as_text()
  found = [
    (i.inside_loop, i.opcode.removesuffix("-start"), device_groups(i.text))
    for i in jaccum.inspect._instructions(text)
    if i.opcode.removesuffix("-start") in COLLECTIVES
  ]
  inside = [groups for in_loop, _, groups in found if in_loop]
  assert len(inside) == counts.inside_loops, found
  assert all(groups == within_replicas for groups in inside), found
  after = [(op, groups) for in_loop, op, groups in found if not in_loop]
  assert [groups for op, groups in after if op == "all-reduce"] == [across_replicas]
  assert all(groups == within_replicas for op, groups in after if op != "all-reduce")


@pytest.mark.parametrize("mode", MODES)
def test_weights_stats_state_and_keys_mean_what_they_mean_on_one_device(mode):
  """Every option, every mode: the same figures as gather_once (checked exact)."""
  params, x, loss, specs = dense_mlp()
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, 4, size=64), jnp.float32)

  def grad_fn(params, count, key, x, tokens):
    noise = jax.random.normal(key, x.shape) * 0.01
    per_row = jax.vmap(lambda xi: loss(params, xi[None]))(x + noise)
    value = jnp.sum(per_row * tokens) / jnp.maximum(jnp.sum(tokens), 1)
    grads = jax.grad(
      lambda p: (
        jnp.sum(jax.vmap(lambda xi: loss(p, xi[None]))(x + noise) * tokens)
        / jnp.maximum(jnp.sum(tokens), 1)
      )
    )(params)
    return (value, grads), count + 1

  mesh = mesh_of(AxisType.Auto)
  p, x_sharded = placed(mesh, params, specs, x)
  tokens_sharded = jax.device_put(tokens, NamedSharding(mesh, P("data")))

  def run(mode):
    step = jax.jit(
      jaccum.data_parallel(
        grad_fn,
        K,
        mesh=mesh,
        param_specs=specs,
        fsdp_mode=mode,
        batch_argnums=(3, 4),
        state_argnum=1,
        rng_argnum=2,
        weight_fn=lambda p, c, k, x, t: jnp.sum(t),
        grad_leaves=(False, True),
        return_stats=True,
      )
    )
    return step(p, jnp.int32(0), jax.random.key(0), x_sharded, tokens_sharded)

  ((value, grads), count), stats = run(mode)
  ((want_value, want_grads), want_count), want_stats = run("gather_once")
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  assert_trees_close(grads, want_grads, rtol=2e-5, atol=1e-7)
  assert int(count) == K  # threaded through each device's micro-batches
  for name in want_stats._fields:
    np.testing.assert_allclose(
      getattr(stats, name), getattr(want_stats, name), rtol=1e-4, err_msg=name
    )
  del want_count


@pytest.mark.parametrize("mode", MODES)
def test_multisteps_takes_sharded_gradients_in_every_mode(mode):
  params, x, loss, specs = dense_mlp()
  mesh = mesh_of(AxisType.Auto)
  p, x_sharded = placed(mesh, params, specs, x)
  step = jax.jit(
    jaccum.data_parallel(
      jax.grad(loss), K, mesh=mesh, param_specs=specs, fsdp_mode=mode
    )
  )
  opt = jaccum.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
  state = opt.init(p)
  updated = p
  for _ in range(2):
    updates, state = opt.update(step(updated, x_sharded), state, updated)
    updated = optax.apply_updates(updated, updates)
  # Two calls with the same gradients: one Adam step on them.
  reference = optax.adam(1e-2)
  whole = jax.grad(loss)(params, x)
  ref_updates, _ = reference.update(whole, reference.init(params), params)
  # The second call saw the same params (the first emitted nothing).
  assert_trees_close(updated, optax.apply_updates(params, ref_updates), rtol=1e-5)
  assert updated["w2"].sharding.is_equivalent_to(NamedSharding(mesh, specs["w2"]), 2)


def test_an_unknown_mode_lists_the_three():
  with pytest.raises(ValueError, match=r"fsdp_mode must be one of \('gather_once', "):
    jaccum.data_parallel(jax.grad(lambda w, x: jnp.sum(x * w)), 2, fsdp_mode="zero3")


def test_a_model_too_big_unsharded_trains_with_shard_all_where_gather_once_is_refused():
  """A budget below the params' own bytes: they cannot sit whole on a device.

  fit_microbatches finds no K for gather_once (which gathers them whole),
  and a K >= 2 for shard_all (candidates from 2 up: a real accumulation
  loop; its peak at K=1, with no loop, is lower still). That step trains
  as plain SGD on the whole batch's gradient does, step for step.
  """
  params, x, loss, specs = stacked_mlp(layers=8, width=256)
  params_bytes = sum(v.nbytes for v in params.values())
  mesh = mesh_of(AxisType.Auto)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
  x_abstract = jax.ShapeDtypeStruct(x.shape, x.dtype)
  # Per device. Measured peaks: shard_all 0.76P-0.77P for K in 2..8,
  # gather_once above 3.2P for every K.
  budget = int(0.9 * params_bytes)
  assert budget < params_bytes
  options = dict(mesh=mesh, param_specs=specs)
  # Refused, with the modes that keep more sharded named.
  with pytest.raises(ValueError, match=r"no candidate K fits[^\n]*'shard_all'"):
    jaccum.fit_microbatches(  # every K that divides the 8 rows per device
      jax.grad(loss), abstract, x_abstract, memory_budget=budget, **options
    )
  fit = jaccum.fit_microbatches(
    jax.grad(loss),
    abstract,
    x_abstract,
    memory_budget=budget,
    fsdp_mode="shard_all",
    candidates=(2, 4, 8),
    **options,
  )
  assert fit.num_microbatches >= 2, fit
  assert fit.peak_bytes <= budget, fit
  step = jax.jit(
    jaccum.data_parallel(
      jax.grad(loss),
      fit.num_microbatches,
      fsdp_mode="shard_all",
      **options,
    )
  )
  p, x_sharded = placed(mesh, params, specs, x)
  whole = params  # the reference: unsharded, the whole batch's gradient
  optimizer = optax.sgd(0.1)
  opt_state, whole_state = optimizer.init(p), optimizer.init(whole)
  for _ in range(3):
    updates, opt_state = optimizer.update(step(p, x_sharded), opt_state)
    p = optax.apply_updates(p, updates)
    updates, whole_state = optimizer.update(jax.grad(loss)(whole, x), whole_state)
    whole = optax.apply_updates(whole, updates)
    assert_trees_close(p, whole, rtol=2e-5, atol=1e-7)
  assert loss(whole, x) < loss(params, x)
  assert p["stack"].sharding.is_equivalent_to(NamedSharding(mesh, specs["stack"]), 3)


@pytest.mark.parametrize("mode", ["shard_grads", "shard_all"])
def test_bf16_gradients_are_scattered_in_the_accumulators_dtype(mode):
  """float32 by default; bf16 on the wire only where accum_dtype=None asks for it."""
  params, x, loss, specs = dense_mlp()
  params16 = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)
  loss16 = lambda p, x: loss(p, x.astype(jnp.bfloat16)).astype(jnp.float32)
  mesh = mesh_of(AxisType.Auto)
  args = placed(mesh, params16, specs, x)
  exact = jax.grad(loss)(jax.tree.map(lambda v: v.astype(jnp.float32), params16), x)

  def scatter_types(accum_dtype):
    step = jax.jit(
      jaccum.data_parallel(
        jax.grad(loss16),
        K,
        mesh=mesh,
        param_specs=specs,
        fsdp_mode=mode,
        accum_dtype=accum_dtype,
      )
    )
    # What jaccum asks for (its program, before XLA:CPU, which may widen bf16
    # collectives itself, compiles it).
    text = str(jax.make_jaxpr(step)(*args))
    types = {
      line.split("=")[0].split(":")[-1].split("[")[0].strip()
      for line in text.splitlines()
      if "= reduce_scatter[" in line
    }
    return step(*args), types

  grads, types = scatter_types(jnp.float32)
  assert types == {"f32"}, types
  assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(
    lambda g: g.dtype, params16
  )
  for name in grads:
    error = jnp.max(jnp.abs(grads[name].astype(jnp.float32) - exact[name]))
    assert error <= 2e-2 * jnp.max(jnp.abs(exact[name])), name
  _, narrow = scatter_types(None)
  assert narrow == {"bf16"}, narrow


def test_bytes_on_the_wire_per_step_follow_each_mode():
  """From the compiled program, per device: P bytes of params, K micro-batches.

  Measured on 2 MiB of params, K=4: gather_once 2P, shard_grads 5P, shard_all
  12P (the stack gathered in the forward and again in the backward).
  """
  params, x, loss, specs = stacked_mlp(layers=8, width=256)
  size = sum(v.nbytes for v in params.values())
  stack = params["stack"].nbytes
  mesh = mesh_of(AxisType.Auto)
  args = placed(mesh, params, specs, x)
  found = {
    mode: jaccum.inspect.collectives(step_of(loss, mesh, specs, mode), *args)
    for mode in MODES
  }
  once, grads, every = found["gather_once"], found["shard_grads"], found["shard_all"]
  # gather_once: every param gathered once, every gradient scattered once.
  assert once.all_gather.bytes_outside_loops == size
  assert once.reduce_scatter.bytes_outside_loops == size
  assert (
    once.all_gather.bytes_inside_loops == once.reduce_scatter.bytes_inside_loops == 0
  )
  # shard_grads: the same gather, and a scatter per micro-batch.
  assert grads.all_gather.bytes_outside_loops == size
  assert grads.reduce_scatter.bytes_inside_loops == K * size
  # shard_all: the stacked layers gathered twice per micro-batch (forward, and
  # again for the backward's recompute), the gradients scattered once each.
  assert every.reduce_scatter.bytes_inside_loops == K * size
  assert every.all_gather.bytes_inside_loops >= 2 * K * stack
  assert every.bytes_per_step <= (3 * K + 1) * size


def test_an_nnx_scan_over_stacked_blocks_gathers_one_block_at_a_time():
  """Flax NNX's nnx.vmap-made stack run by nnx.scan, split and merged functionally."""
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(128, 128, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.linear(x))

  class Model(nnx.Module):
    def __init__(self, rngs):
      @nnx.split_rngs(splits=8)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Block(rngs)

      self.blocks = make(rngs)
      self.head = nnx.Linear(128, 8, rngs=rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def step(x, block):
        return block(x)

      return self.head(step(x, self.blocks))

  graphdef, state = nnx.split(Model(nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)

  def loss(params, x):
    return jnp.mean(nnx.merge(graphdef, nnx.State(params))(x) ** 2)

  specs = {
    "blocks": {"linear": {"kernel": P(None, None, "data"), "bias": P(None, "data")}},
    "head": {"kernel": P("data"), "bias": P()},
  }
  mesh = mesh_of(AxisType.Auto)
  x = jnp.asarray(np.random.default_rng(6).normal(size=(64, 128)), jnp.float32)
  placed_params = jax.tree.map(
    lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), params, specs
  )
  x_sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
  temps = {}
  for mode in ("gather_once", "shard_all"):
    step = jax.jit(
      jaccum.data_parallel(
        jax.grad(loss), 2, mesh=mesh, param_specs=specs, fsdp_mode=mode
      )
    )
    assert_trees_close(
      step(placed_params, x_sharded), jax.grad(loss)(params, x), rtol=2e-5, atol=1e-7
    )
    temps[mode] = jaccum.inspect.memory(step, placed_params, x_sharded).temp_bytes
    if mode == "shard_all":
      counts = jaccum.inspect.collectives(step, placed_params, x_sharded)
      assert counts.all_gather.inside_loops >= 2 and counts.all_reduce.inside_loops == 0
  assert temps["shard_all"] <= temps["gather_once"] / 4, temps

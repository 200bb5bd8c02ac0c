"""Accumulation over a mesh: every device loops over its own rows, then one reduction.

The per-device loop runs under `shard_map` over the data axes, with
`check_vma=False`: the user's function sees each device's rows exactly as
it would see a batch on one device, as under `pmap`. Whatever a model does
(convolutions, `lax.cond` on batch data, gathers, custom VJPs), it does on
local arrays, so nothing in the loop communicates unless the user's own code
names the data axis (`lax.pmean` for synchronised BatchNorm: one all-reduce
per micro-batch, as asked). Without type checks, an array the function
closes over and differentiates gets its per-device gradient, as an argument
does: JAX inserts no psum into the micro-step's backward pass. Each device's
carry leaves the `shard_map` stacked over the devices (no data moves), and a
second, small `shard_map` holds only jaccum's reduction
(`_collective.all_reduce`: one fused psum, a reduce-scatter for FSDP
gradients) and returns global arrays.

Why this route. The previous one ran the loop under `vmap` over a device
axis with `spmd_axis_name`. That keeps the function out of manual axes, but
`vmap`'s batching rules rewrite what the function does: a convolution whose
kernel is batched (every kernel gradient) folds the device axis into its
feature groups, and a `lax.cond` on batch data becomes a `select` under
sharding constraints. On an explicit mesh both failed to trace (a reshape
JAX cannot shard; "Resource axis: data ... not found in mesh: ()"), and on
an auto mesh the convolution compiled to two all-gathers inside the loop
and every device computing all devices' kernel gradients (measured on an
8-device CPU mesh, a 3x3 convolution and a dense head: 2 all-gathers per
micro-step). Running the loop in an auto-typed context (`auto_axes`) fixed
the explicit-mesh errors but kept the all-gathers. `shard_map` runs each
device's rows as they are, so neither happens, and what the function may do
is what it may do inside any `shard_map`.

One case `shard_map` refuses: on an explicit mesh, a function that closes
over arrays placed on the mesh ("Closing over inputs to shard_map where the
input is sharded on Explicit axes is not implemented"), or names the data
axes in an `out_sharding` or a bare-`PartitionSpec` constraint, which
inside the loop name manual axes. There the function is traced outside
the `shard_map`, on one device's shapes, and its program runs per device
with the closed-over arrays as inputs and its shardings retyped
(`_retype`). What fails that way too runs as the whole batch's step runs,
on the sharded batch, with the same micro-batches in the same order and a
warning; options whose result only the per-device loop gives are refused
there by name (`_fallback`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaccum import (
  _collective,
  _compose,
  _config,
  _fallback,
  _fsdp,
  _loop,
  _placement,
  _reduce,
  _retype,
  _stats,
  _step,
)
from jaccum._collective import all_reduce, apply_reduce_fn
from jaccum._config import Config, Positions
from jaccum._fallback import cause_and_fix as _cause_and_fix  # noqa: F401  (_coupled)
from jaccum._jaxpr import (
  spec_axes,  # noqa: F401  (re-exported for _fit)
  without_axes,
)
from jaccum._placement import explicit_batch_axes  # noqa: F401  (for _accumulate)

P = jax.sharding.PartitionSpec
AxisType = jax.sharding.AxisType
FsdpMode = Literal["gather_once", "shard_grads", "shard_all"]
FSDP_MODES = ("gather_once", "shard_grads", "shard_all")


def _check_per_device_leaves(
  local: _loop.Local,
  rows: int,
  axes: tuple[str, ...],
  contiguous: bool,
  shapes_at: Callable[[int], Any],
  deterministic: bool = False,
) -> None:
  """Refuses `"last"` and `"concat"` leaves that are not one row per example.

  Every device returns its own rows of them, so only per-example rows make
  one array. A leaf whose leading size is the per-device micro-batch's may
  still only happen to have it: `shapes_at(n)` (the output's shapes on n
  rows, traced abstractly) tells, where any such leaf exists. Not `"last"`
  with `deterministic`: the global last micro-batch's, whole, any shape.
  """
  flat = jax.tree_util.tree_flatten_with_path(local.leaves, is_leaf=_reduce.is_plan)[0]
  flat = [(path, p) for path, p in flat if not (deterministic and p.mode == "last")]
  bigger = None
  if any(p.mode in ("last", "concat") and p.shape[:1] == (rows,) for _, p in flat):
    try:
      bigger = jax.tree.leaves(shapes_at(2 * rows))
    except Exception:  # the function cannot run on other sizes: cannot tell
      bigger = None
  for index, (path, leaf) in enumerate(flat):
    if leaf.mode == "last" and contiguous:
      raise ValueError(
        f'reduce="last" at output{jax.tree_util.keystr(path)} with split="contiguous" '
        f"and a batch sharded over {axes}: the last contiguous micro-batch lives on "
        f"the last devices only, so the loop that runs on every device's rows "
        f'cannot return it. Use split="strided" (its last micro-batch spans all '
        f"devices), or jaccum.data_parallel for each device's own last micro-batch."
      )
    per_example = leaf.shape[:1] == (rows,) and (
      bigger is None or bigger[index].shape[:1] == (2 * rows,)
    )
    if leaf.mode in ("last", "concat") and not per_example:
      follows = (
        f" (its leading size stays {rows} on a micro-batch of {2 * rows} rows: it "
        f"only happens to match the {rows} rows per device)"
        if leaf.shape[:1] == (rows,)
        else ""
      )
      raise ValueError(
        f'reduce="{leaf.mode}" at output{jax.tree_util.keystr(path)} (shape '
        f"{leaf.shape}) needs one row per example{follows}: with the batch split "
        f"over {axes}, every device runs its own micro-batches, and their rows are "
        f"returned together. A value that is not per-example has no whole-batch "
        f'meaning here; reduce it with "mean", "max" or "min".'
      )


class Route(NamedTuple):
  """Where and how the per-device loop runs, decided once per call.

  Attributes:
    mesh: the device mesh.
    axes: the data axes the batch is split over.
    num_devices: the devices over `axes`.
    explicit: whether the data axes are explicit (arrays are resharded,
      not constrained).
    specs: per leaf of the params (argument 0), its FSDP spec, or None; None
      without FSDP.
    hows: `specs` read as `_fsdp.Sharded` (how each leaf is split), or None.
    fsdp: what the sharded modes change inside the loop, or None
      (`"gather_once"`: nothing).
    per_step: micro-batches per step over all devices, devices × K.
    rows: rows per micro-batch on each device.
  """

  mesh: Any
  axes: tuple[str, ...]
  num_devices: int
  explicit: bool
  specs: list[P | None] | None
  hows: list[_fsdp.Sharded | None] | None
  fsdp: _fsdp.Plan | None
  per_step: int
  rows: int


def _route(
  config: Config,
  at: Positions,
  args: Sequence[Any],
  mesh: Any,
  axes: tuple[str, ...],
  param_specs: Any,
  fsdp_mode: str,
) -> Route:
  """Checks the mesh, the batch and the FSDP specs; says how the loop runs."""
  _config.check_mesh_axes(axes, mesh)
  num_devices = math.prod(mesh.shape[a] for a in axes)
  num_microbatches = config.num_microbatches
  batch_size = _loop.check_batch(
    [args[i] for i in at.batch],
    num_microbatches,
    names=[f"args[{i}]" for i in at.batch],
    hint=_config.batch_hint(config, at),
  )
  per_step = num_devices * num_microbatches
  if batch_size % per_step:
    rows = batch_size // num_devices
    works = [k for k in range(1, rows + 1) if rows % k == 0]
    raise ValueError(
      f"batch_size={batch_size} must be divisible by devices × num_microbatches "
      f"= {num_devices} × {num_microbatches} = {per_step}: every micro-batch takes "
      f"the same number of rows on each device of {axes}."
      + (
        f" K dividing {rows} (rows per device) works: {works}."
        if batch_size % num_devices == 0
        else ""
      )
    )
  explicit = all(
    t == AxisType.Explicit
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if n in axes
  )
  specs = _placement.fsdp_specs(param_specs, args, at, axes, explicit, mesh.shape)
  _loop.check_two_sizes(config, num_devices)
  hows = None
  if specs is not None:
    hows = [None if s is None else _placement.sharded_dim(s, axes) for s in specs]
  fsdp = None
  if hows is not None and fsdp_mode != "gather_once":
    kept: list[_fsdp.Sharded | None] = list(hows)
    if fsdp_mode != "shard_all":
      kept = [None] * len(hows)
    fsdp = _fsdp.Plan(params=kept, grads=hows)
  rows = batch_size // per_step
  return Route(mesh, axes, num_devices, explicit, specs, hows, fsdp, per_step, rows)


def _count(config: Config, num_real: Any, route: Route, unsharded_meaning: bool) -> Any:
  """The count of real micro-batches: one for all devices, or one per device."""
  if num_real is None:
    return None
  if unsharded_meaning and config.deterministic:
    # Global micro-batch m lives on device m // K: each runs those below n,
    # of the K × devices the batch holds.
    count = _loop.check_num_real(num_real, route.per_step)
    first = config.num_microbatches * jnp.arange(route.num_devices, dtype=jnp.int32)
    return jnp.clip(count - first, 0, config.num_microbatches)
  one_per_device = 0 if unsharded_meaning else route.num_devices
  count = _loop.check_num_real(num_real, config.num_microbatches, one_per_device)
  _compose.count_needs_split(config, route.axes, sharded=unsharded_meaning)
  if unsharded_meaning and config.split == "contiguous":
    _compose.count_and_contiguous(route.axes)
  return count


def _per_device(
  config: Config,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  route: Route,
  num_real: Any,
) -> tuple[Any, _loop.Local]:
  """Every device's loop over its own rows, under `shard_map`.

  Returns each device's carry stacked over the devices (nothing moves) and
  one device's `Local` (the plan, the same on every device). A `grad_fn`
  that cannot be traced inside the `shard_map` (it closes over arrays on an
  explicit mesh) is traced outside it, and the loop runs again with those
  arrays as inputs (`_retype`); if that fails too, the first error is raised.
  """
  call, placed, in_specs = _placement.placed_call(
    config,
    at,
    args,
    kwargs,
    route.specs,
    mesh=route.mesh,
    axes=route.axes,
    explicit=route.explicit,
    keep_sharded=route.fsdp is not None and any(route.fsdp.params),
  )
  count_varies = num_real is not None and np.ndim(num_real) == 1
  if num_real is not None:
    # Laid out as the loop reads it: on an explicit mesh a count per device
    # must arrive split over the axes, as its in_spec says.
    count_spec = P(route.axes) if count_varies else P()
    in_specs.append(count_spec)
    placed.append(_placement.place(num_real, route.mesh, count_spec, route.explicit))
  run = lambda lift, consts=(): _loop_on_mesh(
    config,
    at,
    call,
    ([*placed, *consts], [*in_specs, *[P()] * len(consts)]),
    route,
    num_real,
    count_varies,
    lift,
  )
  try:
    return run(_step.Lift(route.mesh))
  except _retype.Retrace as retrace:
    ((outside,), cause) = retrace.outside, retrace.cause
  # The closed-over arrays cross as inputs, whole on every device of the
  # data axes, as the params do (`placed_inputs`).
  consts = [
    _placement.place(
      c,
      route.mesh,
      without_axes(_placement.spec_of(c) or P(), route.axes),
      route.explicit,
    )
    for c in outside.consts
  ]
  try:
    return run(_step.Lift(route.mesh, outside), consts)
  except Exception as error:
    if _loop.is_user_error(error) and cause is not None:
      raise cause from error  # what the whole batch's route names
    raise


def _loop_on_mesh(
  config: Config,
  at: Positions,
  call: Any,
  inputs: tuple[list[Any], list[P]],
  route: Route,
  num_real: Any,
  count_varies: bool,
  lift: _step.Lift,
) -> tuple[Any, _loop.Local]:
  """The per-device loop on `inputs`, `(arrays, in_specs)`.

  The arrays are the call's, the count's if any, then `lift`'s constants.
  """
  found: list[_loop.Local] = []
  num_consts = 0 if lift.outside is None else len(lift.outside.hoisted)

  def per_device(*arrays):
    consts = arrays[len(arrays) - num_consts :]
    arrays = arrays[: len(arrays) - num_consts]
    local_num_real = None
    if num_real is not None:
      *arrays, local_num_real = arrays
      local_num_real = jnp.reshape(local_num_real, (-1,))[0]
    local_args, local_kwargs, bound_args, bound_kwargs = _placement.refill(call, arrays)
    local = _loop.scan(
      config._replace(bound_args=bound_args, bound_kwargs=bound_kwargs),
      at,
      local_args,
      local_kwargs,
      axes=route.axes,
      needs_grads=None if route.specs is None else "FSDP (param_specs)",
      fsdp=route.fsdp,
      num_real=local_num_real,
      count_varies=count_varies,
      lift=lift._replace(consts=consts),
    )
    found.append(local)
    # Each device's carry, stacked over the devices: nothing moves.
    return jax.tree.map(
      lambda x: jnp.asarray(x)[None], (local.acc, local.total, local.state, local.stats)
    )

  # The user's function runs under shard_map, on each device's rows, as it
  # would on one device. Without type checks (check_vma=False, as under
  # pmap), an array it closes over and differentiates gets its per-device
  # gradient, with no psum inserted into the micro-step. Under jit even when
  # called eagerly: an eager shard_map refuses outputs sharded over an
  # explicit axis it does not run manually (a tensor-parallel "model").
  placed, in_specs = inputs
  loop = _jitted_shard_map(
    per_device,
    mesh=route.mesh,
    in_specs=tuple(in_specs),
    out_specs=P(route.axes),
    axis_names=set(route.axes),
    check_vma=False,
  )
  return loop(*placed), found[0]


def _jitted_shard_map(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
  return jax.jit(jax.shard_map(fn, **kwargs))


class Layout(NamedTuple):
  """How each output leaf leaves the reduction, one entry per leaf.

  Attributes:
    scatter: FSDP gradients to reduce-scatter after the loop (`"gather_once"`).
    sharded: every leaf that comes back sharded like its param (scattered
      after the loop or by every micro-step).
    out_specs: each leaf's `PartitionSpec` out of the reduction.
  """

  scatter: list[_fsdp.Sharded | None]
  sharded: list[_fsdp.Sharded | None]
  out_specs: list[P]


def _layout(local: _loop.Local, route: Route, deterministic: bool) -> Layout:
  """Where each output leaf lives after the reduction (`"last"` with
  `deterministic`: the global last micro-batch's, on every device)."""
  plans = jax.tree.leaves(local.leaves, is_leaf=_reduce.is_plan)
  grads = jax.tree.leaves(local.grad_mask)
  # FSDP gradients come back sharded like their params: scattered after the
  # loop ("gather_once"), or by every micro-step (the loop's plan says so).
  scatter: list[_fsdp.Sharded | None] = [None] * len(plans)
  sharded: list[_fsdp.Sharded | None] = [p.scattered for p in plans]
  per_device = ("concat",) if deterministic else ("concat", "last")
  out_specs = [P(route.axes) if p.mode in per_device else P() for p in plans]
  if route.hows is not None:
    grad_positions = [i for i, g in enumerate(grads) if g]
    if len(grad_positions) != len(route.hows):
      raise ValueError(
        f"FSDP needs the gradients of the params (argument 0, {len(route.hows)} "
        f"leaves) in grad_fn's output, found {len(grad_positions)} gradient "
        "leaves; pass grad_leaves to mark them."
      )
    for i, how in zip(grad_positions, route.hows, strict=True):
      if how is None or plans[i].mode not in ("mean", "sum"):
        continue
      if plans[i].scattered is None:
        scatter[i] = how
      sharded[i] = how
      out_specs[i] = P(*(None,) * how.dim, how.axes)
  return Layout(scatter, sharded, out_specs)


def _sharded_sq_norm(result: Any, local: _loop.Local, layout: Layout) -> jax.Array:
  """|G|² of the reduced gradients; a scattered one holds a shard per device."""
  parts = [
    _stats.sq_norm(r, True)
    if how is None
    else jax.lax.psum(_stats.sq_norm(r, True), how.axes)
    for r, g, how in zip(
      jax.tree.leaves(result),
      jax.tree.leaves(local.grad_mask),
      layout.sharded,
      strict=True,
    )
    if g
  ]
  return sum(parts, jnp.zeros((), jnp.float32))


def _reduce_on_mesh(
  config: Config,
  local: _loop.Local,
  stacked: Any,
  route: Route,
  layout: Layout,
  reduce_state: Any,
  num_real: Any,
) -> tuple[Any, Any, Any, Any]:
  """The one reduction after the loop, under a second, small `shard_map`.

  Returns `(result, state, stats, reduce_state)` as global arrays. `num_real`
  (None: K) tells which devices ran a micro-batch, for `"last"` leaves.
  """
  hooked = config.reduce_fn is not None
  grads = jax.tree.leaves(local.grad_mask)
  ran = True if num_real is None else jnp.asarray(num_real) > 0

  def reduce_body(acc, total, state, stats, reduce_state, ran):
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)
    local_weights = first(total)
    acc, total, state, extras = all_reduce(
      local.leaves,
      first(acc),
      local_weights,
      first(state),
      route.axes,
      layout.scatter,
      extras=list(first(stats) or ()),
      wire_dtype=config.reduce_dtype,
      skip=grads if hooked else None,
      last_ran=ran[0] if config.deterministic else None,
    )
    final = None
    if hooked:
      acc, final, reduce_state = apply_reduce_fn(
        local.leaves,
        acc,
        local_weights,
        total,
        local.grad_mask,
        route.per_step,
        route.axes,
        config.reduce_fn,
        reduce_state,
      )
    per_step = None if total is not None else route.per_step
    result = _reduce.finalize(local.leaves, acc, per_step, config.split, final=final)
    estimates = None
    if config.return_stats:
      norm = _sharded_sq_norm(result, local, layout)
      estimates = _loop.stats_of(local, extras, total, route.per_step, norm)
    # float0 zeros are not arrays shard_map can return; put back after it.
    result = jax.tree.map(
      lambda p, r: None if p.mode == "float0" else r,
      local.leaves,
      result,
      is_leaf=_reduce.is_plan,
    )
    return result, state, estimates, reduce_state

  result_specs = jax.tree.unflatten(
    jax.tree.structure(local.leaves, is_leaf=_reduce.is_plan), layout.out_specs
  )
  axes = P(route.axes)
  reduced = _jitted_shard_map(
    reduce_body,
    mesh=route.mesh,
    in_specs=(axes, axes, axes, axes, axes, axes),
    out_specs=(result_specs, P(), P(), axes),
    axis_names=set(route.axes),
  )
  # One row per device: laid out so, as the reduction's shard_map reads it.
  _collective.check_reduce_state(reduce_state, route.num_devices, route.axes)
  reduce_state = jax.tree.map(
    lambda x: _placement.place(x, route.mesh, axes, route.explicit), reduce_state
  )
  acc, total, state, stats = stacked
  ran = jnp.broadcast_to(ran, (route.num_devices,))
  ran = _placement.place(ran, route.mesh, axes, route.explicit)
  return reduced(acc, total, state, stats, reduce_state, ran)


def _typed_as_params(result: Any, local: _loop.Local, route: Route) -> Any:
  """On an explicit mesh, FSDP gradients typed as their params are.

  `"shard_all"`'s gradients come out of the per-use gathers' transposes
  without the params' other axes (`P("data", None)` for a param `P("data",
  "model")`); each device already holds what the param's own type asks for
  of them, so the reshard is a local slice.
  """
  if not route.explicit or route.specs is None:
    return result
  leaves, tree = jax.tree.flatten(result)
  grads = [i for i, g in enumerate(jax.tree.leaves(local.grad_mask)) if g]
  for i, spec in zip(grads, route.specs, strict=True):
    typed = getattr(jax.typeof(leaves[i]).sharding, "spec", None)
    if spec is not None and typed is not None and tuple(typed) != tuple(spec):
      leaves[i] = _placement.place(leaves[i], route.mesh, spec, explicit=True)
  return jax.tree.unflatten(tree, leaves)


def _one_device_over_the_data_axes(
  config: Config,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  route: Route,
  num_real: Any,
) -> Any:
  """The loop where the data axes hold one device (data=1, model=2).

  Nothing is reduced, and XLA's partitioner rejects an all-reduce over a
  manual axis of one device whose operand is split over another axis: the
  loop runs as on one device, the other axes left to XLA as in the whole
  batch's step. The arguments are laid out as for the per-device loop, so
  params split over the data axes are read whole (from the one device).
  """
  call, placed, _ = _placement.placed_call(
    config,
    at,
    args,
    kwargs,
    route.specs,
    mesh=route.mesh,
    axes=route.axes,
    explicit=route.explicit,
    keep_sharded=False,
  )
  args, kwargs, bound_args, bound_kwargs = _placement.refill(call, placed)
  config = config._replace(bound_args=bound_args, bound_kwargs=bound_kwargs)
  count = None if num_real is None else jnp.reshape(num_real, ())
  return _loop.run(config, at, args, kwargs, count)


def run(
  config: Config,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  *,
  mesh: Any,
  axes: tuple[str, ...],
  param_specs: Any = None,
  fsdp_mode: str = "gather_once",
  unsharded_meaning: bool = False,
  num_real: Any = None,
  reduce_state: Any = None,
) -> Any:
  """Every device accumulates K micro-batches of its rows; one reduction after.

  With `unsharded_meaning` (plain `accumulate` on a sharded batch), outputs
  that would differ from the unsharded call are refused. `num_real` (one
  count, or one per device) runs only that many micro-batches per device.
  """
  route = _route(config, at, args, mesh, axes, param_specs, fsdp_mode)
  num_real = _count(config, num_real, route, unsharded_meaning)
  if route.num_devices == 1 and mesh.size > 1 and config.reduce_fn is None:
    return _one_device_over_the_data_axes(config, at, args, kwargs, route, num_real)
  try:
    stacked, local = _per_device(config, at, args, kwargs, route, num_real)
  except Exception as error:
    if not _loop.is_user_error(error):
      raise  # jaccum's own: the options or the output are wrong either way
    return _fallback.run(
      config,
      at,
      args,
      kwargs,
      mesh=mesh,
      axes=axes,
      explicit=route.explicit,
      num_real=num_real,
      error=error,
    )
  _check_per_device_leaves(
    local,
    route.rows,
    axes,
    unsharded_meaning and config.split == "contiguous",
    lambda n: _loop.output_shapes_at(config, at, args, kwargs, n),
    config.deterministic,
  )
  layout = _layout(local, route, config.deterministic)
  _compose.reduce_fn_and_fsdp(config, layout.sharded)
  result, state, estimates, reduce_state = _reduce_on_mesh(
    config, local, stacked, route, layout, reduce_state, num_real
  )
  result = _typed_as_params(result, local, route)
  result = jax.tree.map(
    lambda p, r: np.zeros(p.shape, jax.dtypes.float0) if p.mode == "float0" else r,
    local.leaves,
    result,
    is_leaf=_reduce.is_plan,
  )
  if num_real is not None:  # one count, or one per device
    result = _reduce.none_ran(local.leaves, result, jnp.sum(num_real))
  out = result if at.state is None else (result, state)
  out = out if estimates is None else (out, estimates)
  return out if config.reduce_fn is None else (out, reduce_state)


def data_parallel(
  grad_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  axis: str | tuple[str, ...] = "data",
  param_specs: Any = None,
  fsdp_mode: FsdpMode = "gather_once",
  **accumulate_kwargs: Any,
) -> Callable[..., Any]:
  """Accumulates over K micro-batches on every device, then reduces once.

  Call the returned function under `jit` with global arrays whose batch is
  sharded over `axis` (or will be: it is laid out per device here). Each
  device runs K micro-batches of its own rows, as `accumulate` does: the
  effective batch is devices × K × micro-batch, nothing communicates inside
  the loop, and one all-reduce combines the devices after it. This holds for
  meshes with auto and explicit axis types and for multi-axis meshes (only
  `axis` is split over; other axes, e.g. `"model"`, keep their sharding).
  `grad_fn` may reach its params any way (argument, keyword, closure,
  `functools.partial`): it runs on each device's rows exactly as it would on
  one device (under `shard_map` without type checks, as under `pmap`), so
  any model that runs on one device runs here, and a closed-over array gets
  its gradient, not the gradient summed over devices. On an explicit mesh,
  where JAX cannot pass arrays placed on the mesh into `shard_map` by
  closure, `grad_fn` is traced outside it and its program runs per device
  with those arrays as inputs (so too where it names `axis` in an
  `out_sharding`: each device holds its rows). What cannot run per device
  either runs as the whole-batch step would, on the sharded batch, with the
  same micro-batches and a warning that says what differs (XLA may
  communicate inside the loop; `deterministic`, `return_stats`,
  `state_argnum`, `reduce_fn` and a count are refused there). Code that
  names `axis` runs per micro-batch across devices: `lax.pmean(x, axis)`
  gives synchronised BatchNorm statistics (one all-reduce per micro-batch).

  With `param_specs` (FSDP / ZeRO style), the first argument (the params)
  arrives sharded as those specs say, and its gradients leave sharded like
  them; on an explicit mesh the params' own sharding says this without
  `param_specs`. `fsdp_mode` chooses what stays sharded inside the loop, for
  P bytes of params on D devices, K micro-batches (per device; measured
  figures in the data-parallel guide, `python -m benchmarks --parts fsdp`):

  ===============  ===================  =============  =====================
  mode             params in the loop   accumulator    on the wire per step
  ===============  ===================  =============  =====================
  `"gather_once"`  all, gathered once   all, float32   gather P, scatter 1×
  `"shard_grads"`  all, gathered once   1/D (ZeRO-2)   gather P, scatter K×
  `"shard_all"`    1/D, each use        1/D (ZeRO-3)   gather 2K×, scatter K×
  ===============  ===================  =============  =====================

  `"gather_once"`, the default, sends the fewest bytes and leaves each
  micro-step as it is; it needs the whole params and a whole accumulator
  on every device. `"shard_grads"` reduce-scatters each micro-batch's
  gradients into an accumulator sharded like the params: about P × D−1/D
  less memory (float32 accumulator) for K reduce-scatters instead of one.
  `"shard_all"` keeps the params sharded too: each is all-gathered right
  before each use, in the forward pass and again in the backward pass, and
  never held whole; params a `lax.scan` slices (stacked layers with a leading
  layer axis) are gathered one layer per iteration, and their gradients
  scattered one layer per iteration. Nothing in the model changes. Pick the
  first mode whose step fits (`fit_microbatches` and `fit_plan` tell, before
  running). With `axis=("replica", "fsdp")` and `param_specs` naming only
  `"fsdp"` (HSDP), the sharded modes reduce-scatter over `"fsdp"` inside the
  loop and sum over `"replica"` once after it. The accumulator follows
  `accum_dtype` (float32 by default) in every mode; a weighted mean then sums
  `w·grad`, weighted on each device before the devices are summed.

  Cross-example computations (BatchNorm statistics threaded with
  `state_argnum`) see each device's rows, as in any data-parallel step;
  threaded floating state is averaged over devices at the end, other state
  (counters, keys) takes device 0's value. Keys differ per device and per
  micro-batch: device d > 0 folds a key (`rng_argnum`, or one threaded as
  state) with d first, and device 0 draws exactly as one device would, so a
  key threaded as state comes back as the unsharded call leaves it.

  Args:
    grad_fn: as for `accumulate`.
    num_microbatches: micro-batches per device, K.
    mesh: the device mesh; defaults to the mesh set with `jax.set_mesh`, else
      the mesh of the batch's sharding.
    axis: the mesh axis (or axes) the batch is split over; defaults to
      `"data"`: pass it when your mesh names its batch axis otherwise (e.g.
      `axis="batch"`).
    param_specs: a `PartitionSpec` per leaf of the first argument (or a pytree
      prefix of it), naming only `axis`, for FSDP; `None` replicates it (or,
      on an explicit mesh, reads its sharding).
    fsdp_mode: `"gather_once"`, `"shard_grads"` or `"shard_all"`: what stays
      sharded inside the loop (above).
    **accumulate_kwargs: any other option of `accumulate` (`batch_argnums`,
      `reduce`, `weight_fn`, `rng_argnum`, `state_argnum`, …);
      `deterministic=True` gives the same bits on any number of devices
      (with counts per device, over a padded batch too).

  Returns:
    A function with `grad_fn`'s signature, and `accumulate`'s keyword
    `num_real_microbatches` (one count, or one per device: shape
    `[devices]`; a device that runs fewer micro-batches skips them, and
    nothing waits for it until the reduction, except with the sharded FSDP
    modes, whose collectives inside the loop need every device: there the
    devices run in step, as many micro-batches as the busiest, the others
    joining with a weight of 0). `"mean"`, `"sum"`, `"max"` and
    `"min"` leaves come back replicated (`"last"` too with `deterministic`),
    gradients of FSDP-sharded params sharded like them, `"concat"` and
    `"last"` leaves (one row per example) sharded over `axis`, in row order.

  Raises:
    TypeError, ValueError: as `accumulate` does, and if `axis` is not a mesh
      axis, the batch does not split into devices × K micro-batches, or
      `param_specs` does not fit the params.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> x = jnp.arange(32.0 * len(jax.devices())).reshape(-1, 2) / 100
    >>> step = jax.jit(jaccum.data_parallel(jax.grad(loss), 2, mesh=mesh))
    >>> bool(jnp.allclose(step(jnp.ones(2), x), jax.grad(loss)(jnp.ones(2), x)))
    True
  """
  if "axis_name" in accumulate_kwargs:
    raise TypeError("data_parallel takes `axis`, not `axis_name`.")
  if fsdp_mode not in FSDP_MODES:
    raise ValueError(f"fsdp_mode must be one of {FSDP_MODES}, got {fsdp_mode!r}.")
  config = _config.make_config(grad_fn, num_microbatches, **accumulate_kwargs)
  axes = _config.axis_tuple(axis, "axis")

  def parallel(*args, num_real_microbatches=None, reduce_state=None, **kwargs):
    at = _config.positions(config, args, kwargs)
    the_mesh = mesh if mesh is not None else _placement.find_mesh(args, at)
    return run(
      config,
      at,
      args,
      kwargs,
      mesh=the_mesh,
      axes=axes,
      param_specs=param_specs,
      fsdp_mode=fsdp_mode,
      num_real=num_real_microbatches,
      reduce_state=reduce_state,
    )

  return parallel


def warn_per_device_state(axes: tuple[str, ...]) -> None:
  warnings.warn(
    f"accumulate: the batch is sharded over the explicit mesh axes {axes}, so each "
    f"device threads state_argnum's state through its own rows (per-device "
    f"statistics, as jaccum.data_parallel and pmap training do), and floating "
    f"state is averaged over devices at the end. On one device each "
    f"micro-batch's statistics would span all of its rows. Call "
    f"jaccum.data_parallel to say you mean per-device statistics.",
    stacklevel=3,
  )

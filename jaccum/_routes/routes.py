"""Where the loop runs: one class per route, chosen once per trace by `choose`.

- `OneDevice`: on this device (or on the mesh XLA lays out, as any step is).
- `InShardMap`: inside the user's `shard_map` or `pmap` (`axis_name`): each
  device loops over its rows, then one reduction over the axes.
- `mesh.PerDevice`: `data_parallel`, or a batch sharded over explicit mesh
  axes: jaccum runs the `shard_map` itself.
- `OverOneDevice`: data axes of one device beside other axes (data=1,
  model=2): nothing to reduce, the loop runs as on one device.
- `WholeBatch`: what cannot run per device (on an explicit mesh, a function
  that closes over arrays placed on it) runs as the whole batch's step runs,
  on the sharded batch, with a warning.

Each route says where the user's function is traced (`in_context`) and runs
the plan (`run`); `Output.assemble` builds what the call returns.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaccum._core import accumulators, fsdp, loop, reduction, stats, step
from jaccum._core.step import ARRAY_TYPES, Function, Positions
from jaccum._routes import arguments, mesh, placement, wrappers
from jaccum._routes.options import Mesh

P = jax.sharding.PartitionSpec


def _finished(plan: Any, carry: loop.Carry, call: Any) -> Any:
  """The loop's carry (combined over `plan.reduction`'s axes) as the result."""
  accs, weights = plan.loop.accumulators, carry.total
  total = None if weights is None else accumulators.weight_sum(weights)
  state, sums, done, reduce_state = carry.state, list(carry.stats or ()), None, None
  acc = carry.acc
  if plan.reduction is not None:
    ran = True if plan.count is None else plan.count > 0
    combined = reduction.over_devices(
      plan.reduction, accs, acc, weights, state, sums, call.reduce_state, ran
    )
    acc, total, state, sums = (
      combined.acc,
      combined.total,
      combined.state,
      combined.sums,
    )
    done, reduce_state, weights = combined.done, combined.reduce_state, None
  num_terms = plan.output.num_terms
  how = accumulators.finishing(None if total is not None else num_terms, weights)
  result = accumulators.finish(accs, acc, how, done)
  if plan.count is not None:
    ran = plan.count
    if plan.reduction is not None:
      ran = jax.lax.psum(ran, plan.reduction.axes)
    result = accumulators.none_ran(accs, result, ran)
  estimates = None
  if plan.output.stats is not None:
    measure = plan.loop.measure
    grad_sq_norm = stats.sq_norm(result, plan.output.grad_mask, measure.split)
    if measure.split:  # each device measured its slices of the gradients
      grad_sq_norm, sums[0] = jax.lax.psum((grad_sq_norm, sums[0]), measure.split)
    estimates = plan.output.stats.estimates(sums, total, grad_sq_norm)
  return plan.output.assemble(result, state, estimates, reduce_state)


@dataclasses.dataclass(frozen=True)
class OneDevice:
  """The loop on this device: no reduction over devices."""

  rows: int
  devices = 1
  axes = None
  on_devices = False
  sharded_by_accumulate = False
  count_varies = False
  fsdp = None
  hows = None

  def count(self, count: Any, num_microbatches: int, global_order: bool) -> Any:
    if count is None:
      return None
    return arguments.check_count(count, num_microbatches)

  def arguments(self, function: Function, call: Any) -> tuple[Function, Any, Any]:
    """The function and the call's arguments as the loop takes them."""
    return function, call.args, call.kwargs

  def in_context(
    self, function: Function, call: Any, count: Any, body: Callable[..., Any]
  ) -> Any:
    """`body(function, args, kwargs, count, consts)` where the loop runs."""
    return body(*self.arguments(function, call), count, ())

  def lift(self, consts: Any) -> None:
    """How the step is traced when it closes over arrays on a mesh: here, as is."""
    return None

  def run(self, plan: Any, call: Any) -> Any:
    function, args, kwargs = self.arguments(plan.function, call)
    carry = loop.run(plan.loop, function, args, kwargs, plan.count)
    return _finished(plan, carry, call)


@dataclasses.dataclass(frozen=True)
class InShardMap(OneDevice):
  """Inside the user's `shard_map` (or `pmap`) over `axes`: one reduction after."""

  axes: tuple[str, ...] = ()  # pyright: ignore[reportIncompatibleVariableOverride]
  devices: int = 1  # pyright: ignore[reportIncompatibleVariableOverride]
  count_varies: bool = False  # pyright: ignore[reportIncompatibleVariableOverride]
  on_devices = True


@dataclasses.dataclass(frozen=True)
class OverOneDevice(OneDevice):
  """Data axes of one device beside other axes (data=1, model=2).

  Nothing is reduced, and XLA's partitioner rejects an all-reduce over a
  manual axis of one device whose operand is split over another axis: the
  loop runs as on one device, the other axes left to XLA as in the whole
  batch's step. The arguments are laid out as for the per-device loop, so
  params split over the data axes are read whole (from the one device).
  """

  laid_out: Any = None  # (args, kwargs, bound_args, bound_kwargs)

  def count(self, count, num_microbatches, global_order):
    if count is None:
      return None
    return jnp.reshape(arguments.check_count(count, num_microbatches, 1), ())

  def arguments(self, function, call):
    args, kwargs, bound_args, bound_kwargs = self.laid_out
    return function.with_bound(bound_args, bound_kwargs), args, kwargs


@dataclasses.dataclass(frozen=True)
class WholeBatch(OneDevice):
  """The loop over the sharded batch, as the whole batch's step would run.

  For what cannot run on each device's rows under `shard_map`, traced inside
  or outside it (an `out_sharding` or reshard naming the data axes on fewer
  rows per device than they have devices, a function JAX cannot run inside
  `shard_map` at all). The micro-step is the whole-batch step on every
  device's micro-batch k together, sharded by the batch's types: whatever the
  whole batch runs, this runs, but XLA communicates inside the loop wherever
  the whole batch's step communicates.

  It cuts the same micro-batches in the same order: with the strided split
  the global strided micro-batch k is every device's micro-batch k, device
  after device; with the contiguous one each device's rows are put in that
  order first (`_device_order`: nothing moves between devices), and
  concatenated outputs back in theirs. So sums, maxima, concatenations,
  per-example means and `weight_fn` means whose weight adds up over rows come
  out the same, up to rounding; what depends on each device's micro-batches
  alone is refused by a rule of the table.

  Attributes:
    args: the call's arguments, the batch laid out.
    axes_of_batch: the data axes.
    devices: the devices over them.
    reordered: the contiguous split, its rows put in device order.
    cause: why the function could not run on each device's rows.
  """

  args: tuple = ()
  axes_of_batch: tuple[str, ...] = ()
  num_devices: int = 1
  reordered: bool = False
  cause: Exception | None = None

  def arguments(self, function, call):
    return function, self.args, call.kwargs

  def count(self, count, num_microbatches, global_order):
    return count  # counted per device: a rule of the table refuses it here

  def run(self, plan: Any, call: Any) -> Any:
    out = super().run(plan, call)
    if self.reordered:  # "concat" rows back in the batch's order
      k = plan.loop.inputs.cut[0]
      out = jax.tree.map(
        lambda a, x: (
          _batch_order(x, self.num_devices, k)
          if isinstance(a, accumulators.Concat)
          else x
        ),
        plan.loop.accumulators,
        out,
        is_leaf=accumulators.is_accumulator,
      )
    return out


def _transposed(x: jax.Array, num_devices: int, inner: tuple[int, int]) -> jax.Array:
  """`x` as `[D, *inner, ...]`, its two inner axes swapped, each device's rows
  among themselves (nothing moves between devices)."""
  shape = (num_devices, *inner, *x.shape[1:])
  spec = arguments.spec_of(x)
  if spec is None:
    return jnp.swapaxes(x.reshape(shape), 1, 2).reshape(x.shape)
  mesh = jax.typeof(x).sharding.mesh
  rest = tuple(spec)[1:]
  blocks = jnp.reshape(
    x, shape, out_sharding=jax.NamedSharding(mesh, P(spec[0], None, None, *rest))
  )
  blocks = jnp.swapaxes(blocks, 1, 2)
  return jnp.reshape(blocks, x.shape, out_sharding=jax.NamedSharding(mesh, spec))


def _device_order(x: jax.Array, num_devices: int, num_microbatches: int) -> jax.Array:
  """Rows reordered so that strided micro-batch k is each device's contiguous k:
  `[D, K, R]` read as `[D, R, K]`. `_batch_order` is its inverse."""
  return _transposed(x, num_devices, (num_microbatches, -1))


def _batch_order(x: jax.Array, num_devices: int, num_microbatches: int) -> jax.Array:
  return _transposed(x, num_devices, (-1, num_microbatches))


def whole_batch(
  split: str,
  num_microbatches: int,
  at: Positions,
  call: Any,
  route: mesh.PerDevice,
  error: Exception,
) -> WholeBatch:
  """`route`'s call laid out for the whole batch's step: the batch split over
  the data axes as the per-device loop has it, in its micro-batches' order."""
  reordered = split == "contiguous" and route.devices > 1
  args = list(call.args)

  def lay_out(x):
    if not isinstance(x, ARRAY_TYPES):
      return x
    rest = (arguments.spec_of(x) or P())[1:] if route.explicit else ()
    x = placement.place(x, route.mesh, P(route.axes, *rest), route.explicit)
    if reordered:
      return _device_order(x, route.devices, num_microbatches)
    return x

  for i in at.batch:
    args[i] = jax.tree.map(lay_out, args[i])
  rows = route.rows * route.devices
  return WholeBatch(rows, tuple(args), route.axes, route.devices, reordered, error)


def _first_line(error: BaseException) -> str:
  return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


def failures(error: Exception) -> str:
  """How the function failed per device: inside the loop, then traced outside
  it (`retype.lift` raises the error inside the loop from the one outside)."""
  outside = error.__cause__
  if isinstance(outside, Exception) and outside is not error:
    return f"{_first_line(error)}; traced outside the loop: {_first_line(outside)}"
  return _first_line(error)


def warn_whole_batch(route: WholeBatch) -> None:
  error, axes = route.cause, route.axes_of_batch
  assert error is not None
  warnings.warn(
    f"jaccum could not run grad_fn on each device's rows under shard_map "
    f"({failures(error)}), so it runs the loop as the "
    f"whole batch's step runs, sharded over {axes}. Its micro-batch k is every "
    f"device's micro-batch k together, in the same order: sums, maxima, "
    f"concatenations, per-example means and weight_fn means whose weight adds "
    f"up over rows (token counts) are the same, up to rounding. What is not: a "
    f"mean of a value that is not a mean over examples (a mean over tokens "
    f"without weight_fn) averages K micro-batches of all devices' rows, not "
    f"devices × K of each device's, and a key (rng_argnum) is folded with the "
    f"micro-batch only, not the device. XLA may communicate over {axes} inside "
    f"the loop (count it with jaccum.inspect.collectives(step, *args).by_axis). "
    f"{cause_and_fix(error, axes)}",
    stacklevel=wrappers.user_stacklevel(),
  )


def cause_and_fix(error: Exception, axes: tuple[str, ...]) -> str:
  """What usually makes the user's function fail per device, and what to write
  instead."""
  message = f"{error} {error.__cause__ or ''}"
  if "with_sharding_constraint can only refer to Auto axes" in message:
    return (
      f"The cause is a with_sharding_constraint given a bare PartitionSpec "
      f"that names {axes}: inside the per-device loop JAX resolves it against "
      f"the mesh in context, where those axes are manual. Write it as "
      f"NamedSharding(mesh, P(...)) (jaccum drops the data axes from it: each "
      f"device holds its rows already), or leave {axes} out of the spec, and "
      f"the loop runs per device."
    )
  if any(
    words in message
    for words in (
      "cannot contain axis names that are of type Auto or Manual",
      "does not evenly divide the dimension size",
    )
  ):
    return (
      f"The cause is an out_sharding= (or reshard) that names {axes}: inside "
      f"the per-device loop those axes are manual, and jaccum drops them only "
      f"where each device's micro-batch splits over them. Pick K so that each "
      f"device's micro-batch holds a multiple of the devices of {axes} in "
      f"rows, or leave {axes} out of the spec (or use an auto mesh with "
      f"sharding constraints), and the loop runs per device."
    )
  return (
    "The usual cause is an array that grad_fn closes over (on an explicit "
    "mesh, any array placed on the mesh): pass it as an argument or keyword "
    "instead, and the loop runs per device."
  )


def _warn_per_device_state(axes: tuple[str, ...]) -> None:
  warnings.warn(
    f"accumulate: the batch is sharded over the explicit mesh axes {axes}, so each "
    f"device threads state_argnum's state through its own rows (per-device "
    f"statistics, as jaccum.data_parallel and pmap training do), and floating "
    f"state is averaged over devices at the end. On one device each "
    f"micro-batch's statistics would span all of its rows. Call "
    f"jaccum.data_parallel to say you mean per-device statistics.",
    stacklevel=5,
  )


def _per_device(
  cut: tuple[int, tuple[int, ...]],
  function: Function,
  hooked: bool,
  at: Positions,
  call: Any,
  on_mesh: Any,
  by_batch: bool,
) -> Any:
  """`data_parallel`'s route (or `accumulate`'s on an explicit-mesh batch)."""
  axes, the_mesh = on_mesh.axes, on_mesh.mesh
  devices, rows, explicit = mesh.check_mesh_and_batch(
    *cut, at, call.args, the_mesh, axes
  )
  specs = placement.fsdp_specs(
    on_mesh.param_specs, call.args, at, axes, explicit, the_mesh.shape
  )
  hows = None
  if specs is not None:
    hows = [None if s is None else placement.sharded_dim(s, axes) for s in specs]
  plan_fsdp = None
  if hows is not None and on_mesh.fsdp_mode != "gather_once":
    kept: list[Any] = [None] * len(hows)
    if on_mesh.fsdp_mode == "shard_all":
      kept = list(hows)
    plan_fsdp = fsdp.Plan(params=kept, grads=hows)
  one = devices == 1 and the_mesh.size > 1 and not hooked
  laid_out, placed, in_specs = placement.placed_call(
    function,
    at,
    call.args,
    call.kwargs,
    specs,
    mesh=the_mesh,
    axes=axes,
    explicit=explicit,
    keep_sharded=not one and plan_fsdp is not None and any(plan_fsdp.params),
  )
  if one:
    args, kwargs, bound_args, bound_kwargs = placement.refill(laid_out, placed)
    return OverOneDevice(rows, (args, kwargs, bound_args, bound_kwargs))
  return mesh.PerDevice(
    the_mesh,
    axes,
    devices,
    explicit,
    specs,
    hows,
    plan_fsdp,
    rows,
    by_batch,
    laid_out,
    placed,
    in_specs,
  )


def choose(
  where: tuple[Any, Any],
  cut: tuple[int, tuple[int, ...]],
  function: Function,
  hooked: bool,
  at: Positions,
  call: Any,
) -> Any:
  """The route of one call: where its loop runs.

  `where` is `(axis_name, on_mesh)`, `cut` `(K, batch_argnums)`; `hooked`:
  a `reduce_fn` needs a reduction over devices.
  """
  axis_name, on_mesh = where
  num_microbatches = cut[0]
  if axis_name is not None:
    devices = arguments.check_axes_bound(axis_name)
    rows = arguments.check_batch_size(*cut, at, call.args) // num_microbatches
    count_varies = call.count is not None and bool(
      step.varying_axes(call.count) & set(axis_name)
    )
    return InShardMap(rows, axis_name, devices, count_varies)
  by_batch = False
  if on_mesh is None:
    found = arguments.explicit_batch_axes(call.args, at)
    if found is None:
      rows = arguments.check_batch_size(*cut, at, call.args)
      return OneDevice(rows // num_microbatches)
    the_mesh, axes = found
    on_mesh, by_batch = Mesh(the_mesh, axes), True
    if at.state is not None and any(
      jnp.issubdtype(jnp.result_type(x), jnp.inexact)
      for x in jax.tree.leaves(call.args[at.state])
    ):
      # Floating state (BatchNorm statistics) would be per device; counters
      # and keys advance exactly as unsharded.
      _warn_per_device_state(axes)
  elif on_mesh.mesh is None:
    on_mesh = dataclasses.replace(on_mesh, mesh=placement.find_mesh(call.args, at))
  return _per_device(cut, function, hooked, at, call, on_mesh, by_batch)

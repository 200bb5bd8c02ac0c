"""The per-device route: every device loops over its own rows, then one reduction.

The loop runs under `shard_map` over the data axes, with `check_vma=False`:
the user's function sees each device's rows exactly as it would see a batch
on one device, as under `pmap`. Whatever a model does (convolutions,
`lax.cond` on batch data, gathers, custom VJPs), it does on local arrays, so
nothing in the loop communicates unless the user's own code names the data
axis (`lax.pmean` for synchronised BatchNorm: one all-reduce per
micro-batch, as asked). Without type checks, an array the function closes
over and differentiates gets its per-device gradient, as an argument does:
JAX inserts no psum into the micro-step's backward pass. Each device's carry
leaves the `shard_map` stacked over the devices (no data moves), and a
second, small `shard_map` holds only the reduction (`reduction.over_devices`:
one fused psum, a reduce-scatter for FSDP gradients) and returns global
arrays.

`vmap` over a device axis with `spmd_axis_name` would keep the function out
of manual axes, but its batching rules rewrite what the function does (a
convolution's batched kernel folds the device axis into feature groups, a
`lax.cond` on batch data becomes a `select`), which on a mesh fails to trace
or communicates inside the loop; `shard_map` runs each device's rows as they
are. What it refuses (on an explicit mesh, a function closing over arrays
placed on the mesh) runs as the whole batch's step runs (`routes.WholeBatch`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaccum._core import accumulators, fsdp, loop, reduction, rewrites, stats, step
from jaccum._core.accumulators import Finish
from jaccum._core.step import Function, Positions
from jaccum._routes import arguments, placement

P = jax.sharding.PartitionSpec
AxisType = jax.sharding.AxisType


def jitted_shard_map(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
  # Under jit even when called eagerly: an eager shard_map refuses outputs
  # sharded over an explicit axis it does not run manually (a "model" axis).
  return jax.jit(jax.shard_map(fn, **kwargs))


class Layout(NamedTuple):
  """How each output leaf leaves the reduction, one entry per leaf.

  Attributes:
    scatter: FSDP gradients to reduce-scatter after the loop (`"gather_once"`).
    sharded: every leaf that comes back sharded like its param (scattered
      after the loop or by every micro-step).
    out_specs: each leaf's `PartitionSpec` out of the reduction.
  """

  scatter: list[fsdp.Sharded | None]
  sharded: list[fsdp.Sharded | None]
  out_specs: list[P]


@dataclasses.dataclass(frozen=True)
class PerDevice:
  """Every device of `axes` runs the loop over its own rows under `shard_map`.

  Attributes:
    mesh: the device mesh.
    axes: the data axes the batch is split over.
    devices: the devices over `axes`.
    explicit: whether the data axes are explicit (arrays are resharded,
      not constrained).
    specs: per leaf of the params (argument 0), its FSDP spec, or None; None
      without FSDP.
    hows: `specs` read as `fsdp.Sharded` (how each leaf is split), or None.
    fsdp: what the sharded modes change inside the loop, or None.
    rows: rows per micro-batch on each device.
    sharded_by_accumulate: plain `accumulate` on a batch sharded over
      explicit axes (the unsharded call's meaning is owed).
    call: the call's arguments, `(args, kwargs, bound_args, bound_kwargs)`.
    placed: its arrays laid out for the loop, and `in_specs` their specs.
    outside: where the function could only be traced outside the loop's
      `shard_map` (it closes over arrays on an explicit mesh), that program
      (`retype.Outside`), whose closed-over arrays (`consts`, laid out) cross
      into the loop as inputs.
  """

  mesh: Any
  axes: tuple[str, ...]
  devices: int
  explicit: bool
  specs: list[P | None] | None
  hows: list[fsdp.Sharded | None] | None
  fsdp: fsdp.Plan | None
  rows: int
  sharded_by_accumulate: bool
  call: Any
  placed: list[Any]
  in_specs: list[P]
  outside: Any = None
  consts: tuple[Any, ...] = ()

  on_devices = True
  count_varies = False  # a count per device is one of shape [devices]

  def shard_shape(self, shape: tuple[int, ...], how: fsdp.Sharded) -> tuple[int, ...]:
    """The shape of one device's shard of an array of `shape` split as `how`."""
    size = math.prod(self.mesh.shape[a] for a in how.axes)
    return tuple(d // size if i == how.dim else d for i, d in enumerate(shape))

  def count(self, count: Any, num_microbatches: int, global_order: bool) -> Any:
    """The count of real micro-batches: one for all devices, or one per device."""
    if count is None:
      return None
    if self.sharded_by_accumulate and global_order:
      # Global micro-batch m lives on device m // K: each runs those below n,
      # of the K × devices the batch holds.
      count = arguments.check_count(count, num_microbatches * self.devices)
      first = num_microbatches * jnp.arange(self.devices, dtype=jnp.int32)
      return jnp.clip(count - first, 0, num_microbatches)
    per_device = 0 if self.sharded_by_accumulate else self.devices
    return arguments.check_count(count, num_microbatches, per_device)

  def lift(self, consts: Any) -> step.Lift:
    """How the step is traced here: where it fails inside the `shard_map`, outside
    it (`retype`); once lifted, its closed-over arrays arrive as `consts`."""
    return step.Lift(self.mesh, self.outside, consts)

  def lifted(self, outside: Any) -> PerDevice:
    """This route, running `outside`'s program with its closed-over arrays as
    inputs, whole on every device of the data axes (as the params are)."""
    consts = tuple(
      placement.place(
        c,
        self.mesh,
        rewrites.without_axes(arguments.spec_of(c) or P(), self.axes),
        self.explicit,
      )
      for c in outside.consts
    )
    return dataclasses.replace(self, outside=outside, consts=consts)

  def _inputs(self, count: Any) -> tuple[list[Any], list[P]]:
    """The loop's inputs and their specs: the call's arrays, the count, then a
    lifted function's closed-over arrays."""
    placed, in_specs = list(self.placed), list(self.in_specs)
    if count is not None:
      # Laid out as the loop reads it: on an explicit mesh a count per device
      # must arrive split over the axes, as its in_spec says.
      spec = P(self.axes) if np.ndim(count) == 1 else P()
      in_specs.append(spec)
      placed.append(placement.place(count, self.mesh, spec, self.explicit))
    return [*placed, *self.consts], [*in_specs, *[P()] * len(self.consts)]

  def _on_each_device(
    self, function: Function, count: Any, body: Callable[..., Any]
  ) -> tuple[Callable[..., Any], list[Any], list[P]]:
    """`body(function, args, kwargs, count)` as each device runs it."""
    placed, in_specs = self._inputs(count)

    def per_device(*arrays):
      split = len(arrays) - len(self.consts)
      arrays, consts = list(arrays[:split]), arrays[split:]
      local_count = None
      if count is not None:
        *arrays, local_count = arrays
        local_count = jnp.reshape(local_count, (-1,))[0]
      args, kwargs, bound_args, bound_kwargs = placement.refill(self.call, arrays)
      local = function.with_bound(bound_args, bound_kwargs)
      return body(local, list(args), kwargs, local_count, consts)

    return per_device, placed, in_specs

  def in_context(
    self, function: Function, call: Any, count: Any, body: Callable[..., Any]
  ) -> Any:
    """What `body` returns when run where the loop runs, on one device's
    arguments: traced, not run (an abstract `shard_map`)."""
    found: list[Any] = []

    def probe(*args, **kwargs):
      found.append(body(*args, **kwargs))
      return jnp.zeros((1,))

    per_device, placed, in_specs = self._on_each_device(function, count, probe)
    jax.eval_shape(
      jax.shard_map(
        per_device,
        mesh=self.mesh,
        in_specs=tuple(in_specs),
        out_specs=P(self.axes),
        axis_names=set(self.axes),
        check_vma=False,
      ),
      *placed,
    )
    return found[0]

  def run(self, plan: Any, call: Any) -> Any:
    """Every device's loop, the reduction, the result as global arrays."""

    def loop_body(function, args, kwargs, local_count, consts):
      carry = loop.run(plan.loop, function, args, kwargs, local_count, consts)
      # Each device's carry, stacked over the devices: nothing moves.
      return jax.tree.map(
        lambda x: jnp.asarray(x)[None],
        (carry.acc, carry.total, carry.state, carry.stats),
      )

    per_device, placed, in_specs = self._on_each_device(
      plan.function, plan.count, loop_body
    )
    stacked = jitted_shard_map(
      per_device,
      mesh=self.mesh,
      in_specs=tuple(in_specs),
      out_specs=P(self.axes),
      axis_names=set(self.axes),
      check_vma=False,
    )(*placed)
    result, state, estimates, reduce_state = _reduced(self, plan, stacked, call)
    result = _typed_as_params(result, plan, self)
    result = jax.tree.map(
      lambda a, r: a.finish(None, Finish()) if isinstance(a, accumulators.Zeros) else r,
      plan.loop.accumulators,
      result,
      is_leaf=accumulators.is_accumulator,
    )
    if plan.count is not None:  # one count, or one per device
      ran = jnp.sum(plan.count)
      result = accumulators.none_ran(plan.loop.accumulators, result, ran)
    return plan.output.assemble(result, state, estimates, reduce_state)


def _sharded_sq_norm(result: Any, grad_mask: Any, layout: Layout) -> jax.Array:
  """|G|² of the reduced gradients; a scattered one holds a shard per device."""
  parts = [
    stats.sq_norm(r, True)
    if how is None
    else jax.lax.psum(stats.sq_norm(r, True), how.axes)
    for r, g, how in zip(
      jax.tree.leaves(result), jax.tree.leaves(grad_mask), layout.sharded, strict=True
    )
    if g
  ]
  return sum(parts, jnp.zeros((), jnp.float32))


def _reduced(route: PerDevice, plan: Any, stacked: Any, call: Any) -> Any:
  """The one reduction after the loop, under a second, small `shard_map`.

  Returns `(result, state, stats, reduce_state)` as global arrays.
  """
  accs = plan.loop.accumulators
  layout = plan.layout

  def reduce_body(acc, total, state, sums, reduce_state, ran):
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)
    combined = reduction.over_devices(
      plan.reduction,
      accs,
      first(acc),
      first(total),
      first(state),
      list(first(sums) or ()),
      reduce_state,
      ran[0],
    )
    how = accumulators.finishing(
      None if combined.total is not None else plan.reduction.num_terms, None
    )
    result = accumulators.finish(accs, combined.acc, how, combined.done)
    estimates = None
    if plan.output.stats is not None:
      norm = _sharded_sq_norm(result, plan.reduction.grad_mask, layout)
      estimates = plan.output.stats.estimates(combined.sums, combined.total, norm)
    # float0 zeros are not arrays shard_map can return; put back after it.
    result = jax.tree.map(
      lambda a, r: None if isinstance(a, accumulators.Zeros) else r,
      accs,
      result,
      is_leaf=accumulators.is_accumulator,
    )
    return result, combined.state, estimates, combined.reduce_state

  result_specs = jax.tree.unflatten(
    jax.tree.structure(accs, is_leaf=accumulators.is_accumulator), layout.out_specs
  )
  axes = P(route.axes)
  reduced = jitted_shard_map(
    reduce_body,
    mesh=route.mesh,
    in_specs=(axes, axes, axes, axes, axes, axes),
    out_specs=(result_specs, P(), P(), axes),
    axis_names=set(route.axes),
  )
  # One row per device: laid out so, as the reduction's shard_map reads it.
  reduce_state = jax.tree.map(
    lambda x: placement.place(x, route.mesh, axes, route.explicit), call.reduce_state
  )
  acc, total, state, sums = stacked
  # Which devices ran a micro-batch: who holds the global last one.
  ran = True if plan.count is None else jnp.asarray(plan.count) > 0
  ran = jnp.broadcast_to(ran, (route.devices,))
  ran = placement.place(ran, route.mesh, axes, route.explicit)
  return reduced(acc, total, state, sums, reduce_state, ran)


def _typed_as_params(result: Any, plan: Any, route: PerDevice) -> Any:
  """On an explicit mesh, FSDP gradients typed as their params are.

  `"shard_all"`'s gradients come out of the per-use gathers' transposes
  without the params' other axes (`P("data", None)` for a param `P("data",
  "model")`); each device already holds what the param's own type asks for
  of them, so the reshard is a local slice.
  """
  if not route.explicit or route.specs is None:
    return result
  leaves, tree = jax.tree.flatten(result)
  grads = [i for i, g in enumerate(jax.tree.leaves(plan.reduction.grad_mask)) if g]
  for i, spec in zip(grads, route.specs, strict=True):
    typed = getattr(jax.typeof(leaves[i]).sharding, "spec", None)
    if spec is not None and typed is not None and tuple(typed) != tuple(spec):
      leaves[i] = placement.place(leaves[i], route.mesh, spec, explicit=True)
  return jax.tree.unflatten(tree, leaves)


def layout(accs: Any, grad_mask: Any, route: PerDevice) -> Layout:
  """Where each output leaf lives after the reduction."""
  flat = jax.tree.leaves(accs, is_leaf=accumulators.is_accumulator)
  grads = jax.tree.leaves(grad_mask)
  # FSDP gradients come back sharded like their params: scattered after the
  # loop ("gather_once"), or by every micro-step (the loop's plan says so).
  scatter: list[fsdp.Sharded | None] = [None] * len(flat)
  sharded: list[fsdp.Sharded | None] = [getattr(a, "how", None) for a in flat]
  out_specs = [P(route.axes) if a.per_example else P() for a in flat]
  if route.hows is not None:
    grad_positions = [i for i, g in enumerate(grads) if g]
    if len(grad_positions) != len(route.hows):
      raise ValueError(
        f"FSDP needs the gradients of the params (argument 0, {len(route.hows)} "
        f"leaves) in grad_fn's output, found {len(grad_positions)} gradient "
        "leaves; pass grad_leaves to mark them."
      )
    for i, how in zip(grad_positions, route.hows, strict=True):
      if how is None or flat[i].mode not in ("mean", "sum"):
        continue
      if not isinstance(flat[i], accumulators.Scattered):
        scatter[i] = how
      sharded[i] = how
      out_specs[i] = P(*(None,) * how.dim, how.axes)
  return Layout(scatter, sharded, out_specs)


def per_example_leaves(
  accs: Any, rows: int, axes: tuple[str, ...], shapes_at: Callable[[int], Any]
) -> None:
  """Refuses `"last"` and `"concat"` leaves that are not one row per example.

  Every device returns its own rows of them, so only per-example rows make
  one array. A leaf whose leading size is the per-device micro-batch's may
  still only happen to have it: `shapes_at(n)` (the output's shapes on n
  rows, traced abstractly) tells, where any such leaf exists.
  """
  flat = jax.tree_util.tree_flatten_with_path(accs, is_leaf=accumulators.is_accumulator)
  flat = flat[0]
  bigger = None
  if any(a.per_example and a.shape[:1] == (rows,) for _, a in flat):
    try:
      bigger = jax.tree.leaves(shapes_at(2 * rows))
    except Exception:  # the function cannot run on other sizes: cannot tell
      bigger = None
  for index, (path, acc) in enumerate(flat):
    per_example = acc.shape[:1] == (rows,) and (
      bigger is None or bigger[index].shape[:1] == (2 * rows,)
    )
    if acc.per_example and not per_example:
      follows = (
        f" (its leading size stays {rows} on a micro-batch of {2 * rows} rows: it "
        f"only happens to match the {rows} rows per device)"
        if acc.shape[:1] == (rows,)
        else ""
      )
      raise ValueError(
        f'reduce="{acc.mode}" at output{jax.tree_util.keystr(path)} (shape '
        f"{acc.shape}) needs one row per example{follows}: with the batch split "
        f"over {axes}, every device runs its own micro-batches, and their rows are "
        f"returned together. A value that is not per-example has no whole-batch "
        f'meaning here; reduce it with "mean", "max" or "min".'
      )


def first_last_path(accs: Any) -> str | None:
  """Where the first `"last"` leaf sits in the output, or None."""
  flat = jax.tree_util.tree_flatten_with_path(accs, is_leaf=accumulators.is_accumulator)
  for path, acc in flat[0]:
    if acc.mode == "last" and acc.per_example:
      return jax.tree_util.keystr(path)
  return None


def check_mesh_axes(axes: tuple[str, ...], mesh: Any) -> None:
  """Raises, naming the fix, where `axes` (the batch's axes) are not the mesh's.

  `axis` defaults to "data", so a mesh that names its batch axis otherwise
  (Flax's tutorials use "batch") meets it unasked: the message says so.
  """
  missing = [a for a in axes if a not in mesh.axis_names]
  if not missing:
    return
  names = tuple(mesh.axis_names)
  fix = (
    "axis defaults to 'data': pass axis= naming the mesh axes the batch is split "
    f"over, e.g. axis={names[0]!r}"
    if axes == ("data",) and names
    else f"pass axis= naming the mesh axes the batch is split over, among {names}"
  )
  raise ValueError(f"axis={axes} names {missing}, not axes of the mesh {mesh}; {fix}.")


def check_mesh_and_batch(
  num_microbatches: int,
  batch_argnums: tuple[int, ...],
  at: Positions,
  args: Sequence[Any],
  mesh: Any,
  axes: tuple[str, ...],
) -> tuple[int, int, bool]:
  """`(devices, rows, explicit)`: the mesh names the axes, the batch splits into
  devices × K micro-batches of equal rows."""
  check_mesh_axes(axes, mesh)
  devices = math.prod(mesh.shape[a] for a in axes)
  batch_size = arguments.check_batch_size(num_microbatches, batch_argnums, at, args)
  per_step = devices * num_microbatches
  if batch_size % per_step:
    rows = batch_size // devices
    works = [k for k in range(1, rows + 1) if rows % k == 0]
    raise ValueError(
      f"batch_size={batch_size} must be divisible by devices × num_microbatches "
      f"= {devices} × {num_microbatches} = {per_step}: every micro-batch takes "
      f"the same number of rows on each device of {axes}."
      + (
        f" K dividing {rows} (rows per device) works: {works}."
        if batch_size % devices == 0
        else ""
      )
    )
  explicit = all(
    t == AxisType.Explicit
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if n in axes
  )
  return devices, batch_size // per_step, explicit

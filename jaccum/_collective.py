"""Device-varying values and the one cross-device reduction after the loop.

Inside `shard_map`, JAX tracks which mesh axes a value varies over. A gradient
taken with respect to a device-invariant (replicated) parameter of a loss on a
device-varying batch is itself made invariant by a `psum` that JAX inserts into
the backward pass: inside a loop, one all-reduce per micro-batch. Casting the
parameters to varying before the loop removes that psum; the loop then runs
with no communication, and `all_reduce` combines the devices once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaccum import _reduce

AxisName = str | tuple[str, ...]


def axis_tuple(axis_name: Any) -> tuple[str, ...]:
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  if (
    not isinstance(names, Sequence)
    or not names
    or not all(isinstance(n, str) for n in names)
  ):
    raise TypeError(
      f"axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}."
    )
  return tuple(names)


def spec_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes one `PartitionSpec` entry names: None, a name or a tuple."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def varying_axes(x: Any) -> frozenset[str]:
  """The manual mesh axes over which `x` (an array or a ShapeDtypeStruct) varies."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", ()))


def cast_varying(tree: Any, axes: Sequence[str] | frozenset[str]) -> Any:
  """Casts every array leaf of `tree` to vary over `axes` (a no-op where it does)."""

  def cast(x):
    if not isinstance(x, jax.Array):
      return x
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def match_varying(tree: Any, like: Any) -> Any:
  """Casts `tree`'s leaves to vary like the matching leaves of `like`.

  A scan carry must keep its type across iterations: an accumulator
  initialised from zeros is invariant, the micro-step outputs it absorbs may
  vary over the data axis.
  """
  return jax.tree.map(lambda x, y: cast_varying(x, varying_axes(y)), tree, like)


def all_reduce(
  leaves: Any,
  acc: Any,
  total: jax.Array | int,
  state: Any,
  axis_name: tuple[str, ...],
  scatter: list[int | None] | None = None,
) -> tuple[Any, jax.Array | int, Any]:
  """Combines the per-device accumulators in one fused all-reduce.

  `"mean"` and `"sum"` leaves, the total weight and floating state leaves go
  into a single `psum` (XLA fuses its operands into one all-reduce); `"max"`
  leaves and non-floating state take one `pmax`. `"concat"` and `"last"`
  leaves stay per device. Leaves given a dimension in `scatter` (one entry
  per leaf; FSDP gradients) are reduce-scattered along it instead, so each
  device keeps the shard its parameters live on. Floating state is averaged
  over devices (e.g. BatchNorm statistics, as in synchronised BatchNorm);
  other state takes the largest value (e.g. step counters, equal anyway).

  Returns:
    `(acc, total, state)` with the sums taken over devices; an unweighted
    total becomes `K × devices`.
  """
  plans, treedef = jax.tree.flatten(leaves, is_leaf=_reduce.is_plan)
  values = treedef.flatten_up_to(acc)
  state_values, state_def = jax.tree.flatten(state)
  floating = [jnp.issubdtype(jnp.result_type(s), jnp.inexact) for s in state_values]

  dims = [None] * len(plans) if scatter is None else scatter
  for i, dim in enumerate(dims):
    if dim is not None and plans[i].mode in ("mean", "sum"):
      values[i] = jax.lax.psum_scatter(
        values[i], axis_name, scatter_dimension=dim, tiled=True
      )
  summed = [
    i for i, p in enumerate(plans) if p.mode in ("mean", "sum") and dims[i] is None
  ]
  maxed = [i for i, p in enumerate(plans) if p.mode == "max"]
  to_sum = [values[i] for i in summed] + [
    s for s, f in zip(state_values, floating, strict=True) if f
  ]
  to_max = [values[i] for i in maxed] + [
    s for s, f in zip(state_values, floating, strict=True) if not f
  ]
  weighted = not isinstance(total, int)
  if weighted:
    to_sum.append(total)
  to_sum = jax.lax.psum(to_sum, axis_name) if to_sum else []
  to_max = jax.lax.pmax(to_max, axis_name) if to_max else []

  num_devices = jax.lax.axis_size(axis_name)
  total = to_sum.pop() if weighted else total * num_devices
  sums, maxes = iter(to_sum), iter(to_max)
  for i in summed:
    values[i] = next(sums)
  for i in maxed:
    values[i] = next(maxes)
  state_values = [next(sums) / num_devices if f else next(maxes) for f in floating]
  return (
    jax.tree.unflatten(treedef, values),
    total,
    jax.tree.unflatten(state_def, state_values),
  )

"""Device-varying values and the one cross-device reduction after the loop.

Inside a `shard_map` that checks types (the default), JAX tracks which mesh
axes a value varies over. A gradient taken with respect to a device-invariant
(replicated) parameter of a loss on a device-varying batch is itself made
invariant by a `psum` that JAX inserts into the backward pass: inside a loop,
one all-reduce per micro-batch. Casting the parameters to varying before the
loop removes that psum; the loop then runs with no communication, and
`all_reduce` combines the devices once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from jaccum import _reduce


def varying_axes(x: Any) -> frozenset[str]:
  """The manual mesh axes over which `x` (an array or a ShapeDtypeStruct) varies."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", ()))


def cast_varying(tree: Any, axes: Sequence[str] | frozenset[str]) -> Any:
  """Casts every array leaf of `tree` to vary over `axes` (a no-op where it does).

  Only manual axes (`shard_map`, `pmap`) type values as varying; over a
  `vmap` axis nothing is cast.
  """
  manual = set(jax.sharding.get_abstract_mesh().manual_axes)

  def cast(x):
    if not isinstance(x, jax.Array):
      return x
    missing = tuple(a for a in axes if a in manual and a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def match_varying(tree: Any, like: Any) -> Any:
  """Casts `tree`'s array leaves to vary like the matching leaves of `like`.

  A scan carry must keep its type across iterations: an accumulator
  initialised from zeros is invariant, the micro-step outputs it absorbs may
  vary over the data axis. `like` is the primary tree: `tree` may hold None
  where nothing is carried.
  """
  return jax.tree.map(
    lambda y, x: x if x is None else cast_varying(x, varying_axes(y)), like, tree
  )


def _jaxprs(jaxpr: jex.Jaxpr) -> Iterator[jex.Jaxpr]:
  yield jaxpr
  for sub in jex.subjaxprs(jaxpr):
    yield from _jaxprs(sub)


def sums_over(jaxpr: jex.Jaxpr, axes: Sequence[str]) -> bool:
  """Whether `jaxpr` (or a program nested in it) sums over any of `axes`."""
  return any(
    eqn.primitive.name in ("psum", "psum_invariant")
    and set(eqn.params.get("axes", ())) & set(axes)
    for sub in _jaxprs(jaxpr)
    for eqn in sub.eqns
  )


def fold_device(key: jax.Array, axes: Sequence[str]) -> jax.Array:
  """`key` on device 0, `fold_in(key, d)` on device d > 0 of `axes`.

  Devices draw different numbers, and device 0 draws (and advances a key
  threaded as state) exactly as one device running the whole batch would, so
  the key that comes back after the loop is the unsharded one.
  """
  device = jax.lax.axis_index(tuple(axes))
  data = jax.random.key_data(key)
  folded = jax.random.key_data(jax.random.fold_in(key, device))
  return jax.random.wrap_key_data(
    jnp.where(device == 0, data, folded), impl=jax.random.key_impl(key)
  )


def _device_zero(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """Device 0's value of `x` on every device (exact for any dtype, keys too)."""
  is_key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  data = jax.random.key_data(x) if is_key else x
  as_int = data.astype(jnp.int32) if data.dtype == jnp.bool_ else data
  first = jax.lax.psum(
    jnp.where(jax.lax.axis_index(axes) == 0, as_int, jnp.zeros_like(as_int)), axes
  )
  first = first.astype(data.dtype)
  return (
    jax.random.wrap_key_data(first, impl=jax.random.key_impl(x)) if is_key else first
  )


def all_reduce(
  leaves: Any,
  acc: Any,
  weights: _reduce.Weights | None,
  state: Any,
  axes: tuple[str, ...],
  scatter: list[Any] | None = None,
  extras: Sequence[jax.Array] = (),
) -> tuple[Any, jax.Array | None, Any, list[jax.Array]]:
  """Combines the per-device accumulators, one fused all-reduce for the sums.

  `"sum"` and unweighted `"mean"` leaves are summed over devices. Weighted
  `"mean"` leaves hold each device's `Σ w out / Σ |w|`; they are combined as
  `Σ_d norm_d acc_d / Σ_d total_d` (`weights`), in float32 at least. These
  sums, the total weight and the floating state go into a single `psum` (XLA fuses its
  operands into one all-reduce); `"max"` and `"min"` leaves take a `pmax` and
  a `pmin`. `"concat"` and `"last"` leaves stay per device. Leaves given an
  `_fsdp.Sharded` in `scatter` (one entry per leaf; FSDP gradients) are
  reduce-scattered over its axes instead, so each device keeps the shard its
  parameters live on, and summed over the other data axes (HSDP's replicas);
  leaves the loop scattered already (`Leaf.scattered`) are only summed over
  the other axes. Floating state is averaged over devices (BatchNorm
  statistics, as synchronised BatchNorm does); other state (counters, keys,
  flags) takes device 0's value.

  `extras` are further scalars to sum over devices, in the same psum.

  Returns:
    `(acc, total, state, extras)` combined over devices; `total` is the summed
    weight (None when unweighted).
  """
  plans, treedef = jax.tree.flatten(leaves, is_leaf=_reduce.is_plan)
  values = treedef.flatten_up_to(acc)
  hows = [None] * len(plans) if scatter is None else scatter
  weighted = weights is not None
  total = None if weights is None else weights.total

  def summand(i):
    # A scattered leaf holds Σ w·out already; others Σ w·out / Σ |w|.
    if weights is not None and plans[i].mode == "mean" and not plans[i].scattered:
      compute = jnp.promote_types(values[i].dtype, weights.norm.dtype)
      return values[i].astype(compute) * weights.norm.astype(compute)
    return values[i]

  summed = [
    i
    for i, p in enumerate(plans)
    if p.mode in ("mean", "sum") and hows[i] is None and p.scattered is None
  ]
  # Sharded over some axes: scattered over those, summed over the rest.
  by_rest: dict[tuple[str, ...], list[int]] = {}
  for i, p in enumerate(plans):
    how = hows[i] if p.mode in ("mean", "sum") else None
    if how is not None:
      values[i] = how.scatter(summand(i))
    how = how or p.scattered
    rest = () if how is None else tuple(a for a in axes if a not in how.axes)
    if rest:
      by_rest.setdefault(rest, []).append(i)
  for rest, indices in by_rest.items():
    for i, value in zip(
      indices,
      jax.lax.psum(
        [summand(i) if hows[i] is None else values[i] for i in indices], rest
      ),
      strict=True,
    ):
      values[i] = value

  state_values, state_def = jax.tree.flatten(state)
  floating = [jnp.issubdtype(jnp.result_type(s), jnp.inexact) for s in state_values]
  to_sum = [summand(i) for i in summed]
  to_sum += [s for s, f in zip(state_values, floating, strict=True) if f]
  to_sum += list(extras)
  if weighted:
    to_sum.append(total)
  to_sum = jax.lax.psum(to_sum, axes) if to_sum else []
  num_devices = jax.lax.axis_size(axes)
  total = to_sum.pop() if weighted else None
  summed_extras = to_sum[len(to_sum) - len(extras) :]
  sums = iter(to_sum[: len(to_sum) - len(extras)])
  for i in summed:
    values[i] = next(sums)
  for i, p in enumerate(plans):
    if p.mode in ("max", "min"):
      values[i] = (jax.lax.pmax if p.mode == "max" else jax.lax.pmin)(values[i], axes)
    if total is not None and p.mode == "mean":
      values[i] = _reduce.weighted_mean(values[i], jnp.ones_like(total), total)
      values[i] = values[i].astype(p.carry_dtype)
  state_values = [
    next(sums) / num_devices if f else _device_zero(s, axes)
    for s, f in zip(state_values, floating, strict=True)
  ]
  return (
    jax.tree.unflatten(treedef, values),
    total,
    jax.tree.unflatten(state_def, state_values),
    summed_extras,
  )

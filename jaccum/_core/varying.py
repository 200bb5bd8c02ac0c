"""Device-varying types, the collectives a program holds, and per-device keys.

Inside a `shard_map` that checks types (the default), JAX tracks which mesh
axes a value varies over. A gradient taken with respect to a device-invariant
(replicated) parameter of a loss on a device-varying batch is itself made
invariant by a `psum` that JAX inserts into the backward pass: inside a loop,
one all-reduce per micro-batch. Casting the parameters to varying before the
loop removes that psum; the loop then runs with no communication, and the one
reduction (`reduction`) combines the devices once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp


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


_COLLECTIVES = {
  "psum": "axes",
  "psum_invariant": "axes",
  "pmax": "axes",
  "pmin": "axes",
  "pbroadcast": "axes",
  "all_gather": "axis_name",
  "all_gather_invariant": "axis_name",
  "reduce_scatter": "axis_name",
  "ppermute": "axis_name",
  "all_to_all": "axis_name",
  "ragged_all_to_all": "axis_name",
}


def collective_axes(jaxpr: jex.Jaxpr) -> set[str]:
  """The mesh axes that collectives in `jaxpr` (nested programs too) run over."""
  found: set[str] = set()
  for sub in _jaxprs(jaxpr):
    for eqn in sub.eqns:
      param = _COLLECTIVES.get(eqn.primitive.name)
      names = eqn.params.get(param, ()) if param else ()
      found.update((names,) if isinstance(names, str) else names)
  return found


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


def first_microbatch(
  axes: Sequence[str], num_microbatches: int, num_real: Any, count_varies: bool
) -> jax.Array:
  """This device's first micro-batch in the global order (`deterministic=True`).

  Devices hold consecutive micro-batches: device d's first is the number the
  devices before it run, d·K without a count (one small all-gather when the
  counts differ between devices).
  """
  device = jax.lax.axis_index(tuple(axes))
  if num_real is None:
    return device * num_microbatches
  if not count_varies:
    return device * num_real
  counts = jax.lax.all_gather(num_real, tuple(axes))
  return jnp.sum(jnp.where(jnp.arange(counts.shape[0]) < device, counts, 0))


def device_zero(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
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

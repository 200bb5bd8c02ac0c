"""Exact sums of floating arrays: the same bits in any order, on any number of devices.

A float `x` is cut at fixed power-of-two boundaries, every `BITS` = 16 bits,
into integer slices: `s_b(x) = trunc(x / 2^(16b)) - 2^16 trunc(x / 2^(16(b+1)))`
counts the units of `2^(16b)` that `x` holds between bin `b` and bin `b + 1`.
A slice depends on `x` and `b` alone, never on the other terms. An `Acc`
keeps, per element, the int32 sums of the slices of `L` consecutive bins
(the binned, or "indexed", sums of ReproBLAS, here in integers): integer
addition is exact and associative, so the bins hold the same integers
whatever order the terms arrive in and however they are grouped into
micro-batches and devices. The highest bin (`top`) is the one the largest
magnitude seen so far needs; when a larger term raises it, the lowest bins
are dropped, which are exactly the slices that every term loses when the sum
is read at the final `top`. That `top` is a function of the largest
magnitude over all the terms of the leaf (a maximum: itself order-free), so
the scale of a leaf does not depend on how the terms were divided.

Devices combine with a `pmax` of the tops, then an integer `psum` of the
bins, aligned to that top (`psum`, `scatter`). The bins are read back into a
float once, at the end (`value`), by carrying between them (exact) and adding
their floats in a fixed order: a deterministic function of the bins.

Accuracy (`L = 3` bins for float32 and narrower, 5 for float64). With `F` the
largest magnitude of a leaf's `n` terms, each term loses less than
`2^-32 F` (float64: `2^-64 F`) below the lowest bin, and the read-back is
within 1.5 ulp of the bins' exact sum: `|value - Σ x| <= n 2^-32 F + 1.5 ulp`.
A mean then adds one rounding (its division). Leaves whose every magnitude is
below `2^-112` (float64: `2^-1008`) are kept with the resolution of that
floor. The bins hold at most `MAX_TERMS` = 2^15 - 1 terms (sums of slices
below 2^16 in an int32, with room for the carries when read back). A
non-finite term makes its whole leaf NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BITS = 16
MAX_TERMS = 2**15 - 1
# Bins per element, and the lowest top whose scale 2^(-16 top) is a normal
# float of the compute dtype: 3 bins keep 32 bits below a float32 leaf's
# largest magnitude (24 in its significand), 5 keep 64 for float64 (53).
_BINS = {np.dtype(np.float32): 3, np.dtype(np.float64): 5}
_LOWEST_TOP = {np.dtype(np.float32): -7, np.dtype(np.float64): -63}
_FLOAT_OF = {bins: dtype for dtype, bins in _BINS.items()}


class Acc(NamedTuple):
  """An exact sum of floating terms, as binned integers.

  Attributes:
    bins: int32 arrays shaped like the terms, highest bin first: `bins[l]`
      counts units of `2^(16 (top - l))`.
    top: int32 scalar, the index of the highest bin.
    bad: bool scalar: a term was not finite.
  """

  bins: tuple[jax.Array, ...]
  top: jax.Array
  bad: jax.Array

  @property
  def dtype(self) -> np.dtype:
    """The floating dtype the sum is read back in."""
    return _FLOAT_OF[len(self.bins)]


def compute_dtype(dtype: Any) -> np.dtype:
  """The dtype terms of `dtype` are sliced in: float64, or float32 for narrower."""
  return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def is_acc(x: Any) -> bool:
  return isinstance(x, Acc)


def zeros(
  shape: tuple[int, ...],
  dtype: Any,
  full: Callable[[tuple[int, ...], Any, Any], jax.Array] | None = None,
) -> Acc:
  """The empty sum of terms of `shape` and `dtype`.

  `full(shape, value, dtype)` makes each array (default `jnp.full`): the
  loop passes one that types the carry on the mesh in context.
  """
  make = full or (lambda s, v, d: jnp.full(s, v, d))
  dtype = compute_dtype(dtype)
  return Acc(
    tuple(make(shape, 0, jnp.int32) for _ in range(_BINS[dtype])),
    make((), _LOWEST_TOP[dtype], jnp.int32),
    make((), False, jnp.bool_),
  )


def _power_of_two(exponent: jax.Array, dtype: np.dtype) -> jax.Array:
  """`2^exponent` exactly, for a normal float's exponent (built from its bits)."""
  if dtype == np.float64:
    bits = (exponent.astype(jnp.int64) + 1023) << 52
    return jax.lax.bitcast_convert_type(bits, jnp.float64)
  return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def _top_of(largest: jax.Array, dtype: np.dtype) -> jax.Array:
  """The lowest bin whose slices hold `largest`: `largest < 2^(16 (top + 1))`."""
  _, exponent = jnp.frexp(largest)  # largest < 2^exponent
  top = -((-exponent) // BITS) - 1  # ceil(exponent / 16) - 1
  lowest = _LOWEST_TOP[dtype]
  return jnp.where(largest > 0, jnp.maximum(top, lowest), lowest)


def _align(acc: Acc, top: jax.Array) -> tuple[jax.Array, ...]:
  """The bins read at a `top` no lower than `acc.top`: the lowest ones dropped."""
  shift = top - acc.top
  aligned = []
  for level in range(len(acc.bins)):
    bin_ = jnp.zeros_like(acc.bins[level])
    for by in range(level + 1):
      bin_ = jnp.where(shift == by, acc.bins[level - by], bin_)
    aligned.append(bin_)
  return tuple(aligned)


def add(acc: Acc, terms: jax.Array) -> Acc:
  """`acc` plus `terms` (an array of its shape), exactly.

  About twenty elementwise operations: the largest magnitude, the realigned
  bins (selects on a scalar), then per bin a truncating conversion, an
  integer add, and the remainder scaled up by 2^16 (all exact).
  """
  dtype = acc.dtype
  terms = jnp.asarray(terms).astype(dtype)
  largest = jnp.max(jnp.abs(terms)) if terms.size else jnp.zeros((), dtype)
  finite = jnp.isfinite(largest)
  top = jnp.maximum(acc.top, _top_of(jnp.where(finite, largest, 0), dtype))
  rest = terms * _power_of_two(-BITS * top, dtype)  # |rest| < 2^16: exact
  bins = []
  for level, bin_ in enumerate(_align(acc, top)):
    units = rest.astype(jnp.int32)  # toward zero
    bins.append(bin_ + units)
    if level + 1 < len(acc.bins):
      rest = (rest - units.astype(dtype)) * (2.0**BITS)
  return Acc(tuple(bins), top, acc.bad | ~finite)


def value(acc: Acc) -> jax.Array:
  """The sum as a float of `acc.dtype`: carried between bins, then added in order.

  The carries are exact; the additions round at most twice (within 1.5 ulp
  of the bins' exact sum, typically 0.5), always in the same way for the
  same bins.
  """
  dtype = acc.dtype
  bins = list(acc.bins)
  for level in range(len(bins) - 1, 0, -1):
    carry = jax.lax.shift_right_arithmetic(bins[level], jnp.int32(BITS))
    bins[level] = bins[level] & (2**BITS - 1)
    bins[level - 1] = bins[level - 1] + carry
  total = bins[0].astype(dtype)
  for bin_ in bins[1:]:
    total = total * (2.0**BITS) + bin_.astype(dtype)
  # The scale of the lowest bin, in two factors: each a normal float.
  exponent = BITS * (acc.top - len(bins) + 1)
  half = exponent // 2
  total = total * _power_of_two(half, dtype) * _power_of_two(exponent - half, dtype)
  return jnp.where(acc.bad, jnp.asarray(np.nan, dtype), total)


def as_float(x: Any) -> Any:
  """`value(x)` for an `Acc`, anything else as it is."""
  return value(x) if is_acc(x) else x


def divide(total: jax.Array, weight: Any) -> jax.Array:
  """`total / weight` in one rounding (a mean), or zeros where the weight is 0.

  XLA rewrites a division by a broadcast scalar into a multiplication by its
  reciprocal (two roundings) in some programs and not in others, so the
  same sum would read back differently on one device and on several: the
  divisor is made an array XLA cannot see through.
  """
  weight = jnp.asarray(weight)
  dtype = jnp.promote_types(total.dtype, weight.dtype)
  safe = jnp.where(weight != 0, weight, 1).astype(dtype)
  divisor = jax.lax.optimization_barrier(jnp.broadcast_to(safe, total.shape))
  return jnp.where(weight != 0, total.astype(dtype) / divisor, 0)


def _global_tops(accs: Sequence[Acc], axes: Sequence[str]) -> list[tuple[Any, Any]]:
  """Each sum's top and bad flag, the highest over `axes` (one small pmax)."""
  tops = [a.top for a in accs] + [a.bad.astype(jnp.int32) for a in accs]
  tops = jax.lax.pmax(tops, tuple(axes))
  return list(zip(tops[: len(accs)], tops[len(accs) :], strict=True))


def psum(xs: Sequence[Any], axes: Sequence[str]) -> list[Any]:
  """`jax.lax.psum(xs, axes)`, with each `Acc` summed exactly and read back.

  Arrays are summed as `psum` sums them; every `Acc` is aligned to the
  highest top over `axes` and its int32 bins go into the same psum (exact:
  integers). It comes back as a float (`value`).
  """
  positions = [i for i, x in enumerate(xs) if is_acc(x)]
  if not positions:
    return jax.lax.psum(list(xs), tuple(axes))
  tops = _global_tops([xs[i] for i in positions], axes)
  parts = [x.bins if is_acc(x) else x for x in xs]
  for i, (top, _) in zip(positions, tops, strict=True):
    parts[i] = _align(xs[i], top)
  summed = jax.lax.psum(parts, tuple(axes))
  for i, (top, bad) in zip(positions, tops, strict=True):
    summed[i] = value(Acc(tuple(summed[i]), top, bad > 0))
  return summed


def scatter(acc: Acc, how: Any, axes: Sequence[str]) -> jax.Array:
  """The exact sum over `axes`, each device keeping the slice `how` scatters.

  The bins are aligned over every axis of `axes`, reduce-scattered over
  `how.axes` (an `_fsdp.Sharded`) and summed over the others, all in int32.
  """
  ((top, bad),) = _global_tops([acc], axes)
  rest = tuple(a for a in axes if a not in how.axes)
  bins = [
    jax.lax.psum_scatter(b, how.axes, scatter_dimension=how.dim, tiled=True)
    for b in _align(acc, top)
  ]
  if rest:
    bins = jax.lax.psum(bins, rest)
  return value(Acc(tuple(bins), top, bad > 0))

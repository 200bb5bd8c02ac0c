"""Exact sums of floating arrays: the same bits in any order, on any number of devices.

A float `x` is cut at fixed power-of-two boundaries, every `BITS` = 16 bits,
into integer slices: with `R` rounding to the nearest integer,
`s_b(x) = R(x / 2^(16b)) - 2^16 R(x / 2^(16(b+1)))` counts the units of
`2^(16b)` that `x` holds at bin `b` (|s_b| <= 2^15). A slice depends on `x`
and `b` alone, never on the other terms, and the slices of the bins from `b`
up add up to `R(x / 2^(16b)) 2^(16b)`. An `Acc` keeps, per element, the sums
of the slices of `L` consecutive bins, below the highest bin in use (`top`):
the binned, or "indexed", sums of ReproBLAS, in integers. Integer addition is
exact and associative, so the bins hold the same integers whatever order the
terms arrive in and however they are grouped into micro-batches and devices.
`top` is the bin the largest magnitude seen so far needs; when a larger term
raises it, the lowest bins are dropped, which are exactly the slices that
every term loses when the sum is read at the final `top`. That `top` is a
function of the largest magnitude over all the terms of the leaf (a maximum:
itself order-free), so the scale of a leaf does not depend on how the terms
were divided.

Bin `b` lives in slot `b mod L` of the carry, so raising `top` only zeroes the
slots of the bins dropped: each slot is updated from itself alone, in place.
On a device the slots are floats holding integers (exact up to 2^24: at most
`MAX_PER_DEVICE` terms of float32, 512; float adds are cheaper than integer
conversions); devices combine with a `pmax` of the tops, then one integer
`psum` of the slots aligned to that top (`psum`, `scatter`). The sum is read
back into a float once (`value`): the bins carried into each other (exact),
then added as floats in a fixed order, a deterministic function of the bins.

Accuracy (`L = 3` bins for float32 and narrower, 5 for float64). With `F` the
largest magnitude of a leaf's `n` terms, each term loses at most
`2^-32 F` (float64: `2^-64 F`) below the lowest bin, and the read-back is
within 1.5 ulp of the bins' exact sum: `|value - Σ x| <= n 2^-32 F + 1.5 ulp`.
A mean then adds one rounding (its division). A leaf whose largest magnitude
is below `2^-80` (float64: `2^-944`) is kept at the resolution of that floor
(`2^-112`, `2^-1008`); a term of `2^111` or more (float64: `2^1007`), as one
that is not finite, makes its whole leaf NaN. The int32 bins hold at most
`MAX_TERMS` = 2^15 - 1 terms over all devices (sums of slices of at most
2^15, with room for the carries when read back).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaccum import _wire

BITS = 16
MAX_TERMS = 2**15 - 1
# Bins per element, and the range of tops whose scales 2^(-16 b) (b from
# top - L + 1 to top + 1) are normal floats of the compute dtype: 3 bins keep
# 32 bits below a float32 leaf's largest magnitude (24 in its significand), 5
# keep 64 for float64 (53). Float slots stay exact to 2^24 (2^53): 2^9 terms.
_BINS = {np.dtype(np.float32): 3, np.dtype(np.float64): 5}
_LOWEST_TOP = {np.dtype(np.float32): -5, np.dtype(np.float64): -59}
_HIGHEST_TOP = {np.dtype(np.float32): 6, np.dtype(np.float64): 62}
_FLOAT_OF = {bins: dtype for dtype, bins in _BINS.items()}
MAX_PER_DEVICE = 2 ** (24 - (BITS - 1))


class Acc(NamedTuple):
  """An exact sum of floating terms, as binned integers.

  Attributes:
    bins: arrays shaped like the terms, one per slot: slot `s` holds the sum
      of the slices of the bin `b` with `b mod L = s` and
      `top - L < b <= top`, in units of `2^(16 b)`; floats holding integers
      on a device, int32 once summed over devices.
    top: int32 scalar, the index of the highest bin.
    bad: bool scalar: a term was not finite (or too large).
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
  *,
  integers: bool = False,
) -> Acc:
  """The empty sum of terms of `shape` and `dtype`.

  `full(shape, value, dtype)` makes each array (default `jnp.full`): the
  loop passes one that types the carry on the mesh in context. With
  `integers`, the slots are int32 (up to `MAX_TERMS` terms, one conversion
  more per slot and term), not floats (up to `MAX_PER_DEVICE`).
  """
  make = full or (lambda s, v, d: jnp.full(s, v, d))
  dtype = compute_dtype(dtype)
  slots = jnp.int32 if integers else dtype
  return Acc(
    tuple(make(shape, 0, slots) for _ in range(_BINS[dtype])),
    make((), _LOWEST_TOP[dtype], jnp.int32),
    make((), False, jnp.bool_),
  )


def empty_like(acc: Acc) -> Acc:
  """The empty sum shaped, typed and placed like `acc`."""
  return Acc(
    tuple(jnp.zeros_like(b) for b in acc.bins),
    jnp.full_like(acc.top, _LOWEST_TOP[acc.dtype]),
    jnp.zeros_like(acc.bad),
  )


def _power_of_two(exponent: jax.Array, dtype: np.dtype) -> jax.Array:
  """`2^exponent` exactly, for a normal float's exponent (built from its bits)."""
  if dtype == np.float64:
    bits = (exponent.astype(jnp.int64) + 1023) << 52
    return jax.lax.bitcast_convert_type(bits, jnp.float64)
  return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def _top_of(largest: jax.Array, dtype: np.dtype) -> jax.Array:
  """The lowest bin whose slice holds `largest` in at most 2^15 units:
  `largest < 2^(16 top + 15)`, so that every bin above it takes 0."""
  _, exponent = jnp.frexp(largest)  # largest < 2^exponent
  top = -((BITS - 1 - exponent) // BITS)  # ceil((exponent - 15) / 16)
  return jnp.clip(top, _LOWEST_TOP[dtype], _HIGHEST_TOP[dtype])


def _bin_of_slot(top: jax.Array, slot: int, num_bins: int) -> jax.Array:
  """The bin slot `slot` holds below `top`: `b = slot (mod L)`, `top - L < b <= top`."""
  return top - jnp.mod(top - slot, num_bins)


def _align(acc: Acc, top: jax.Array) -> tuple[jax.Array, ...]:
  """The slots read at a `top` no lower than `acc.top`: dropped bins zeroed.

  Each slot from itself alone (elementwise, so XLA updates it in place).
  """
  lowest = top - len(acc.bins) + 1
  return tuple(
    jnp.where(_bin_of_slot(acc.top, slot, len(acc.bins)) >= lowest, bin_, 0)
    for slot, bin_ in enumerate(acc.bins)
  )


def _largest(terms: jax.Array) -> jax.Array:
  """`max |terms|` (NaN if any is), in two steps that vectorize.

  A maximum over columns first (elementwise over rows, which XLA:CPU runs in
  vector registers) then over one row: three times faster than one reduce
  over every element, measured on CPU. A maximum is exact in any order.
  """
  if not terms.size:
    return jnp.zeros((), terms.dtype)
  if any(e is not None for e in getattr(jax.typeof(terms).sharding, "spec", ())):
    # Sharded over an explicit mesh axis (tensor parallel): a reshape would
    # need an output sharding, a plain reduce does not.
    return jnp.max(jnp.abs(terms))
  lanes = math.gcd(terms.size, 256)
  return jnp.max(jnp.max(jnp.abs(terms).reshape(-1, lanes), axis=0))


def _slice(terms: jax.Array, bin_: jax.Array) -> jax.Array:
  """`s_b(terms)` for the bin `bin_`, as floats holding integers (exact)."""
  nearest = lambda x: jax.lax.round(x, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
  dtype = terms.dtype
  units = nearest(terms * _power_of_two(-BITS * bin_, dtype))
  above = nearest(terms * _power_of_two(-BITS * (bin_ + 1), dtype))
  return units - (2.0**BITS) * above


def add(acc: Acc, terms: jax.Array) -> Acc:
  """`acc` plus `terms` (an array of its shape), exactly.

  About ten elementwise operations per slot, each slot from itself and the
  terms: zeroed if its bin was dropped, plus the terms' slice of its bin (two
  products by powers of two, two roundings, a product and two adds).
  """
  dtype = acc.dtype
  terms = jnp.asarray(terms).astype(dtype)
  largest = _largest(terms)
  ok = jnp.isfinite(largest) & (largest < 2.0 ** (BITS * _HIGHEST_TOP[dtype] + 15))
  top = jnp.maximum(acc.top, _top_of(jnp.where(ok, largest, 0), dtype))
  bins = tuple(
    kept + _slice(terms, _bin_of_slot(top, slot, len(acc.bins))).astype(kept.dtype)
    for slot, kept in enumerate(_align(acc, top))
  )
  return Acc(bins, top, acc.bad | ~ok)


def _levels(acc: Acc) -> list[jax.Array]:
  """The bins as int32, highest first (level l is bin `top - l`)."""
  num_bins = len(acc.bins)
  levels = []
  for level in range(num_bins):
    slot = jnp.mod(acc.top - level, num_bins)
    picked = acc.bins[0]
    for s in range(1, num_bins):
      picked = jnp.where(slot == s, acc.bins[s], picked)
    levels.append(picked.astype(jnp.int32))
  return levels


def value(acc: Acc) -> jax.Array:
  """The sum as a float of `acc.dtype`: carried between bins, then added in order.

  The carries are exact; the additions round at most twice (within 1.5 ulp
  of the bins' exact sum, typically 0.5), always in the same way for the
  same bins.
  """
  dtype = acc.dtype
  bins = _levels(acc)
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


def _integers(bins: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
  """Slots as int32 (exact: floats holding integers), to be summed over devices."""
  return tuple(b.astype(jnp.int32) for b in bins)


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
    return _wire.reduced(lambda xs: jax.lax.psum(xs, tuple(axes)), list(xs))
  tops = _global_tops([xs[i] for i in positions], axes)
  parts = [x.bins if is_acc(x) else x for x in xs]
  for i, (top, _) in zip(positions, tops, strict=True):
    parts[i] = _integers(_align(xs[i], top))
  summed = _wire.reduced(lambda xs: jax.lax.psum(xs, tuple(axes)), parts)
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
  bins = [how.scatter(b) for b in _integers(_align(acc, top))]
  if rest:
    bins = jax.lax.psum(bins, rest)
  return value(Acc(tuple(bins), top, bad > 0))

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
`top` is the bin the largest magnitude seen so far needs (a term of zeros
needs none: it leaves `top` where it is); when a larger term raises it, the
lowest bins are dropped, which are exactly the slices that every term loses
when the sum is read at the final `top`. That `top` is a function of the
largest magnitude over all the terms of the leaf (a maximum: itself
order-free), so the scale of a leaf does not depend on how the terms were
divided.

Bin `b` lives in slot `b mod L` of the carry, so raising `top` only zeroes the
slots of the bins dropped: each slot is updated from itself alone, in place.
On a device the slots are floats holding integers (exact up to 2^24: at most
`MAX_PER_DEVICE` terms of float32, 512; float adds are cheaper than integer
conversions); devices combine with a `pmax` of the tops, then one integer
`psum` of the slots aligned to that top (`psum`, `scatter`). The sum is read
back once (`Total`): the bins carried into each other (exact), then added as
floats in a fixed order, a deterministic function of the bins, and scaled
by the lowest bin's power of two when it becomes a float (`value`), or after
a mean's division (`divide`), so that a sum beyond the dtype's range still
gives its mean.

Accuracy (`L = 3` bins for float32 and narrower, 5 for float64). With `F` the
largest magnitude of a leaf's `n` terms, each term loses at most
`2^-32 F` (float64: `2^-64 F`) below the lowest bin, and the read-back is
within 1.5 ulp of the bins' exact sum: `|value - Σ x| <= n 2^-32 F + 1.5 ulp`,
wherever the result is a normal float. A mean then adds one rounding (its
division). The range of tops covers every term `w·x` of a normal weight and
a normal term (for float32, bins from `2^-288` and terms below `2^271`), the
powers of two applied in three factors that are each a normal float; a
weight's power of two joins the bins' scale (`add`), so `w·x` is never
rounded into the subnormals or overflowed on the way in. A non-finite term
makes its whole leaf NaN. The int32 bins hold at most `MAX_TERMS` = 2^15 - 1
terms over all devices (sums of slices of at most 2^15, with room for the
carries when read back).

Derivatives: the sum is linear, and differentiates as a float sum does
(`jax.grad` of a gradient penalty, `jax.jvp`): each exact operation has a
custom JVP that carries the tangent, in absolute units, in the first slot's
tangent (a `Total`: its significand's), so tangents add as ordinary floats.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaccum._core import wire as _wire

BITS = 16
MAX_TERMS = 2**15 - 1
# Bins per element: 3 keep 32 bits below a float32 leaf's largest magnitude
# (24 in its significand), 5 keep 64 for float64 (53). Float slots stay exact
# to 2^24 (2^53): 2^9 terms.
_BINS = {np.dtype(np.float32): 3, np.dtype(np.float64): 5}
_FLOAT_OF = {bins: dtype for dtype, bins in _BINS.items()}
MAX_PER_DEVICE = 2 ** (24 - (BITS - 1))
_LOG_BITS = BITS.bit_length() - 1  # BITS is a power of two


def _top_for(exponent: Any) -> Any:
  """The lowest bin whose slice holds a magnitude below `2^exponent` in at most
  2^15 units: `2^exponent <= 2^(16 top + 15)`, so every bin above takes 0.

  A shift, not `//`: the same floor, and XLA fuses a shift into the kernels
  that use it where it runs an integer division as a kernel of its own.
  """
  return -((BITS - 1 - exponent) >> _LOG_BITS)  # ceil((exponent - 15) / 16)


# Integer divisions by a constant as a multiply and a shift (the same floor
# over the ranges used: tops and exponents, `|n| < 2^13`), for the reason of
# `_top_for`: XLA runs a scalar `//` or `%` as a kernel of its own, one per
# use, and a leaf's add used a dozen of them.
_DIVIDE_RANGE = 2**13
_MAGIC_SHIFT = 17


def _floor_divide(n: jax.Array, divisor: int) -> jax.Array:
  """`n // divisor` for int32 `n` with `|n| < 2^13` (exact there: tested)."""
  offset = divisor * -(-_DIVIDE_RANGE // divisor)  # a multiple of divisor
  magic = -(-(2**_MAGIC_SHIFT) // divisor)  # ceil(2^17 / divisor)
  shifted = (n + offset) * magic >> _MAGIC_SHIFT
  return shifted - offset // divisor


def _mod(n: jax.Array, divisor: int) -> jax.Array:
  """`n % divisor` (floored, in [0, divisor)) for `|n| < 2^13`."""
  return n - divisor * _floor_divide(n, divisor)


# The range of tops: every term `w·x` of two normal floats (a weight and a
# term) has its bins, from the product of the two smallest (frexp exponent
# 2·minexp + 1) to that of the two largest (below 2^(2·maxexp)).
_LOWEST_TOP = {d: _top_for(2 * np.finfo(d).minexp + 1) for d in _BINS}
_HIGHEST_TOP = {d: _top_for(2 * np.finfo(d).maxexp) for d in _BINS}


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


def _scale(x: jax.Array, exponent: Any, dtype: np.dtype) -> jax.Array:
  """`x · 2^exponent`, in three factors that are each a normal float.

  The factors share the exponent's sign, so each product lies between `x`
  and the result: nothing overflows on the way, and a product that falls
  below the normal range only does so where the result is smaller still.
  Beyond three factors' reach the result is 0 or infinite anyway (`x` holds
  at most 2^64 units), so the exponent is clamped there.
  """
  info = np.finfo(dtype)
  exponent = jnp.clip(
    jnp.asarray(exponent, jnp.int32), 3 * info.minexp, 3 * info.maxexp - 3
  )
  first = _floor_divide(exponent, 3)
  second = (exponent - first) >> 1
  for part in (first, second, exponent - first - second):
    x = x * _power_of_two(part, dtype)
  return x


def _bin_of_slot(top: jax.Array, slot: int, num_bins: int) -> jax.Array:
  """The bin slot `slot` holds below `top`: `b = slot (mod L)`, `top - L < b <= top`."""
  return top - _mod(top - slot, num_bins)


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
  """`max |terms|` (NaN if any is): one reduce, exact in any order.

  (Folding it first into 256 lanes no longer runs faster: the same time per
  element from 2^16 to 2^22 elements, on XLA:CPU of jax 0.10.2.)
  """
  if not terms.size:
    return jnp.zeros((), terms.dtype)
  return jnp.max(jnp.abs(terms))


def _slice(terms: jax.Array, exponent: jax.Array, is_top: jax.Array) -> jax.Array:
  """The slice of `terms · 2^exponent` at the bin of unit 1, as floats holding
  integers (exact): its units, less those of the bin above, which are none
  in the top bin (a slice there is below 2^15 units: `_top_for`).

  The terms are put in units of the bin by one power of two where it is a
  normal float, else by two of the same sign: the product is exact wherever
  it is a normal float, which is wherever it can round to a unit, and a
  scalar condition costs XLA:CPU's loops nothing (each runs one branch).
  Each slot's kernel starts from the terms (XLA runs one kernel per slot
  and would compute a shared intermediate in each): six operations an
  element, three in the top bin, where putting the terms in units of the
  lowest bin first took ten in every bin, for the same bits.
  """
  nearest = lambda x: jax.lax.round(x, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
  dtype = np.dtype(terms.dtype)
  info = np.finfo(dtype)
  # Past these the product is 0 (no nonzero term is that small next to its
  # bins) or below 2^-124, where it rounds to 0 whichever way it is scaled.
  exponent = jnp.clip(exponent, 2 * info.minexp, 2 * (info.maxexp - 1))
  single = (exponent >= info.minexp) & (exponent <= info.maxexp - 1)
  half = exponent >> 1
  units = jnp.where(
    single,
    terms * _power_of_two(jnp.clip(exponent, info.minexp, info.maxexp - 1), dtype),
    terms * _power_of_two(half, dtype) * _power_of_two(exponent - half, dtype),
  )
  whole = nearest(units)
  return jnp.where(is_top, whole, whole - (2.0**BITS) * nearest(units * 2.0**-BITS))


def add(acc: Acc, terms: jax.Array, weight: jax.Array | None = None) -> Acc:
  """`acc` plus `weight · terms` (an array of its shape; a scalar weight), exactly.

  The weight's power of two joins the bins' scale and only its significand
  multiplies the terms, so `w·x` never rounds into the subnormals or
  overflows on the way in. A weight of 0 adds nothing, even to NaN terms.
  Per element, one maximum and six elementwise operations per slot (three in
  the top one), each slot from itself and the terms: zeroed if its bin was
  dropped, plus the terms' slice of its bin.

  Differentiable as a sum: the derivative is carried, in absolute units, in
  the first slot's tangent, and `value`, `divide`, `psum` and `scatter` read
  it there (int32 slots, `MultiSteps`' windows, carry none: refused).
  """
  dtype = acc.dtype
  terms = jnp.asarray(terms).astype(dtype)
  exponent = jnp.zeros((), jnp.int32)
  if weight is not None:
    weight = jnp.asarray(weight).astype(dtype)
    _, exponent = jnp.frexp(weight)  # weight = m · 2^exponent, 1/2 <= |m| < 1
    exponent = exponent.astype(jnp.int32)
    significand = _scale(weight, -exponent, dtype)
    terms = jnp.where(weight != 0, significand * terms, 0)
  return _add(acc, terms, exponent)


def _add(acc: Acc, terms: jax.Array, exponent: jax.Array) -> Acc:
  """`acc` plus `terms · 2^exponent`: the top follows the largest nonzero term
  (a term of zeros moves nothing), the terms are put in units of the lowest
  bin once, and each slot takes its bin's slice."""
  largest = _largest(terms)
  ok = jnp.isfinite(largest)
  _, power = jnp.frexp(jnp.where(ok, largest, 0))  # largest < 2^power
  needed = jnp.where(
    ok & (largest > 0), _top_for(power + exponent), _LOWEST_TOP[acc.dtype]
  )
  top = jnp.maximum(acc.top, needed)
  return Acc(_added(acc.bins, acc.top, terms, top, exponent), top, acc.bad | ~ok)


@jax.custom_jvp
def _added(
  bins: tuple[jax.Array, ...],
  old_top: jax.Array,
  terms: jax.Array,
  top: jax.Array,
  exponent: jax.Array,
) -> tuple[jax.Array, ...]:
  """The slots at `top`: each kept if its bin is, plus the terms' slice of it."""
  num_bins = len(bins)
  slots = []
  for slot, kept in enumerate(_align(Acc(bins, old_top, jnp.bool_(False)), top)):
    bin_ = _bin_of_slot(top, slot, num_bins)
    piece = _slice(terms, exponent - BITS * bin_, bin_ == top)
    slots.append(kept + piece.astype(kept.dtype))
  return tuple(slots)


@_added.defjvp
def _added_jvp(primals, tangents):
  bins, exponent = primals[0], primals[4]
  bins_dot, terms_dot = tangents[0], tangents[2]
  out = _added(*primals)
  if not jnp.issubdtype(bins[0].dtype, jnp.floating):
    raise TypeError(
      "MultiSteps(deterministic=True) is not differentiable: its window is "
      "kept in int32 bins from call to call, which carry no derivative. "
      "Differentiate the gradients before they enter it, or use "
      "MultiSteps(deterministic=False)."
    )
  dtype = _FLOAT_OF[len(bins)]
  carried = bins_dot[0] + _scale(terms_dot.astype(dtype), exponent, dtype)
  return out, (carried, *(jnp.zeros_like(b) for b in out[1:]))


class Total(NamedTuple):
  """A sum read back from its bins: `significand · 2^exponent`.

  Kept apart until a mean divides it (`divide`), so that a sum beyond the
  dtype's range still gives its mean. The significand's tangent is the
  sum's, in absolute units (as `Acc`'s first slot carries it).

  Attributes:
    significand: the bins carried into each other and added as floats, in a
      fixed order (within 1.5 ulp of their exact sum); NaN for a bad term.
    exponent: int32 scalar, the scale of the lowest bin.
  """

  significand: jax.Array
  exponent: jax.Array


def is_exact(x: Any) -> bool:
  """Whether `x` is an exact sum: an `Acc`, or a `Total` read back from one."""
  return isinstance(x, Acc | Total)


def _levels(acc: Acc) -> list[jax.Array]:
  """The bins as int32, highest first (level l is bin `top - l`)."""
  num_bins = len(acc.bins)
  levels = []
  for level in range(num_bins):
    slot = _mod(acc.top - level, num_bins)
    picked = acc.bins[0]
    for s in range(1, num_bins):
      picked = jnp.where(slot == s, acc.bins[s], picked)
    levels.append(picked.astype(jnp.int32))
  return levels


def _total(acc: Acc) -> Total:
  """The bins carried into each other (exact), then added as floats in order.

  The additions round at most twice (within 1.5 ulp of the bins' exact sum,
  typically 0.5), always in the same way for the same bins.
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
  total = jnp.where(acc.bad, jnp.asarray(np.nan, dtype), total)
  return Total(total, BITS * (acc.top - len(bins) + 1))


def _as_total(x: Any) -> Total:
  """An exact sum or a float as `significand · 2^exponent`."""
  if isinstance(x, Total):
    return x
  if isinstance(x, Acc):
    return _total(x)
  x = jnp.asarray(x)
  significand, exponent = jnp.frexp(x)
  return Total(significand, exponent.astype(jnp.int32))


def _tangent_of(x: Any, x_dot: Any) -> Any:
  """The absolute tangent of an exact sum (its first slot's, or its
  significand's), or of a float (itself)."""
  if isinstance(x, Acc):
    return x_dot.bins[0]
  if isinstance(x, Total):
    return x_dot.significand
  return x_dot


@jax.custom_jvp
def value(x: Acc | Total) -> jax.Array:
  """The sum as a float of its dtype (one rounding, and 0 or inf past its range)."""
  total = _as_total(x)
  return _scale(total.significand, total.exponent, np.dtype(total.significand.dtype))


@value.defjvp
def _value_jvp(primals, tangents):
  (x,), (x_dot,) = primals, tangents
  out = value(x)
  return out, jnp.asarray(_tangent_of(x, x_dot)).astype(out.dtype)


def as_float(x: Any) -> Any:
  """`value(x)` for an exact sum, anything else as it is."""
  return value(x) if is_exact(x) else x


def divide(total: Any, weight: Any) -> jax.Array:
  """`total / weight` in one rounding (a mean), or zeros where the weight is 0.

  Either may be an exact sum (`Acc`, `Total`): the quotient is then taken
  from their significands and scaled once, so a sum or a weight beyond the
  dtype's range still gives its mean.

  XLA rewrites a division by a broadcast scalar into a multiplication by its
  reciprocal (two roundings) in some programs and not in others, so the
  same sum would read back differently on one device and on several: the
  divisor is made an array XLA cannot see through.
  """
  if is_exact(total) or is_exact(weight):
    return _quotient(_as_exact_operand(total), _as_exact_operand(weight))
  weight = jnp.asarray(weight)
  dtype = jnp.promote_types(total.dtype, weight.dtype)
  safe = jnp.where(weight != 0, weight, 1).astype(dtype)
  divisor = jax.lax.optimization_barrier(jnp.broadcast_to(safe, total.shape))
  return jnp.where(weight != 0, total.astype(dtype) / divisor, 0)


def _as_exact_operand(x: Any) -> Any:
  """An exact sum as it is; a number as a floating array (a count: float32)."""
  if is_exact(x):
    return x
  x = jnp.asarray(x)
  return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)


@jax.custom_jvp
def _quotient(total: Any, weight: Any) -> jax.Array:
  """`divide` for exact sums: `(s_t / s_w) · 2^(e_t - e_w)`, in one rounding
  where the result is normal (the same bits as dividing their values)."""
  num, den = _as_total(total), _as_total(weight)
  dtype = np.dtype(jnp.promote_types(num.significand.dtype, den.significand.dtype))
  safe = jnp.where(den.significand != 0, den.significand, 1).astype(dtype)
  divisor = jax.lax.optimization_barrier(jnp.broadcast_to(safe, num.significand.shape))
  quotient = _scale(
    num.significand.astype(dtype) / divisor, num.exponent - den.exponent, dtype
  )
  return jnp.where(den.significand != 0, quotient, 0)


@_quotient.defjvp
def _quotient_jvp(primals, tangents):
  (total, weight), (total_dot, weight_dot) = primals, tangents
  out = _quotient(total, weight)
  den = as_float(weight)
  safe = jnp.where(den != 0, den, 1).astype(out.dtype)
  num_dot = jnp.asarray(_tangent_of(total, total_dot)).astype(out.dtype)
  den_dot = jnp.asarray(_tangent_of(weight, weight_dot)).astype(out.dtype)
  return out, jnp.where(den != 0, (num_dot - out * den_dot) / safe, 0)


def _integers(bins: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
  """Slots as int32 (exact: floats holding integers), to be summed over devices."""
  return tuple(b.astype(jnp.int32) for b in bins)


def _global_tops(accs: Sequence[Acc], axes: Sequence[str]) -> list[tuple[Any, Any]]:
  """Each sum's top and bad flag, the highest over `axes` (one small pmax)."""
  tops = [a.top for a in accs] + [a.bad.astype(jnp.int32) for a in accs]
  tops = jax.lax.pmax(tops, tuple(axes))
  return list(zip(tops[: len(accs)], tops[len(accs) :], strict=True))


def psum(xs: Sequence[Any], axes: Sequence[str]) -> list[Any]:
  """`jax.lax.psum(xs, axes)`, with each `Acc` summed exactly (a `Total`).

  Arrays are summed as `psum` sums them; every `Acc` is aligned to the
  highest top over `axes` and its int32 bins go into the same psum as the
  floating arrays (exact: integers). It comes back read (`Total`: `value` or
  `divide` it).
  """
  axes, xs = tuple(axes), list(xs)
  positions = [i for i, x in enumerate(xs) if is_acc(x)]
  if not positions:
    return _wire.reduced(lambda xs: jax.lax.psum(xs, axes), xs)
  # Integer arrays carry no derivative: summed apart from the differentiable sum.
  floats = [i for i, x in enumerate(xs) if is_acc(x) or _inexact(x)]
  others = [i for i in range(len(xs)) if i not in floats]
  summed = list(xs)
  if others:
    for i, total in zip(
      others,
      _wire.reduced(lambda xs: jax.lax.psum(xs, axes), [xs[i] for i in others]),
      strict=True,
    ):
      summed[i] = total
  tops = _global_tops([xs[i] for i in positions], axes)
  significands = _psum(
    axes, [xs[i] for i in floats], [t for t, _ in tops], [b for _, b in tops]
  )
  for i, total in zip(floats, significands, strict=True):
    summed[i] = total
  for i, (top, _) in zip(positions, tops, strict=True):
    summed[i] = Total(summed[i], BITS * (top - len(xs[i].bins) + 1))
  return summed


def _inexact(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _psum(
  axes: tuple[str, ...], xs: list[Any], tops: list[jax.Array], bads: list[jax.Array]
) -> list[jax.Array]:
  """Floating arrays summed, and each `Acc`'s significand at its global top."""
  tops_of, bads_of = iter(tops), iter(bads)
  aligned = [_integers(_align(x, next(tops_of))) if is_acc(x) else x for x in xs]
  summed = _wire.reduced(lambda xs: jax.lax.psum(xs, axes), aligned)
  tops_of = iter(tops)
  return [
    _total(Acc(tuple(s), next(tops_of), next(bads_of) > 0)).significand
    if is_acc(x)
    else s
    for x, s in zip(xs, summed, strict=True)
  ]


@_psum.defjvp
def _psum_jvp(axes, primals, tangents):
  xs, tops, bads = primals
  xs_dot = tangents[0]
  out = _psum(axes, xs, tops, bads)
  parts = [_tangent_of(x, t) for x, t in zip(xs, xs_dot, strict=True)]
  return out, _wire.reduced(lambda xs: jax.lax.psum(xs, axes), parts)


def scatter(acc: Acc, how: Any, axes: Sequence[str]) -> Total:
  """The exact sum over `axes`, each device keeping the slice `how` scatters.

  The bins are aligned over every axis of `axes`, reduce-scattered over
  `how.axes` (an `fsdp.Sharded`) and summed over the others, all in int32.
  """
  axes = tuple(axes)
  ((top, bad),) = _global_tops([acc], axes)
  significand = _scatter(how, axes, acc, top, bad)
  return Total(significand, BITS * (top - len(acc.bins) + 1))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _scatter(
  how: Any, axes: tuple[str, ...], acc: Acc, top: jax.Array, bad: jax.Array
) -> jax.Array:
  rest = tuple(a for a in axes if a not in how.axes)
  bins = [how.scatter(b) for b in _integers(_align(acc, top))]
  if rest:
    bins = jax.lax.psum(bins, rest)
  return _total(Acc(tuple(bins), top, bad > 0)).significand


@_scatter.defjvp
def _scatter_jvp(how, axes, primals, tangents):
  acc, top, bad = primals
  out = _scatter(how, axes, acc, top, bad)
  rest = tuple(a for a in axes if a not in how.axes)
  summed = how.scatter(tangents[0].bins[0])
  if rest:
    summed = jax.lax.psum(summed, rest)
  return out, summed

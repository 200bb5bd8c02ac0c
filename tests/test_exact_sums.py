"""The exact sums' bins against their definition, computed apart in float64.

`deterministic=True` keeps, per element, the sums of the slices
`s_b(x) = R(x / 2^(16b)) - 2^16 R(x / 2^(16(b+1)))` of the bins `b` from
`top - 2` to `top` (float32), `top` the bin the largest magnitude of all the
terms needs, in slot `b mod 3`. The reference below computes each slice
from a float64 copy of the term with numpy's round-half-even, and adds them
in float64 (integers below 2^53: exact): the bins `exact.add` keeps must be
the same integers, whatever path its kernels take (one power of two or two,
the top bin or not, a raised top, weights). As XLA computes them on CPU,
subnormal float32s count as 0.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaccum._core import exact

LOWEST_TOP = exact._LOWEST_TOP[np.dtype(np.float32)]


def _needed(value: float, lowest: int = LOWEST_TOP) -> int:
  """The top a float64 magnitude needs (the lowest for 0)."""
  if value == 0:
    return lowest
  _, power = math.frexp(value)  # value < 2^power
  return math.ceil((power - 15) / 16)


def _flushed(x: np.ndarray) -> np.ndarray:
  """float32 values, subnormals as 0 (XLA:CPU flushes them), in float64."""
  x = np.asarray(x, np.float32).astype(np.float64)
  return np.where(np.abs(x) < np.finfo(np.float32).tiny, 0.0, x)


def _slice(x: np.ndarray, b: int) -> np.ndarray:
  units = np.round(np.ldexp(x, -16 * b))
  above = np.round(np.ldexp(x, -16 * (b + 1)))
  return units - 2.0**16 * above


def reference(
  steps: list[np.ndarray], num_bins: int = 3, lowest: int = LOWEST_TOP
) -> tuple[int, list[np.ndarray]]:
  """`(top, slots)` after adding each float64 array of `steps`, exactly (3
  bins for float32 terms, 5 for float64: their slices are integers below
  2^16, their sums below 2^53)."""
  top = max(_needed(float(np.max(np.abs(s))), lowest) for s in steps)
  slots = [np.zeros(steps[0].shape) for _ in range(num_bins)]
  for terms in steps:
    for b in range(top - num_bins + 1, top + 1):
      slots[b % num_bins] = slots[b % num_bins] + _slice(terms, b)
  return top, slots


def added(steps, weights=None, dtype=jnp.float32):
  acc = exact.zeros(steps[0].shape, dtype)
  for k, terms in enumerate(steps):
    weight = None if weights is None else jnp.asarray(weights[k], dtype)
    acc = jax.jit(exact.add)(acc, jnp.asarray(terms, dtype), weight)
  return acc


def _terms(rng, shape, low, high, dtype=np.float32):
  """Terms of magnitudes 10^low .. 10^high, signed, with some zeros (all
  zeros where `low` is None)."""
  if low is None:
    return np.zeros(shape, dtype)
  magnitude = 10.0 ** rng.uniform(low, high, shape)
  terms = (rng.choice([-1.0, 1.0], shape) * magnitude).astype(dtype)
  terms[rng.random(shape) < 0.05] = 0
  return terms


# Magnitudes: ordinary gradients; ones that need two powers of two to reach
# their bins (below 2^-126 next to their top, subnormals among them); large
# ones; steps whose scale grows, so that the top is raised and bins are
# dropped along the way; terms 10^38 apart in one step, most of them below
# the lowest bin the largest leaves (their slices round to 0 or to a unit);
# and all-zero steps, first (nothing moves the top) and between others.
CASES = {
  "gradients": [(-8, 1)] * 4,
  "tiny": [(-44, -30)] * 3,
  "large": [(20, 37)] * 3,
  "raised": [(-12, -6), (-6, -2), (-3, 4), (2, 9)],
  "wide": [(-30, 8)] * 3,
  "zeros": [(None, None), (-3, 1), (None, None), (-20, -10)],
  "only zeros": [(None, None)] * 2,
}


@pytest.mark.parametrize("case", list(CASES))
def test_bins_are_the_sums_of_the_slices_of_their_definition(case):
  rng = np.random.default_rng(len(case))
  steps = [_terms(rng, (64, 96), low, high) for low, high in CASES[case]]
  top, slots = reference([_flushed(s) for s in steps])
  acc = added(steps)
  assert int(acc.top) == top and not bool(acc.bad)
  for got, want in zip(acc.bins, slots, strict=True):
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)


def test_weighted_terms_are_sliced_as_their_significands_products():
  """`w·x` enters as the float32 product of `w`'s significand and `x` (one
  rounding, never into the subnormals), scaled by `w`'s power of two exactly
  (weights from 2^-120 to 2^100, one of them 0: nothing added). The tiny
  weight comes after the large one has raised the top: its terms are put in
  units of bins 2^200 above them, by two powers of two."""
  rng = np.random.default_rng(7)
  steps = [_terms(rng, (32, 40), -10, 10) for _ in range(5)]
  weights = [3.0, 2.0**100 * 0.75, 2.0**-120 * 1.5, 0.0, 7.0 / 3.0]
  weights = [float(np.float32(w)) for w in weights]
  products = []
  for terms, weight in zip(steps, weights, strict=True):
    significand, power = math.frexp(weight)
    product = _flushed(np.float32(significand) * terms)
    products.append(np.ldexp(product, power))
  top, slots = reference(products)
  acc = added(steps, weights)
  assert int(acc.top) == top
  for got, want in zip(acc.bins, slots, strict=True):
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)


# float64 terms, five bins: ordinary, terms whose bins lie past 2^1023 above
# them (two powers of two), large, and 10^80 apart in one step.
CASES_64 = {
  "gradients": [(-12, 2)] * 3,
  "tiny": [(-307, -290)] * 3,
  "large": [(280, 307)] * 3,
  "wide": [(-60, 20), (-40, 25)],
}


@pytest.mark.parametrize("case", list(CASES_64))
def test_float64_bins_are_the_sums_of_the_slices_of_their_definition(case):
  rng = np.random.default_rng(len(case) + 64)
  with jax.enable_x64(True):
    steps = [
      _terms(rng, (48, 40), low, high, np.float64) for low, high in CASES_64[case]
    ]
    lowest = exact._LOWEST_TOP[np.dtype(np.float64)]
    top, slots = reference(steps, num_bins=5, lowest=lowest)
    acc = added(steps, dtype=jnp.float64)
    assert int(acc.top) == top and not bool(acc.bad)
    assert len(acc.bins) == 5
    for got, want in zip(acc.bins, slots, strict=True):
      np.testing.assert_array_equal(np.asarray(got, np.float64), want)


@pytest.mark.parametrize("divisor", [2, 3, 5, 16])
def test_integer_divisions_by_a_constant_floor_over_the_whole_range(divisor):
  """The multiply-and-shift divisions equal Python's `//` and `%` for every
  `|n| < 2^13` (tops and scale exponents, float64's included, lie there)."""
  n = np.arange(-(2**13) + 1, 2**13, dtype=np.int32)
  quotient = np.asarray(jax.jit(exact._floor_divide, static_argnums=1)(n, divisor))
  remainder = np.asarray(jax.jit(exact._mod, static_argnums=1)(n, divisor))
  np.testing.assert_array_equal(quotient, n // divisor)
  np.testing.assert_array_equal(remainder, n % divisor)
  assert abs(exact._LOWEST_TOP[np.dtype(np.float64)]) < 2**13
  assert 3 * np.finfo(np.float64).maxexp < 2**13

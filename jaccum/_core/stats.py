"""The gradient noise scale, from the micro-batch gradients accumulation already has.

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training"
(arXiv:1812.06162): the critical batch size is predicted by the simple noise
scale `B_simple = tr(Σ) / |G|²`, with `G` the true gradient and `Σ` the
per-example gradient covariance. For a batch of B examples drawn independently,
`E |g_B|² = |G|² + tr(Σ) / B`, so squared gradient norms measured at two batch
sizes give unbiased estimates of both (their Appendix A.1). Accumulation has
two sizes for free: every micro-batch (per device) and their combination.

With micro-batches of unequal weight `w_k` (tokens, with `weight_fn`), the
small-batch figure is the weighted mean `S = Σ_k w_k |g_k|² / W`, `W = Σ_k w_k`,
whose expectation is `|G|² + K' tr(Σ) / W` with `K'` the micro-batches of
nonzero weight: the small batch size is `B_small = W / K'`, and `B_big = W`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaccum._core import exact
from jaccum._core.step import varying_axes


class AccumulationStats(NamedTuple):
  """Gradient-noise statistics of one accumulated step, float32 scalars.

  Batch sizes are in weight units: examples, or with `weight_fn` whatever it
  counts (tokens). All figures cover the global batch (every device).

  Attributes:
    micro_grad_sq_norm: the weighted mean over micro-batches of `|g_k|²`.
    grad_sq_norm: `|G_big|²`, the squared norm of the accumulated gradient.
    true_grad_sq_norm: the unbiased estimate of `|G|²`.
    trace_covariance: the unbiased estimate of `tr(Σ)`, per weight unit.
    noise_scale: `B_simple = trace_covariance / true_grad_sq_norm`, in weight
      units. Noisy from one step; smooth the two parts with `NoiseScaleEMA`.
    total_weight: `B_big`, the step's batch size `W`.
    microbatch_weight: `B_small = W / K'`, the mean weight of the micro-batches
      that had any (NaN figures come from fewer than two of them).

  Examples:
    Linear regression `y = x·w* + 0.5 ε` with Gaussian `x` in 4 dimensions and
    the loss `0.5 mean((x·w - y)²)`: at `w = 0`, `G = -w*` and
    `tr(Σ) = (d + 1) |w*|² + 0.5² d`, so with `w* = (1, 1, 1, 1)` the truth is
    `|G|² = 4`, `tr(Σ) = 21`, `B_simple = 5.25`.

    >>> import jax, jax.numpy as jnp, jaccum
    >>> def loss(w, x, y):
    ...   return 0.5 * jnp.mean((x @ w - y) ** 2)
    >>> kx, ky = jax.random.split(jax.random.key(0))
    >>> x = jax.random.normal(kx, (4096, 4))
    >>> y = x @ jnp.ones(4) + 0.5 * jax.random.normal(ky, (4096,))
    >>> step = jaccum.accumulate(
    ...   jax.grad(loss), 64, batch_argnums=(1, 2), return_stats=True
    ... )
    >>> grads, stats = jax.jit(step)(jnp.zeros(4), x, y)
    >>> float(stats.total_weight), float(stats.microbatch_weight)
    (4096.0, 64.0)
    >>> bool(jnp.isclose(stats.grad_sq_norm, jnp.sum(grads**2)))
    True
    >>> s = stats
    >>> print(f"{s.true_grad_sq_norm:.1f} {s.trace_covariance:.0f} {s.noise_scale:.0f}")
    4.3 22 5
  """

  micro_grad_sq_norm: jax.Array
  grad_sq_norm: jax.Array
  true_grad_sq_norm: jax.Array
  trace_covariance: jax.Array
  noise_scale: jax.Array
  total_weight: jax.Array
  microbatch_weight: jax.Array


def sq_norm(tree: Any, mask: Any, split: Sequence[str] = ()) -> jax.Array:
  """The squared norm of the leaves of `tree` where `mask`, as a float32 scalar.

  Each leaf's |x|² is summed in float32 or wider (bfloat16 gradients are
  not summed in bfloat16, float64 ones stay float64); the result is float32
  whatever the leaves, as the loop's scalar carry and `AccumulationStats` are.

  `split` names manual mesh axes over which some leaves hold slices (tensor
  parallelism inside the user's `shard_map`): the result is then this
  device's share of a psum over them, so a leaf the same on every device of
  an axis counts once, not once per device.
  """
  terms = [
    jnp.sum(
      jnp.square(
        jnp.abs(  # |g|², complex gradients too
          jnp.asarray(x).astype(jnp.promote_types(jnp.result_type(x), jnp.float32))
        )
      )
    ).astype(jnp.float32)
    / _copies(x, split)
    for x, on in zip(jax.tree.leaves(tree), jax.tree.leaves(mask), strict=True)
    # float0 leaves (gradients of integer inputs) are zeros with no values.
    if on and jnp.result_type(x) != jax.dtypes.float0
  ]
  return sum(terms, jnp.zeros((), jnp.float32))


def _copies(x: Any, split: Sequence[str]) -> int:
  """How many devices of the axes `split` hold the same `x`."""
  same = [a for a in split if a not in varying_axes(x)]
  return math.prod(jax.lax.axis_size(a) for a in same)


def split_axes(shapes: Any, mask: Any, axes: Sequence[str] | None) -> tuple[str, ...]:
  """The manual mesh axes, other than the data `axes`, that leaves vary over.

  Inside the user's `shard_map`, a gradient that varies over such an axis
  (`"model"`) is this device's slice of its param's gradient: its |g|² is a
  part of the whole, to be summed over the axis.
  """
  found = set()
  for x, on in zip(jax.tree.leaves(shapes), jax.tree.leaves(mask), strict=True):
    if on:
      found |= varying_axes(x)
  return tuple(sorted(found - set(axes or ())))


def estimate(
  weighted_sq_sum: jax.Array,
  num_weighted: jax.Array,
  total_weight: jax.Array,
  grad_sq_norm: jax.Array,
) -> AccumulationStats:
  """The unbiased estimates from the two batch sizes.

  Args:
    weighted_sq_sum: `Σ_k w_k |g_k|²` over every micro-batch of every device.
    num_weighted: `K'`, how many of them had nonzero weight.
    total_weight: `W = Σ_k w_k`.
    grad_sq_norm: `|G_big|²`.
  """
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  total, big = f32(total_weight), f32(grad_sq_norm)
  small = f32(weighted_sq_sum) / total
  b_small, b_big = total / f32(num_weighted), total
  # Two batch sizes need two micro-batches of nonzero weight; with fewer the
  # estimates are undefined (0/0 or x/0): NaN, never ±inf.
  defined = (f32(num_weighted) >= 2) & (total != 0)
  nan = jnp.float32(jnp.nan)
  true = jnp.where(defined, (b_big * big - b_small * small) / (b_big - b_small), nan)
  trace = jnp.where(defined, (small - big) / (1 / b_small - 1 / b_big), nan)
  return AccumulationStats(
    micro_grad_sq_norm=small,
    grad_sq_norm=big,
    true_grad_sq_norm=true,
    trace_covariance=trace,
    noise_scale=trace / true,
    total_weight=total,
    microbatch_weight=b_small,
  )


def from_sums(
  sums: Sequence[Any],
  total: jax.Array | None,
  unit_weight: int,
  num_terms: int,
  grad_sq_norm: jax.Array,
  exact_sums: bool,
) -> AccumulationStats:
  """The estimates, once the devices' sums are combined.

  `sums` are `(Σ_k w_k |g_k|², K')` over every micro-batch of every device;
  without `weight_fn` (`total` None) every micro-batch weighs its rows
  (`unit_weight`), `num_terms` of them.
  """
  weighted_sq_sum, num_weighted = (exact.as_float(x) for x in sums)
  weight = jnp.float32(unit_weight * num_terms) if total is None else total
  if exact_sums:
    # The same divisions on every route: XLA rounds a division by a constant
    # (a weight known when tracing) as a product with its reciprocal.
    weight, num_weighted = jax.lax.optimization_barrier((weight, num_weighted))
  return estimate(weighted_sq_sum, num_weighted, weight, grad_sq_norm)

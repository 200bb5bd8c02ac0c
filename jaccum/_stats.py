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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


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
  """

  micro_grad_sq_norm: jax.Array
  grad_sq_norm: jax.Array
  true_grad_sq_norm: jax.Array
  trace_covariance: jax.Array
  noise_scale: jax.Array
  total_weight: jax.Array
  microbatch_weight: jax.Array


def sq_norm(tree: Any, mask: Any) -> jax.Array:
  """The squared norm, in float32 at least, of the leaves of `tree` where `mask`."""
  terms = [
    jnp.sum(
      jnp.square(
        jnp.asarray(x).astype(jnp.promote_types(jnp.result_type(x), jnp.float32))
      )
    )
    for x, on in zip(jax.tree.leaves(tree), jax.tree.leaves(mask), strict=True)
    if on
  ]
  return sum(terms, jnp.zeros((), jnp.float32))


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
  true = (b_big * big - b_small * small) / (b_big - b_small)
  trace = (small - big) / (1 / b_small - 1 / b_big)
  return AccumulationStats(
    micro_grad_sq_norm=small,
    grad_sq_norm=big,
    true_grad_sq_norm=true,
    trace_covariance=trace,
    noise_scale=trace / true,
    total_weight=total,
    microbatch_weight=b_small,
  )

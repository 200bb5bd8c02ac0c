"""`NoiseScaleEMA`: the gradient noise scale smoothed over training steps.

One step's `AccumulationStats` estimate `|G|²` and `tr(Σ)` from a single
batch, which is noisy; the ratio of two noisy estimates is noisier still.
McCandlish et al. (2018) smooth the two parts separately and take their ratio.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from jaccum._core.stats import AccumulationStats


class NoiseScaleEMAState(NamedTuple):
  """State of `NoiseScaleEMA`: the smoothed estimates, bias-corrected.

  Attributes:
    count: int32, the steps averaged so far (steps with a non-finite estimate
      are skipped and not counted).
    true_grad_sq_norm: float32, the average of the `|G|²` estimates, each
      weighing `decay` times the one after it (0 before the first step).
    trace_covariance: float32, the same average of the `tr(Σ)` estimates.

  Examples:
    Two steps' estimates, then one that is not finite (skipped), averaged with
    `decay = 0.5`: `|G|² = (0.5·4 + 1) / 1.5 = 2`, `tr(Σ) = (0.5·20 + 26) / 1.5`.

    >>> import jaccum
    >>> nan = float("nan")
    >>> def estimates(grad_sq, trace):  # what an accumulated step reports
    ...   return jaccum.AccumulationStats(nan, nan, grad_sq, trace, nan, 64.0, 8.0)
    >>> ema = jaccum.NoiseScaleEMA(decay=0.5)
    >>> state = ema.init()
    >>> for grad_sq, trace in [(4.0, 20.0), (1.0, 26.0), (nan, 30.0)]:
    ...   state, noise_scale = ema.update(state, estimates(grad_sq, trace))
    >>> int(state.count), float(state.true_grad_sq_norm), float(state.trace_covariance)
    (2, 2.0, 24.0)
    >>> float(noise_scale)
    12.0
  """

  count: jax.Array
  true_grad_sq_norm: jax.Array
  trace_covariance: jax.Array


@dataclasses.dataclass(frozen=True)
class NoiseScaleEMA:
  """Smooths `|G|²` and `tr(Σ)` separately over steps; their ratio is `B_simple`.

  One step's estimates are noisy, `|G|²`'s especially (it can come out
  negative), so McCandlish et al. average each over steps with an exponential
  moving average and take the ratio of the averages, never the average of the
  ratios. The averages are bias-corrected as in Adam: after `t` steps each is
  `Σ_s decay^(t-s) x_s / Σ_s decay^(t-s)`, so the first steps are not pulled
  towards the zero it starts from. A step whose estimates are not finite
  (fewer than two micro-batches of nonzero weight) is skipped.

  Pure and jit-able, like an optax transformation: `init()` gives a
  `NoiseScaleEMAState` of three scalars, to keep beside the optimizer state
  and save in the same checkpoint.

  Attributes:
    decay: the weight of the past, in [0, 1): about `1 / (1 - decay)` steps are
      averaged. 0 keeps the last step only. A Python, NumPy or JAX scalar; a
      traced one (decays swept under `vmap`) is used as it is, unchecked.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> def loss(w, x, y):  # at w = 0 the truth is B_simple = 21 / 4 = 5.25
    ...   return 0.5 * jnp.mean((x @ w - y) ** 2)
    >>> step = jax.jit(jaccum.accumulate(
    ...   jax.grad(loss), 8, batch_argnums=(1, 2), return_stats=True
    ... ))
    >>> ema = jaccum.NoiseScaleEMA(decay=0.95)
    >>> state = ema.init()
    >>> for key in jax.random.split(jax.random.key(0), 100):
    ...   kx, ky = jax.random.split(key)
    ...   x = jax.random.normal(kx, (512, 4))
    ...   y = x @ jnp.ones(4) + 0.5 * jax.random.normal(ky, (512,))
    ...   grads, stats = step(jnp.zeros(4), x, y)
    ...   state, noise_scale = ema.update(state, stats)
    >>> int(state.count)
    100
    >>> bool(4 < noise_scale < 7)
    True
  """

  decay: float = 0.99

  def __post_init__(self) -> None:
    if isinstance(self.decay, jax.Array | np.ndarray):
      if jnp.ndim(self.decay) != 0:
        raise TypeError(
          f"decay must be a scalar in [0, 1), got a "
          f"{self.decay.dtype}{list(self.decay.shape)} array."
        )
      if isinstance(self.decay, Tracer):
        # Traced (a sweep under vmap or jit): its value exists only inside the
        # trace, where update uses it as it is; there is nothing to check yet.
        if jnp.issubdtype(self.decay.dtype, jnp.floating):
          return
      else:
        object.__setattr__(self, "decay", self.decay[()].item())
    if isinstance(self.decay, bool | np.bool_) or not isinstance(
      self.decay, int | float | np.integer | np.floating
    ):
      raise TypeError(f"decay must be a float in [0, 1), got {self.decay!r}.")
    if not 0 <= self.decay < 1:
      raise ValueError(
        f"decay must be a number in [0, 1), got {self.decay!r}; e.g. 0.99 "
        "averages about the last 100 steps."
      )

  def init(self) -> NoiseScaleEMAState:
    """The state before any step: nothing averaged yet."""
    zero = jnp.zeros((), jnp.float32)
    return NoiseScaleEMAState(jnp.zeros((), jnp.int32), zero, zero)

  def update(
    self, state: NoiseScaleEMAState, stats: AccumulationStats
  ) -> tuple[NoiseScaleEMAState, jax.Array]:
    """Adds one step's estimates.

    Args:
      state: the state so far, from `init` or the last `update`.
      stats: the step's `AccumulationStats`.

    Returns:
      `(new_state, noise_scale)`: `noise_scale` is the smoothed `B_simple`,
      `trace_covariance / true_grad_sq_norm` of the new state, in the batch
      size units of `stats`. It is `inf` while the smoothed `|G|²` is not
      positive (the noise hides the gradient: the noise scale is larger than
      these steps can measure), NaN before any finite step.
    """
    grad_sq = jnp.asarray(stats.true_grad_sq_norm, jnp.float32)
    trace = jnp.asarray(stats.trace_covariance, jnp.float32)
    finite = jnp.isfinite(grad_sq) & jnp.isfinite(trace)
    count = state.count + finite.astype(jnp.int32)
    # The bias-corrected EMA, updated in place: m_t = m_{t-1} + r_t (x_t - m_{t-1})
    # with r_t = (1 - decay) / (1 - decay^t) equals Adam's m_t / (1 - decay^t).
    # Both terms from the same float32 decay, each as expm1(t log decay): at a
    # decay of 0.9999 and up, 1 - decay is cancellation in float32, and one
    # term in float64 beside the other in float32 put r_1 off 1 by 1e-4 to 1e-2.
    log_decay = jnp.log(jnp.float32(self.decay))
    steps = jnp.maximum(count, 1).astype(jnp.float32)
    rate = jnp.expm1(log_decay) / jnp.expm1(steps * log_decay)
    rate = jnp.where(finite, rate, 0)
    move = lambda old, new: old + rate * (jnp.where(finite, new, old) - old)
    new_state = NoiseScaleEMAState(
      count, move(state.true_grad_sq_norm, grad_sq), move(state.trace_covariance, trace)
    )
    return new_state, noise_scale(new_state)


def noise_scale(state: NoiseScaleEMAState) -> jax.Array:
  """`B_simple` from smoothed estimates: inf if `|G|²` is not positive, NaN if none."""
  grad_sq, trace = state.true_grad_sq_norm, state.trace_covariance
  ratio = trace / jnp.where(grad_sq > 0, grad_sq, 1)
  return jnp.where(
    state.count == 0, jnp.nan, jnp.where(grad_sq > 0, ratio, jnp.inf)
  ).astype(jnp.float32)

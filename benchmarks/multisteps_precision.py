"""Benchmark: how far a `MultiSteps` window mean drifts from the exact mean as K grows.

K mini-steps of gradients g_k (4,096 entries each, N(1, 1): a mean of 1, as
gradients have, and noise as large) go through `jaccum.MultiSteps` and
`optax.MultiSteps` around `optax.sgd(1.0)`, in a `lax.scan` under `jit`; the
emitted update is minus the window mean. Its error is measured against the
float64 mean of the same (rounded) gradients, relative to the mean's size, in
two norms: the worst entry, max |update + mean| / max |mean|, and the
root-mean-square, ||update + mean||_2 / ||mean||_2. Rows: float32 params (the
default float32 accumulator), bfloat16 params with the default float32
accumulator (whose error is the final rounding of the mean to bf16), and
bfloat16 params with `accumulator_dtype=None` (accumulating in bf16).

Numbers, not timings: they do not depend on the machine's load. Part of the
suite (`python -m benchmarks --parts precision`): K up to 4096, or up to 256
with `--quick`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaccum

SIZE = 4096  # entries per gradient
# row name: (wrapper, params dtype, accumulator_dtype)
ROWS = {
  "jaccum f32": (jaccum.MultiSteps, jnp.float32, jnp.float32),
  "optax f32": (optax.MultiSteps, jnp.float32, jnp.float32),
  "jaccum bf16, f32 accumulator": (jaccum.MultiSteps, jnp.bfloat16, jnp.float32),
  "optax bf16, f32 accumulator": (optax.MultiSteps, jnp.bfloat16, jnp.float32),
  "jaccum bf16, accumulator_dtype=None": (jaccum.MultiSteps, jnp.bfloat16, None),
}


def gradients(num_microbatches: int, dtype) -> jax.Array:
  key = jax.random.key(num_microbatches)
  return (1 + jax.random.normal(key, (num_microbatches, SIZE))).astype(dtype)


@functools.partial(jax.jit, static_argnums=0)
def window_update(opt, grads):
  """The update `opt` emits after the window of `grads` (one row per mini-step)."""
  params = {"w": jnp.zeros(grads.shape[1:], grads.dtype)}

  def mini_step(state, grad):
    updates, state = opt.update({"w": grad}, state, params)
    return state, updates["w"]

  _, updates = jax.lax.scan(mini_step, opt.init(params), grads)
  return updates[-1]


def relative_errors(row: str, num_microbatches: int) -> dict[str, float]:
  wrapper, dtype, accumulator_dtype = ROWS[row]
  opt = wrapper(optax.sgd(1.0), num_microbatches, accumulator_dtype=accumulator_dtype)
  grads = gradients(num_microbatches, dtype)
  exact = np.asarray(grads, np.float64).mean(axis=0)
  update = np.asarray(window_update(opt, grads), np.float64)
  error = update + exact
  return {
    "max": float(np.abs(error).max() / np.abs(exact).max()),
    "rms": float(np.linalg.norm(error) / np.linalg.norm(exact)),
  }


def run(quick: bool) -> dict:
  ks = [16, 256] if quick else [16, 256, 1024, 4096]
  table = {row: {k: relative_errors(row, k) for k in ks} for row in ROWS}
  width = max(map(len, ROWS))
  for norm in ("max", "rms"):
    print(f"\n{norm} relative error of the window mean ({SIZE} entries, g ~ N(1, 1))")
    print(f"{'':{width}} " + " ".join(f"{f'K={k}':>9}" for k in ks))
    for row, errors in table.items():
      print(f"{row:{width}} " + " ".join(f"{errors[k][norm]:9.2g}" for k in ks))
  return {
    "size": SIZE,
    "relative_error": {
      row: {str(k): e for k, e in errors.items()} for row, errors in table.items()
    },
  }

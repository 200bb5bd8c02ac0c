"""Differentially private training on scikit-learn's digits: DP-SGD, accounted.

Each step samples its batch by Poisson sampling (every training image joins
with probability q = 256 / 1,500), so the batch size varies from step to
step. The batch is padded to a fixed capacity of K = 8 micro-batches of 48
rows (384 rows: a Poisson batch of mean 256 exceeds it with probability
below 1e-16), the real rows first: `example_mask` marks them and
`num_real_microbatches` skips the micro-batches that hold none, so one
compilation serves every batch size. `jaccum.dp_value_and_grad` clips each
example's gradient to C = 1 inside the loop, sums them, and adds Gaussian
noise of standard deviation σC (σ = 2.5) once per step; the sum is divided by the
expected batch size, 256. `dp_accounting` (Google's accountant, an optional
dependency: `pip install "jaccum[examples]"`) turns (q, σ, steps) into ε at
δ = 1e-5 with its Rényi-DP accountant, and the script prints it with the
test accuracy.

    python examples/dp_digits.py            # 200 steps: accuracy 0.89 at ε = 5.0
    python examples/dp_digits.py --quick    # 25 steps, for CI
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jaccum

try:
  import dp_accounting
except ModuleNotFoundError as error:  # an optional dependency of the examples
  raise ImportError(
    'this example needs dp_accounting: pip install "jaccum[examples]"'
  ) from error

EXPECTED_BATCH = 256  # q × training images
MICROBATCHES, ROWS = 8, 48  # a capacity of 384 rows
CLIP, NOISE = 1.0, 2.5  # C and σ
DELTA = 1e-5


def loss_fn(params, batch):
  """One loss per example: what per-example clipping needs."""
  hidden = jnp.tanh(batch["image"] @ params["w1"] + params["b1"])
  logits = hidden @ params["w2"] + params["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])


def poisson_batch(rng, images, labels):
  """A Poisson-sampled batch, padded at its end to the capacity: `(batch, real)`."""
  rows = np.flatnonzero(rng.random(len(labels)) < EXPECTED_BATCH / len(labels))
  capacity = MICROBATCHES * ROWS
  if len(rows) > capacity:
    raise RuntimeError(
      f"a Poisson batch of {len(rows)} exceeds the capacity {capacity}"
    )
  pad = capacity - len(rows)
  batch = {
    "image": np.concatenate([images[rows], np.zeros((pad, 64), np.float32)]),
    "label": np.concatenate([labels[rows], np.zeros(pad, np.int32)]),
  }
  return batch, len(rows)


def epsilon(steps, sampling_rate):
  """ε at δ for `steps` Poisson-sampled Gaussian steps (Rényi-DP accountant)."""
  event = dp_accounting.PoissonSampledDpEvent(
    sampling_rate, dp_accounting.GaussianDpEvent(NOISE)
  )
  # Integer orders: the fractional ones fail to converge at this large q.
  accountant = dp_accounting.rdp.RdpAccountant(orders=list(range(2, 257)))
  accountant.compose(event, steps)
  return accountant.get_epsilon(DELTA)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="25 steps, for CI")
  parser.add_argument("--steps", type=int, default=None, help="steps (default 200)")
  args = parser.parse_args()
  steps = args.steps or (25 if args.quick else 200)

  images, labels = load_digits(return_X_y=True)
  images, labels = (images / 16.0).astype(np.float32), labels.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(labels))
  train, test = order[:1500], order[1500:]
  rng = np.random.default_rng(1)
  params = {
    "w1": (rng.standard_normal((64, 64)) / 8).astype(np.float32),
    "b1": np.zeros(64, np.float32),
    "w2": (rng.standard_normal((64, 10)) / 8).astype(np.float32),
    "b2": np.zeros(10, np.float32),
  }
  optimizer = optax.adam(2e-3)
  opt_state = optimizer.init(params)
  private_grad = jaccum.dp_value_and_grad(
    loss_fn,
    MICROBATCHES,
    l2_clip_norm=CLIP,
    noise_multiplier=NOISE,
    normalize_by=EXPECTED_BATCH,
    split="contiguous",  # micro-batch k is rows 48k .. 48k + 47: the padding last
  )

  @jax.jit
  def train_step(params, opt_state, batch, real, key):
    mask = jnp.arange(MICROBATCHES * ROWS) < real
    count = (real + ROWS - 1) // ROWS  # the micro-batches that hold real rows
    loss, grads = private_grad(
      params, batch, noise_key=key, example_mask=mask, num_real_microbatches=count
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  key = jax.random.key(0)
  start = time.perf_counter()
  for step in range(steps):
    batch, real = poisson_batch(rng, images[train], labels[train])
    params, opt_state, loss = train_step(
      params, opt_state, batch, real, jax.random.fold_in(key, step)
    )
    if step % max(steps // 5, 1) == 0 or step == steps - 1:
      print(f"step {step:4d}  batch {real:3d}  loss {float(loss):.3f}", flush=True)
  logits = (
    jnp.tanh(images[test] @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
  )
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == labels[test]))
  eps = epsilon(steps, EXPECTED_BATCH / len(train))
  print(
    f"{steps} steps in {time.perf_counter() - start:.1f} s (one compilation): "
    f"test accuracy {accuracy:.3f}, (ε = {eps:.2f}, δ = {DELTA:g})-DP "
    f"(σ = {NOISE}, C = {CLIP}, q = {EXPECTED_BATCH / len(train):.3f})"
  )


if __name__ == "__main__":
  main()

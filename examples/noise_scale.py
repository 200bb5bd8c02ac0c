"""Is a bigger batch still worth it? Track the gradient noise scale while training.

A CNN learns scikit-learn's digits with batches of 128 images accumulated as 8
micro-batches of 16. `return_stats=True` makes every step also estimate the
simple noise scale `B_simple = tr(Σ) / |G|²` of McCandlish et al. (2018) from
the 8 micro-batch gradients the loop computes anyway, and `NoiseScaleEMA`
smooths its two parts over steps. `B_simple` predicts the critical batch size:
well below it, doubling the batch nearly halves the steps to a given loss;
well above it, a bigger batch buys few steps and costs examples.

The plot (examples/out/noise_scale.png) shows B_simple against the step next
to the batch in use; the last line printed says where the batch stands. The
CNN has no BatchNorm: BatchNorm couples the examples of a micro-batch, and
the estimator assumes independent examples. The data (1,797 8x8 images) ships
with scikit-learn; nothing is downloaded.

  python examples/noise_scale.py [--quick] [--epochs N] [--out PATH.png]
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaccum
import jaccum.nnx

BATCH_SIZE = 128
NUM_MICROBATCHES = 8
EMA = jaccum.NoiseScaleEMA(decay=0.98)  # about the last 50 steps


class CNN(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
    self.head = nnx.Linear(4 * 4 * 32, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))))
    x = nnx.max_pool(x, (2, 2), strides=(2, 2))  # 8x8 -> 4x4
    return self.head(x.reshape(x.shape[0], -1))


def loss_fn(model: CNN, images: jax.Array, labels: jax.Array) -> jax.Array:
  logits = model(images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@nnx.jit
def train_step(model, optimizer, ema_state, images, labels):
  (loss, grads), stats = jaccum.nnx.value_and_grad(
    loss_fn, NUM_MICROBATCHES, return_stats=True
  )(model, images, labels)
  optimizer.update(model, grads)
  ema_state, noise_scale = EMA.update(ema_state, stats)
  return loss, stats.noise_scale, noise_scale, ema_state


def verdict(batch_size: float, noise_scale: float) -> str:
  """The one-line recommendation: below/near/above the critical size, and why.

  McCandlish et al.'s model of training with batch B (B_noise ≈ B_simple):
  steps S = S_min (1 + B_simple / B), examples E = E_min (1 + B / B_simple),
  so doubling the batch saves the fraction 1 / (2 (1 + r)) of the steps and
  costs r / (1 + r) more examples, with r = B / B_simple. Within a factor 2
  of B_simple is "near".
  """
  ratio = batch_size / noise_scale if noise_scale > 0 else 0.0
  where = "below" if ratio < 0.5 else "above" if ratio > 2 else "near"
  steps_saved, more_examples = 1 / (2 * (1 + ratio)), ratio / (1 + ratio)
  return (
    f"B_simple ≈ {noise_scale:.0f} examples, batch {batch_size}: the batch is "
    f"{where} the critical size; doubling it would take about "
    f"{steps_saved:.0%} fewer steps for {more_examples:.0%} more examples."
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few epochs, for CI")
  parser.add_argument("--epochs", type=int, default=None)
  parser.add_argument("--out", default="examples/out/noise_scale.png")
  args = parser.parse_args()
  epochs = args.epochs or (6 if args.quick else 40)

  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1]
  x_train, _, y_train, _ = train_test_split(
    images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
  )
  model = CNN(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  ema_state = EMA.init()

  rng = np.random.default_rng(0)
  steps_per_epoch = len(x_train) // BATCH_SIZE
  history = []  # per step: loss, one step's B_simple, smoothed B_simple
  with tqdm(total=epochs * steps_per_epoch, desc="digits, B_simple") as bar:
    for _ in range(epochs):
      order = rng.permutation(len(x_train))
      for step in range(steps_per_epoch):
        rows = order[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]
        *figures, ema_state = train_step(
          model, optimizer, ema_state, x_train[rows], y_train[rows]
        )
        history.append([float(f) for f in figures])
        bar.update()
        bar.set_postfix(loss=f"{history[-1][0]:.3f}", B_simple=f"{history[-1][2]:.0f}")
  losses, raw, smoothed = np.array(history).T

  steps = np.arange(1, len(history) + 1)
  for step in np.unique(np.linspace(1, len(steps), 5).astype(int)):
    print(
      f"step {step:4d}: loss {losses[step - 1]:.3f}, B_simple {smoothed[step - 1]:.0f}"
    )

  fig, (ax_b, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
  positive = raw > 0  # one step's |G|² estimate can come out negative
  ax_b.plot(steps[positive], raw[positive], ".", ms=3, color="C0", alpha=0.3)
  ax_b.plot(steps, smoothed, "C0-", lw=2, label="B_simple (NoiseScaleEMA)")
  ax_b.plot(steps, np.full(len(steps), BATCH_SIZE), "k-", lw=1.5, label="batch in use")
  ax_b.fill_between(
    steps, BATCH_SIZE / 2, BATCH_SIZE * 2, color="k", alpha=0.08, label="near (×2)"
  )
  ax_b.set(
    xlabel="step",
    ylabel="examples",
    yscale="log",
    title="gradient noise scale vs batch size",
  )
  ax_b.legend(loc="upper left")
  ax_loss.plot(steps, losses, lw=1)
  ax_loss.set(xlabel="step", ylabel="train loss", yscale="log", title="training loss")
  fig.suptitle(
    f"digits CNN, batch {BATCH_SIZE} as {NUM_MICROBATCHES} micro-batches of "
    f"{BATCH_SIZE // NUM_MICROBATCHES}"
  )
  fig.tight_layout()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  print(f"saved {out}")

  print(verdict(BATCH_SIZE, smoothed[-1]))


if __name__ == "__main__":
  main()

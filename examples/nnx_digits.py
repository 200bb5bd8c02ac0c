"""Train a CNN with BatchNorm and Dropout on scikit-learn's digits, K=8 micro-batches.

`jaccum.nnx.value_and_grad` runs each batch of 128 images as 8 micro-batches
of 16 inside one jitted step: the gradient is the whole batch's, BatchNorm's
running statistics see the 8 micro-batches one after another, and every
micro-batch draws its own dropout mask. The data (1,797 8x8 images) ships
with scikit-learn; nothing is downloaded.

  python examples/nnx_digits.py [--quick] [--out examples/out/nnx_digits.png]
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaccum.nnx

BATCH_SIZE = 128
NUM_MICROBATCHES = 8


class CNN(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 16, (3, 3), use_bias=False, rngs=rngs)
    self.norm1 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, (3, 3), use_bias=False, rngs=rngs)
    self.norm2 = nnx.BatchNorm(32, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.3, rngs=rngs)
    self.head = nnx.Linear(4 * 4 * 32, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(self.norm1(self.conv1(x)))
    x = jax.nn.relu(self.norm2(self.conv2(x)))
    x = nnx.max_pool(x, (2, 2), strides=(2, 2))  # 8x8 -> 4x4
    return self.head(self.dropout(x.reshape(x.shape[0], -1)))


def loss_fn(model: CNN, images: jax.Array, labels: jax.Array) -> jax.Array:
  logits = model(images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@nnx.jit
def train_step(model, optimizer, images, labels):
  loss, grads = jaccum.nnx.value_and_grad(loss_fn, NUM_MICROBATCHES)(
    model, images, labels
  )
  optimizer.update(model, grads)
  return loss


@nnx.jit
def accumulated_gradient(model, images, labels):
  return jaccum.nnx.value_and_grad(loss_fn, NUM_MICROBATCHES)(model, images, labels)


@nnx.jit
def whole_batch_gradient(model, images, labels):
  return nnx.value_and_grad(loss_fn)(model, images, labels)


def step_times(model, images, labels, rounds: int) -> dict[str, float]:
  """Median ms of the gradient step, K micro-batches against the whole batch.

  The two alternate within each round, so background load hits them alike.
  """
  steps = {
    "whole batch": whole_batch_gradient,
    f"K={NUM_MICROBATCHES}": accumulated_gradient,
  }
  times = {name: [] for name in steps}
  for step in steps.values():
    jax.block_until_ready(step(model, images, labels))  # compile
  for _ in range(rounds):
    for name, step in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step(model, images, labels))
      times[name].append(time.perf_counter() - start)
  return {name: 1e3 * float(np.median(t)) for name, t in times.items()}


@nnx.jit
def accuracy(model, images, labels):
  return jnp.mean(jnp.argmax(model(images), -1) == labels)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few epochs, for CI")
  parser.add_argument("--epochs", type=int, default=None)
  parser.add_argument("--out", default="examples/out/nnx_digits.png")
  args = parser.parse_args()
  epochs = args.epochs or (3 if args.quick else 25)

  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1]
  x_train, x_test, y_train, y_test = train_test_split(
    images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
  )
  model = CNN(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  rng = np.random.default_rng(0)
  steps_per_epoch = len(x_train) // BATCH_SIZE
  losses, test_accuracy = [], []
  with tqdm(total=epochs * steps_per_epoch, desc=f"digits K={NUM_MICROBATCHES}") as bar:
    for _ in range(epochs):
      model.train()
      order = rng.permutation(len(x_train))
      for step in range(steps_per_epoch):
        rows = order[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]
        losses.append(float(train_step(model, optimizer, x_train[rows], y_train[rows])))
        bar.update()
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
      model.eval()  # Running BatchNorm statistics, no dropout.
      test_accuracy.append(float(accuracy(model, x_test, y_test)))
      bar.set_postfix(loss=f"{losses[-1]:.3f}", test_acc=f"{test_accuracy[-1]:.3f}")

  print(f"final train loss {np.mean(losses[-steps_per_epoch:]):.4f}")
  print(f"test accuracy {test_accuracy[-1]:.4f} on {len(x_test)} held-out digits")
  model.train()
  times = step_times(
    model, x_train[:BATCH_SIZE], y_train[:BATCH_SIZE], 10 if args.quick else 50
  )
  whole = times["whole batch"]
  print("gradient step, batch of", BATCH_SIZE, "(median ms; CPU convolutions run in")
  print("XLA's fast layout inside the loop too, see jaccum's performance guide):")
  for name, ms in times.items():
    print(f"  {name:<12} {ms:7.2f} ms  {ms / whole:5.2f}x the whole batch")

  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
  ax_loss.plot(losses, lw=1)
  ax_loss.set(
    xlabel="step",
    ylabel="train loss",
    yscale="log",
    title=f"batch {BATCH_SIZE} as {NUM_MICROBATCHES} micro-batches",
  )
  epoch_ends = np.arange(1, epochs + 1) * steps_per_epoch
  ax_acc.plot(epoch_ends, test_accuracy, marker="o")
  ax_acc.set(xlabel="step", ylabel="test accuracy", title="held-out digits")
  fig.tight_layout()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  print(f"saved {out}")


if __name__ == "__main__":
  main()

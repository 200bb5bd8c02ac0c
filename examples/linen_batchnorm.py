"""Linen recipe: a TrainState with batch_stats, trained with `jaccum.accumulate`.

A Linen MLP with BatchNorm and Dropout learns scikit-learn's bundled digits
with batches of 128 run as K=4 micro-batches. `state_argnum` threads the
BatchNorm statistics through the micro-batches in order (as 4 sequential
forward passes would update them) and `rng_argnum` gives each micro-batch its
own dropout key. For contrast, the same model is trained with the statistics
dropped, the bug of accumulation loops that keep only the gradients: its
evaluation, which uses the running statistics, stays poor.

  python examples/linen_batchnorm.py [--quick] [--epochs N] [--out PATH.png]
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaccum

BATCH_SIZE = 128
NUM_MICROBATCHES = 4


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    x = nn.Dense(128, use_bias=False)(x)  # BatchNorm brings its own bias.
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
    return nn.Dense(10)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any


def loss_fn(params, batch_stats, images, labels, key):
  logits, updates = MLP().apply(
    {"params": params, "batch_stats": batch_stats},
    images,
    train=True,
    mutable=["batch_stats"],
    rngs={"dropout": key},
  )
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, updates["batch_stats"]


# The recipe: a micro-step returns (out, new_batch_stats) for `state_argnum`.
def micro_step(params, batch_stats, images, labels, key):
  (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
    params, batch_stats, images, labels, key
  )
  return (loss, grads), batch_stats


accumulated = jaccum.accumulate(
  micro_step, NUM_MICROBATCHES, batch_argnums=(2, 3), state_argnum=1, rng_argnum=4
)


@jax.jit
def train_step(state: TrainState, images, labels, key):
  (loss, grads), batch_stats = accumulated(
    state.params, state.batch_stats, images, labels, key
  )
  return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss


@jax.jit
def train_step_dropping_stats(state: TrainState, images, labels, key):
  (loss, grads), _ = accumulated(state.params, state.batch_stats, images, labels, key)
  return state.apply_gradients(grads=grads), loss  # The bug: stats never saved.


@jax.jit
def accuracy(state: TrainState, images, labels):
  variables = {"params": state.params, "batch_stats": state.batch_stats}
  logits = MLP().apply(variables, images, train=False)
  return jnp.mean(jnp.argmax(logits, -1) == labels)


def check_against_sequential(state: TrainState, images, labels, key) -> float:
  """Max difference of one step's statistics from 4 sequential forward passes."""
  expected = state.batch_stats
  for k in range(NUM_MICROBATCHES):
    rows = slice(k, None, NUM_MICROBATCHES)  # The strided split's micro-batch k.
    _, expected = jax.jit(loss_fn)(
      state.params, expected, images[rows], labels[rows], jax.random.fold_in(key, k)
    )
  new_state, _ = train_step(state, images, labels, key)
  diffs = jax.tree.map(
    lambda a, b: jnp.max(jnp.abs(a - b)), new_state.batch_stats, expected
  )
  return float(max(jax.tree.leaves(diffs)))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few epochs, for CI")
  parser.add_argument("--epochs", type=int, default=None)
  parser.add_argument("--out", default="examples/out/linen_batchnorm.png")
  args = parser.parse_args()
  epochs = args.epochs or (3 if args.quick else 30)

  digits = load_digits()
  x_train, x_test, y_train, y_test = train_test_split(
    (digits.data / 16.0).astype(np.float32),
    digits.target,
    test_size=0.2,
    random_state=0,
    stratify=digits.target,
  )
  variables = MLP().init(jax.random.key(0), x_train[:1], train=False)
  init_state = TrainState.create(
    apply_fn=MLP().apply,
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    tx=optax.adam(1e-3),
  )
  diff = check_against_sequential(
    init_state, x_train[:BATCH_SIZE], y_train[:BATCH_SIZE], jax.random.key(1)
  )
  print(f"one step: max |batch_stats - 4 sequential forward passes| = {diff:.1e}")

  steps_per_epoch = len(x_train) // BATCH_SIZE
  results = {}
  for name, step_fn in [
    ("jaccum, stats threaded", train_step),
    ("stats dropped", train_step_dropping_stats),
  ]:
    state, rng = init_state, np.random.default_rng(0)
    losses, test_accuracy = [], []
    for epoch in tqdm(range(epochs), desc=name):
      order = rng.permutation(len(x_train))
      for step in range(steps_per_epoch):
        rows = order[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]
        key = jax.random.key(epoch * steps_per_epoch + step)
        state, loss = step_fn(state, x_train[rows], y_train[rows], key)
        losses.append(float(loss))
      test_accuracy.append(float(accuracy(state, x_test, y_test)))
    results[name] = (losses, test_accuracy)
    print(
      f"{name}: final train loss {np.mean(losses[-steps_per_epoch:]):.4f}, "
      f"test accuracy {test_accuracy[-1]:.4f}"
    )

  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
  for (name, (losses, test_accuracy)), color in zip(
    results.items(), ["C0", "C3"], strict=True
  ):
    ax_loss.plot(losses, color, lw=1, label=name)
    epoch_ends = np.arange(1, epochs + 1) * steps_per_epoch
    ax_acc.plot(epoch_ends, test_accuracy, color, marker="o", ms=3, label=name)
  ax_loss.set(
    xlabel="step",
    ylabel="train loss",
    yscale="log",
    title="training (the same for both)",
  )
  ax_acc.set(
    xlabel="step", ylabel="test accuracy (running statistics)", title="evaluation"
  )
  ax_loss.legend()
  ax_acc.legend()
  fig.suptitle(
    f"Linen MLP with BatchNorm, batch {BATCH_SIZE} as {NUM_MICROBATCHES} micro-batches"
  )
  fig.tight_layout()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  print(f"saved {out}")


if __name__ == "__main__":
  main()

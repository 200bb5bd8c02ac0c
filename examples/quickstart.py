"""Quickstart: train an MLP on scikit-learn's digits with gradient accumulation.

Every training step wants a batch of 512 images. `jaccum.accumulate` runs it
as 16 micro-batches of 32 inside one jitted step and averages their gradients,
so the optimizer sees the whole-batch gradient while the step only holds one
micro-batch's activations. Plain JAX and optax; nothing is downloaded.

    python examples/quickstart.py            # 400 steps, well under a minute
    python examples/quickstart.py --quick    # 40 steps, for CI

It ends with a table comparing the accumulated train step with the same step
on the whole batch at once: XLA's compiled memory and the step time of each,
and how far apart their gradients are. On a model this small the accumulated
step is slower than the whole batch's (its 32-row micro-steps are too small
to keep the matrix kernels busy), and it says so: what accumulation buys is
memory, and time only where a micro-batch fills the device.
"""

import argparse
import functools
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaccum
import jaccum.inspect

BATCH_SIZE = 512
HIDDEN = 256


def init_mlp(key, sizes):
  """A list of {"w", "b"} layers, He-initialised."""
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {
      "w": jax.random.normal(k, (m, n)) * jnp.sqrt(2.0 / m),
      "b": jnp.zeros(n),
    }
    for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def mlp(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss(params, batch):
  """Mean cross-entropy over the examples, with the accuracy as auxiliary output.

  A per-example mean is what makes the mean over equal micro-batches equal
  the whole-batch value: `jaccum.accumulate`'s default `reduce="mean"`.
  """
  logits = mlp(params, batch["image"])
  labels = batch["label"]
  cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return cross_entropy.mean(), {"accuracy": (logits.argmax(-1) == labels).mean()}


def make_train_step(grad_fn, optimizer):
  """One jitted optimizer step around `grad_fn(params, batch)`."""

  @jax.jit
  def train_step(params, opt_state, batch):
    (loss_value, aux), grads = grad_fn(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss_value, aux

  return train_step


@functools.partial(jax.jit, static_argnums=(0, 1))
def gradient_gap(grad_fn, accumulated_grad_fn, params, batch):
  """The largest |accumulated - whole-batch| entry, and the relative error."""
  (_, _), whole = grad_fn(params, batch)
  (_, _), accumulated = accumulated_grad_fn(params, batch)
  difference = optax.tree.sub(accumulated, whole)
  largest = optax.tree.max(jax.tree.map(jnp.abs, difference))
  return largest, optax.tree.norm(difference) / optax.tree.norm(whole)


def median_seconds(fn, *args, repeats):
  """Median wall time of `fn(*args)`, after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def batches(data, batch_size, rng):
  """Endless shuffled batches of `data`, a dict of equally long arrays."""
  size = len(data["label"])
  while True:
    order = rng.permutation(size)
    for start in range(0, size - batch_size + 1, batch_size):
      rows = order[start : start + batch_size]
      yield {name: array[rows] for name, array in data.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="a short run, for CI")
  parser.add_argument("--steps", type=int, default=None, help="training steps")
  parser.add_argument("--microbatches", type=int, default=16, help="K")
  args = parser.parse_args()
  num_steps = args.steps or (40 if args.quick else 400)
  num_microbatches = args.microbatches

  # 1797 8x8 images of digits, pixel values 0..16.
  images, labels = load_digits(return_X_y=True)
  x_train, x_test, y_train, y_test = train_test_split(
    (images / 16.0).astype(np.float32), labels, test_size=0.25, random_state=0
  )
  train = {"image": x_train, "label": y_train.astype(np.int32)}

  params = init_mlp(jax.random.key(0), [64, HIDDEN, HIDDEN, 10])
  optimizer = optax.adam(1e-3)
  opt_state = optimizer.init(params)

  grad_fn = jax.value_and_grad(loss, has_aux=True)
  accumulated_grad_fn = jaccum.accumulate(grad_fn, num_microbatches)
  train_step = make_train_step(accumulated_grad_fn, optimizer)

  data = batches(train, BATCH_SIZE, np.random.default_rng(0))
  # The accumulated gradient against the whole batch at once, on the fresh
  # params: near a minimum the gradient almost cancels out and any float32
  # comparison measures that cancellation more than the accumulation.
  difference, relative = gradient_gap(grad_fn, accumulated_grad_fn, params, next(data))

  progress = tqdm(range(num_steps), desc=f"training, K={num_microbatches}")
  for _ in progress:
    params, opt_state, loss_value, aux = train_step(params, opt_state, next(data))
    progress.set_postfix(
      loss=f"{loss_value:.3f}", accuracy=f"{aux['accuracy']:.3f}", refresh=False
    )

  test_logits = jax.jit(mlp)(params, x_test)
  test_accuracy = float((test_logits.argmax(-1) == y_test).mean())
  print(f"test accuracy: {test_accuracy:.1%} on {len(y_test)} held-out images")

  # XLA's compiled memory and the time of the two train steps, same inputs.
  batch = next(data)
  steps = {
    "whole batch": make_train_step(grad_fn, optimizer),
    f"accumulated (K={num_microbatches})": train_step,
  }
  step_args = (params, opt_state, batch)
  memory = {
    name: jaccum.inspect.memory(step, *step_args) for name, step in steps.items()
  }
  # Alternate the two so background load slows both alike.
  repeats = 5 if args.quick else 20
  times = {name: [] for name in steps}
  for _ in range(3):
    for name, step in steps.items():
      times[name].append(median_seconds(step, *step_args, repeats=repeats))

  mib = 2**20
  rows = {
    # Small for the accumulated step: XLA reuses the (not yet written) output
    # buffers for the loop's accumulator and activations.
    "XLA temporaries (MiB)": [m.temp_bytes / mib for m in memory.values()],
    "XLA total with args (MiB)": [
      (m.temp_bytes + m.argument_bytes + m.output_bytes - m.alias_bytes) / mib
      for m in memory.values()
    ],
    "step time, median (ms)": [1e3 * np.median(t) for t in times.values()],
  }
  print(
    f"\none step = gradients of a batch of {BATCH_SIZE} "
    f"({num_microbatches} micro-batches of {BATCH_SIZE // num_microbatches}) "
    "+ adam update"
  )
  print(f"{'':28}" + "".join(f"{name:>22}" for name in steps))
  for label, values in rows.items():
    print(f"{label:28}" + "".join(f"{value:>22.2f}" for value in values))
  print(
    f"gradient at the initial params, accumulated vs whole batch: largest "
    f"|difference| {difference:.1e}, relative error {relative:.1e}"
  )
  print(
    "\n" + textwrap.fill(time_note(rows, num_microbatches), 88, break_on_hyphens=False)
  )


def time_note(rows, num_microbatches):
  """What the step times mean: on this small model, per-micro-step costs."""
  whole_ms, accumulated_ms = rows["step time, median (ms)"]
  whole_mib, accumulated_mib = rows["XLA total with args (MiB)"]
  ratio = accumulated_ms / whole_ms
  head = (
    f"The accumulated step took {ratio:.2f}x the whole batch's time, in "
    f"{accumulated_mib:.2f} MiB instead of {whole_mib:.2f}."
  )
  if ratio <= 1.1:
    return head + " Accumulation bought memory at about the whole batch's time."
  return head + (
    f" Each of its {num_microbatches} micro-steps runs "
    f"{BATCH_SIZE // num_microbatches} rows through a 64-{HIDDEN}-{HIDDEN}-10 "
    "MLP: too little work to keep the kernels busy, so their fixed cost per "
    "call, paid once per micro-step, shows (the loop itself adds a few "
    "microseconds per micro-batch). Accumulation is for batches that do not "
    "fit: with micro-batches that fill the device it costs about the whole "
    "batch's time, so choose the smallest K that fits "
    "(docs/guides/performance.md#small-micro-batches)."
  )


if __name__ == "__main__":
  main()

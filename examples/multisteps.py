"""Train on scikit-learn's digits with `jaccum.MultiSteps` and `optax.MultiSteps`.

The data arrives one micro-batch of 32 images per call, as from a data
loader; 8 calls make one Adam step on 256 images. Both wrappers get the same
inner optimizer and the same micro-batches, so their trajectories agree to
float32 rounding, but jaccum runs Adam once per window where optax runs it on
every call and keeps one result in eight.

A second run feeds one NaN micro-batch (a corrupt example) in the third
window, with `optax.zero_nans()` first in the inner chain, as a guard. jaccum
loses that one window and trains on; optax's accumulator is reset by
multiplying with 0, stays NaN, and every later update is zeroed: training
silently stops.

A third run moves an optax.MultiSteps training over to jaccum half-way through
a window, as when resuming an optax checkpoint: `jaccum.MultiStepsState(*state)`
continues the optax state exactly, Adam's moments and the half-filled window
included, and the params end where optax's own would.

The data (1,797 8x8 images) ships with scikit-learn; nothing is downloaded.

  python examples/multisteps.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaccum

MICROBATCH = 32
EVERY_K = 8
WIDTH = 512


def init_params(key: jax.Array) -> list[dict[str, jax.Array]]:
  sizes = [64, WIDTH, WIDTH, 10]
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
    for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def predict(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x: jax.Array, y: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(predict(params, x), y).mean()


def make_step(wrapper):
  """A jitted mini-step that donates params and state, as a real loop does."""
  opt = wrapper(optax.chain(optax.zero_nans(), optax.adam(1e-3)), EVERY_K)

  @jax.jit
  def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(predict(params, x), -1) == y)

  def step(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return opt, jax.jit(step, donate_argnums=(0, 1)), accuracy


def main(quick: bool) -> None:
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  x_train, x_test, y_train, y_test = train_test_split(
    x, digits.target, test_size=0.2, random_state=0
  )
  window = MICROBATCH * EVERY_K
  windows_per_epoch = len(x_train) // window
  epochs = 4 if quick else 25
  wrappers = {"jaccum": jaccum.MultiSteps, "optax": optax.MultiSteps}
  steps = {name: make_step(wrapper) for name, wrapper in wrappers.items()}

  def train(epochs, nan_window=None, progress=True):
    """Trains both side by side, a window each in turn; returns per-epoch test
    accuracy, per-window loss and seconds per mini-step (after compiling)."""
    params0 = init_params(jax.random.key(0))
    runs = {
      name: [jax.tree.map(jnp.copy, params0), opt.init(params0)]
      for name, (opt, _, _) in steps.items()
    }
    history = {name: {"accuracy": [], "loss": [], "seconds": []} for name in steps}
    order = np.random.default_rng(0)
    total = epochs * windows_per_epoch
    bar = tqdm(total=total, desc="jaccum vs optax MultiSteps", disable=not progress)
    for epoch in range(epochs):
      perm = order.permutation(len(x_train))
      for w in range(windows_per_epoch):
        rows = perm[w * window : (w + 1) * window].reshape(EVERY_K, MICROBATCH)
        for name, (_, step, _) in steps.items():
          params, state = runs[name]
          start, losses = time.perf_counter(), []
          for k, micro in enumerate(rows):
            xb = x_train[micro]
            if epoch * windows_per_epoch + w == nan_window and k == 3:
              xb = np.full_like(xb, np.nan)  # one corrupt micro-batch
            params, state, loss = step(params, state, xb, y_train[micro])
            losses.append(loss)
          jax.block_until_ready(params)
          if epoch or w:  # the first window includes compiling
            history[name]["seconds"].append((time.perf_counter() - start) / EVERY_K)
          history[name]["loss"].append(float(np.mean(losses)))
          runs[name] = [params, state]
        bar.update()
      for name, (_, _, accuracy) in steps.items():
        history[name]["accuracy"].append(float(accuracy(runs[name][0], x_test, y_test)))
    bar.close()
    return history

  history = train(epochs)
  print(
    f"\n{'epoch':>5} | {'jaccum loss':>11} {'acc':>6} | {'optax loss':>10} {'acc':>6}"
  )
  for epoch in range(epochs):
    losses = [
      np.mean(history[name]["loss"][epoch * windows_per_epoch :][:windows_per_epoch])
      for name in steps
    ]
    accuracy = [history[name]["accuracy"][epoch] for name in steps]
    print(
      f"{epoch + 1:>5} | {losses[0]:>11.4f} {accuracy[0]:>6.3f}"
      f" | {losses[1]:>10.4f} {accuracy[1]:>6.3f}"
    )
  difference = max(
    abs(a - b)
    for a, b in zip(history["jaccum"]["loss"], history["optax"]["loss"], strict=True)
  )
  ms = {name: 1e3 * np.median(history[name]["seconds"]) for name in steps}
  print(f"largest difference between the two loss trajectories: {difference:.2g}")
  num_params = sum(p.size for p in jax.tree.leaves(init_params(jax.random.key(0))))
  print(
    f"time per mini-step ({num_params:,} params, Adam, K={EVERY_K}): "
    f"jaccum {ms['jaccum']:.2f} ms, optax {ms['optax']:.2f} ms "
    f"({ms['jaccum'] / ms['optax']:.2f}x)"
  )

  handover(steps, x_train, y_train)

  fault_epochs = 2 if quick else 6
  print(f"\nagain for {fault_epochs} epochs, one NaN micro-batch in window 3:")
  faulty = train(fault_epochs, nan_window=2, progress=False)
  for name in steps:
    print(
      f"  {name:6} test accuracy by epoch: "
      + " ".join(f"{a:.3f}" for a in faulty[name]["accuracy"])
    )


def handover(steps, x_train, y_train, windows: int = 4) -> None:
  """Trains with optax for 1.5 windows, then hands its state to jaccum; compares
  the params with those of optax throughout."""
  rows = np.random.default_rng(1).permutation(len(x_train))
  rows = rows[: windows * EVERY_K * MICROBATCH].reshape(-1, MICROBATCH)
  switch = EVERY_K + EVERY_K // 2
  (_, optax_step, _), (jaccum_opt, jaccum_step, _) = steps["optax"], steps["jaccum"]
  final = {}
  for name, handover_at in (("optax throughout", None), ("handed over", switch)):
    params = init_params(jax.random.key(0))
    state, step = steps["optax"][0].init(params), optax_step
    for call, micro in enumerate(rows):
      if call == handover_at:
        state, step = jaccum.MultiStepsState(*state), jaccum_step
        print(f"\nhanding an optax state over to jaccum at mini-step {state.mini_step}")
      params, state, _ = step(params, state, x_train[micro], y_train[micro])
    final[name] = params
  assert bool(jaccum_opt.has_updated(state))
  difference = max(
    float(jnp.abs(a - b).max())
    for a, b in zip(*map(jax.tree.leaves, final.values()), strict=True)
  )
  print(
    f"after {windows} windows, largest param difference from optax throughout: "
    f"{difference:.2g}"
  )


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="a short run, for CI")
  main(parser.parse_args().quick)

"""A CLIP-style model of digits and their names, batch 256 as K=8 micro-batches.

Two towers learn to embed scikit-learn's 8x8 digit images and their label's
name as text ("seven", "the digit seven", ...), read byte by byte, so that
each image is closest to its label's captions among all 256 of the batch:
a CLIP loss (with the batch's captions of the same label as positives),
whose negatives are the rest of the batch. Three runs from the same start
see the same batches:

* the whole batch, `jax.value_and_grad`;
* `jaccum.accumulate_coupled(encode, clip_loss, 8)`: 8 micro-batches of 32,
  the same loss and gradient, so the same training curve to float32 rounding;
* plain `jaccum.accumulate` of the same loss at K = 8: each micro-batch
  contrasts its 32 pairs only, another objective; its curve is the true
  (whole-batch) loss at its params.

At the end, each model classifies the held-out digits zero-shot, by the
nearest of the ten captions "the digit zero" ... "the digit nine". The data
ship with scikit-learn; nothing is downloaded.

  python examples/clip_digits.py [--quick] [--out examples/out/clip_digits.png]
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jaccum

BATCH_SIZE = 256
NUM_MICROBATCHES = 8
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = ("{}", "the digit {}", "a handwritten {}", "number {}")
TEXT_LENGTH = 24  # bytes; captions are padded with 0
EMBED = 32


def encode_text(captions: list[str]) -> np.ndarray:
  """Each caption as UTF-8 bytes, padded with zeros to `TEXT_LENGTH`."""
  out = np.zeros((len(captions), TEXT_LENGTH), np.int32)
  for row, caption in enumerate(captions):
    data = caption.encode()[:TEXT_LENGTH]
    out[row, : len(data)] = list(data)
  return out


def init_params(key: jax.Array) -> dict:
  keys = iter(jax.random.split(key, 8))

  def dense(fan_in, fan_out):
    return jax.random.normal(next(keys), (fan_in, fan_out)) / np.sqrt(fan_in)

  return {
    "image": {"w1": dense(64, 256), "w2": dense(256, 256), "w3": dense(256, EMBED)},
    "text": {
      "bytes": jax.random.normal(next(keys), (256, 32)) * 0.1,
      "conv": dense(3 * 32, 128),  # 3 bytes wide
      "out": dense(128, EMBED),
    },
    "log_temp": jnp.float32(np.log(10.0)),
  }


def image_tower(params: dict, images: jax.Array) -> jax.Array:
  hidden = jax.nn.gelu(images @ params["w1"])
  return jax.nn.gelu(hidden @ params["w2"]) @ params["w3"]


def text_tower(params: dict, text: jax.Array) -> jax.Array:
  """Byte embeddings, a width-3 convolution, a mean over the caption's bytes."""
  embedded = params["bytes"][text]  # [rows, length, 32]
  padded = jnp.pad(embedded, ((0, 0), (1, 1), (0, 0)))
  windows = jnp.concatenate([padded[:, i : i + TEXT_LENGTH] for i in range(3)], -1)
  hidden = jax.nn.gelu(windows @ params["conv"])
  mask = (text > 0)[..., None]
  pooled = jnp.sum(hidden * mask, 1) / jnp.maximum(jnp.sum(mask, 1), 1)
  return pooled @ params["out"]


def normalize(x: jax.Array) -> jax.Array:
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def encode(params: dict, batch: dict) -> dict:
  """Per row, on its own: the image's and the caption's unit embeddings, and
  the label (an integer leaf: it passes through, undifferentiated)."""
  return {
    "image": normalize(image_tower(params["image"], batch["image"])),
    "text": normalize(text_tower(params["text"], batch["text"])),
    "label": batch["label"],
  }


def clip_loss(params: dict, reps: dict) -> jax.Array:
  """Every image against every caption of the batch, and back.

  Digits of one label share their captions, so every caption of an image's
  label is a positive for it (spread evenly), the batch's others negatives.
  The cross-entropy less the targets' own entropy (a constant), so that a
  perfect model scores 0: the KL divergence from the targets.
  """
  logits = jnp.exp(params["log_temp"]) * reps["image"] @ reps["text"].T
  same = (reps["label"][:, None] == reps["label"][None, :]).astype(logits.dtype)
  targets = same / jnp.sum(same, axis=1, keepdims=True)
  entropy = -jnp.sum(jnp.where(same > 0, targets * jnp.log(targets), 0), axis=1)
  ce = optax.softmax_cross_entropy
  both_ways = ce(logits, targets) + ce(logits.T, targets)  # targets symmetric
  return jnp.mean(both_ways / 2 - entropy)


def whole_batch_loss(params: dict, batch: dict) -> jax.Array:
  return clip_loss(params, encode(params, batch))


OPTIMIZER = optax.adam(3e-3)
GRADIENTS = {
  "whole batch": jax.value_and_grad(whole_batch_loss),
  f"accumulate_coupled K={NUM_MICROBATCHES}": jaccum.accumulate_coupled(
    encode, clip_loss, NUM_MICROBATCHES
  ),
  f"plain accumulate K={NUM_MICROBATCHES}": jaccum.accumulate(
    jax.value_and_grad(whole_batch_loss), NUM_MICROBATCHES
  ),
}


def make_train_step(grad_fn):
  @jax.jit
  def train_step(params, opt_state, batch):
    _, grads = grad_fn(params, batch)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    # The true loss at the params the step started from: for plain
    # accumulation this is not the loss it computed.
    return (
      optax.apply_updates(params, updates),
      opt_state,
      whole_batch_loss(params, batch),
    )

  return train_step


@jax.jit
def zero_shot_accuracy(params: dict, images: jax.Array, labels: jax.Array):
  """Each image's label: the nearest of the ten captions "the digit <name>"."""
  captions = jnp.asarray(encode_text([f"the digit {name}" for name in NAMES]))
  reps = encode(params, {"image": images, "text": captions[labels], "label": labels})
  names = normalize(text_tower(params["text"], captions))
  return jnp.mean(jnp.argmax(reps["image"] @ names.T, -1) == labels)


def batches(images, labels, num_steps, rng):
  """Random batches of images and one of their label's captions."""
  captions = [[t.format(name) for t in TEMPLATES] for name in NAMES]
  for _ in range(num_steps):
    rows = rng.choice(len(images), BATCH_SIZE, replace=False)
    text = [captions[label][rng.integers(len(TEMPLATES))] for label in labels[rows]]
    yield {
      "image": jnp.asarray(images[rows]),
      "text": jnp.asarray(encode_text(text)),
      "label": jnp.asarray(labels[rows]),
    }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few steps, for CI")
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--out", default="examples/out/clip_digits.png")
  args = parser.parse_args()
  num_steps = args.steps or (10 if args.quick else 300)

  digits = load_digits()
  images = (digits.images.reshape(-1, 64) / 16.0).astype(np.float32)
  x_train, x_test, y_train, y_test = train_test_split(
    images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
  )
  data = list(batches(x_train, y_train, num_steps, np.random.default_rng(0)))
  start = init_params(jax.random.key(0))
  curves, accuracy = {}, {}
  for name, grad_fn in GRADIENTS.items():
    train_step = make_train_step(grad_fn)
    params, opt_state, curve = start, OPTIMIZER.init(start), []
    for batch in data:
      params, opt_state, loss = train_step(params, opt_state, batch)
      curve.append(float(loss))
    curves[name] = np.array(curve)
    accuracy[name] = float(zero_shot_accuracy(params, x_test, y_test))

  whole, coupled, plain = curves.values()
  print(f"true CLIP loss of the batch of {BATCH_SIZE}, every {num_steps // 10} steps:")
  print(f"{'step':>5}" + "".join(f"{name:>30}" for name in curves))
  for step in range(0, num_steps, num_steps // 10):
    print(f"{step:>5}" + "".join(f"{c[step]:>30.4f}" for c in curves.values()))
  gap = np.max(np.abs(coupled - whole) / np.abs(whole))
  print(f"accumulate_coupled against the whole batch: largest relative gap {gap:.1e}")
  print(
    f"plain accumulate against the whole batch, last step: {plain[-1]:.4f} vs "
    f"{whole[-1]:.4f}"
  )
  print(f"zero-shot accuracy on {len(x_test)} held-out digits:")
  for name, value in accuracy.items():
    print(f"  {name:<30} {value:.3f}")
  # Exact: the two curves differ by float32 rounding, grown over the steps.
  assert gap < (1e-4 if args.quick else 1e-2), gap

  fig, ax = plt.subplots(figsize=(6, 4))
  for name, curve in curves.items():
    ax.plot(curve, lw=1, ls="--" if "coupled" in name else "-", label=name)
  ax.set(xlabel="step", ylabel="true CLIP loss (batch of 256)", yscale="log")
  ax.set_title("digits against their names, batch 256", fontsize=10)
  ax.legend()
  fig.tight_layout()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  print(f"saved {out}")


if __name__ == "__main__":
  main()

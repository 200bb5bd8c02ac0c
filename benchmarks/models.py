"""The three models the suite trains: an MLP, a CNN and a transformer LM, in Flax NNX.

Each is an `nnx.Module` with a per-example (or per-token, at a fixed length)
mean loss, so the mean over equal micro-batches is the whole-batch loss. The
suite uses them in two forms: as modules, for `jaccum.nnx` and
`nnx.value_and_grad`, and as a pure function `loss(params, batch)` of the
module's state (`nnx.split` once, `nnx.merge` inside the trace), for
everything else. Sizes have a full and a `--quick` variant.

* **mlp**: the quickstart's MLP (64 → 256 → 256 → 10) on scikit-learn's 8x8
  digits, rows drawn with replacement up to the batch size.
* **cnn**: the Flax NNX MNIST tutorial's CNN (two 3x3 convolutions of 32 and
  64 channels, each followed by a 2x2 average pool, dense 256, dense 10) on
  random 28x28 images with random labels: the MNIST shape, without a download.
* **lm**: a 2-block (1 with `--quick`) pre-norm causal transformer (d=128,
  4 heads, MLP 4d) over bytes (vocabulary 256), trained on next-byte
  prediction over windows of 64 bytes of the Python documentation text that
  ships with Python (`pydoc_data.topics`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, sizes=(64, 256, 256, 10)):
    self.layers = nnx.List(
      [nnx.Linear(m, n, rngs=rngs) for m, n in itertools.pairwise(sizes)]
    )

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = jax.nn.relu(layer(x))
    return self.layers[-1](x)


class CNN(nnx.Module):
  """The CNN of Flax's NNX MNIST tutorial."""

  def __init__(self, rngs: nnx.Rngs, size: int = 28):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.linear1 = nnx.Linear((size // 4) ** 2 * 64, 256, rngs=rngs)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x):
    pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = pool(jax.nn.relu(self.conv1(x)))
    x = pool(jax.nn.relu(self.conv2(x)))
    x = x.reshape(x.shape[0], -1)
    return self.linear2(jax.nn.relu(self.linear1(x)))


class Block(nnx.Module):
  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
    self.heads = heads
    self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
    self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
    self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x):
    batch, length, dim = x.shape
    qkv = self.qkv(self.norm1(x)).reshape(batch, length, 3 * self.heads, -1)
    q, k, v = jnp.split(qkv, 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dim // self.heads)
    causal = jnp.tril(jnp.ones((length, length), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x + self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class LM(nnx.Module):
  """A small byte-level causal transformer language model."""

  def __init__(self, rngs: nnx.Rngs, dim=128, heads=4, depth=2, length=64):
    self.embed = nnx.Embed(256, dim, rngs=rngs)
    self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (length, dim)))
    self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(depth)])
    self.norm = nnx.RMSNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, 256, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.position[...][: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


def classification_loss(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def lm_loss(model, batch):
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def digits_batch(batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
  from sklearn.datasets import load_digits

  images, labels = load_digits(return_X_y=True)
  rows = np.random.default_rng(seed).integers(0, len(labels), batch_size)
  x = (images[rows] / 16.0).astype(np.float32)
  return {"x": x, "y": labels[rows].astype(np.int32)}


def image_batch(
  batch_size: int, seed: int = 0, size: int = 28
) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch_size, size, size, 1)).astype(np.float32)
  return {"x": x, "y": rng.integers(0, 10, batch_size).astype(np.int32)}


def text_batch(
  batch_size: int, seed: int = 0, length: int = 64
) -> dict[str, np.ndarray]:
  from pydoc_data.topics import topics

  text = np.frombuffer("".join(topics.values()).encode(), np.uint8)
  starts = np.random.default_rng(seed).integers(0, len(text) - length - 1, batch_size)
  windows = text[starts[:, None] + np.arange(length + 1)]
  return {"tokens": windows.astype(np.int32)}


class Spec(NamedTuple):
  """A model as the suite uses it.

  Attributes:
    make: `make(rngs) -> nnx.Module`.
    loss: `loss(model, batch) -> scalar`, a mean over the examples.
    batch: `batch(batch_size) -> dict of numpy arrays`.
    batch_size: the effective batch of a full run.
    quick_batch_size: of a `--quick` run.
    ks: the numbers of micro-batches of a full run.
    quick_ks: of a `--quick` run.
    description: one line for tables and plots.
    quick_options: keyword arguments of `make` in a `--quick` run.
    quick_methods: the methods a `--quick` run measures (None: all). CI's
      run takes every method through the MLP, and every model through the
      whole batch and jaccum: each piece of code runs once, in little time.
  """

  make: Callable[[nnx.Rngs], nnx.Module]
  loss: Callable[[Any, Any], jax.Array]
  batch: Callable[[int], dict[str, np.ndarray]]
  batch_size: int
  quick_batch_size: int
  ks: tuple[int, ...]
  quick_ks: tuple[int, ...]
  description: str
  quick_options: dict[str, Any] | None = None
  quick_methods: tuple[str, ...] | None = None


MODELS = {
  "mlp": Spec(
    MLP,
    classification_loss,
    digits_batch,
    2048,
    512,
    (1, 2, 4, 8, 16, 32, 64),
    (4,),
    "MLP 64-256-256-10 on 8x8 digits",
  ),
  "cnn": Spec(
    CNN,
    classification_loss,
    image_batch,
    128,
    32,
    (1, 2, 4, 8, 16, 32),
    (4,),
    "CNN conv32-conv64-dense256 on 28x28 images",
    quick_methods=("whole", "jaccum"),
  ),
  "lm": Spec(
    LM,
    lm_loss,
    text_batch,
    64,
    16,
    (1, 2, 4, 8, 16, 32),
    (4,),
    "transformer LM d=128, 64 bytes",
    {"depth": 1},
    ("whole", "jaccum"),
  ),
}


class Model(NamedTuple):
  """One model ready to train: its pieces in both forms, and one batch.

  Attributes:
    name: the key in `MODELS`.
    graphdef: the module's structure, for `nnx.merge`.
    params: the module's state (all `nnx.Param`), the pytree optimizers see.
    loss: the pure loss `loss(params, batch)`.
    module_loss: the loss of the module, `module_loss(model, batch)`.
    batch: one batch of the effective batch size, on the default device.
  """

  name: str
  graphdef: Any
  params: Any
  loss: Callable[[Any, Any], jax.Array]
  module_loss: Callable[[Any, Any], jax.Array]
  batch: dict[str, jax.Array]


def initial_params(shapes: Any, seed: int = 0) -> Any:
  """Params for the module's shapes, drawn with numpy: no JAX program to compile.

  Flax's initialisers would compile one program per initialiser op (or one
  large one), seconds of a `--quick` run on a small CPU. Weights are
  N(0, 1/fan_in) with fan_in all axes but the last, norm scales 1, biases 0:
  plain arrays, so that every method (and optax) sees the same pytree.
  """
  rng = np.random.default_rng(seed)

  def init(path, shape):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      value = np.ones(shape.shape)
    elif "bias" in name:
      value = np.zeros(shape.shape)
    else:
      fan_in = int(np.prod(shape.shape[:-1]))
      value = rng.standard_normal(shape.shape) / np.sqrt(fan_in)
    return jnp.asarray(value.astype(shape.dtype))

  return jax.tree_util.tree_map_with_path(init, shapes)


def build(name: str, quick: bool) -> Model:
  spec = MODELS[name]
  options = (spec.quick_options or {}) if quick else {}
  graphdef, shapes = nnx.split(
    nnx.eval_shape(lambda: spec.make(nnx.Rngs(0), **options))
  )
  params = initial_params(shapes)

  def loss(params, batch):
    return spec.loss(nnx.merge(graphdef, params), batch)

  batch_size = spec.quick_batch_size if quick else spec.batch_size
  batch = jax.tree.map(jnp.asarray, spec.batch(batch_size))
  return Model(name, graphdef, params, loss, spec.loss, batch)

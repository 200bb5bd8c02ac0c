"""`jaccum.dp_value_and_grad`: per-example clipping in the loop, noise once.

The reference (`reference`) does not call jaccum: `jax.vmap` of `jax.grad`
of the loss on one example (a batch of one row), each example's gradient
clipped to C in NumPy over all its leaves, the real ones summed, divided by
the rows given; the loss the mean over real examples. Both norm paths
(`"auto"`: ghost norms and per-example leaves; `"vmap"`) are compared with
it, in float64 to 1e-12 of each leaf's largest magnitude and in float32 to
1e-5, on an MLP, a CNN, a transformer LM (embedding, attention, layer norm,
tied output) and an NNX model, for K = 1, 4, 8, with masks and counts, on
one device and eight.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close

import jaccum
from jaccum._core import clipping, ghost

ROWS = 16
C = 0.5


# Models: `init(rng, dtype) -> params`, `loss(params, batch) -> [rows]`,
# `batch(rng, rows, dtype)`.


def mlp_init(rng, dtype):
  sizes = [(6, 16), (16, 16), (16, 3)]
  params = {}
  for i, (m, n) in enumerate(sizes):
    params[f"w{i}"] = rng.normal(size=(m, n)) / np.sqrt(m)
    params[f"b{i}"] = rng.normal(size=n) / 10
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def cross_entropy(logits, labels):
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]


def mlp_loss(params, batch):
  h = batch["x"]
  for i in range(2):
    h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
  return cross_entropy(h @ params["w2"] + params["b2"], batch["y"])


def mlp_batch(rng, rows, dtype):
  return {
    "x": jnp.asarray(rng.normal(size=(rows, 6)), dtype),
    "y": jnp.asarray(rng.integers(0, 3, rows), jnp.int32),
  }


def cnn_init(rng, dtype):
  params = {
    "k1": rng.normal(size=(3, 3, 1, 4)) / 3,
    "c1": rng.normal(size=4) / 10,
    "k2": rng.normal(size=(3, 3, 4, 6)) / 6,
    "c2": rng.normal(size=6) / 10,
    "w": rng.normal(size=(2 * 2 * 6, 3)) / 5,
    "b": np.zeros(3),
  }
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def cnn_loss(params, batch):
  conv = lambda x, k: jax.lax.conv_general_dilated(
    x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  pool = lambda x: (
    jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
  )
  h = pool(jax.nn.relu(conv(batch["x"], params["k1"]) + params["c1"]))
  h = jax.nn.relu(conv(h, params["k2"]) + params["c2"])
  h = pool(h).reshape(h.shape[0], -1)
  return cross_entropy(h @ params["w"] + params["b"], batch["y"])


def cnn_batch(rng, rows, dtype):
  return {
    "x": jnp.asarray(rng.normal(size=(rows, 8, 8, 1)), dtype),
    "y": jnp.asarray(rng.integers(0, 3, rows), jnp.int32),
  }


VOCAB, WIDTH, LENGTH, HEADS = 11, 8, 6, 2


def lm_init(rng, dtype):
  d = WIDTH
  params = {
    "embed": rng.normal(size=(VOCAB, d)),
    "position": rng.normal(size=(LENGTH, d)) / 10,
    "ln1": {"scale": 1 + rng.normal(size=d) / 10, "bias": rng.normal(size=d) / 10},
    "qkv": rng.normal(size=(d, 3 * d)) / np.sqrt(d),
    "out": rng.normal(size=(d, d)) / np.sqrt(d),
    "ln2": {"scale": 1 + rng.normal(size=d) / 10, "bias": rng.normal(size=d) / 10},
    "up": rng.normal(size=(d, 2 * d)) / np.sqrt(d),
    "up_bias": rng.normal(size=2 * d) / 10,
    "down": rng.normal(size=(2 * d, d)) / np.sqrt(2 * d),
    "ln_f": {"scale": 1 + rng.normal(size=d) / 10, "bias": rng.normal(size=d) / 10},
  }
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def layer_norm(x, p):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def lm_loss(params, batch):
  """A pre-norm transformer block, the output tied to the embedding."""
  tokens = batch["tokens"]
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  rows, length = inputs.shape
  x = params["embed"][inputs] + params["position"][:length]
  q, k, v = jnp.split(layer_norm(x, params["ln1"]) @ params["qkv"], 3, axis=-1)
  heads = lambda t: t.reshape(rows, length, HEADS, -1)
  scores = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / np.sqrt(WIDTH // HEADS)
  causal = jnp.tril(jnp.ones((length, length), bool))
  weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  attended = jnp.einsum("bhqk,bkhd->bqhd", weights, heads(v)).reshape(x.shape)
  x = x + attended @ params["out"]
  h = jax.nn.gelu(layer_norm(x, params["ln2"]) @ params["up"] + params["up_bias"])
  x = x + h @ params["down"]
  logits = layer_norm(x, params["ln_f"]) @ params["embed"].T
  return cross_entropy(logits, targets).mean(-1)


def lm_batch(rng, rows, dtype):
  del dtype
  return {"tokens": jnp.asarray(rng.integers(0, VOCAB, (rows, LENGTH + 1)), jnp.int32)}


MODELS = {
  "mlp": (mlp_init, mlp_loss, mlp_batch),
  "cnn": (cnn_init, cnn_loss, cnn_batch),
  "lm": (lm_init, lm_loss, lm_batch),
}


def setup(name, dtype=jnp.float64, rows=ROWS, seed=0):
  init, loss, make_batch = MODELS[name]
  rng = np.random.default_rng(seed)
  return loss, init(rng, dtype), make_batch(rng, rows, dtype)


def reference(loss, params, batch, mask=None, clip=C, normalize_by=None):
  """`(loss, grads, norms)` of DP-SGD without noise, in float64, without jaccum."""
  rows = jax.tree.leaves(batch)[0].shape[0]
  mask = np.ones(rows, bool) if mask is None else np.asarray(mask, bool)

  def one(params, example):
    return loss(params, jax.tree.map(lambda x: x[None], example))[0]

  losses, per_example = jax.vmap(jax.value_and_grad(one), (None, 0))(params, batch)
  per_example = jax.tree.map(lambda g: np.asarray(g, np.float64), per_example)
  norms = np.sqrt(
    sum(np.sum(g.reshape(rows, -1) ** 2, 1) for g in jax.tree.leaves(per_example))
  )
  factor = np.where(mask, np.minimum(1, clip / np.maximum(norms, 1e-300)), 0)
  normalize_by = rows if normalize_by is None else normalize_by
  grads = jax.tree.map(lambda g: np.tensordot(factor, g, 1) / normalize_by, per_example)
  real = np.asarray(losses, np.float64)[mask]
  mean = real.mean() if real.size else 0.0
  return mean, grads, np.where(mask, norms, 0)


def check(out, expected, rtol):
  loss, grads, norms = out
  want_loss, want_grads, want_norms = expected
  np.testing.assert_allclose(float(loss), want_loss, rtol=rtol, atol=rtol)
  grads = jax.tree.map(lambda g: np.asarray(g, np.float64), grads)
  assert_trees_close(grads, want_grads, rtol)
  np.testing.assert_allclose(norms, want_norms, rtol=rtol, atol=rtol * want_norms.max())


def private(loss, k, **options):
  options = {"l2_clip_norm": C, "noise_multiplier": 0.0, **options}
  return jax.jit(jaccum.dp_value_and_grad(loss, k, return_norms=True, **options))


def some_mask(rows=ROWS, seed=1):
  mask = np.random.default_rng(seed).random(rows) < 0.7
  mask[0] = False  # a padding row among the first micro-batch's
  return mask


CASES = [(n, "auto", k) for n in MODELS for k in (1, 4, 8)]
CASES += [(n, "vmap", 4) for n in MODELS]


@pytest.mark.parametrize(("name", "norms", "num_microbatches"), CASES)
def test_float64_matches_reference(name, norms, num_microbatches):
  with jax.enable_x64(True):
    loss, params, batch = setup(name)
    mask = some_mask()
    step = private(loss, num_microbatches, norms=norms)
    out = step(params, batch, example_mask=mask)
    check(out, reference(loss, params, batch, mask), 1e-12)


@pytest.mark.parametrize("name", list(MODELS))
def test_float32_matches_float64_reference(name):
  loss, params, batch = setup(name, jnp.float32)
  mask = some_mask()
  out = private(loss, 4)(params, batch, example_mask=mask)
  assert (
    out[1]["b0" if name == "mlp" else "position" if name == "lm" else "b"].dtype
    == jnp.float32
  )
  with jax.enable_x64(True):
    as64 = lambda tree: jax.tree.map(
      lambda x: (
        jnp.asarray(x, jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x
      ),
      tree,
    )
    expected = reference(loss, as64(params), as64(batch), mask)
  check(out, expected, 1e-5)


# Which leaves take the ghost path (their norms from activations and
# cotangents), and which form their per-example gradients.
PATHS = {
  "mlp": {
    "['w0']": "ghost dot_general (gram)",
    "['w1']": "ghost dot_general (gram)",
    "['w2']": "ghost dot_general (gram)",
    "['b0']": "per-example",
    "['b1']": "per-example",
    "['b2']": "per-example",
  },
  "cnn": {
    "['k1']": "ghost conv (outer)",
    "['k2']": "ghost conv (outer)",
    "['w']": "ghost dot_general (gram)",
    "['c1']": "per-example",
    "['c2']": "per-example",
    "['b']": "per-example",
  },
  "lm": {
    # The tied embedding reaches the loss twice (gather and output matmul).
    "['embed']": "per-example",
    "['position']": "per-example",
    "['qkv']": "ghost dot_general (outer)",
    "['out']": "ghost dot_general (outer)",
    "['up']": "ghost dot_general (outer)",
    "['down']": "ghost dot_general (outer)",
    "['up_bias']": "per-example",
    **{
      f"['{n}']['{p}']": "per-example"
      for n in ("ln1", "ln2", "ln_f")
      for p in ("scale", "bias")
    },
  },
}


def describe(loss, params, batch):
  names = [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  one = clipping.one_example(loss, clipping.Layout((1,), None), [params, batch], {})
  _, analysis = ghost.trace(one, params, (batch,), None)
  return analysis.describe(names)


@pytest.mark.parametrize("name", list(MODELS))
def test_which_uses_take_the_ghost_path(name):
  loss, params, batch = setup(name, jnp.float32)
  assert describe(loss, params, batch) == dict(sorted(PATHS[name].items()))

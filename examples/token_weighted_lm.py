"""Token-weighted accumulation: a small NNX transformer LM on Python's own docs.

Paragraphs of English text from `pydoc_data.topics` (it ships with CPython)
become byte sequences of different lengths, padded to one length. The loss is
the mean over the real (unpadded) tokens. The same model, from the same start
and on the same batches of 16 paragraphs, is trained three ways:

- whole batch: `nnx.value_and_grad` on all 16 sequences at once;
- exact: `jaccum.nnx.value_and_grad` with K=16 micro-batches of one sequence
  (per-device batch 1, as in LLM fine-tuning) and `weight_fn` returning each
  micro-batch's number of real tokens;
- naive: the same K=16 micro-batches averaged equally (the mean of
  per-micro-batch means, what many trainers did), which gives every token of
  a short paragraph more say than a token of a long one.

The exact curve lies on the whole-batch curve; the naive one drifts from it,
and the loss it reports for itself is further off still.

  python examples/token_weighted_lm.py [--quick] [--steps N] [--out PATH.png]
"""

from __future__ import annotations

import argparse
import pathlib
import re
from pydoc_data.topics import topics  # CPython's own help text, ~460 KB.

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import jaccum.nnx

BATCH_SIZE = 16
NUM_MICROBATCHES = 16
SEQ_LEN = 96  # Tokens (bytes) per padded sequence; 0 is the padding byte.


def load_paragraphs() -> tuple[np.ndarray, np.ndarray]:
  """Returns `(tokens [P, SEQ_LEN + 1], lengths [P])`, one paragraph per row."""
  text = "\n\n".join(topics[name] for name in sorted(topics))
  paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
  encoded = [p.encode()[: SEQ_LEN + 1] for p in paragraphs if len(p) >= 8]
  tokens = np.zeros((len(encoded), SEQ_LEN + 1), np.int32)
  for row, data in enumerate(encoded):
    tokens[row, : len(data)] = np.frombuffer(data, np.uint8)
  return tokens, np.array([len(data) for data in encoded])


class Block(nnx.Module):
  def __init__(self, dim: int, num_heads: int, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.attn_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
    self.attn_out = nnx.Linear(dim, dim, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, dim = x.shape
    qkv = self.qkv(self.attn_norm(x)).reshape(batch, length, 3 * self.num_heads, -1)
    q, k, v = jnp.split(qkv, 3, axis=2)
    # Causal is enough: padding sits at the end, so real tokens never see it.
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + self.attn_out(attn.reshape(batch, length, dim))
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class TinyLM(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, dim: int = 64, num_heads: int = 4, depth: int = 2):
    self.embed = nnx.Embed(256, dim, rngs=rngs)
    self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ_LEN, dim)))
    self.blocks = nnx.List([Block(dim, num_heads, rngs) for _ in range(depth)])
    self.norm = nnx.LayerNorm(dim, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.position[...]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.norm(x))  # Output weights tied to the input's.


def loss_fn(model, inputs, targets, mask):
  """Mean over the real tokens; aux holds the sums that make it exact anywhere."""
  losses = optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets)
  total, count = jnp.sum(losses * mask), jnp.sum(mask)
  return total / jnp.maximum(count, 1.0), (total, count)


def count_tokens(inputs, targets, mask):
  return mask.sum()


# value_and_grad returns ((loss, (total, count)), grads); the sums are summed.
REDUCE = (("mean", ("sum", "sum")), "mean")
METHODS = {
  "whole batch": nnx.value_and_grad(loss_fn, has_aux=True),
  "exact (weight_fn)": jaccum.nnx.value_and_grad(
    loss_fn, NUM_MICROBATCHES, has_aux=True, reduce=REDUCE, weight_fn=count_tokens
  ),
  "naive (mean of means)": jaccum.nnx.value_and_grad(
    loss_fn, NUM_MICROBATCHES, has_aux=True, reduce=REDUCE
  ),
}


def train(value_and_grad, batches, desc: str) -> np.ndarray:
  """Returns `[steps, 2]`: the loss the method reports, and the true loss."""
  model = TinyLM(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, inputs, targets, mask):
    (reported, (total, count)), grads = value_and_grad(model, inputs, targets, mask)
    optimizer.update(model, grads)
    # The true whole-batch per-token loss, measured the same way for all.
    return jnp.stack([reported, total / count])

  return np.stack(
    [np.asarray(train_step(model, optimizer, *batch)) for batch in tqdm(batches, desc)]
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few steps, for CI")
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--out", default="examples/out/token_weighted_lm.png")
  args = parser.parse_args()
  num_steps = args.steps or (10 if args.quick else 150)

  tokens, lengths = load_paragraphs()
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(num_steps):
    rows = rng.choice(len(tokens), BATCH_SIZE, replace=False)
    mask = np.arange(SEQ_LEN) < lengths[rows, None] - 1  # Real next-byte targets.
    batches.append((tokens[rows, :-1], tokens[rows, 1:], mask.astype(np.float32)))
  micro_tokens = np.concatenate(
    [m.sum(1).reshape(-1, NUM_MICROBATCHES).sum(0) for *_, m in batches]
  )
  print(
    f"{len(tokens)} paragraphs, {lengths.sum() / 1e3:.0f}k bytes; real tokens per "
    f"micro-batch: min {micro_tokens.min():.0f}, median {np.median(micro_tokens):.0f},"
    f" max {micro_tokens.max():.0f}"
  )

  runs = {name: train(fn, batches, name) for name, fn in METHODS.items()}
  whole = runs["whole batch"][:, 1]
  exact, naive = runs["exact (weight_fn)"], runs["naive (mean of means)"]
  print(f"whole-batch loss: first {whole[0]:.3f}, last {whole[-1]:.3f} nats/token")
  print(f"max |exact - whole batch| = {np.abs(exact[:, 1] - whole).max():.2e}")
  print(
    f"max |naive - whole batch| = {np.abs(naive[:, 1] - whole).max():.2e} "
    f"(mean {np.mean(naive[:, 1] - whole):+.3f}); the loss naive reports for "
    f"itself is off by up to {np.abs(naive[:, 0] - whole).max():.2e}"
  )

  steps = np.arange(num_steps)
  fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(11, 4))
  ax_loss.plot(steps, whole, "k-", lw=1.2, label="whole batch")
  ax_loss.plot(steps, exact[:, 1], "C0--", lw=1.2, label="exact (weight_fn)")
  ax_loss.plot(steps, naive[:, 1], "C3-", lw=1, label="naive (mean of means)")
  ax_loss.plot(steps, naive[:, 0], "C3:", lw=1, label="naive, as it reports itself")
  ax_loss.set(xlabel="step", ylabel="per-token loss (nats)", title="training loss")
  ax_loss.legend()
  window = max(1, num_steps // 15)
  smooth = lambda x: np.convolve(x, np.ones(window) / window, mode="valid")
  ax_gap.axhline(0, color="k", lw=0.8)
  ax_gap.plot(steps, exact[:, 1] - whole, "C0", lw=1.5, label="exact")
  ax_gap.plot(steps, naive[:, 1] - whole, "C3", lw=0.6, alpha=0.4)
  ax_gap.plot(
    steps[window - 1 :],
    smooth(naive[:, 1] - whole),
    "C3",
    lw=2,
    label=f"naive ({window}-step mean)",
  )
  ax_gap.set(
    xlabel="step", ylabel="loss - whole-batch loss", title="difference from whole batch"
  )
  ax_gap.legend()
  fig.suptitle(
    f"batches of {BATCH_SIZE} padded paragraphs, accumulated over "
    f"K={NUM_MICROBATCHES} micro-batches of {BATCH_SIZE // NUM_MICROBATCHES}"
  )
  fig.tight_layout()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  print(f"saved {out}")


if __name__ == "__main__":
  main()

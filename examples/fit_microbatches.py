"""Choose K from a memory budget before running: `jaccum.fit_train_step`.

For two models, the digits CNN of `nnx_digits.py` (BatchNorm, Dropout) and
the small transformer LM of `token_weighted_lm.py` (token-weighted loss),
this compiles the whole train step (gradients over K micro-batches, the Adam
update, the donated model and optimizer state) for a few K, reads XLA's
memory figures, and picks the smallest K whose step fits the budget. It
compiles on abstract arguments and runs nothing; then it trains one step with
the K it chose, to show that step runs: `make_step` is cached, so that step
is the one already compiled. On a GPU it also compares the
predicted peak with the device's `peak_bytes_in_use`.

  python examples/fit_microbatches.py --budget 8MiB [--quick]
  python examples/fit_microbatches.py --budget 0.5   # half the GPU's memory
"""

from __future__ import annotations

import argparse
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from nnx_digits import CNN
from nnx_digits import loss_fn as cnn_loss
from sklearn.datasets import load_digits
from token_weighted_lm import REDUCE, TinyLM, count_tokens, load_paragraphs
from token_weighted_lm import loss_fn as lm_loss

import jaccum
import jaccum.nnx

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(text: str) -> int | float:
  """`"8MiB"`, `"3e6"` or `"8000000"` are bytes; `"0.5"` is half the device."""
  match = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-zA-Z]*)\s*", text)
  if match is None or match.group(2).lower() not in _UNITS:
    raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8MiB or 0.5")
  value = float(match.group(1))
  if not match.group(2) and 0 < value <= 1:
    return value  # A fraction of the device's memory.
  return int(value * _UNITS[match.group(2).lower()])


def make_train_step(graphdef, value_and_grad):
  """A jitted Adam step on the (model, optimizer) state, which it donates."""

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(state, *batch):
    model, optimizer = nnx.merge(graphdef, state)
    out, grads = value_and_grad(model, *batch)
    optimizer.update(model, grads)
    loss = out[0] if isinstance(out, tuple) else out
    return nnx.state((model, optimizer)), loss

  return train_step


def digits_cnn(batch_size: int):
  """The CNN, its batch, and `make_step(K)` for it."""
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1]
  rows = np.random.default_rng(0).choice(len(images), batch_size, replace=False)
  batch = (images[rows], digits.target[rows].astype(np.int32))
  model = CNN(nnx.Rngs(0))
  graphdef, state = nnx.split(
    (model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param))
  )
  # Cached: the step for the chosen K is then the one the fit compiled, and
  # running it compiles nothing again.
  make_step = functools.cache(
    lambda k: make_train_step(graphdef, jaccum.nnx.value_and_grad(cnn_loss, k))
  )
  return state, batch, make_step


def transformer_lm(batch_size: int):
  """The LM, a batch of padded paragraphs, and `make_step(K)` for it."""
  tokens, lengths = load_paragraphs()
  rows = np.random.default_rng(0).choice(len(tokens), batch_size, replace=False)
  mask = np.arange(tokens.shape[1] - 1) < lengths[rows, None] - 1
  batch = (tokens[rows, :-1], tokens[rows, 1:], mask.astype(np.float32))
  model = TinyLM(nnx.Rngs(0))
  graphdef, state = nnx.split(
    (model, nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param))
  )
  make_step = functools.cache(
    lambda k: make_train_step(
      graphdef,
      jaccum.nnx.value_and_grad(
        lm_loss, k, has_aux=True, reduce=REDUCE, weight_fn=count_tokens
      ),
    )
  )
  return state, batch, make_step


def abstract(tree):
  """The shapes and dtypes of `tree`: enough to compile, nothing allocated."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), tree)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--budget",
    type=parse_budget,
    default="8MiB",
    help="memory per device: bytes (8MiB, 3e6) or a fraction of the GPU's (0.5)",
  )
  parser.add_argument(
    "--quick", action="store_true", help="smaller batches, three candidate K, for CI"
  )
  args = parser.parse_args()
  scale = 4 if args.quick else 1
  # Every K costs one compilation; by default the candidates are every divisor
  # of the batch size, of which the search compiles O(log n).
  candidates = [1, 4, 16] if args.quick else None
  models = {
    f"digits CNN, batch {1024 // scale}": digits_cnn(1024 // scale),
    f"transformer LM, batch {64 // scale}": transformer_lm(64 // scale),
  }
  print(f"{jax.devices()[0].device_kind}, {jax.default_backend()} backend")
  for name, (state, batch, make_step) in models.items():
    try:
      fit = jaccum.fit_train_step(
        make_step,
        *abstract((state, *batch)),
        memory_budget=args.budget,
        batch_size=len(batch[0]),
        candidates=candidates,
      )
    except ValueError as error:
      print(f"\n{name}: {error}")
      continue
    print(f"\n{name}: whole train step, {len(fit.tried)} compilations\n{fit}")

    device = jax.devices()[0]
    # The batch on the device before measuring; uncommitted, like the fit's
    # abstract batch, so the call below reuses the fit's compilation.
    batch = jax.device_put(batch)
    before = device.memory_stats() or {}
    state, loss = make_step(fit.num_microbatches)(state, *batch)
    print(f"one step with K={fit.num_microbatches}: loss {float(loss):.4f}")
    if jax.default_backend() == "gpu" and "peak_bytes_in_use" in before:
      # The device's peak is a high-water mark over the whole process; buffers
      # that live beside the step (not its arguments) add to it.
      after = device.memory_stats()
      others = before["bytes_in_use"] - fit.stats[fit.num_microbatches].argument_bytes
      measured = after["peak_bytes_in_use"] - max(others, 0)
      masked = after["peak_bytes_in_use"] <= before["peak_bytes_in_use"]
      print(
        f"GPU: predicted peak {fit.peak_bytes / 2**20:.2f} MiB, measured "
        f"{measured / 2**20:.2f} MiB (peak_bytes_in_use "
        f"{after['peak_bytes_in_use'] / 2**20:.2f} MiB, minus "
        f"{max(others, 0) / 2**20:.2f} MiB held outside the step)"
        + (" - masked by an earlier, higher peak" if masked else "")
      )


if __name__ == "__main__":
  main()

"""Benchmark: `jaccum.accumulate_coupled` against the whole batch and a GradCache loop.

A CLIP loss over two activation-dominated towers: each row is a sequence of
tokens (image patches, text bytes), each tower a stack of per-token
residual MLP blocks and a mean over the tokens, so the activations grow
with rows × tokens × width while the params stay width² (the B × B logits
are small beside them). For K micro-batches, on one device:

* temporaries (XLA's, from the compiled step: `jaccum.inspect.memory`);
* step time, in interleaved rounds, as a paired ratio to the whole batch's;

for three ways to the same loss and gradient (each checked against the
whole batch before it is timed):

* the whole batch: `jax.jit(jax.value_and_grad(loss))`;
* `jaccum.accumulate_coupled(encode, clip_loss, K)`;
* GradCache by hand, as its JAX port writes it: the batch reshaped into
  `[K, rows, ...]` chunks, a `lax.scan` of the encoder for the reps, the
  loss's gradient for them, and a `lax.scan` of `grad(sum(encode(p, chunk)
  × cached gradient))` adding the chunks' gradients in the params' dtype.

Targets (issue 30): at K = 8, temporaries ≤ 0.4× and step time ≤ 1.4× the
whole batch's.

    python -m benchmarks.coupled          # K = 2 … 64, minutes on 2 cores
    python -m benchmarks.coupled --quick  # a smaller model, K = 2 and 8, for CI

Writes `benchmarks/results/coupled.json` and `coupled.md` (`results/quick/`
with `--quick`), or with `--out PATH` only the record, as JSON. The suite's
`coupled` part (`python -m benchmarks --parts coupled`) calls `run` in its
own process (one device).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaccum
import jaccum.inspect

GOAL_TEMP = 0.4
GOAL_TIME = 1.4
TARGET_K = 8
TOLERANCE = 1e-4  # each method's gradient against the whole batch's, relative


class Size(NamedTuple):
  batch: int
  tokens: int
  width: int
  blocks: int
  embed: int


FULL = Size(batch=256, tokens=16, width=256, blocks=4, embed=128)
QUICK = Size(batch=128, tokens=8, width=128, blocks=2, embed=64)


def init_params(size: Size, key: jax.Array) -> dict[str, Any]:
  keys = iter(jax.random.split(key, 4 * size.blocks + 4))

  def dense(fan_in, fan_out):
    return jax.random.normal(next(keys), (fan_in, fan_out)) / np.sqrt(fan_in)

  def tower():
    return {
      "blocks": [
        {
          "w_in": dense(size.width, 2 * size.width),
          "w_out": dense(2 * size.width, size.width),
        }
        for _ in range(size.blocks)
      ],
      "head": dense(size.width, size.embed),
    }

  return {"image": tower(), "text": tower(), "log_temp": jnp.float32(np.log(10.0))}


def tower(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
  """Residual per-token MLP blocks, then the mean over the tokens."""
  h = tokens
  for block in params["blocks"]:
    h = h + jax.nn.gelu(h @ block["w_in"]) @ block["w_out"]
  return jnp.mean(h, axis=1) @ params["head"]


def encode(params: dict[str, Any], batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  return {
    "image": tower(params["image"], batch["image"]),
    "text": tower(params["text"], batch["text"]),
  }


def clip_loss(params: dict[str, Any], reps: dict[str, jax.Array]) -> jax.Array:
  image = reps["image"] / jnp.linalg.norm(reps["image"], axis=-1, keepdims=True)
  text = reps["text"] / jnp.linalg.norm(reps["text"], axis=-1, keepdims=True)
  logits = jnp.exp(params["log_temp"]) * image @ text.T
  labels = jnp.arange(logits.shape[0])
  ce = optax.softmax_cross_entropy_with_integer_labels
  return (ce(logits, labels).mean() + ce(logits.T, labels).mean()) / 2


def whole_batch(params, batch):
  return jax.value_and_grad(lambda p, b: clip_loss(p, encode(p, b)))(params, batch)


def grad_cache(num_microbatches: int):
  """GradCache written by hand in JAX: chunked scans, gradients summed as they come."""

  def step(params, batch):
    chunks = jax.tree.map(
      lambda x: x.reshape(num_microbatches, -1, *x.shape[1:]), batch
    )
    _, reps = jax.lax.scan(lambda c, chunk: (c, encode(params, chunk)), None, chunks)
    reps = jax.tree.map(lambda r: r.reshape(-1, *r.shape[2:]), reps)
    loss, (direct, cache) = jax.value_and_grad(clip_loss, argnums=(0, 1))(params, reps)
    cache = jax.tree.map(lambda c: c.reshape(num_microbatches, -1, *c.shape[1:]), cache)

    def chunk_grad(acc, chunk_and_cache):
      chunk, cached = chunk_and_cache
      surrogate = lambda p: sum(
        jnp.sum(r * c)
        for r, c in zip(
          jax.tree.leaves(encode(p, chunk)), jax.tree.leaves(cached), strict=True
        )
      )
      return jax.tree.map(jnp.add, acc, jax.grad(surrogate)(params)), None

    grads, _ = jax.lax.scan(chunk_grad, direct, (chunks, cache))
    return loss, grads

  return step


def methods(ks: tuple[int, ...]) -> dict[str, Any]:
  out = {"whole batch": whole_batch}
  for k in ks:
    out[f"coupled K={k}"] = jaccum.accumulate_coupled(encode, clip_loss, k)
    out[f"gradcache K={k}"] = grad_cache(k)
  return out


def make_batch(size: Size, key: jax.Array) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(key)
  shape = (size.batch, size.tokens, size.width)
  return {"image": jax.random.normal(k1, shape), "text": jax.random.normal(k2, shape)}


def run(quick: bool, rounds: int | None = None) -> dict[str, Any]:
  from benchmarks import _measure

  size = QUICK if quick else FULL
  ks = (2, TARGET_K) if quick else (2, 4, 8, 16, 32, 64)
  rounds = rounds or (2 if quick else 10)
  params = init_params(size, jax.random.key(0))
  batch = make_batch(size, jax.random.key(1))
  steps = {name: jax.jit(fn) for name, fn in methods(ks).items()}
  if quick:
    _measure.precompile([(step, (params, batch)) for step in steps.values()])
  reference = jax.device_get(steps["whole batch"](params, batch))
  rows = {}
  for name, step in steps.items():
    stats = jaccum.inspect.memory(step, params, batch)
    error = _measure.relative_difference(jax.device_get(step(params, batch)), reference)
    assert error < TOLERANCE, (name, error)
    rows[name] = {"temp_bytes": stats.temp_bytes, "max_rel_error": error}
    print(f"{name:<16} compiled, checked: error {error:.1e}", flush=True)
  times = _measure.interleaved(
    {name: lambda step=step: step(params, batch) for name, step in steps.items()},
    rounds,
  )
  whole = rows["whole batch"]
  for name, row in rows.items():
    row["step_s"] = float(np.median(times[name]))
    row["step_s_rounds"] = times[name].tolist()
    row["temp_ratio"] = row["temp_bytes"] / whole["temp_bytes"]
    row["time_ratio"] = _measure.paired_ratio(times, name, "whole batch")
    print(
      f"{name:<16} temporaries {row['temp_bytes'] / 2**20:8.2f} MiB "
      f"({row['temp_ratio']:.2f}×)  step {row['step_s'] * 1e3:8.1f} ms "
      f"({row['time_ratio']:.2f}×)  error {row['max_rel_error']:.1e}",
      flush=True,
    )
  return {
    "size": size._asdict(),
    "ks": list(ks),
    "rounds": rounds,
    "goals": {"temp_ratio": GOAL_TEMP, "time_ratio": GOAL_TIME, "k": TARGET_K},
    "param_bytes": _measure.nbytes(params),
    "rows": rows,
  }


def main() -> None:
  from benchmarks import _record

  _record.standalone(
    "coupled", __doc__, run, lambda: _record.section("coupled"),
    "small model, K = 2 and 8",
  )  # fmt: skip


if __name__ == "__main__":
  main()

"""Benchmark: whole-batch gradients vs `jaccum.accumulate` vs `optax.microbatch`.

For an MLP and a small transformer block, and K in {1, 2, 4, 8, 16, 32}
micro-batches, it compiles the three ways of computing `value_and_grad` of a
per-example-mean loss on one batch and reports

* the median step time (the three variants alternate within every round, so
  background load hits them alike), and
* XLA's temporary memory (`compiled.memory_analysis().temp_size_in_bytes`),
  next to the bounds accumulation should meet. "strict": the temporaries of
  one micro-batch step plus one accumulator. "bound": that, plus what a loop
  must also hold as temporaries: the micro-step's gradients and its
  micro-batch, sliced out of the batch (an XLA slice is a copy, not a view).

"K×micro" is K times the time of one micro-batch step on its own: the work of
the loop without the loop, to tell loop overhead from the cost of small
micro-batches.

All three compute the same numbers (checked before timing). Only the gradient
computation is timed: the optimizer update after it is the same for all three.

    python benchmarks/core.py            # 3-5 minutes on 2 CPU cores
    python benchmarks/core.py --quick    # K in {1, 4, 32}, fewer rounds

The table is printed and saved as JSON under benchmarks/results/.
"""

import argparse
import functools
import os
import pathlib
import time

import _record
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import microbatching

import jaccum

# --- models: per-example-mean losses, plain JAX ------------------------------


def init_mlp(key, width=256, depth=3, classes=10):
  keys = jax.random.split(key, depth + 1)
  sizes = [width] * (depth + 1) + [classes]
  return [
    {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
    for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def mlp_loss(params, batch):
  x = batch["x"]
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  logits = x @ params[-1]["w"] + params[-1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def mlp_batch(key, batch_size, width=256, classes=10):
  kx, ky = jax.random.split(key)
  return {
    "x": jax.random.normal(kx, (batch_size, width)),
    "y": jax.random.randint(ky, (batch_size,), 0, classes),
  }


HEADS = 4


def init_block(key, dim=128, classes=10):
  """A pre-norm transformer block (causal attention + MLP) and a linear head."""
  k = jax.random.split(key, 5)
  dense = lambda key, m, n: jax.random.normal(key, (m, n)) / np.sqrt(m)
  return {
    "qkv": dense(k[0], dim, 3 * dim),
    "out": dense(k[1], dim, dim),
    "up": dense(k[2], dim, 4 * dim),
    "down": dense(k[3], 4 * dim, dim),
    "head": dense(k[4], dim, classes),
    "norm1": jnp.ones(dim),
    "norm2": jnp.ones(dim),
  }


def block_loss(params, batch):
  x = batch["x"]  # [B, L, D], e.g. patch or token embeddings
  batch_size, length, dim = x.shape
  norm = lambda x, scale: (
    scale * x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)
  )
  qkv = norm(x, params["norm1"]) @ params["qkv"]
  q, k, v = jnp.split(qkv.reshape(batch_size, length, 3 * HEADS, -1), 3, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dim // HEADS)
  causal = jnp.tril(jnp.ones((length, length), bool))
  weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)
  x = x + attended @ params["out"]
  x = x + jax.nn.gelu(norm(x, params["norm2"]) @ params["up"]) @ params["down"]
  logits = x.mean(1) @ params["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def block_batch(key, batch_size, length=64, dim=128, classes=10):
  kx, ky = jax.random.split(key)
  return {
    "x": jax.random.normal(kx, (batch_size, length, dim)),
    "y": jax.random.randint(ky, (batch_size,), 0, classes),
  }


MODELS = {
  # name: (init, loss, make_batch, batch size)
  "mlp": (init_mlp, mlp_loss, mlp_batch, 4096),
  "transformer": (init_block, block_loss, block_batch, 32),
}


# --- measuring ---------------------------------------------------------------


def nbytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def max_difference(a, b):
  return max(
    float(jnp.max(jnp.abs(x - y)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def time_interleaved(calls, rounds):
  """Seconds of each `fn(*args)` in `calls`, one array entry per round.

  Every round runs each call once, in a rotated order, so that a burst of
  background load lands on all of them; ratios are then taken per round.
  """
  for fn, args in calls.values():
    for _ in range(2):  # warm-up
      jax.block_until_ready(fn(*args))
  times = {name: [] for name in calls}
  names = list(calls)
  for round_index in range(rounds):
    shift = round_index % len(names)
    for name in names[shift:] + names[:shift]:
      fn, args = calls[name]
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {name: np.array(t) for name, t in times.items()}


@functools.cache
def setup(model):
  """Params, a batch and the compiled whole-batch step, shared across K."""
  init, loss, make_batch, batch_size = MODELS[model]
  params = init(jax.random.key(0))
  batch = make_batch(jax.random.key(1), batch_size)
  whole = jax.jit(jax.value_and_grad(loss)).lower(params, batch).compile()
  return params, batch, whole


def measure(model, num_microbatches, rounds):
  _, loss, _, batch_size = MODELS[model]
  params, batch, whole = setup(model)
  grad_fn = jax.value_and_grad(loss)
  accumulated = {
    "jaccum": jaccum.accumulate(grad_fn, num_microbatches),
    "optax": microbatching.microbatch(
      grad_fn,
      argnums=1,
      microbatch_size=batch_size // num_microbatches,
      accumulator=microbatching.AccumulationType.MEAN,
    ),
  }
  compiled = {"whole": whole} | {
    name: jax.jit(fn).lower(params, batch).compile() for name, fn in accumulated.items()
  }
  temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in compiled.items()}

  # All three must agree before their speed means anything.
  expected = whole(params, batch)
  for name in accumulated:
    difference = max_difference(compiled[name](params, batch), expected)
    assert difference < 1e-4, (
      f"{model} K={num_microbatches}: {name} off by {difference}"
    )

  # One micro-batch's step on its own. K of them is the loop's work without
  # the loop. Its temporaries plus one accumulator is the strict memory bound;
  # inside a loop its gradients and its micro-batch (sliced out of the batch:
  # an XLA slice is a copy, not a view) are temporaries too: the full bound.
  microbatch = jax.tree.map(lambda x: x[: batch_size // num_microbatches], batch)
  micro = jax.jit(grad_fn).lower(params, microbatch).compile()
  micro_memory = micro.memory_analysis()
  accumulator = nbytes(jax.eval_shape(grad_fn, params, batch))
  strict = micro_memory.temp_size_in_bytes + accumulator
  bound = strict + micro_memory.output_size_in_bytes + nbytes(microbatch)

  calls = {name: (c, (params, batch)) for name, c in compiled.items()}
  calls["micro"] = (micro, (params, microbatch))
  times = time_interleaved(calls, rounds)
  times["k_micro"] = num_microbatches * times.pop("micro")
  ratio = lambda a, b: float(np.median(times[a] / times[b]))  # paired by round
  return {
    "model": model,
    "num_microbatches": num_microbatches,
    "batch_size": batch_size,
    "param_bytes": nbytes(params),
    "batch_bytes": nbytes(batch),
    "seconds": {name: float(np.median(t)) for name, t in times.items()},
    "seconds_min": {name: float(np.min(t)) for name, t in times.items()},
    "time_ratios": {
      "jaccum/whole": ratio("jaccum", "whole"),
      "jaccum/optax": ratio("jaccum", "optax"),
      "jaccum/k_micro": ratio("jaccum", "k_micro"),
    },
    "temp_bytes": temp,
    "micro_step_temp_bytes": micro_memory.temp_size_in_bytes,
    "micro_step_output_bytes": micro_memory.output_size_in_bytes,
    "microbatch_bytes": nbytes(microbatch),
    "accumulator_bytes": accumulator,
    "strict_bound_bytes": strict,
    "bound_bytes": bound,
    "memory_ratios": {
      "jaccum/optax": temp["jaccum"] / temp["optax"],
      "jaccum/strict": temp["jaccum"] / strict,
      "jaccum/bound": temp["jaccum"] / bound,
    },
  }


# --- reporting -----------------------------------------------------------------


def table(results):
  """A text table; ratios of times are medians of per-round ratios."""
  mib = 2**20
  header = (
    f"{'model':12}{'K':>3} |{'whole':>7}{'jaccum':>7}{'optax':>7}{'K×micro':>8} ms"
    f"{'j/whole':>8}{'j/optax':>8}{'j/Kμ':>6} |{'whole':>7}{'jaccum':>7}"
    f"{'optax':>7}{'strict':>7}{'bound':>7} MiB{'j/optax':>8}{'j/strict':>9}"
    f"{'j/bound':>8}"
  )
  lines = [header, "-" * len(header)]
  for r in results:
    s, t, tr, mr = r["seconds"], r["temp_bytes"], r["time_ratios"], r["memory_ratios"]
    lines.append(
      f"{r['model']:12}{r['num_microbatches']:>3} |"
      + "".join(f"{s[n] * 1e3:>7.1f}" for n in ("whole", "jaccum", "optax"))
      + f"{s['k_micro'] * 1e3:>8.1f}   "
      + f"{tr['jaccum/whole']:>8.2f}{tr['jaccum/optax']:>8.2f}"
      + f"{tr['jaccum/k_micro']:>6.2f} |"
      + "".join(f"{t[n] / mib:>7.2f}" for n in ("whole", "jaccum", "optax"))
      + f"{r['strict_bound_bytes'] / mib:>7.2f}{r['bound_bytes'] / mib:>7.2f}    "
      + f"{mr['jaccum/optax']:>8.2f}{mr['jaccum/strict']:>9.2f}"
      + f"{mr['jaccum/bound']:>8.2f}"
    )
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="K in {1, 4, 32}")
  parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
  parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path")
  args = parser.parse_args()
  ks = (1, 4, 32) if args.quick else (1, 2, 4, 8, 16, 32)
  rounds = args.rounds or (10 if args.quick else 25)

  results = []
  print(table([]))
  start, load_before = time.perf_counter(), os.getloadavg()
  for model in MODELS:
    for num_microbatches in ks:
      results.append(measure(model, num_microbatches, rounds))
      print(table(results[-1:]).splitlines()[-1], flush=True)
  elapsed = time.perf_counter() - start

  print(
    f"\n{_record.machine()['cpu']}, {os.cpu_count()} cores, jax {jax.__version__}, "
    f"optax {optax.__version__}; median of {rounds} rounds; {elapsed:.0f} s\n"
  )
  print(table(results))
  out = args.out or _record.RESULTS / f"core{'-quick' if args.quick else ''}.json"
  _record.save(
    out, load_before[0], rounds=rounds, seconds_total=elapsed, results=results
  )


if __name__ == "__main__":
  main()

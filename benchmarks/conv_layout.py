"""Benchmark: the Flax tutorial's CNN accumulated in a scan, with and without the
CPU convolution rewrite (`jaccum._core.rewrites`), against the whole batch and
`optax.microbatching.microbatch`.

The model is the Flax NNX MNIST tutorial's CNN (3x3 convolutions of 32 and 64
channels, 2x2 average pooling, dense 256, dense 10) on the 8x8 digits of
`sklearn.datasets.load_digits`, batch 64. The loop is the one jaccum runs: the
micro-step `value_and_grad(loss)` traced once with `jax.make_jaxpr`, evaluated
with `jax.core.eval_jaxpr` in a `lax.scan` over K strided micro-batches,
averaged; "rewrite" evaluates `canonicalize_convolutions` of it, "plain" the
traced micro-step as it is.

Reported: the median step time of each variant for K in {2, 4, 8} (variants
alternate within every round; ratios are medians of per-round ratios; "min"
ratios compare each variant's fastest round, the least disturbed), and the
compile time (trace, lower, compile) of "rewrite" at K=256 against K=2 on a
batch of 512. Targets (issue 10): rewrite/whole <= 1.0, rewrite/optax <= 0.3,
compile(K=256)/compile(K=2) <= 1.2. "rewrite" applies jaccum's rule, which
rewrites every convolution of this CNN (2-D, ungrouped).

    python -m benchmarks.conv_layout           # about 2 minutes on 2 cores
    python -m benchmarks.conv_layout --quick   # fewer rounds

Results: `benchmarks/results/conv_layout.json` (`results/quick/` with --quick).
"""

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from optax import microbatching
from sklearn.datasets import load_digits

from benchmarks import _record
from jaccum._core.rewrites import canonicalize_convolutions

BATCH = 64


class TutorialCNN(nnx.Module):
  def __init__(self, rngs):
    self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
    self.linear1 = nnx.Linear(64 * 2 * 2, 256, rngs=rngs)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x):
    pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    x = pool(nnx.relu(self.conv1(x)))
    x = pool(nnx.relu(self.conv2(x)))
    x = nnx.relu(self.linear1(x.reshape(x.shape[0], -1)))
    return self.linear2(x)


def scan_accumulate(grad_fn, num_microbatches, *, rewrite):
  """The mean of `grad_fn` over strided micro-batches, in one `lax.scan`."""

  def accumulated(params, batch):
    rows = jax.tree.map(lambda x: x.reshape(-1, num_microbatches, *x.shape[1:]), batch)
    take = lambda k: jax.tree.map(
      lambda x: jax.lax.dynamic_index_in_dim(x, k, 1, keepdims=False), rows
    )
    closed, out_shape = jax.make_jaxpr(grad_fn, return_shape=True)(params, take(0))
    if rewrite:
      closed = canonicalize_convolutions(closed)

    def body(total, k):
      out = jax.core.eval_jaxpr(
        closed.jaxpr, closed.consts, *jax.tree.leaves((params, take(k)))
      )
      return [t + o for t, o in zip(total, out, strict=True)], None

    zeros = [jnp.zeros(a.shape, a.dtype) for a in closed.out_avals]
    total, _ = jax.lax.scan(body, zeros, jnp.arange(num_microbatches))
    mean = [t / num_microbatches for t in total]
    return jax.tree.unflatten(jax.tree.structure(out_shape), mean)

  return accumulated


def time_interleaved(calls, rounds):
  """Seconds per call of each `(fn, args)`, one entry per round, rotated order."""
  for fn, args in calls.values():
    for _ in range(2):
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


def setup(batch_size):
  digits = load_digits()
  batch = {
    "x": (digits.images[:batch_size, :, :, None] / 16).astype(np.float32),
    "y": digits.target[:batch_size].astype(np.int32),
  }
  graphdef, params = nnx.split(TutorialCNN(nnx.Rngs(0)))

  def loss(params, batch):
    logits = nnx.merge(graphdef, params)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return params, batch, jax.value_and_grad(loss)


def step_times(num_microbatches, rounds):
  params, batch, grad_fn = setup(BATCH)
  variants = {
    "whole": grad_fn,
    "rewrite": scan_accumulate(grad_fn, num_microbatches, rewrite=True),
    "plain": scan_accumulate(grad_fn, num_microbatches, rewrite=False),
    "optax": microbatching.microbatch(
      grad_fn,
      argnums=1,
      microbatch_size=BATCH // num_microbatches,
      accumulator=microbatching.AccumulationType.MEAN,
    ),
  }
  compiled = {
    name: jax.jit(fn).lower(params, batch).compile() for name, fn in variants.items()
  }
  expected = compiled["whole"](params, batch)
  for name, fn in compiled.items():  # all the same numbers, or no comparison
    leaves = zip(
      jax.tree.leaves(fn(params, batch)), jax.tree.leaves(expected), strict=True
    )
    difference = max(float(jnp.max(jnp.abs(a - b))) for a, b in leaves)
    assert difference < 1e-5, (name, num_microbatches, difference)
  times = time_interleaved(
    {n: (c, (params, batch)) for n, c in compiled.items()}, rounds
  )
  ratio = lambda a, b: float(np.median(times[a] / times[b]))
  return {
    "num_microbatches": num_microbatches,
    "seconds": {name: float(np.median(t)) for name, t in times.items()},
    "seconds_min": {name: float(np.min(t)) for name, t in times.items()},
    "ratios": {
      "rewrite/whole": ratio("rewrite", "whole"),
      "plain/whole": ratio("plain", "whole"),
      "optax/whole": ratio("optax", "whole"),
      "rewrite/optax": ratio("rewrite", "optax"),
      "rewrite/plain": ratio("rewrite", "plain"),
    },
    # The fastest round of each: what the machine does when nothing else runs.
    "min_ratios": {
      "rewrite/whole": float(np.min(times["rewrite"]) / np.min(times["whole"])),
      "rewrite/optax": float(np.min(times["rewrite"]) / np.min(times["optax"])),
    },
  }


def compile_times(repeats, batch_size=512, ks=(2, 256)):
  """Seconds to trace, lower and compile "rewrite" at each K, alternating."""
  params, batch, grad_fn = setup(batch_size)
  times = {k: [] for k in ks}
  for _ in range(repeats):
    for k in ks:
      fn = jax.jit(scan_accumulate(grad_fn, k, rewrite=True))  # fresh: no cache
      start = time.perf_counter()
      fn.lower(params, batch).compile()
      times[k].append(time.perf_counter() - start)
  return {k: np.array(t) for k, t in times.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer rounds")
  args = parser.parse_args()
  rounds, repeats = (9, 3) if args.quick else (31, 7)
  start, load_before = time.perf_counter(), os.getloadavg()

  names = ("whole", "rewrite", "plain", "optax")
  print(
    f"{'K':>3} |" + "".join(f"{n:>9}" for n in names) + " ms |"
    f"{'rw/whole':>9}{'plain/wh':>9}{'optax/wh':>9}{'rw/optax':>9} | min: rw/wh rw/opt"
  )
  rows = []
  for num_microbatches in (2, 4, 8):
    row = step_times(num_microbatches, rounds)
    rows.append(row)
    s, r = row["seconds"], row["ratios"]
    print(
      f"{num_microbatches:>3} |"
      + "".join(f"{s[n] * 1e3:>9.2f}" for n in names)
      + "    |"
      + "".join(
        f"{r[k]:>9.2f}"
        for k in ("rewrite/whole", "plain/whole", "optax/whole", "rewrite/optax")
      )
      + f" | {row['min_ratios']['rewrite/whole']:>9.2f}"
      + f"{row['min_ratios']['rewrite/optax']:>7.2f}",
      flush=True,
    )

  compiles = compile_times(repeats)
  compile_ratio = float(np.median(compiles[256] / compiles[2]))
  print(
    f"\ncompile, rewrite, batch 512: K=2 {np.median(compiles[2]):.2f} s, "
    f"K=256 {np.median(compiles[256]):.2f} s, ratio {compile_ratio:.2f}"
  )
  elapsed = time.perf_counter() - start
  print(
    f"{_record.machine()['cpu']}, {os.cpu_count()} cores, jax {jax.__version__}; "
    f"median of {rounds} rounds; {elapsed:.0f} s"
  )
  _record.save(
    "conv_layout",
    args.quick,
    load_before[0],
    rounds=rounds,
    batch_size=BATCH,
    seconds_total=elapsed,
    results=rows,
    compile_seconds={str(k): t.tolist() for k, t in compiles.items()},
    compile_ratio=compile_ratio,
  )


if __name__ == "__main__":
  main()

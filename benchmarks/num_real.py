"""A traced number of real micro-batches against a static K of that number.

`jax.jit(accumulate(grad_fn, K))(..., num_real_microbatches=n)` compiles once
for the capacity K and runs only n micro-batches (a while loop). The goal of
issue 24: its step time within 1.03x of `accumulate(grad_fn, n)` on the same
rows (a scan of n, compiled for that n). Both are timed side by side,
interleaved, on the quickstart-sized MLP; the ratio is the median of
per-round ratios.

    python -m benchmarks.num_real [--quick]

Writes `results/num_real.json` (`results/quick/` with `--quick`) with the
machine, the date and the load around the run.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaccum
from benchmarks import _record

CAPACITY, ROWS, WIDTH = 16, 32, 256


def run(quick: bool, rounds: int) -> dict:
  rng = np.random.default_rng(0)
  params = [
    jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32)
    for _ in range(3)
  ]
  x = jnp.asarray(rng.normal(size=(CAPACITY * ROWS, WIDTH)), jnp.float32)

  def loss(params, x):
    for w in params:
      x = jnp.tanh(x @ w)
    return jnp.mean(x**2)

  grad_fn = jax.grad(loss)
  traced = jax.jit(jaccum.accumulate(grad_fn, CAPACITY, split="contiguous"))
  rows = []
  for n in (4, 8) if quick else (2, 4, 8, 12, 16):
    first = x[: n * ROWS]
    static = jax.jit(jaccum.accumulate(grad_fn, n, split="contiguous"))
    count = jnp.int32(n)
    calls = {
      "traced": lambda count=count: traced(params, x, num_real_microbatches=count),
      "static": lambda static=static, first=first: static(params, first),
    }
    for a, b in zip(
      jax.tree.leaves(calls["traced"]()),
      jax.tree.leaves(calls["static"]()),
      strict=True,
    ):
      assert float(jnp.max(jnp.abs(a - b))) < 1e-5
    times = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
      for name in names[r % 2 :] + names[: r % 2]:
        start = time.perf_counter()
        jax.block_until_ready(calls[name]())
        times[name].append(time.perf_counter() - start)
    ratio = float(np.median(np.array(times["traced"]) / np.array(times["static"])))
    rows.append(
      {
        "n": n,
        "capacity": CAPACITY,
        "traced_ms": 1e3 * float(np.median(times["traced"])),
        "static_ms": 1e3 * float(np.median(times["static"])),
        "ratio": ratio,
      }
    )
    print(
      f"n={n:>2} of K={CAPACITY}: traced {rows[-1]['traced_ms']:.2f} ms, static "
      f"{rows[-1]['static_ms']:.2f} ms, ratio {ratio:.3f}",
      flush=True,
    )
  return {"model": f"MLP 3x{WIDTH}, {ROWS} rows per micro-batch", "rows": rows}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="two counts, few rounds")
  args = parser.parse_args()
  load_before = _record.load()
  record = run(args.quick, 10 if args.quick else 60)
  _record.save("num_real", args.quick, load_before, **record)


if __name__ == "__main__":
  main()

"""Benchmark: what `accumulate(..., return_stats=True)` costs, in time and memory.

For the MLP and the transformer block of `benchmarks/core.py` (same models,
batches and per-example-mean losses) and K micro-batches, it compiles
`jaccum.accumulate(jax.value_and_grad(loss), K)` twice, with and without
`return_stats=True`, and reports

* the median step time of each; the two alternate within every round, so
  background load hits them alike, and "ratio" is the median of the per-round
  ratios (target: at most 1.03), "min" the ratio of the fastest rounds, and
  "µs/μstep" what the stats add to each micro-step (the median per-round
  difference over K): a fixed cost per micro-step, which weighs most when
  micro-steps are short;
* XLA's temporary memory of each (`jaccum.inspect.memory`) and the difference,
  next to the params' size: the stats add one scalar to the loop's carry and
  one squared norm per micro-step, never a params-sized buffer (target: the
  difference is far below the params' bytes).

The gradients of the two must agree before their speed means anything.

    python benchmarks/noise_scale.py            # about 2 minutes on 2 CPU cores
    python benchmarks/noise_scale.py --quick    # K = 4 only, fewer rounds

The table is printed and saved as JSON under benchmarks/results/.
"""

import argparse
import os
import pathlib
import time

import _record
import core
import jax
import numpy as np

import jaccum

TIME_TARGET = 1.03


def steps(model, num_microbatches):
  """The jitted accumulated step, without and with stats."""
  _, loss, _, _ = core.MODELS[model]
  grad_fn = jax.value_and_grad(loss)
  return {
    "plain": jax.jit(jaccum.accumulate(grad_fn, num_microbatches)),
    "stats": jax.jit(jaccum.accumulate(grad_fn, num_microbatches, return_stats=True)),
  }


def measure(model, num_microbatches, rounds):
  """Step times, their ratio and XLA's temporaries, with and without stats."""
  params, batch, _ = core.setup(model)
  jitted = steps(model, num_microbatches)
  compiled = {name: f.lower(params, batch).compile() for name, f in jitted.items()}
  plain = compiled["plain"](params, batch)
  with_stats, stats = compiled["stats"](params, batch)
  difference = core.max_difference(with_stats, plain)
  assert difference < 1e-5, f"{model} K={num_microbatches}: off by {difference}"

  memory = {
    name: jaccum.inspect.memory(f, params, batch).temp_bytes
    for name, f in jitted.items()
  }
  times = core.time_interleaved(
    {name: (c, (params, batch)) for name, c in compiled.items()}, rounds
  )
  param_bytes = core.nbytes(params)
  return {
    "model": model,
    "num_microbatches": num_microbatches,
    "batch_size": core.MODELS[model][3],
    "param_bytes": param_bytes,
    "seconds": {name: float(np.median(t)) for name, t in times.items()},
    "seconds_min": {name: float(np.min(t)) for name, t in times.items()},
    "time_ratio": float(np.median(times["stats"] / times["plain"])),
    "time_ratio_of_minima": float(times["stats"].min() / times["plain"].min()),
    # What the stats add to each micro-step, paired by round.
    "extra_seconds_per_microstep": float(
      np.median(times["stats"] - times["plain"]) / num_microbatches
    ),
    "temp_bytes": memory,
    "extra_temp_bytes": memory["stats"] - memory["plain"],
    "extra_temp_over_params": (memory["stats"] - memory["plain"]) / param_bytes,
    "noise_scale": float(stats.noise_scale),
  }


def table(results):
  header = (
    f"{'model':12}{'K':>3} |{'plain':>8}{'stats':>8} ms{'ratio':>7}{'min':>7}"
    f"{'µs/μstep':>9} |"
    f"{'plain':>8}{'stats':>8} MiB{'extra':>9} B{'params':>8} MiB{'extra/params':>13}"
  )
  lines = [header, "-" * len(header)]
  mib = 2**20
  for r in results:
    s, m = r["seconds"], r["temp_bytes"]
    lines.append(
      f"{r['model']:12}{r['num_microbatches']:>3} |"
      f"{s['plain'] * 1e3:>8.1f}{s['stats'] * 1e3:>8.1f}   {r['time_ratio']:>7.3f}"
      f"{r['time_ratio_of_minima']:>7.3f}"
      f"{r['extra_seconds_per_microstep'] * 1e6:>9.0f} |"
      f"{m['plain'] / mib:>8.2f}{m['stats'] / mib:>8.2f}    "
      f"{r['extra_temp_bytes']:>9,}  {r['param_bytes'] / mib:>8.2f}    "
      f"{r['extra_temp_over_params']:>13.4f}"
    )
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="K = 4 only, 10 rounds")
  parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
  parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path")
  args = parser.parse_args()
  ks = (4,) if args.quick else (4, 32)
  rounds = args.rounds or (10 if args.quick else 40)

  results = []
  print(table([]))
  start, load_before = time.perf_counter(), os.getloadavg()
  for model in core.MODELS:
    for num_microbatches in ks:
      results.append(measure(model, num_microbatches, rounds))
      print(table(results[-1:]).splitlines()[-1], flush=True)
  elapsed = time.perf_counter() - start

  print(
    f"\n{_record.machine()['cpu']}, {os.cpu_count()} cores, jax {jax.__version__}; "
    f"median of {rounds} rounds; {elapsed:.0f} s; target ratio <= {TIME_TARGET}\n"
  )
  print(table(results))
  out = (
    args.out or _record.RESULTS / f"noise_scale{'-quick' if args.quick else ''}.json"
  )
  _record.save(
    out, load_before[0], rounds=rounds, seconds_total=elapsed, results=results
  )


if __name__ == "__main__":
  main()

"""The GPU check: one command, under 8 minutes on one GPU, what the CPU cannot say.

    bash benchmarks/gpu.sh            # on a GPU machine: writes results/gpu.md
    bash benchmarks/gpu.sh --quick    # anywhere (CI runs it on the CPU)

Every figure the suite gives for a GPU comes from here; none is claimed until
this has run on one. It runs, on the default device:

1. **Accumulation against its alternatives**: for the suite's MLP, CNN and
   LM (`benchmarks/models.py`, full sizes) at K = 1, 4, 8, 16, one optimizer
   step (Adam, params and state donated) by the whole batch, by
   `jaccum.accumulate` and by `optax.microbatching.microbatch`, each checked
   against the whole batch's gradient before it is timed, then timed in
   interleaved rounds: accumulate ÷ whole batch and accumulate ÷
   `optax.microbatch`, in step time (medians of per-round ratios) and in
   memory (XLA's temporaries, and the working set: temporaries, outputs not
   written into donated inputs, buffers held between programs).
2. **The plan against a timed grid**: `jaccum.fit_plan` on the transformer LM
   and the in-batch contrastive loss of `benchmarks/plan.py`, by the cost
   model alone and with `measure=`, against every point of the grid timed
   (rank, ratio to the grid's best, compilations), at the generous budget.
3. **The overlap of the reduction**, where more than one GPU is present:
   `data_parallel` over all devices on an MLP of large layers, K = 4, with
   `overlap_reduction` off and on, against the same step on one device's
   rows with no reduction at all; the share of the reduction's time the
   overlap hides is (off − on) ÷ (off − no reduction).

Writes `benchmarks/results/gpu.md` and `gpu.json` (`results/quick/` with
`--quick`, where the sizes are the suite's quick ones, K = 4 only, and two
simulated CPU devices stand in for GPUs in part 3, so that every line of it
runs in CI) and prints each table as it is made, with the time spent so far.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

# The size of the reduction part's model: LAYERS layers of WIDTH² float32.
WIDTH, LAYERS, OVERLAP_K = 4096, 8, 4
QUICK_WIDTH, QUICK_LAYERS = 256, 2
# The whole check must end within this on one GPU (the issue's bound).
TIME_LIMIT_S = 8 * 60
SWEEP_METHODS = ("whole", "jaccum", "optax.microbatch")


def sweep_part(quick: bool, rounds: int) -> list[dict[str, Any]]:
  """Part 1: a row per (model, K) with the ratios of accumulate to the others."""
  from benchmarks import sweep

  ks = (4,) if quick else (1, 4, 8, 16)
  rows = []
  for name in ("mlp", "cnn", "lm"):
    # --quick: optax.microbatch on the MLP only (the others compile slowly).
    names = SWEEP_METHODS[:2] if quick and name != "mlp" else SWEEP_METHODS
    record = sweep.run_model(name, quick, rounds, ks=ks, method_names=names)
    for k in ks:
      by = {r["method"]: r for r in record["rows"] if r["num_microbatches"] == k}
      rows.append(
        {
          "model": name,
          "description": record["description"],
          "batch_size": record["batch_size"],
          "num_microbatches": k,
          **{
            f"{m}_step_s": by[m]["step_s"] if m in by else None for m in SWEEP_METHODS
          },
          "time_vs_whole": _paired(by, "whole"),
          "time_vs_optax": _paired(by, "optax.microbatch"),
          "temp_vs_whole": _ratio(by, "temp_bytes", "whole"),
          "temp_vs_optax": _ratio(by, "temp_bytes", "optax.microbatch"),
          "working_vs_whole": _ratio(by, "working_bytes", "whole"),
          "working_vs_optax": _ratio(by, "working_bytes", "optax.microbatch"),
        }
      )
  return rows


def _paired(by: dict[str, dict[str, Any]], other: str) -> float | None:
  """The median over rounds of accumulate's step time ÷ `other`'s in the same
  round (None where `other` was not run)."""
  import numpy as np

  if other not in by:
    return None
  mine, theirs = by["jaccum"]["step_s_rounds"], by[other]["step_s_rounds"]
  return float(np.median(np.divide(mine, theirs)))


def _ratio(by: dict[str, dict[str, Any]], figure: str, other: str) -> float | None:
  if other not in by:
    return None
  mine, theirs = by["jaccum"][figure], by[other][figure]
  return None if mine is None or not theirs else mine / theirs


def plan_part(quick: bool, rounds: int) -> dict[str, Any]:
  """Part 2: fit_plan's choices on the LM and the contrastive loss, against
  their grids timed, at the generous budget (--quick: the contrastive loss
  alone, with the default cost model; the plan benchmark's own --quick runs
  the LM)."""
  import jaccum
  from benchmarks import plan

  cost_model = jaccum.CostModel.default() if quick else jaccum.CostModel.calibrate()
  models = []
  for name in ("contrastive",) if quick else ("lm", "contrastive"):
    model = plan.MODELS[name](quick)
    measure = plan.QUICK_MEASURE if quick else 20.0
    generous = {"generous": plan.BUDGET_SHARES["generous"]}
    models.append(plan.run_model(model, cost_model, rounds, measure, quick, generous))
  return {"cost_model": cost_model._asdict(), "models": models}


def overlap_part(quick: bool, rounds: int) -> dict[str, Any] | None:
  """Part 3: the reduction's time that `overlap_reduction` hides, or None on
  one device."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jaccum
  from benchmarks import _measure

  devices = jax.devices()
  if len(devices) < 2:
    return None
  width, layers = (QUICK_WIDTH, QUICK_LAYERS) if quick else (WIDTH, LAYERS)
  rows_per_device = OVERLAP_K * (8 if quick else 64)
  mesh = jax.make_mesh((len(devices),), ("data",))
  rng = np.random.default_rng(0)
  params = [
    jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32)
    for _ in range(layers)
  ]
  x = rng.normal(size=(len(devices) * rows_per_device, width)).astype(np.float32)
  sharded = jax.device_put(x, jax.NamedSharding(mesh, jax.P("data")))

  def loss(params, x):
    for w in params:
      x = jnp.tanh(x @ w)
    return jnp.mean(x**2)

  grad_fn = jax.grad(loss)
  steps = {
    f"overlap_reduction={on}": jax.jit(
      jaccum.data_parallel(grad_fn, OVERLAP_K, mesh=mesh, overlap_reduction=on)
    )
    for on in (False, True)
  }
  local = jax.jit(jaccum.accumulate(grad_fn, OVERLAP_K))
  one_device = jax.device_put(x[:rows_per_device], devices[0])
  want = jax.jit(grad_fn)(params, x)
  for step in steps.values():
    error = _measure.relative_difference(step(params, sharded), want)
    assert error < 1e-4, error
  calls = {name: (lambda s=step: s(params, sharded)) for name, step in steps.items()}
  calls["no reduction (one device's rows)"] = lambda: local(params, one_device)
  times = _measure.interleaved(calls, rounds)
  off, on, alone = (float(np.median(t)) for t in times.values())
  return {
    "devices": len(devices),
    "model": f"{layers} layers of {width}x{width} float32, K={OVERLAP_K}, "
    f"{rows_per_device} rows per device",
    "step_s": {name: float(np.median(t)) for name, t in times.items()},
    "on_vs_off": _measure.paired_ratio(
      times, "overlap_reduction=True", "overlap_reduction=False"
    ),
    "hidden_share": None if off <= alone else (off - on) / (off - alone),
  }


def report(record: dict[str, Any]) -> str:
  """The markdown of `gpu.md`."""
  from benchmarks import _record
  from benchmarks.report import _fmt, markdown_table, plan_section

  sweep_rows = [
    [
      r["model"],
      str(r["num_microbatches"]),
      *(
        _fmt(r[f"{m}_step_s"] and r[f"{m}_step_s"] * 1e3, ".2f") for m in SWEEP_METHODS
      ),
      _fmt(r["time_vs_whole"], ".2f"),
      _fmt(r["time_vs_optax"], ".2f"),
      f"{_fmt(r['working_vs_whole'], '.2f')} ({_fmt(r['temp_vs_whole'], '.2f')})",
      f"{_fmt(r['working_vs_optax'], '.2f')} ({_fmt(r['temp_vs_optax'], '.2f')})",
    ]
    for r in record["sweep"]
  ]
  models = sorted(
    {(r["model"], r["description"], r["batch_size"]) for r in record["sweep"]}
  )
  lines = [
    "# GPU check\n",
    f"{_record.caption(record)}; {record['seconds']:.0f} s in all "
    f"(limit {TIME_LIMIT_S} s). `{record['command']}`.\n",
    "## Accumulation against the whole batch and `optax.microbatch`\n",
    "One Adam step at the same effective batch; step times are medians of "
    f"{record['rounds']} interleaved rounds, ratios medians of per-round "
    "ratios; memory is XLA's working set of the step (in brackets its "
    "temporaries). "
    + "; ".join(
      f"{name}: {description}, batch {batch}" for name, description, batch in models
    )
    + ".\n",
    markdown_table(
      [
        "model",
        "K",
        "whole ms",
        "accumulate ms",
        "optax.microbatch ms",
        "time ÷ whole",
        "time ÷ optax",
        "memory ÷ whole",
        "memory ÷ optax",
      ],
      sweep_rows,
    ),
    "\n"
    + plan_section(
      {
        **record["plan"],
        "rounds": record["rounds"],
        "tie": record["tie"],
        "goals": record["goals"],
      }
    ),
    "\n## The overlap of the reduction\n",
  ]
  overlap = record["overlap"]
  if overlap is None:
    lines.append("One device: nothing to reduce, so nothing to overlap.")
  else:
    lines += [
      f"`data_parallel` over {overlap['devices']} devices, {overlap['model']}: "
      "median step times; the share of the reduction's time that "
      "`overlap_reduction=True` hides is (off − on) ÷ (off − no reduction).\n",
      markdown_table(
        ["step", "ms"],
        [[name, f"{s * 1e3:.2f}"] for name, s in overlap["step_s"].items()],
      ),
      f"\non ÷ off: {overlap['on_vs_off']:.2f}; hidden share of the reduction: "
      f"{_fmt(overlap['hidden_share'], '.0%')}.",
    ]
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
  parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
  parser.add_argument("--out", type=pathlib.Path, default=None, help="results folder")
  args = parser.parse_args()
  import jax

  if args.quick:
    # Two simulated CPU devices (before JAX starts its backends), so that the
    # overlap part runs in CI; a GPU, where there is one, stays the default.
    jax.config.update("jax_num_cpu_devices", 2)
  import jaccum._planning.points
  from benchmarks import _record, plan

  start = time.perf_counter()
  rounds = args.rounds or (3 if args.quick else 10)
  record: dict[str, Any] = {
    "date": _record.now(),
    "machine": _record.machine(),
    "quick": args.quick,
    "command": " ".join(["bash benchmarks/gpu.sh", *sys.argv[1:]]),
    "rounds": rounds,
    "tie": jaccum._planning.points.TIE,
    "goals": {
      "vs_best": plan.GOAL_VS_BEST,
      "vs_full_remat": plan.GOAL_VS_FULL_REMAT,
      "measured_vs_best": plan.GOAL_MEASURED_VS_BEST,
    },
  }
  for name, part in (
    ("sweep", sweep_part),
    ("plan", plan_part),
    ("overlap", overlap_part),
  ):
    print(f"\n=== {name} ({time.perf_counter() - start:.0f} s) ===", flush=True)
    record[name] = part(args.quick, rounds)
  record["seconds"] = time.perf_counter() - start
  out = args.out or (_record.RESULTS / "quick" if args.quick else _record.RESULTS)
  out.mkdir(parents=True, exist_ok=True)
  (out / "gpu.json").write_text(json.dumps(record, indent=1) + "\n")
  text = report(record)
  (out / "gpu.md").write_text(text)
  print(f"\n{text}\nwrote {out / 'gpu.md'} in {record['seconds']:.0f} s")
  if record["seconds"] > TIME_LIMIT_S and not args.quick:
    sys.exit(f"over the {TIME_LIMIT_S} s limit: trim the grids or the rounds")


if __name__ == "__main__":
  main()

"""`python -m benchmarks [--quick] [--parts ...]`: run the suite, write its results.

Writes `suite.json` (every number, with the machine, versions, date and the
load around each part), `suite.md` (the tables) and the PNG plots of the
sweep, the convolution, fsdp and plan parts into `benchmarks/results/`
(`benchmarks/results/quick/` with `--quick`). A run of some of the parts
(`--parts`) replaces those in the folder's `suite.json` and keeps the others.
`--report-only` redraws the tables and plots from an existing `suite.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

RESULTS = pathlib.Path(__file__).parent / "results"


def _sweep(args: argparse.Namespace) -> dict[str, Any]:
  from benchmarks import sweep

  return sweep.run(args.quick, args.rounds or (2 if args.quick else 15), args.models)


def _loop(args: argparse.Namespace) -> dict[str, Any]:
  from benchmarks import loop

  record = loop.run(args.quick, args.rounds or (10 if args.quick else 100))
  print(loop.table(record))
  return record


def _conv(args: argparse.Namespace) -> dict[str, Any]:
  from benchmarks import conv_families

  return conv_families.run(args.quick, args.rounds or (5 if args.quick else 15))


def _multisteps(args: argparse.Namespace) -> dict[str, Any]:
  from benchmarks import multisteps

  # The full run also measures every variant without donation.
  donations = (True,) if args.quick else (True, False)
  runs = [multisteps.run(args.quick, args.rounds, donate) for donate in donations]
  return {"runs": runs}


def _precision(args: argparse.Namespace) -> dict[str, Any]:
  from benchmarks import multisteps_precision

  return multisteps_precision.run(args.quick)


def _in_own_process(module: str, args: argparse.Namespace) -> dict[str, Any]:
  # Its own process: it needs 8 simulated CPU devices, set before JAX starts,
  # and this process's single-device measurements must not share them.
  out = args.out / f"{module}.json.tmp"
  command = [sys.executable, "-m", f"benchmarks.{module}", "--out", str(out)]
  subprocess.run(command + (["--quick"] if args.quick else []), check=True)
  record = json.loads(out.read_text())
  out.unlink()
  return record


def _distributed(args: argparse.Namespace) -> dict[str, Any]:
  return _in_own_process("distributed", args)


def _fsdp(args: argparse.Namespace) -> dict[str, Any]:
  return _in_own_process("fsdp", args)


def _reduction(args: argparse.Namespace) -> dict[str, Any]:
  return _in_own_process("reduction", args)


def _pipeline(args: argparse.Namespace) -> dict[str, Any]:
  return _in_own_process("pipeline", args)


def _diloco(args: argparse.Namespace) -> dict[str, Any]:
  return _in_own_process("diloco", args)


def _deterministic(args: argparse.Namespace) -> dict[str, Any]:
  from benchmarks import deterministic

  # Timed here, on one device like the sweep; the bytes on 8 simulated
  # devices in a process of their own.
  record = deterministic.run(args.quick, args.rounds)
  wire = _in_own_process("deterministic", args)
  for row in record["rows"]:
    row["wire"] = wire[row["model"]]
  return record


def _overheads(args: argparse.Namespace) -> dict[str, Any]:
  from benchmarks import _record, overheads

  # Timed here, on one device like the sweep; the FSDP temporaries on 8
  # simulated devices in a process of their own.
  load_before = _record.load()
  record = overheads.run(args.quick, args.rounds)
  record["fsdp"] = _in_own_process("overheads", args)
  # Also on its own, as the standalone parts are: results/overheads.{json,md}.
  command = " ".join(["python -m benchmarks", *sys.argv[1:]])
  _record.save_with_table(
    "overheads", args.quick, load_before, {"command": command, **record},
    overheads.section,
  )  # fmt: skip
  return record


def _plan(args: argparse.Namespace) -> dict[str, Any]:
  from benchmarks import plan

  # In this process: one device, like the sweep's.
  return plan.run(args.quick, args.rounds)


def _coupled(args: argparse.Namespace) -> dict[str, Any]:
  from benchmarks import coupled

  # In this process: one device, like the sweep's.
  return coupled.run(args.quick, args.rounds)


def _private(args: argparse.Namespace) -> dict[str, Any]:
  from benchmarks import private

  # In this process: one device, like the sweep's.
  return private.run(args.quick, args.rounds)


# name: how to run it. Parts run in this order, one at a time; the processes
# of the distributed, fsdp, reduction, pipeline and diloco parts (and the
# deterministic part's bytes) are waited for before the next part starts.
PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
  "sweep": _sweep,
  "loop": _loop,
  "conv": _conv,
  "multisteps": _multisteps,
  "precision": _precision,
  "distributed": _distributed,
  "fsdp": _fsdp,
  "reduction": _reduction,
  "pipeline": _pipeline,
  "plan": _plan,
  "coupled": _coupled,
  "deterministic": _deterministic,
  "overheads": _overheads,
  "diloco": _diloco,
  "private": _private,
}


def write_report(record: dict[str, Any], out: pathlib.Path) -> None:
  from benchmarks import plots, report

  (out / "suite.md").write_text(report.render(record))
  written = [out / "suite.md"]
  if "sweep" in record["parts"]:
    written += plots.plot_sweep(record, out)
  if "families" in record["parts"].get("conv", {}):
    written += plots.plot_conv(record, out)
  if "rows" in record["parts"].get("fsdp", {}):
    written += plots.plot_fsdp(record, out)
  if "models" in record["parts"].get("plan", {}):
    written += plots.plot_plan(record, out)
  print("wrote " + ", ".join(str(p) for p in written))


def main() -> None:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks", description=__doc__.splitlines()[0]
  )
  parser.add_argument(
    "--quick", action="store_true", help="small sizes and few rounds, for CI"
  )
  parser.add_argument(
    "--parts",
    default=",".join(PARTS),
    help=f"comma-separated parts to run, of {', '.join(PARTS)} (default: all)",
  )
  parser.add_argument(
    "--models", default="mlp,cnn,lm", help="models of the sweep (default: all)"
  )
  parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
  parser.add_argument("--out", type=pathlib.Path, default=None, help="results folder")
  parser.add_argument(
    "--report-only",
    action="store_true",
    help="redraw suite.md and the plots from the folder's suite.json",
  )
  args = parser.parse_args()
  args.out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
  args.out.mkdir(parents=True, exist_ok=True)
  args.models = args.models.split(",")
  if args.report_only:
    write_report(json.loads((args.out / "suite.json").read_text()), args.out)
    return

  from benchmarks import _record

  parts = args.parts.split(",")
  unknown = sorted(set(parts) - set(PARTS))
  if unknown:
    parser.error(f"unknown parts {unknown}; the parts are {list(PARTS)}")
  command = " ".join(["python -m benchmarks", *sys.argv[1:]])
  record: dict[str, Any] = {
    "date": _record.now(),
    "machine": _record.machine(),
    "quick": args.quick,
    "command": command,
    "parts": {},
  }
  suite = args.out / "suite.json"
  merged = False
  if set(parts) < set(PARTS) and suite.exists():
    earlier = json.loads(suite.read_text())
    # Some parts, run again: they replace theirs in the folder's record and
    # the others stay, so one part can be measured without the rest. The
    # record's date, machine and command stay those of the earlier run; each
    # part run since says its own.
    merged = earlier["quick"] == args.quick
    record = earlier if merged else record
  start = time.perf_counter()
  for name in (name for name in PARTS if name in parts):
    print(f"\n=== {name} ===", flush=True)
    load_before, part_start = _record.load(), time.perf_counter()
    cpu_start = time.process_time()
    result = PARTS[name](args)
    if merged:
      result |= {"date": _record.now(), "command": command}
      result["machine"] = _record.machine()
    result["load_average"] = [load_before, _record.load()]
    # Not "seconds": the loop part keeps its per-variant medians there.
    result["part_seconds"] = time.perf_counter() - part_start
    # This process's CPU time (the distributed part's runs in a child).
    result["cpu_seconds"] = time.process_time() - cpu_start
    record["parts"][name] = result
    record["parts"] = {n: record["parts"][n] for n in PARTS if n in record["parts"]}
    if not merged:
      record["seconds_total"] = time.perf_counter() - start
    # Saved after every part: a failure later loses nothing measured.
    (args.out / "suite.json").write_text(json.dumps(record, indent=1) + "\n")
  print(
    f"\n{len(parts)} parts in {time.perf_counter() - start:.0f} s "
    f"(load average now {os.getloadavg()[0]:.1f})"
  )
  write_report(record, args.out)


if __name__ == "__main__":
  main()

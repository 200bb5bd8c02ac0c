"""What every result records beside its numbers: the machine, the versions, when."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
from collections.abc import Callable
from typing import Any

import flax
import jax
import optax

import jaccum

RESULTS = pathlib.Path(__file__).parent / "results"


def machine() -> dict[str, Any]:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
  except (OSError, StopIteration):
    pass
  devices = jax.devices()
  return {
    "cpu": cpu,
    "cores": os.cpu_count(),
    "backend": jax.default_backend(),
    "device_kind": devices[0].device_kind,
    "devices": [str(d) for d in devices],
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jax.lib.__version__,
    "flax": flax.__version__,
    "optax": optax.__version__,
    "jaccum": jaccum.__version__,
  }


def now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def load() -> float:
  """The 1-minute load average: how much other work shares the machine."""
  return os.getloadavg()[0]


def caption(record: dict[str, Any]) -> str:
  """One line naming the machine, the versions and the date of a suite record."""
  m = record["machine"]
  device = m["cpu"] if m["backend"] == "cpu" else m["device_kind"]
  return (
    f"{device} ({m['backend']}, {m['cores']} cores), jax {m['jax']}, "
    f"flax {m['flax']}, optax {m['optax']}, jaccum {m['jaccum']}, "
    f"{record['date'][:10]}{', --quick' if record['quick'] else ''}"
  )


def save(name: str, quick: bool, load_before: float, **record: Any) -> pathlib.Path:
  """Writes a standalone script's `record` as `results/{name}.json`.

  With `quick`, into `results/quick/`, which is not committed. The record
  gets the date, the machine and the load average before and after the run:
  ratios are measured side by side, single timings are not.
  """
  out = RESULTS / "quick" if quick else RESULTS
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"{name}.json"
  record = {
    "date": now(),
    "machine": machine(),
    "quick": quick,
    "load_average": [load_before, load()],
    **record,
  }
  path.write_text(json.dumps(record, indent=1) + "\n")
  print(f"\nsaved {path}")
  return path


def save_with_table(
  name: str,
  quick: bool,
  load_before: float,
  record: dict[str, Any],
  section: Callable[[dict[str, Any]], str],
) -> tuple[pathlib.Path, dict[str, Any], str]:
  """`save`, then the report's `section` of the saved record as `{name}.md`.

  Returns the JSON's path, the record as saved and the table.
  """
  path = save(name, quick, load_before, **record)
  saved = json.loads(path.read_text())
  table = section(saved)
  path.with_suffix(".md").write_text(f"{table}\n")
  return path, saved, table


def standalone(
  name: str,
  doc: str,
  run: Callable[..., dict[str, Any]],
  section: Callable[[], Callable[[dict[str, Any]], str]],
  quick_help: str,
  *,
  rounds: bool = True,
  devices: int | None = None,
) -> None:
  """A part's own command line: `python -m benchmarks.NAME [--quick]
  [--rounds N] [--out PATH]`, its record saved with its table as
  `results/NAME.{json,md}`, or with `--out` written there alone.

  `section` returns the table's function when called (the report is
  imported only when it is needed); `devices` simulated CPU devices are
  set before any JAX computation.
  """
  import argparse

  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help=quick_help)
  if rounds:
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
  parser.add_argument("--out", type=pathlib.Path, help="write the record here only")
  args = parser.parse_args()
  if devices is not None:
    jax.config.update("jax_num_cpu_devices", devices)
  load_before = os.getloadavg()[0]
  record = run(args.quick, args.rounds) if rounds else run(args.quick)
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return
  path, _, table = save_with_table(name, args.quick, load_before, record, section())
  print(f"\n{table}\nsaved {path.with_suffix('.md')}")


def section(name: str) -> Callable[[dict[str, Any]], str]:
  """The report's table function for part `name`."""
  from benchmarks import report

  return report.SECTIONS[name]

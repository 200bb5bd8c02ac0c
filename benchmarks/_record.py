"""What every benchmark records beside its numbers: the machine, the load, when."""

import datetime
import json
import os
import pathlib
import platform

import jax
import optax

import jaccum

RESULTS = pathlib.Path(__file__).parent / "results"


def machine() -> dict:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
  except (OSError, StopIteration):
    pass
  return {
    "cpu": cpu,
    "cores": os.cpu_count(),
    "backend": jax.default_backend(),
    "devices": [str(d) for d in jax.devices()],
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jax.lib.__version__,
    "optax": optax.__version__,
    "jaccum": jaccum.__version__,
  }


def save(out: pathlib.Path, load_before: float, **record) -> None:
  """Writes `record` with the date, the machine and the load around the run.

  The 1-minute load average before and after says how much other work shared
  the machine: ratios are measured side by side, single timings are not.
  """
  out.parent.mkdir(parents=True, exist_ok=True)
  record = {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "load_average": [load_before, os.getloadavg()[0]],
    **record,
  }
  out.write_text(json.dumps(record, indent=2) + "\n")
  print(f"\nsaved {out}")

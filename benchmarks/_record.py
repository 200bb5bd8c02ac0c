"""What every result records beside its numbers: the machine, the versions, when."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

import flax
import jax
import optax

import jaccum


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

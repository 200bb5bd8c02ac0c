"""How the suite measures: interleaved timing, compile events, compiled memory.

Timings on a shared machine are noisy, so every comparison is made side by
side: each round runs every variant once, in an order rotated from round to
round, so that a burst of background load lands on all of them alike, and
ratios are taken per round before their median. Nothing here assumes a CPU:
`memory_analysis` fields that a backend leaves out come back as None.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import jax
import numpy as np

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def nbytes(tree: Any) -> int:
  """Bytes of the array leaves of `tree` (arrays or ShapeDtypeStructs)."""
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def relative_difference(actual: Any, expected: Any) -> float:
  """max |actual - expected| / max |expected| over all leaves together (the
  absolute difference where everything expected is 0)."""
  actual, expected = jax.tree.leaves(actual), jax.tree.leaves(expected)
  assert len(actual) == len(expected), (len(actual), len(expected))
  diff = max(
    float(np.max(np.abs(np.asarray(a) - e)))
    for a, e in zip(actual, expected, strict=True)
  )
  scale = max(float(np.max(np.abs(e))) for e in expected)
  return diff / scale if scale else diff


@contextlib.contextmanager
def compile_events() -> Iterator[dict[str, float]]:
  """Sums, per event, the seconds JAX reports compiling in this thread in the block.

  The backend (XLA) compile of every program compiled in the block counts
  once, including eager ops compiled on first use; lowering too. JAX reports
  an event in the thread that compiled, so blocks in other threads at the
  same time are counted apart.
  """
  totals = {BACKEND_COMPILE: 0.0, LOWER: 0.0}
  thread = threading.get_ident()

  def listen(event: str, duration: float, **_: Any) -> None:
    if event in totals and threading.get_ident() == thread:
      totals[event] += duration

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield totals
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def precompile(programs: list[tuple[Any, tuple[Any, ...]]]) -> None:
  """Compiles `(jitted, args)` programs two at a time, into JAX's cache.

  For a `--quick` run, where only the running matters: both cores compile,
  and the later calls find their executables compiled.
  """
  with futures.ThreadPoolExecutor(2) as pool:
    for done in [
      pool.submit(lambda p: p[0].lower(*p[1]).compile(), p) for p in programs
    ]:
      done.result()


def interleaved(
  calls: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1
) -> dict[str, np.ndarray]:
  """Seconds of each zero-argument call, one entry per round.

  Every round runs each call once, in a rotated order; a call's result is
  waited for (`block_until_ready`) before its clock stops.
  """
  for call in calls.values():
    for _ in range(warmup):
      jax.block_until_ready(call())
  times: dict[str, list[float]] = {name: [] for name in calls}
  names = list(calls)
  for round_index in range(rounds):
    shift = round_index % len(names)
    for name in names[shift:] + names[:shift]:
      start = time.perf_counter()
      jax.block_until_ready(calls[name]())
      times[name].append(time.perf_counter() - start)
  return {name: np.array(t) for name, t in times.items()}


def paired_ratio(times: dict[str, np.ndarray], a: str, b: str) -> float:
  """The median over rounds of time(a) / time(b), measured in the same round."""
  return float(np.median(times[a] / times[b]))


def memory(jitted: Any, *args: Any) -> dict[str, int | None]:
  """XLA's memory figures for `jitted` on `args` (compiled already: cached).

  Returns temp, argument, output and alias bytes; None where the backend
  reports nothing.
  """
  analysis = jitted.lower(*args).compile().memory_analysis()
  if analysis is None:
    return {"temp": None, "argument": None, "output": None, "alias": None}
  get = lambda name: getattr(analysis, f"{name}_size_in_bytes", None)
  return {name: get(name) for name in ("temp", "argument", "output", "alias")}

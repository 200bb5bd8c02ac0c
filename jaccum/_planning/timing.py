"""Timing steps side by side on the device, within a time bound.

`fit_plan(..., measure=seconds)` times its best candidates here. A shared
machine's load comes in bursts, so each round runs every step once, in an
order rotated from round to round, and a step's figure is the median of its
rounds. The bound is kept by looking ahead: a batch of compilations, a first
call or a round starts only if the time left covers it, judged by the longest
such thing seen so far as it really ran; only the last thing started can pass
the bound, by what it took beyond that.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent import futures
from typing import Any, Generic, TypeVar

import jax

# The clock a new `Timer` reads (tests put a fake one here).
CLOCK: Callable[[], float] = time.perf_counter
# A first call is judged by the step's predicted time times the largest
# measured ÷ predicted ratio seen, and at least this many times it.
FIRST_CALL_MARGIN = 3.0

KeyT = TypeVar("KeyT", bound=Hashable)


class Timer(Generic[KeyT]):
  """Compiles and times steps within `seconds`, in interleaved rounds.

  Each thing starts only if the time left covers its estimate: a batch of
  compilations side by side, the longest batch seen so far; a step's first
  call (its warm-up, not counted), its predicted seconds times the largest
  ratio of measured to predicted seen so far, and at least
  `FIRST_CALL_MARGIN` times; a round, the sum of each step's longest call
  so far. The time spent stays within the bound as long as nothing takes
  longer than that.

  Attributes:
    seconds: the time bound.
    longest_compile: the longest batch of compilations seen, in seconds
      (to start with, the longest compilation seen before the timer).
    first: `{key: seconds}` of each step's first call.
    rounds: `{key: [seconds, ...]}` of each step's timed rounds.
    rounds_run: the rounds run, all steps together.
    cut_short: whether something was left out for want of time.
  """

  def __init__(
    self,
    seconds: float,
    longest_compile: float = 0.0,
    clock: Callable[[], float] | None = None,
  ):
    self._clock = clock or CLOCK
    self._start = self._clock()
    self.seconds = seconds
    self.longest_compile = longest_compile
    self._calls: dict[KeyT, Callable[[], Any]] = {}
    self._predicted: dict[KeyT, float] = {}
    self.first: dict[KeyT, float] = {}
    self.rounds: dict[KeyT, list[float]] = {}
    self.rounds_run = 0
    self.cut_short = False

  def elapsed(self) -> float:
    """Seconds since the timer started."""
    return self._clock() - self._start

  def _covers(self, estimate: float) -> bool:
    if self.elapsed() + estimate <= self.seconds:
      return True
    self.cut_short = True
    return False

  def _time(self, call: Callable[[], Any]) -> float:
    start = self._clock()
    jax.block_until_ready(call())
    return self._clock() - start

  def compile(self, builds: Sequence[Callable[[], Any]], workers: int = 1) -> list[Any]:
    """The results of as many `builds` as the time left covers, in order.

    They run in batches of `workers` side by side (XLA compiles outside
    Python's lock). A batch starts only if the time left covers the longest
    batch so far, measured as it ran (side by side on a busy machine, a
    batch can take as long as its builds one after another): so only the
    batch that takes longer than any before it can pass the bound.
    """
    workers = max(1, workers)
    results: list[Any] = []
    with futures.ThreadPoolExecutor(workers) as pool:
      for first in range(0, len(builds), workers):
        if not self._covers(self.longest_compile):
          break
        start = self._clock()
        results += pool.map(lambda build: build(), builds[first : first + workers])
        self.longest_compile = max(self.longest_compile, self._clock() - start)
    return results

  def _ratio(self) -> float:
    ratios = [
      max([self.first[key], *self.rounds[key]]) / self._predicted[key]
      for key in self._calls
      if self._predicted[key] > 0
    ]
    return max([FIRST_CALL_MARGIN, *ratios])

  def first_call_estimate(self, predicted: float) -> float:
    """What a step's first call is judged to take, from its predicted time."""
    return predicted * self._ratio()

  def add(self, key: KeyT, call: Callable[[], Any], predicted: float) -> bool:
    """Runs `call` once as its warm-up if that fits in the time left.

    Returns whether the step is in (a step added before is).
    """
    if key in self._calls:
      return True
    if not self._covers(self.first_call_estimate(predicted)):
      return False
    self.first[key] = self._time(call)
    self._calls[key] = call
    self._predicted[key] = predicted
    self.rounds[key] = []
    return True

  def _longest(self, key: KeyT) -> float:
    return max([self.first[key], *self.rounds[key]])

  def race(self, keys: list[KeyT], count: int) -> int:
    """Up to `count` interleaved rounds of the steps `keys`; how many ran."""
    keys = [key for key in keys if key in self._calls]
    for done in range(count):
      if not keys or not self._covers(sum(self._longest(key) for key in keys)):
        return done
      shift = self.rounds_run % len(keys)
      for key in keys[shift:] + keys[:shift]:
        self.rounds[key].append(self._time(self._calls[key]))
      self.rounds_run += 1
    return count

  def median(self, key: KeyT) -> float | None:
    """The median of the step's timed rounds, None before any."""
    times = self.rounds.get(key)
    return statistics.median(times) if times else None

  def fastest(self) -> KeyT | None:
    """The step with the least median, of those timed (None if none is)."""
    timed = [key for key in self.rounds if self.rounds[key]]
    return min(timed, key=lambda key: self.median(key), default=None)  # type: ignore[arg-type,return-value]

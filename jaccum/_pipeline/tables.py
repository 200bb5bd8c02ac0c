"""Pipeline schedules: what each device runs, tick by tick, in one step.

A tick is what every device does between two exchanges with its neighbours:
some of F (a stage's forward on one micro-batch), B (its backward to the
stage's input, which the previous stage waits for) and W (its backward to the
stage's weights, which nothing waits for). `pipeline_schedule` returns the
schedule `jaccum.pipeline` runs, as a table; the pipeline builds its loop from
the same object.
"""

from __future__ import annotations

import operator
from typing import Any, Literal, NamedTuple

import numpy as np

from jaccum._core.microbatch import check_num_microbatches

ScheduleName = Literal["gpipe", "1f1b", "zb-h1"]
SCHEDULES = ("gpipe", "1f1b", "zb-h1")
# What runs in a tick, in the order a device runs it, and its code in the
# zero-bubble loop's table (0 is idle).
KINDS = ("F", "B", "W")

Work = tuple[str, int, int]  # (kind, micro-batch, chunk)


class PipelineSchedule(NamedTuple):
  """What every device of a pipeline runs in each tick of one step.

  Each device runs, in a tick, some of F (its stage's forward on one
  micro-batch), B (the stage's backward to its input, which the previous stage
  waits for) and W (its backward to its weights, which nothing waits for),
  then passes activations to the next device and input cotangents to the
  previous one. In lockstep a tick lasts as long as its busiest device's work,
  F, B and W each taking 1/V of a whole stage's forward (V stages per
  device); the rest of the device-ticks are idle.

  Attributes:
    schedule: `"gpipe"`, `"1f1b"` or `"zb-h1"`.
    num_stages: S, devices on the stage axis.
    num_microbatches: K, micro-batches per step (per data shard).
    num_virtual_stages: V, stages per device; chunk v of device s is stage
      v·S + s.
    ticks: `ticks[t][s]`, what device s runs in tick t, in order: a tuple of
      `(kind, micro-batch, chunk)`, kind `"F"`, `"B"` or `"W"`; empty when
      the device is idle. GPipe's ticks are its forward loop's, then those of
      the backward loop autodiff makes of it (B and W in one).

  Examples:
    At S = 4 stages and K = 8 micro-batches, 1F1B leaves the devices idle
    27.3% of the step, the zero-bubble ZB-H1 11.1%:

    >>> import jaccum
    >>> one_f_one_b = jaccum.pipeline_schedule(4, 8, schedule="1f1b")
    >>> zb = jaccum.pipeline_schedule(4, 8, schedule="zb-h1")
    >>> f"{one_f_one_b.idle:.1%}, {zb.idle:.1%}"
    '27.3%, 11.1%'
    >>> zb.num_ticks, zb.time  # lockstep ticks, and their time in forwards
    (27, 27.0)
    >>> zb.ticks[7]  # per device: B of micro-batch 0, F of 3, B of 1, F of 2
    ((('B', 0, 0),), (('F', 3, 0),), (('B', 1, 0),), (('F', 2, 0),))
  """

  schedule: str
  num_stages: int
  num_microbatches: int
  num_virtual_stages: int
  ticks: tuple[tuple[tuple[Work, ...], ...], ...]

  @property
  def num_ticks(self) -> int:
    """Ticks in one step.

    Examples:
      >>> import jaccum
      >>> jaccum.pipeline_schedule(4, 8, schedule="1f1b").num_ticks
      14
    """
    return len(self.ticks)

  @property
  def time(self) -> float:
    """The step's time in lockstep ticks, in forwards of a whole stage.

    Each tick lasts as long as its busiest device's work: F, B and W each
    1/V.

    Examples:
      >>> import jaccum
      >>> jaccum.pipeline_schedule(4, 8, schedule="gpipe").time
      33.0
    """
    return float(sum(max(map(self._cost, tick)) for tick in self.ticks))

  @property
  def idle(self) -> float:
    """The idle share of the device-ticks, each tick as long as its busiest
    device's work (F, B and W each 1/V of a stage's forward).

    Examples:
      >>> import jaccum
      >>> schedule = jaccum.pipeline_schedule(4, 8, schedule="1f1b",
      ...                                     num_virtual_stages=2)
      >>> round(schedule.idle, 3)
      0.158
    """
    busy = sum(self._cost(work) for tick in self.ticks for work in tick)
    return 1 - busy / (self.num_stages * self.time)

  def _cost(self, works: tuple[Work, ...]) -> float:
    return len(works) / self.num_virtual_stages

  def __str__(self) -> str:
    """The table: a row per device, a column per tick, `.` where idle.

    A cell names what runs, kind then micro-batch (`F3`, `B0W0`), with
    `.v` after the micro-batch for chunk v when V > 1.
    """
    V = self.num_virtual_stages
    label = lambda kind, k, v: f"{kind}{k}" + (f".{v}" if V > 1 else "")
    cells = [
      ["".join(label(*w) for w in works) or "." for works in tick]
      for tick in self.ticks
    ]
    width = max(len(c) for tick in cells for c in tick)
    head = (
      f"{self.schedule}: {self.num_stages} stages, {self.num_microbatches} "
      f"micro-batches, {self.num_ticks} ticks, idle {self.idle:.1%}"
    )
    rows = [
      f"device {s:<3}" + " ".join(tick[s].ljust(width) for tick in cells).rstrip()
      for s in range(self.num_stages)
    ]
    return "\n".join([head, *rows])


def pipeline_schedule(
  num_stages: int,
  num_microbatches: int,
  *,
  schedule: ScheduleName = "gpipe",
  num_virtual_stages: int = 1,
) -> PipelineSchedule:
  """The schedule `jaccum.pipeline` runs: what each device runs, tick by tick.

  `jaccum.pipeline(..., schedule=schedule, num_virtual_stages=V)` over a
  stage axis of `num_stages` devices, with `num_microbatches` micro-batches
  per data shard, runs this schedule's ticks in a loop, one tick per
  iteration: the pipeline builds its loop from this same object.

  - `"gpipe"`: a loop of forwards (micro-batch k = g·S + j through stage
    v·S + s at tick g·S·V + v·S + j + s), then autodiff's backward loop,
    the forward loop in reverse, running B and W together.
  - `"1f1b"`: one loop; in each tick a device runs one micro-batch's F and
    an earlier one's B and W, stage l 2(L − 1 − l) ticks after its F.
  - `"zb-h1"`: the zero-bubble schedule H1 of Qi et al.: one of F, B or W
    per tick. Stage s runs S − s forwards, then B and F in turn with its W
    held back until s micro-batches wait for theirs, so that the last stages
    pass their B on at once; the W held back fill the ticks at the end where
    1F1B's devices idle. A device holds at most S micro-batches between F and
    W (1F1B's lockstep loop holds up to 2S − 1 between F and B). Needs V = 1.

  Args:
    num_stages: S, the size of the pipeline's stage axis.
    num_microbatches: K, micro-batches per step and data shard.
    schedule: `"gpipe"`, `"1f1b"` or `"zb-h1"`.
    num_virtual_stages: V, stages per device.

  Returns:
    A `PipelineSchedule`: its `ticks`, `idle` share and `time`; `print` it
    for the table.

  Raises:
    TypeError: `num_stages`, `num_microbatches` or `num_virtual_stages` is
      not an int (or is a bool).
    ValueError: `num_stages`, `num_microbatches` or `num_virtual_stages` is
      below 1, `schedule` is unknown, or `"zb-h1"` has V > 1.

  Examples:
    >>> import jaccum
    >>> print(jaccum.pipeline_schedule(2, 3, schedule="zb-h1"))
    zb-h1: 2 stages, 3 micro-batches, 10 ticks, idle 10.0%
    device 0  F0 F1 .  B0 W0 F2 B1 W1 B2 W2
    device 1  .  F0 B0 F1 B1 W0 F2 B2 W1 W2
    >>> print(jaccum.pipeline_schedule(2, 3, schedule="1f1b"))
    1f1b: 2 stages, 3 micro-batches, 5 ticks, idle 25.0%
    device 0  F0     F1     F2B0W0 B1W1   B2W2
    device 1  .      F0B0W0 F1B1W1 F2B2W2 .
  """
  num_stages = check_positive_int(num_stages, "num_stages")
  num_microbatches = check_num_microbatches(num_microbatches)
  num_chunks = check_positive_int(num_virtual_stages, "num_virtual_stages")
  check_schedule(schedule, num_chunks)
  ticks = _Ticks(num_stages, num_chunks, num_microbatches)
  if schedule == "gpipe":
    table = _gpipe_table(ticks)
  elif schedule == "1f1b":
    table = _one_f_one_b_table(ticks)
  else:
    table = _zero_bubble_table(num_stages, num_microbatches)
  return PipelineSchedule(schedule, num_stages, num_microbatches, num_chunks, table)


def check_schedule(schedule: Any, num_chunks: int) -> None:
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
  if schedule == "zb-h1" and num_chunks > 1:
    raise ValueError(
      f'schedule="zb-h1" runs one stage per device, but num_virtual_stages='
      f'{num_chunks}: use num_virtual_stages=1, or "1f1b" for interleaved '
      "stages."
    )


def check_positive_int(value: Any, name: str) -> int:
  """`value` as an int: a TypeError if it is not one, a ValueError below 1.

  The errors of `check_num_microbatches`, for the other counts.
  """
  try:
    number = operator.index(value)
  except TypeError:
    number = None
  if number is None or isinstance(value, bool | np.bool_):
    raise TypeError(f"{name} must be a positive int, got {value!r}.")
  if number < 1:
    raise ValueError(f"{name} must be a positive int, got {number}.")
  return number


# --- GPipe and 1F1B: arithmetic on the tick ---------------------------------------


class _Ticks(NamedTuple):
  """Which micro-batch and which of its V chunks a device runs at a tick.

  Micro-batches enter in groups of S. Micro-batch k = g·S + j passes stage
  l = v·S + s (chunk v of device s) forward at tick g·S·V + v·S + j + s: it
  reaches the next stage one tick later, goes round the devices V times, and
  no device gets two forwards in one tick. Backwards run the same way in
  reverse, starting in the tick of the last stage's forward: stage l runs a
  micro-batch's backward 2(L − 1 − l) ticks after its forward. The
  arithmetic works on Python ints, NumPy and traced arrays alike.
  """

  num_stages: int
  num_chunks: int
  num_microbatches: int

  def _slot(self, offset: Any, reverse: bool) -> tuple[Any, Any, Any]:
    period = self.num_stages * self.num_chunks
    group, rest = offset // period, offset % period
    microbatch = group * self.num_stages + rest % self.num_stages
    chunk = rest // self.num_stages
    if reverse:
      chunk = self.num_chunks - 1 - chunk
    return microbatch, chunk, (offset >= 0) & (microbatch < self.num_microbatches)

  def forward(self, tick: Any, device: Any) -> tuple[Any, Any, Any]:
    """`(micro-batch, chunk, active)` of the forward `device` runs at `tick`."""
    return self._slot(tick - device, reverse=False)

  def backward(self, tick: Any, device: Any) -> tuple[Any, Any, Any]:
    """`(micro-batch, chunk, active)` of the backward `device` runs at `tick`."""
    return self._slot(tick - self._lag_offset + device, reverse=True)

  @property
  def _lag_offset(self) -> int:
    return self.num_stages * (self.num_chunks + 1) - 2

  def _start(self, microbatch: int) -> int:
    """The tick of micro-batch k's forward through the first stage."""
    group, j = divmod(microbatch, self.num_stages)
    return group * self.num_stages * self.num_chunks + j

  @property
  def num_forward_ticks(self) -> int:
    last = self._start(self.num_microbatches - 1)
    return last + self.num_stages * self.num_chunks

  @property
  def num_1f1b_ticks(self) -> int:
    last = self._start(self.num_microbatches - 1)
    return last + 2 * self.num_stages * self.num_chunks - 1

  def ring_sizes(self) -> tuple[int, ...]:
    """For each chunk, the most micro-batches a device holds between F and B.

    Counted in the tick of a forward, after it writes its slot and before
    that tick's backward reads one. The micro-batches a device holds for a
    chunk are consecutive, so slot `k % size` never holds two at once.
    Counted as if more micro-batches followed: an idle forward at the end
    writes the slot micro-batch K + j would use, harmlessly, rather than
    spend a `select` on keeping the slot's old value.
    """
    S, V = self.num_stages, self.num_chunks
    num_microbatches = self.num_microbatches + 3 * S
    starts = np.array([self._start(k) for k in range(num_microbatches)])
    sizes = []
    for v in range(V):
      size = 1
      for s in range(S):
        stage = v * S + s
        forward = starts + stage
        backward = forward + 2 * (S * V - 1 - stage)
        ticks = np.arange(forward[0], self.num_1f1b_ticks)
        done = np.searchsorted(forward, ticks, side="right")
        freed = np.searchsorted(backward, ticks, side="left")
        size = max(size, int((done - freed).max()))
      sizes.append(size)
    return tuple(sizes)


def _forward_work(ticks: _Ticks, tick: int, device: int) -> list[Work]:
  k, v, active = ticks.forward(tick, device)
  return [("F", k, v)] if active else []


def _gpipe_table(ticks: _Ticks) -> tuple[tuple[tuple[Work, ...], ...], ...]:
  """The forward loop's ticks, then the backward loop's: the forward's in reverse."""
  forward = [
    tuple(tuple(_forward_work(ticks, t, s)) for s in range(ticks.num_stages))
    for t in range(ticks.num_forward_ticks)
  ]
  backward = [
    tuple(
      tuple(w for _, k, v in works for w in (("B", k, v), ("W", k, v)))
      for works in tick
    )
    for tick in reversed(forward)
  ]
  return (*forward, *backward)


def _one_f_one_b_table(ticks: _Ticks) -> tuple[tuple[tuple[Work, ...], ...], ...]:
  table = []
  for t in range(ticks.num_1f1b_ticks):
    row = []
    for s in range(ticks.num_stages):
      works = _forward_work(ticks, t, s)
      k, v, active = ticks.backward(t, s)
      if active:
        works += [("B", k, v), ("W", k, v)]
      row.append(tuple(works))
    table.append(tuple(row))
  return tuple(table)


# --- ZB-H1: one of F, B and W per tick, from each stage's order -------------------


def _zero_bubble_order(num_stages: int, num_microbatches: int, stage: int) -> list:
  """Stage s's F, B and W in the order it runs them (ZB-H1).

  S − s forwards first, as 1F1B's warm-up and one; then a B, the W that
  leaves s micro-batches waiting for theirs, and an F, in turn. Holding s W
  back lets the later stages run each B as soon as its cotangent arrives in
  the last ticks, where W fill the time 1F1B's devices wait. Every stage
  then holds at most S micro-batches between F and W, as stage 0 does.
  """
  K = num_microbatches
  order = [("F", k, 0) for k in range(min(num_stages - stage, K))]
  forwards, backwards, weights = len(order), 0, 0
  while backwards < K:
    order.append(("B", backwards, 0))
    backwards += 1
    while backwards - weights > stage:
      order.append(("W", weights, 0))
      weights += 1
    if forwards < K:
      order.append(("F", forwards, 0))
      forwards += 1
  order += [("W", k, 0) for k in range(weights, K)]
  return order


def _zero_bubble_table(
  num_stages: int, num_microbatches: int
) -> tuple[tuple[tuple[Work, ...], ...], ...]:
  """Each stage runs its order, each op in the first tick after what it needs.

  F of micro-batch k on stage s needs its F on stage s − 1, B needs its B on
  stage s + 1 (on the last stage, its F), W its B on the same stage: each
  done in an earlier tick, whose exchange brought the activation or
  cotangent.
  """
  S = num_stages
  orders = [_zero_bubble_order(S, num_microbatches, s) for s in range(S)]
  done: dict[Work, int] = {}  # (kind, micro-batch, stage) -> tick
  position = [0] * S
  table = []
  while any(position[s] < len(orders[s]) for s in range(S)):
    t = len(table)
    row = []
    for s in range(S):
      work = orders[s][position[s]] if position[s] < len(orders[s]) else None
      need = None if work is None else _needs(work, s, S)
      if need is not None and done.get(need, t) >= t:
        work = None
      row.append(work)
    if not any(row):
      raise AssertionError(f"ZB-H1 deadlocked at tick {t}: {position}")
    for s, work in enumerate(row):
      if work is not None:
        done[work[0], work[1], s] = t
        position[s] += 1
    table.append(tuple(() if work is None else (work,) for work in row))
  return tuple(table)


def _needs(work: Work, stage: int, num_stages: int) -> Work | None:
  """What must run before `work` on `stage`: `(kind, micro-batch, stage)`."""
  kind, k, _ = work
  if kind == "F":
    return ("F", k, stage - 1) if stage > 0 else None
  if kind == "B":
    return ("B", k, stage + 1) if stage < num_stages - 1 else ("F", k, stage)
  return ("B", k, stage)


class ZeroBubbleTables(NamedTuple):
  """A zero-bubble schedule as the loop reads it.

  Attributes:
    table: `[ticks, S]` int32: what device s runs in tick t, 0 (idle) or
      1 + its index in `KINDS`, plus (len(KINDS) + 1) × its micro-batch.
    sizes: for each of what waits on a device (`"x"`, `"cotangent"`: what
      arrived, until used; `"fb"`, `"fw"`, `"bw"`: from F to B, F to W and B
      to W), the most micro-batches that wait at once on any device: its
      ring's slots. Micro-batches wait in order, so micro-batch k's slot
      `k % size` holds no other while it waits.
  """

  table: np.ndarray
  sizes: dict[str, int]


def zero_bubble_tables(schedule: PipelineSchedule) -> ZeroBubbleTables:
  """`schedule`'s table as codes, and the rings its loop needs (V = 1)."""
  S, K = schedule.num_stages, schedule.num_microbatches
  num_kinds = len(KINDS) + 1
  table = np.zeros((schedule.num_ticks, S), np.int32)
  when = {kind: np.zeros((S, K), np.int64) for kind in KINDS}
  for t, tick in enumerate(schedule.ticks):
    for s, works in enumerate(tick):
      for kind, k, _ in works:
        table[t, s] = KINDS.index(kind) + 1 + num_kinds * k
        when[kind][s, k] = t
  F, B, W = when["F"], when["B"], when["W"]
  # Each wait, per device, from the tick its value is there (stored in the
  # tick it arrives, or written after the branch that computes it) to the
  # tick that reads it, both counted.
  waits = {
    "x": [(F[s - 1] + 1, F[s]) for s in range(1, S)],
    "cotangent": [(B[s + 1] + 1, B[s]) for s in range(S - 1)] + [(F[-1], B[-1])],
    "fb": [(F[s], B[s]) for s in range(S)],
    "fw": [(F[s], W[s]) for s in range(S)],
    "bw": [(B[s], W[s]) for s in range(S)],
  }
  sizes = {
    name: max([1] + [_most_at_once(*w) for w in w_list])
    for name, w_list in waits.items()
  }
  return ZeroBubbleTables(table, sizes)


def _most_at_once(starts: np.ndarray, ends: np.ndarray) -> int:
  """The most intervals `[starts[k], ends[k]]` holding one tick; both rise with k."""
  assert np.all(np.diff(starts) > 0) and np.all(np.diff(ends) > 0)
  ticks = np.arange(starts.min(), ends.max() + 1)
  begun = np.searchsorted(starts, ticks, side="right")
  ended = np.searchsorted(ends, ticks, side="left")
  return int((begun - ended).max())

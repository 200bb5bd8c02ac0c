"""Pipeline schedules: what each device runs, tick by tick, in one step.

A tick is what every device does between two exchanges with its neighbours:
some of F (a stage's forward on one micro-batch), B (its backward to the
stage's input, which the previous stage waits for) and W (its backward to the
stage's weights, which nothing waits for). `pipeline_schedule` returns the
schedule `jaccum.pipeline` runs, as a table; the pipeline builds its loop from
the same object.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Literal, NamedTuple

import numpy as np

from jaccum._core.microbatch import check_num_microbatches

ScheduleName = Literal["gpipe", "1f1b", "zb-h1", "zb-v"]
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-v")
# What runs in a tick, and its code in the zero-bubble loop's table (0 is idle).
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
    schedule: `"gpipe"`, `"1f1b"`, `"zb-h1"` or `"zb-v"`.
    num_stages: S, devices on the stage axis.
    num_microbatches: K, micro-batches per step (per data shard).
    num_virtual_stages: V, stages per device; chunk v of device s is stage
      v·S + s, but with `"zb-v"` stage s (chunk 0) and 2S − 1 − s (chunk 1).
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
  - `"zb-v"`: the zero-bubble schedule ZB-V of Qi et al., V = 2 chunks per
    device placed in a V: device s holds stages s (chunk 0, run down the
    devices) and 2S − 1 − s (chunk 1, back up), so the last stage and its
    loss are on device 0, beside the first. One of F, B or W per tick, each
    half a stage's: in every tick a device runs the ready F or B of the
    earliest micro-batch (an F counted ⌊(S − 1)/2⌋ micro-batches early), an
    F only while fewer than 2S of its chunks' micro-batches wait for their W
    (1F1B's S whole stages on device 0), else a W. For K ≥ S it takes
    6K + S − 1 ticks up to S = 4 (and at most S/2 more beyond, at K close
    to S): the fewest possible, since the last device's first forward comes
    S − 1 ticks after the first's. Needs V = 2.

  Args:
    num_stages: S, the size of the pipeline's stage axis.
    num_microbatches: K, micro-batches per step and data shard.
    schedule: `"gpipe"`, `"1f1b"`, `"zb-h1"` or `"zb-v"`.
    num_virtual_stages: V, stages per device (2 with `"zb-v"`).

  Returns:
    A `PipelineSchedule`: its `ticks`, `idle` share and `time`; `print` it
    for the table.

  Raises:
    TypeError: `num_stages`, `num_microbatches` or `num_virtual_stages` is
      not an int (or is a bool).
    ValueError: `num_stages`, `num_microbatches` or `num_virtual_stages` is
      below 1, `schedule` is unknown, `"zb-h1"` has V > 1, or `"zb-v"` has
      V other than 2.

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

    ZB-V at S = 4, K = 8: 6K + S − 1 = 51 ticks of half a stage each, idle
    3/51 against ZB-H1's 3/27:

    >>> zb_v = jaccum.pipeline_schedule(4, 8, schedule="zb-v", num_virtual_stages=2)
    >>> zb_v.num_ticks, f"{zb_v.idle:.1%}"
    (51, '5.9%')
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
  elif schedule == "zb-h1":
    table = _zero_bubble_table(num_stages, num_microbatches)
  else:
    table = _zero_bubble_v_table(num_stages, num_microbatches)
  return PipelineSchedule(schedule, num_stages, num_microbatches, num_chunks, table)


def check_schedule(schedule: Any, num_chunks: int) -> None:
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
  if schedule == "zb-h1" and num_chunks > 1:
    raise ValueError(
      f'schedule="zb-h1" runs one stage per device, but num_virtual_stages='
      f'{num_chunks}: use num_virtual_stages=1, or "zb-v" (two stages per '
      'device) or "1f1b" for more.'
    )
  if schedule == "zb-v" and num_chunks != 2:
    raise ValueError(
      f'schedule="zb-v" runs two stages per device, placed in a V, but '
      f"num_virtual_stages={num_chunks}: pass num_virtual_stages=2."
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

  With `v_shape` (ZB-V's placement, V = 2) chunk 0 of device s is stage s
  and chunk 1 stage 2S − 1 − s; micro-batch k enters at tick 2k and passes
  stage l forward at tick 2k + l, so that a device's chunk 0 runs at ticks
  of the parity of s and its chunk 1 at the others: forwards only (GPipe's
  loop, which the zero-bubble loop's custom VJP runs undifferentiated).
  """

  num_stages: int
  num_chunks: int
  num_microbatches: int
  v_shape: bool = False

  def stage(self, device: Any, chunk: Any) -> Any:
    """The stage that chunk `chunk` of `device` holds."""
    if self.v_shape:
      return device + chunk * (2 * self.num_stages - 1 - 2 * device)
    return chunk * self.num_stages + device

  def is_first(self, device: Any, chunk: Any) -> Any:
    return (device == 0) & (chunk == 0)

  def is_last(self, device: Any, chunk: Any) -> Any:
    """Does chunk `chunk` of `device` hold the last stage, the loss's?"""
    return self.stage(device, chunk) == self.num_stages * self.num_chunks - 1

  @property
  def last_device(self) -> int:
    return 0 if self.v_shape else self.num_stages - 1

  @property
  def cyclic(self) -> bool:
    """Do activations pass from the last device to the first (interleaved)?"""
    return self.num_chunks > 1 and not self.v_shape

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
    if self.v_shape:
      offset = tick - device
      chunk = offset % 2
      microbatch = (offset - chunk * (2 * self.num_stages - 1 - 2 * device)) // 2
      active = (microbatch >= 0) & (microbatch < self.num_microbatches)
      return microbatch, chunk, active
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
    if self.v_shape:
      return 2 * (self.num_microbatches + self.num_stages - 1)
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


# --- the zero-bubble schedules: one of F, B and W per tick ---------------------

Op = tuple[str, int, int, int]  # (kind, micro-batch, chunk, device)


class _Placement(NamedTuple):
  """Where the zero-bubble schedules' stages live, and what each pass needs.

  ZB-H1: stage s on device s. ZB-V (`v_shape`): chunk 0 of device s is
  stage s and chunk 1 stage 2S − 1 − s.
  """

  num_stages: int
  v_shape: bool

  @property
  def num_layers(self) -> int:
    return self.num_stages * (2 if self.v_shape else 1)

  def stage(self, chunk: int, device: int) -> int:
    return _Ticks(self.num_stages, 2, 1, self.v_shape).stage(device, chunk)

  def place(self, stage: int) -> tuple[int, int]:
    """`(chunk, device)` of `stage`."""
    S = self.num_stages
    return (0, stage) if stage < S else (1, 2 * S - 1 - stage)

  def needs(self, work: Work, device: int) -> Op | None:
    """What must run before `work` on `device`: F after the previous
    stage's F, B after the next stage's B (on the last stage, after its
    own F), W after its B."""
    kind, k, chunk = work
    stage = self.stage(chunk, device)
    if kind == "F":
      return None if stage == 0 else ("F", k, *self.place(stage - 1))
    if kind == "B" and stage < self.num_layers - 1:
      return ("B", k, *self.place(stage + 1))
    return ("F" if kind == "B" else "B", k, chunk, device)

  def consumer(self, work: Work, device: int) -> Op | None:
    """What reads `work`'s output: the next stage's F, the previous stage's
    B, or, for the last stage's F, its own B (the loss's cotangent)."""
    kind, k, chunk = work
    stage = self.stage(chunk, device)
    if kind == "F" and stage == self.num_layers - 1:
      return ("B", k, chunk, device)
    if kind == "F":
      return ("F", k, *self.place(stage + 1))
    if kind == "B" and stage > 0:
      return ("B", k, *self.place(stage - 1))
    return None


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


Table = tuple[tuple[tuple[Work, ...], ...], ...]
# `pick(device, counts, ready)`: what `device` runs this tick, or None;
# `counts[kind, chunk]` says how many of those it has run (each kind and
# chunk runs its micro-batches in order), `ready(work)` whether what `work`
# needs ran in an earlier tick.
Pick = Any


def _simulate(placement: _Placement, num_microbatches: int, pick: Pick) -> Table:
  """The ticks in which every device runs, one at a time, what `pick` chooses."""
  S, K = placement.num_stages, num_microbatches
  num_chunks = 2 if placement.v_shape else 1
  done: dict[Op, int] = {}
  counts = [dict.fromkeys(((k, c) for k in KINDS for c in range(num_chunks)), 0)]
  counts = [dict(counts[0]) for _ in range(S)]
  table = []
  while len(done) < 3 * K * S * num_chunks:
    t = len(table)

    def ready(work: Work, device: int, t: int = t) -> bool:
      need = placement.needs(work, device)
      return need is None or done.get(need, t) < t

    row = [pick(s, counts[s], functools.partial(ready, device=s)) for s in range(S)]
    if not any(row):
      raise AssertionError(f"the zero-bubble schedule deadlocked at tick {t}")
    for s, work in enumerate(row):
      if work is not None:
        done[(*work, s)] = t
        counts[s][work[0], work[2]] += 1
    table.append(tuple(() if work is None else (work,) for work in row))
  return tuple(table)


@functools.cache
def _zero_bubble_table(num_stages: int, num_microbatches: int) -> Table:
  """ZB-H1: each stage runs its order, each pass in the first tick after
  what it needs."""
  orders = [
    _zero_bubble_order(num_stages, num_microbatches, s) for s in range(num_stages)
  ]

  def pick(device, counts, ready):
    order, position = orders[device], sum(counts.values())
    work = order[position] if position < len(order) else None
    return work if work is not None and ready(work) else None

  return _simulate(_Placement(num_stages, False), num_microbatches, pick)


@functools.cache
def _zero_bubble_v_table(num_stages: int, num_microbatches: int) -> Table:
  """ZB-V: in each tick, each device runs the ready F or B of the earliest
  micro-batch, counting an F ⌊(S − 1)/2⌋ micro-batches earlier than it is
  (a B before an F, chunk 1 before chunk 0, on a tie), and an F only while
  fewer than 2S of its micro-batch chunks wait for their W; else a W.

  B soon, because the previous stage waits for it; F a little ahead of B,
  so that the last micro-batches' forwards reach the turn without waiting
  behind backwards; no more chunks in flight than 1F1B's first stage holds
  (S whole stages: 2S chunks); W, which nothing waits for, where the device
  would otherwise idle. For S ≤ 4 and K ≥ S (and most K beyond at more
  stages) this takes 6K + S − 1 ticks, the fewest any schedule can: the last
  device's first F comes S − 1 ticks after the first device's.
  """
  S, K = num_stages, num_microbatches
  lead = (S - 1) // 2

  def pick(device, counts, ready):
    in_flight = sum(counts["F", c] - counts["W", c] for c in (0, 1))
    runs = [
      (kind, counts[kind, c], c)
      for kind in ("B", "F")
      for c in (1, 0)
      if counts[kind, c] < K and (kind == "B" or in_flight < 2 * S)
    ]
    runs = [w for w in runs if ready(w)]
    if runs:
      return min(runs, key=lambda w: (w[1] - lead * (w[0] == "F"), w[0] == "F"))
    weights = [("W", counts["W", c], c) for c in (1, 0) if counts["W", c] < K]
    weights = [w for w in weights if ready(w)]
    return min(weights, key=lambda w: w[1]) if weights else None

  return _simulate(_Placement(S, True), K, pick)


# The zero-bubble loop's table: for device s in tick t, what it runs and the
# slots it reads and writes.
COLUMNS = (
  "work",  # 0 idle, else 1 + the index in KINDS
  "microbatch",
  "chunk",
  "x",  # the inbox slot of F's input
  "cotangent",  # the inbox slot of B's output cotangent
  "fb",  # the ring slots of what waits from F to B, F to W, B to W
  "fw",
  "bw",
  "from_previous",  # the inbox slots where tick t − 1's messages are stored:
  "from_next",  # from the previous device, the next and the device itself
  "from_self",
)
_SOURCES = {1: "from_previous", -1: "from_next", 0: "from_self"}


class ZeroBubbleTables(NamedTuple):
  """A zero-bubble schedule as the loop reads it.

  Every F and B output goes on at once to the device whose pass reads it
  (`ppermute` to both neighbours, and kept for the device itself); there it
  waits in the inbox, a ring of slots, from the tick after until the pass
  that reads it. What a pass keeps for later waits in rings `fb` (from F to
  B), `fw` (F to W) and `bw` (B to W). Each wait has a slot of its own for
  its duration, ticks at both ends counted, assigned per device: a ring has
  as many slots as one device ever holds at once. A message no pass of the
  device reads is stored in a slot free in that tick, so that stores need
  no condition.

  Attributes:
    table: `[ticks, S, len(COLUMNS)]` int32, as `COLUMNS` says.
    sizes: the slots of each ring: `"inbox"`, `"fb"`, `"fw"`, `"bw"`.
  """

  table: np.ndarray
  sizes: dict[str, int]


def zero_bubble_tables(schedule: PipelineSchedule) -> ZeroBubbleTables:
  """`schedule`'s table as codes and slots, and the rings its loop needs."""
  S = schedule.num_stages
  placement = _Placement(S, schedule.schedule == "zb-v")
  when: dict[Op, int] = {}
  for t, tick in enumerate(schedule.ticks):
    for s, works in enumerate(tick):
      for kind, k, c in works:
        when[kind, k, c, s] = t
  inbox, stores = {}, {}
  for (kind, k, c, s), t in when.items():
    reader = None if kind == "W" else placement.consumer((kind, k, c), s)
    if reader is not None:
      inbox[reader] = (t + 1, when[reader])
      stores[t + 1, reader[3], _SOURCES[reader[3] - s]] = reader
  passes = [key[1:] for key in when if key[0] == "F"]
  at = lambda kind, key: when[(kind, *key)]
  waits = {
    "inbox": inbox,
    "fb": {key: (at("F", key), at("B", key)) for key in passes},
    "fw": {key: (at("F", key), at("W", key)) for key in passes},
    "bw": {key: (at("B", key), at("W", key)) for key in passes},
  }
  slots = {name: _assign_slots(w, S, schedule.num_ticks) for name, w in waits.items()}
  sizes = {
    name: max(1, int(occupied.shape[2])) for name, (_, occupied) in slots.items()
  }
  table = np.zeros((schedule.num_ticks, S, len(COLUMNS)), np.int32)
  column = {name: i for i, name in enumerate(COLUMNS)}
  for (kind, k, c, s), t in when.items():
    row = table[t, s]
    row[: column["x"]] = KINDS.index(kind) + 1, k, c
    for name in ("fb", "fw", "bw"):
      row[column[name]] = slots[name][0][k, c, s]
    row[column["x"]] = slots["inbox"][0].get(("F", k, c, s), 0)
    row[column["cotangent"]] = slots["inbox"][0].get(("B", k, c, s), 0)
  # A store no pass reads goes to a slot free in its tick; if none is, to
  # one more slot.
  occupied = slots["inbox"][1]
  for t in range(schedule.num_ticks):
    for s in range(S):
      free = np.flatnonzero(~occupied[s, t])
      spare = int(free[0]) if free.size else occupied.shape[2]
      sizes["inbox"] = max(sizes["inbox"], spare + 1)
      for source in _SOURCES.values():
        reader = stores.get((t, s, source))
        slot = spare if reader is None else slots["inbox"][0][reader]
        table[t, s, column[source]] = slot
  return ZeroBubbleTables(table, sizes)


def _assign_slots(
  waits: dict[Any, tuple[int, int]], num_stages: int, num_ticks: int
) -> tuple[dict[Any, int], np.ndarray]:
  """A slot for each wait `[start, end]` (ticks), per device (a key's last
  element), none holding two waits in one tick.

  Returns the slots, and `occupied[s, t, slot]`: is the slot of device s
  held in tick t. Waits take, in the order they begin, the lowest slot free:
  as many slots as the most waits at once on a device (an interval graph's
  colouring).
  """
  slots: dict[Any, int] = {}
  ends: list[list[int]] = [[] for _ in range(num_stages)]  # per slot: last end
  for key, (start, end) in sorted(waits.items(), key=lambda item: item[1]):
    assert start <= end, (key, start, end)
    free = ends[key[-1]]
    slot = next((i for i, last in enumerate(free) if last < start), len(free))
    if slot == len(free):
      free.append(end)
    free[slot] = end
    slots[key] = slot
  size = max(len(e) for e in ends)
  occupied = np.zeros((num_stages, num_ticks + 1, size), bool)
  for key, (start, end) in waits.items():
    occupied[key[-1], start : end + 1, slots[key]] = True
  return slots, occupied

"""Batch sizes that change in training: K per step from a schedule or the noise scale.

`BatchSchedule` turns a schedule keyed by data (examples or tokens seen) into
the number of micro-batches K of every optimizer step and the data offset at
which each step starts, exactly, so that a data loader knows where it is after
the batch size changes. `BatchSizeController` proposes the next K from the
smoothed gradient noise scale (`NoiseScaleEMA`): the batch grows while the
critical batch estimated by `B_simple` exceeds it.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import operator
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaccum._training.noise_scale import NoiseScaleEMAState, noise_scale

Step = int | jax.Array | np.ndarray


def _check_int(value: Any, name: str, *, minimum: int) -> int:
  """Returns `value` as an int if it is an integer >= minimum, else raises."""
  if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
    raise TypeError(f"{name} must be an int >= {minimum}, got {value!r:.60}.")
  if value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value}.")
  return operator.index(value)


def _is_array(step: Any) -> bool:
  """Whether `step` takes the array route (jit-able) rather than Python ints."""
  if isinstance(step, bool | np.bool_):
    raise TypeError(f"step must be an int or an integer array, got the bool {step}.")
  if isinstance(step, int | np.integer):
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}.")
    return False
  if isinstance(step, jax.Array | np.ndarray) and jnp.issubdtype(
    step.dtype, jnp.integer
  ):
    return True
  raise TypeError(
    f"step must be an int or an integer array, got {type(step).__name__} {step!r:.60}."
  )


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
  """K per optimizer step, and where each step starts in the data, from a schedule.

  The schedule maps a data offset (examples, or tokens, seen before a step) to
  the number of micro-batches from there on: `{0: 4, 10_000: 8}` runs 4
  micro-batches per step until 10,000 examples have been seen, then 8. A step
  runs the K of the last entry at or before the offset at which it starts, so
  the batch changes at the first step boundary at or after each entry
  (a boundary need not fall on one); a whole step is never split. What it
  computes, in exact integer arithmetic::

    offset = 0
    for step in itertools.count():
      num_microbatches = schedule[max(o for o in schedule if o <= offset)]
      yield num_microbatches, offset          # this step's K and first example
      offset += num_microbatches * microbatch_size

  `changes` holds that sequence compressed to the steps where K changes, so
  every lookup is one search, and under `jit` an integer array of steps works
  too: pass `num_microbatches` as `jaccum.MultiSteps(every_k_schedule=...)`,
  or read it as the (traced) K of in-step accumulation.

  Args:
    schedule: `{offset: K}`, from the data offset (examples or tokens seen, in
      the units of `microbatch_size`) to the number of micro-batches per step;
      it must have an entry at 0. Pairs `[(offset, K), ...]` work too.
    microbatch_size: examples (or tokens) per micro-batch, over all devices:
      a step with K micro-batches consumes `K * microbatch_size` of them.

  Raises:
    TypeError, ValueError: for a bad schedule or `microbatch_size`, naming it.

  Examples:
    Micro-batches of 32 examples, 4 per step until 10,000 examples, then 8.
    10,000 is not a multiple of 128: step 78 starts at 9,984 < 10,000 and
    still runs 4; step 79 starts at 10,112 and runs 8.

    >>> import jax.numpy as jnp, jaccum
    >>> schedule = jaccum.BatchSchedule({0: 4, 10_000: 8}, microbatch_size=32)
    >>> schedule.changes  # (first step, its offset, K) of each stretch
    ((0, 0, 4), (79, 10112, 8))
    >>> [schedule.num_microbatches(s) for s in (0, 78, 79)]
    [4, 4, 8]
    >>> [schedule.offset(s) for s in (78, 79, 80)]
    [9984, 10112, 10368]
    >>> schedule.num_microbatches(jnp.arange(77, 81))  # arrays too, under jit
    Array([4, 4, 8, 8], dtype=int32)

    Megatron's `--rampup-batch-size 32 32 6000` with a global batch of 128
    and micro-batches of 32: K from 1 to 4, one more every 2,000 samples.

    >>> ramp = jaccum.BatchSchedule.ramp(1, 4, increment=1, over=6000,
    ...                                  microbatch_size=32)
    >>> ramp.schedule
    ((0, 1), (2000, 2), (4000, 3), (6000, 4))
    >>> ramp.changes
    ((0, 0, 1), (63, 2016, 2), (94, 4000, 3), (115, 6016, 4))
  """

  schedule: Mapping[int, int] | Iterable[tuple[int, int]]
  microbatch_size: int

  def __post_init__(self) -> None:
    _check_int(self.microbatch_size, "microbatch_size", minimum=1)
    schedule: Any = self.schedule
    try:
      items = [
        tuple(item)
        for item in (schedule.items() if isinstance(schedule, Mapping) else schedule)
      ]
    except TypeError:
      raise TypeError(
        "schedule must be a mapping {offset: num_microbatches}, e.g. "
        f"{{0: 4, 10_000: 8}}, got {schedule!r:.60}."
      ) from None
    pairs = []
    for item in items:
      if len(item) != 2:
        raise ValueError(f"schedule must hold (offset, K) pairs, got {item!r:.60}.")
      offset, k = item
      offset = _check_int(offset, f"schedule's offset {offset!r}", minimum=0)
      k = _check_int(k, f"schedule[{offset}]", minimum=1)
      pairs.append((offset, k))
    pairs.sort()
    offsets = [offset for offset, _ in pairs]
    if len(set(offsets)) != len(offsets):
      raise ValueError(f"schedule has an offset twice: {pairs}.")
    if not pairs or offsets[0] != 0:
      raise ValueError(
        "schedule must say K from the start, with an entry at offset 0, e.g. "
        f"{{0: 4, 10_000: 8}}, got {dict(pairs)}."
      )
    object.__setattr__(self, "schedule", tuple(pairs))
    object.__setattr__(self, "_changes", _changes(pairs, self.microbatch_size))

  @classmethod
  def ramp(
    cls, start: int, stop: int, *, increment: int, over: int, microbatch_size: int
  ) -> BatchSchedule:
    """A Megatron-style ramp-up: K from `start` to `stop`, evenly over `over` examples.

    Megatron-LM's `--rampup-batch-size S I R` with `--global-batch-size G`,
    counted in micro-batches of `microbatch_size` examples: `start = S / m`,
    `increment = I / m`, `stop = G / m`, `over = R`. A step that starts after
    `c` examples runs `start + increment * min(⌊c n / over⌋, n)` micro-batches,
    `n = (stop - start) / increment`, as Megatron's `update(consumed_samples)`
    computes it (in exact arithmetic; Megatron divides in floating point).

    Args:
      start: K at the start.
      stop: K at the end of the ramp, and after.
      increment: how much K grows at a time; it must divide `stop - start`.
      over: examples (or tokens) over which K grows from `start` to `stop`.
      microbatch_size: as for `BatchSchedule`.

    Returns:
      The `BatchSchedule` with one entry per increment.

    Examples:
      >>> import jaccum
      >>> ramp = jaccum.BatchSchedule.ramp(2, 8, increment=2, over=900,
      ...                                  microbatch_size=16)
      >>> ramp.schedule
      ((0, 2), (300, 4), (600, 6), (900, 8))
      >>> [ramp.num_microbatches(s) for s in range(0, 30, 5)]
      [2, 2, 4, 6, 8, 8]
    """
    start = _check_int(start, "start", minimum=1)
    stop = _check_int(stop, "stop", minimum=start)
    increment = _check_int(increment, "increment", minimum=1)
    over = _check_int(over, "over", minimum=1)
    if (stop - start) % increment:
      raise ValueError(
        f"increment={increment} must divide stop - start = {stop - start} "
        "(as Megatron requires), so that the ramp ends at stop."
      )
    steps = (stop - start) // increment
    schedule = {0: start}
    for i in range(1, steps + 1):
      # ⌊c·n / over⌋ ≥ i exactly when c ≥ ⌈i·over / n⌉; a later i sharing
      # the same threshold (over < n) overrides the earlier one, as it should.
      schedule[-(-i * over // steps)] = start + i * increment
    return cls(schedule, microbatch_size)

  @property
  def changes(self) -> tuple[tuple[int, int, int], ...]:
    """`(step, offset, K)` for the first step of each stretch at one K, in order.

    The table every lookup reads: step `s` with `step <= s < next step` starts
    at `offset + (s - step) * K * microbatch_size`. An entry of the schedule
    that a single step jumps over never runs, and consecutive entries with
    the same K make one stretch.

    Examples:
      >>> import jaccum
      >>> jaccum.BatchSchedule({0: 8, 100: 2, 200: 4}, microbatch_size=32).changes
      ((0, 0, 8), (1, 256, 4))
    """
    return self._changes  # pyright: ignore[reportAttributeAccessIssue]

  @property
  def max_num_microbatches(self) -> int:
    """The largest K the schedule runs: the capacity a traced K needs.

    Examples:
      >>> import jaccum
      >>> jaccum.BatchSchedule({0: 2, 64: 8, 512: 4}, 16).max_num_microbatches
      8
    """
    return max(k for _, _, k in self.changes)

  def num_microbatches(self, step: Step) -> Any:
    """The number of micro-batches of optimizer step `step` (from 0).

    Args:
      step: a Python int, or an integer array (traced under `jit`, e.g. the
        `gradient_step` that `jaccum.MultiSteps` passes to its
        `every_k_schedule`).

    Returns:
      An int for an int; an int32 array of `step`'s shape for an array.

    Examples:
      >>> import jax, jax.numpy as jnp, jaccum
      >>> schedule = jaccum.BatchSchedule({0: 1, 40: 2, 100: 4}, 10)
      >>> [schedule.num_microbatches(s) for s in range(8)]
      [1, 1, 1, 1, 2, 2, 2, 4]
      >>> jax.jit(schedule.num_microbatches)(jnp.int32(6))
      Array(2, dtype=int32)
    """
    if not _is_array(step):
      return self.changes[self._stretch(step)][2]
    table = jnp.asarray([k for _, _, k in self.changes], jnp.int32)
    return table[self._stretch_array(step)]

  def offset(self, step: Step) -> Any:
    """The examples (or tokens) seen before optimizer step `step` (from 0).

    Step `step` consumes the data from `offset(step)` to `offset(step + 1)`;
    a data loader resuming at a step starts reading there.

    Args:
      step: a Python int, or an integer array.

    Returns:
      For an int, the exact offset, an int. For an array, a float32 array,
      for a learning-rate schedule under `jit` (see `by_step`): exact up to
      2²⁴ (16.7 million), within a relative 6e-8 beyond (int32 would wrap
      around at 2.1 billion tokens).

    Examples:
      >>> import jax.numpy as jnp, jaccum
      >>> schedule = jaccum.BatchSchedule({0: 1, 40: 2, 100: 4}, 10)
      >>> [schedule.offset(s) for s in range(9)]
      [0, 10, 20, 30, 40, 60, 80, 100, 140]
      >>> schedule.offset(jnp.arange(6, 9))
      Array([ 80., 100., 140.], dtype=float32)
    """
    m = self.microbatch_size
    if not _is_array(step):
      first_step, first_offset, k = self.changes[self._stretch(step)]
      return first_offset + (step - first_step) * k * m
    stretch = self._stretch_array(step)
    first_steps, first_offsets, sizes = zip(*self.changes, strict=True)
    first_step = jnp.asarray(first_steps, jnp.int32)[stretch]
    first_offset = jnp.asarray(first_offsets, jnp.float32)[stretch]
    k = jnp.asarray(sizes, jnp.float32)[stretch]
    return first_offset + (step - first_step).astype(jnp.float32) * k * m

  def by_step(self, fn: Callable[[jax.Array], Any]) -> Callable[[Step], Any]:
    """Turns a schedule of the data offset into one of the optimizer step.

    optax's schedules are called with the optimizer's step count; to key a
    learning rate by examples (or tokens) seen instead, write it as a
    function of the offset and pass `by_step(fn)` to the optimizer:
    `by_step(fn)(step) == fn(offset(step))`, the offset as a float32 array.

    Args:
      fn: a function of the data offset, e.g. an optax schedule whose
        `decay_steps` and `warmup_steps` are counted in examples.

    Returns:
      The function of the step `step -> fn(offset(step))`.

    Examples:
      Warm-up over the first 100 examples, whatever the batch does meanwhile:

      >>> import jax.numpy as jnp, optax, jaccum
      >>> schedule = jaccum.BatchSchedule({0: 1, 40: 2, 100: 4}, 10)
      >>> by_examples = optax.linear_schedule(0.0, 1.0, transition_steps=100)
      >>> learning_rate = schedule.by_step(by_examples)
      >>> [float(learning_rate(jnp.int32(s))) for s in range(0, 9, 2)]
      [0.0, 0.2, 0.4, 0.8, 1.0]
    """

    def by_step(step: Step) -> Any:
      return fn(self.offset(jnp.asarray(step)))

    return by_step

  def _stretch(self, step: Any) -> int:
    return bisect.bisect_right(self.changes, step, key=lambda change: change[0]) - 1

  def _stretch_array(self, step: Any) -> jax.Array:
    starts = jnp.asarray([first_step for first_step, _, _ in self.changes], jnp.int32)
    # A negative step (it cannot be checked when traced) reads the first stretch.
    return jnp.maximum(jnp.searchsorted(starts, step, side="right") - 1, 0)


def _changes(pairs: list[tuple[int, int]], microbatch_size: int) -> tuple:
  """`(first step, its offset, K)` of each stretch of steps at one K."""
  offsets = [offset for offset, _ in pairs]
  changes, step, offset = [], 0, 0
  while True:
    entry = bisect.bisect_right(offsets, offset) - 1  # the last entry <= offset
    k = pairs[entry][1]
    if not changes or changes[-1][2] != k:
      changes.append((step, offset, k))
    if entry + 1 == len(pairs):
      return tuple(changes)
    # The steps at this K until one starts at or after the next entry.
    batch = k * microbatch_size
    num_steps = -(-(offsets[entry + 1] - offset) // batch)
    step, offset = step + num_steps, offset + num_steps * batch


class BatchSizeControllerState(NamedTuple):
  """State of `BatchSizeController`: the K it proposes, and the learning-rate factor.

  Attributes:
    num_microbatches: int32, K for the next step.
    lr_scale: float32, the factor by which to multiply the learning rate (or
      the optimizer's updates) for the next step: `(K / K₀) ** p` with `K₀`
      the K of `init`, `p` given by `lr_scaling` (1.0 without).
    steps_at_size: int32, the steps run since K last changed (or since `init`).

  Examples:
    >>> import jaccum
    >>> controller = jaccum.BatchSizeController(16, max_num_microbatches=8)
    >>> state = controller.init(2)
    >>> int(state.num_microbatches), float(state.lr_scale), int(state.steps_at_size)
    (2, 1.0, 0)
  """

  num_microbatches: jax.Array
  lr_scale: jax.Array
  steps_at_size: jax.Array


_LR_POWERS = {None: 0.0, "linear": 1.0, "sqrt": 0.5}


@dataclasses.dataclass(frozen=True)
class BatchSizeController:
  """Proposes the next K from the gradient noise scale: grow while it exceeds the batch.

  McCandlish et al. (2018): below the critical batch size, a bigger batch
  takes proportionally fewer steps for nearly the same examples; above it, it
  costs examples for few steps saved. `B_simple`, which `NoiseScaleEMA`
  smooths, estimates it, and it grows during training as the gradient shrinks
  against its noise. After each step, with `b` that smoothed `B_simple`
  (from the `NoiseScaleEMAState`) divided by `headroom`, and
  `m = microbatch_size`::

    up = min(ceil(K * growth), max_num_microbatches)
    down = max(floor(K * shrink), min_num_microbatches)
    if steps run at K >= cooldown:
      if b > K * m:       K = up      # the batch is below the critical batch
      elif b < down * m:  K = down    # even the smaller batch would be above it
    lr_scale = (K / K_init) ** p      # p: 1 "linear", 0.5 "sqrt", 0 None

  `up` and `down` are exact: `growth` and `shrink` count as the decimals they
  are written as (1.2 is 6/5, so 45 grows to 54) and the step computes them
  in int32 arithmetic, under `jit` too.

  Between the two conditions K holds (`down * m <= b <= K * m`), so it does
  not flip back and forth; a NaN `b` (no estimate yet) holds, an infinite one
  (the noise hides the gradient) grows. K changes by at most the factor
  `growth` up or `shrink` down per change, and at most once per `cooldown`
  steps: the batch never shrinks faster than `shrink ** (1 / cooldown)` per
  step.

  With `headroom = 1` the batch tracks the critical batch itself, where
  McCandlish et al.'s model spends about twice the fewest steps and twice the
  fewest examples; a `headroom` of h keeps it near `B_simple / h`, saving
  fewer steps for fewer extra examples (measured in the batch-size guide).

  The learning-rate rule follows the optimizer: linear scaling for SGD (Goyal
  et al. 2017; Smith et al. 2018 trade learning-rate decay for batch growth
  by this rule) and square-root scaling for Adam (Malladi et al. 2022), which
  OLMo-core's `BatchSizeSchedulerCallback` applies on every change. Multiply
  the optimizer's updates by `lr_scale`: for SGD, Adam(W) and other
  optimizers whose update is the learning rate times a direction, that is
  the same as scaling the learning rate.

  Pure and jit-able, like `NoiseScaleEMA`: the state is three scalars to keep
  beside the optimizer state and save in the same checkpoint.

  Args:
    microbatch_size: examples per micro-batch over all devices, in the units
      of the noise scale: with `weight_fn` counting tokens, the mean tokens
      per micro-batch.
    max_num_microbatches: the largest K to propose.
    min_num_microbatches: the smallest K to propose.
    growth: the factor K grows by per change, > 1 (1 never grows).
    shrink: the factor K shrinks by per change, in (0, 1] (1 never shrinks).
      Either must be a fraction `p / q` with `max_num_microbatches * q` below
      2**31 (any decimal of up to 4 places with K up to 2**16), or within
      float32's precision of one.
    headroom: how far below `B_simple` to keep the batch, >= 1: K grows only
      while `B_simple > headroom * K * m`.
    cooldown: the fewest steps run at one K before it may change (counting
      from `init`); 1 lets it change after any step.
    lr_scaling: `None`, `"linear"` (SGD) or `"sqrt"` (Adam).

  Raises:
    TypeError, ValueError: for a bad argument, naming it.

  Examples:
    Micro-batches of 16 examples, K from 2 (a batch of 32): a noise scale of
    50 exceeds the batch, so K doubles to 4 (64 ≥ 50) and holds there; at 10
    the batch of 2 micro-batches would still exceed it, so K halves.

    >>> import jax.numpy as jnp, jaccum
    >>> controller = jaccum.BatchSizeController(
    ...   16, max_num_microbatches=32, lr_scaling="sqrt")
    >>> def smoothed(b_simple):  # a NoiseScaleEMAState with tr(Σ)/|G|² = b_simple
    ...   return jaccum.NoiseScaleEMAState(jnp.int32(100), jnp.float32(1),
    ...                                    jnp.float32(b_simple))
    >>> state = controller.init(2)
    >>> for b_simple in (50, 50, 10):
    ...   state = controller.update(state, smoothed(b_simple))
    ...   print(int(state.num_microbatches), round(float(state.lr_scale), 4))
    4 1.4142
    4 1.4142
    2 1.0
  """

  microbatch_size: float
  max_num_microbatches: int
  min_num_microbatches: int = 1
  growth: float = 2.0
  shrink: float = 0.5
  headroom: float = 1.0
  cooldown: int = 1
  lr_scaling: Literal["linear", "sqrt"] | None = None

  def __post_init__(self) -> None:
    for name in ("microbatch_size", "growth", "shrink", "headroom"):
      value = getattr(self, name)
      if isinstance(value, bool | np.bool_) or not isinstance(
        value, int | float | np.integer | np.floating
      ):
        raise TypeError(f"{name} must be a number, got {value!r:.60}.")
    if not 0 < self.microbatch_size < math.inf:
      raise ValueError(f"microbatch_size must be > 0, got {self.microbatch_size}.")
    low = _check_int(self.min_num_microbatches, "min_num_microbatches", minimum=1)
    _check_int(self.max_num_microbatches, "max_num_microbatches", minimum=low)
    _check_int(self.cooldown, "cooldown", minimum=1)
    if not 1 <= self.growth < math.inf:
      raise ValueError(
        f"growth must be a factor >= 1 (2 doubles K), got {self.growth}."
      )
    if not 0 < self.shrink <= 1:
      raise ValueError(
        f"shrink must be a factor in (0, 1] (0.5 halves K, 1 never shrinks), "
        f"got {self.shrink}."
      )
    if not 1 <= self.headroom < math.inf:
      raise ValueError(
        f"headroom must be a factor >= 1 (1 grows the batch up to B_simple, 4 "
        f"up to B_simple / 4), got {self.headroom}."
      )
    for name in ("growth", "shrink"):
      _fraction(getattr(self, name), name, self.max_num_microbatches)
    if self.lr_scaling not in _LR_POWERS:
      raise ValueError(
        f"lr_scaling must be None, 'linear' (SGD) or 'sqrt' (Adam), got "
        f"{self.lr_scaling!r}."
      )

  def init(self, num_microbatches: int | None = None) -> BatchSizeControllerState:
    """The state before the first step: K, a learning-rate factor of 1.

    Args:
      num_microbatches: K for the first step, in `[min_num_microbatches,
        max_num_microbatches]`; by default `min_num_microbatches`.

    Examples:
      >>> import jaccum
      >>> controller = jaccum.BatchSizeController(8, 64, min_num_microbatches=4)
      >>> int(controller.init().num_microbatches)
      4
    """
    k = self.min_num_microbatches if num_microbatches is None else num_microbatches
    _check_int(k, "num_microbatches", minimum=self.min_num_microbatches)
    if k > self.max_num_microbatches:
      raise ValueError(
        f"num_microbatches must be <= max_num_microbatches="
        f"{self.max_num_microbatches}, got {k}."
      )
    return BatchSizeControllerState(
      num_microbatches=jnp.asarray(k, jnp.int32),
      lr_scale=jnp.ones((), jnp.float32),
      steps_at_size=jnp.zeros((), jnp.int32),
    )

  def update(
    self, state: BatchSizeControllerState, ema_state: NoiseScaleEMAState
  ) -> BatchSizeControllerState:
    """Proposes K for the next step, after a step that ran `state.num_microbatches`.

    Args:
      state: from `init` or the last `update`.
      ema_state: the `NoiseScaleEMA` state after the step, in the units of
        `microbatch_size`.

    Returns:
      The new state: `num_microbatches` for the next step and its `lr_scale`.

    Examples:
      >>> import jax, jax.numpy as jnp, jaccum
      >>> controller = jaccum.BatchSizeController(1, 64, cooldown=2)
      >>> ema = jaccum.NoiseScaleEMAState(jnp.int32(1), jnp.float32(1),
      ...                                 jnp.float32(1000))  # B_simple 1000
      >>> state, sizes = controller.init(), []
      >>> for _ in range(8):
      ...   state = jax.jit(controller.update)(state, ema)
      ...   sizes.append(int(state.num_microbatches))
      >>> sizes  # doubles every second step, up to the bound
      [1, 2, 2, 4, 4, 8, 8, 16]
    """
    if not isinstance(state, BatchSizeControllerState):
      raise TypeError(
        "state must be the BatchSizeControllerState from init or update, got "
        f"{type(state).__name__}."
      )
    if not isinstance(ema_state, NoiseScaleEMAState):
      raise TypeError(
        "ema_state must be the NoiseScaleEMAState of a jaccum.NoiseScaleEMA, got "
        f"{type(ema_state).__name__}; the controller reads the smoothed noise "
        "scale, not one step's AccumulationStats."
      )
    b_simple = noise_scale(ema_state) / self.headroom
    k = jnp.asarray(state.num_microbatches, jnp.int32)
    k_float = k.astype(jnp.float32)
    up = jnp.minimum(self._scaled(k, self.growth, ceil=True), self.max_num_microbatches)
    down = jnp.maximum(self._scaled(k, self.shrink), self.min_num_microbatches)
    ran = state.steps_at_size + 1
    may_change = ran >= self.cooldown
    # Comparisons with NaN are false: no estimate yet holds K.
    grow = may_change & (b_simple > k_float * self.microbatch_size)
    shrink = may_change & (b_simple < down.astype(jnp.float32) * self.microbatch_size)
    new_k = jnp.where(grow, up, jnp.where(shrink, down, k))
    changed = new_k != k
    power = _LR_POWERS[self.lr_scaling]
    ratio = new_k.astype(jnp.float32) / k_float
    lr_scale = state.lr_scale * (ratio**power if power else 1.0)
    return BatchSizeControllerState(
      num_microbatches=new_k,
      lr_scale=jnp.asarray(lr_scale, jnp.float32),
      steps_at_size=jnp.where(changed, 0, ran).astype(jnp.int32),
    )

  def _scaled(self, k: jax.Array, factor: float, *, ceil: bool = False) -> jax.Array:
    """`ceil(k * factor)` (or `floor`) in exact int32 arithmetic, capped at the max."""
    largest = self.max_num_microbatches
    p, q = _fraction(factor, "factor", largest)
    p = min(p, 2**31 - 1)  # a larger p leaves cap at 1, and p unused
    # From `cap` on, k * factor >= largest; below it, k * p < largest * q < 2**31.
    cap = -(-largest * q // p)
    small = jnp.minimum(k, cap)
    scaled = -(-small * p // q) if ceil else small * p // q
    return jnp.where(k < cap, scaled, largest)


def _fraction(factor: float, name: str, largest: int) -> tuple[int, int]:
  """`factor` as `(p, q)`, p / q the decimal it was written as, for int32 products.

  `Fraction(str(1.2))` is 6/5, where the float 1.2 is a little more than 6/5:
  `ceil(5 * 1.2)` would be 7 in exact arithmetic (and float32 rounds 45 * 1.2
  up to 55). A denominator too long for products `k * p < largest * q < 2**31`
  (`2 ** 0.5` written out) is cut to the nearest fraction that fits, if that
  is within float32's precision of the factor.
  """
  exact = Fraction(str(factor))
  fraction = exact.limit_denominator((2**31 - 1) // largest)
  if fraction <= 0 or abs(fraction - exact) > exact * 2**-24:
    raise ValueError(
      f"{name}={factor} is too fine for exact int32 arithmetic with "
      f"max_num_microbatches={largest} (K * {name} must stay below 2**31 as a "
      f"fraction): round it to fewer decimals, or lower max_num_microbatches."
    )
  return fraction.numerator, fraction.denominator

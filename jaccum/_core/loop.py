"""The local loop: K micro-steps folded into one carry, on this device.

Everything is decided before the loop (`LoopPlan`, made by the plan): how
micro-batch k is cut and keyed, the traced micro-step, one accumulator per
output leaf, how micro-batches are weighed, which loop runs them (a scan, a
while loop over a traced count, devices in lockstep), and what the noise
scale measures. This module only runs it and hands back one device's carry
(`Local`), which the device reduction (`reduction`) combines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaccum._core import accumulators, exact, stats, step
from jaccum._core.accumulators import Fold, Weights


def first_microbatch(
  axes: Sequence[str], num_microbatches: int, num_real: Any, count_varies: bool
) -> jax.Array:
  """This device's first micro-batch in the global order (`deterministic=True`).

  Devices hold consecutive micro-batches: device d's first is the number the
  devices before it run, d·K without a count (one small all-gather when the
  counts differ between devices).
  """
  device = jax.lax.axis_index(tuple(axes))
  if num_real is None:
    return device * num_microbatches
  if not count_varies:
    return device * num_real
  counts = jax.lax.all_gather(num_real, tuple(axes))
  return jnp.sum(jnp.where(jnp.arange(counts.shape[0]) < device, counts, 0))


class Weighing(NamedTuple):
  """How each micro-batch is weighed.

  With `weight_fn`, by its result. With a count of real micro-batches and
  no `weight_fn`, by its rows (`unit`), so that a mean divides by what ran,
  however many devices ran how many, and a count of 0 gives zeros. A
  micro-batch that runs only to keep devices in step (`active` False)
  weighs 0. `exact`: the weights are summed exactly (`deterministic=True`).
  """

  weight_fn: Callable[..., Any] | None
  unit: int | None
  dtype: Any
  exact: bool

  def init(self, weight_shape: Any) -> Weights:
    weights = accumulators.no_weights(self.dtype, self.exact, self.unit)
    if weight_shape is not None:
      like = jax.tree.map(lambda _: weight_shape, weights)
      weights = step.match_varying(weights, like)
    return weights

  def __call__(self, step_args: Sequence[Any], active: Any) -> jax.Array:
    if self.weight_fn is not None:
      weight = step.call_weight(self.weight_fn, step_args)
    else:
      weight = jnp.asarray(self.unit, jnp.float32)
    return weight if active is None else jnp.where(active, weight, 0)


class Driver(NamedTuple):
  """Which loop runs the micro-batches, and how many.

  Attributes:
    num_microbatches: K.
    unroll: `lax.scan`'s.
    overlap: run the last micro-batch after the loop (`overlap_reduction`).
    lockstep: with counts that differ between devices whose collectives
      need every device (FSDP in the loop), the axes over which devices run
      as many micro-batches as the busiest, the others weighing 0.
  """

  num_microbatches: int
  unroll: int | bool = 1
  overlap: bool = False
  lockstep: tuple[str, ...] | None = None

  def run(self, body: Callable[..., Any], carry: Any, num_real: Any) -> Any:
    if self.lockstep is not None:
      most = jax.lax.pmax(num_real, self.lockstep)
      return jax.lax.fori_loop(0, most, lambda i, c: body(c, i, i < num_real), carry)
    if num_real is not None:
      # A traced count: a while loop that runs only the real micro-batches,
      # so the others cost nothing (masking them would still compute them).
      return jax.lax.fori_loop(0, num_real, lambda i, c: body(c, i, None), carry)
    if self.num_microbatches == 1:
      # One micro-batch is the whole batch: no loop, so XLA schedules the
      # step as it would without accumulation (a scan of length 1 keeps a
      # carry).
      return body(carry, jnp.int32(0), None)
    scanned = self.num_microbatches - 1 if self.overlap else self.num_microbatches
    carry, _ = jax.lax.scan(
      lambda c, i: (body(c, i, None), None),
      carry,
      jnp.arange(scanned),
      unroll=self.unroll,
    )
    if self.overlap:
      # The last micro-batch after the loop: each gradient leaf is then final
      # as soon as its backward pass makes it, and its reduction need not
      # wait for the rest of that pass.
      return body(carry, jnp.int32(scanned), None)
    return carry


class Measure(NamedTuple):
  """What the noise scale measures in each micro-step (`return_stats`).

  Attributes:
    whole_grads: bools like the output: the gradients held whole (scattered
      ones are measured before their scatter, by the micro-step).
    split: manual axes other than the data axes over which gradients hold
      slices (tensor parallelism in the user's `shard_map`): each device
      measures its share, summed after the loop.
    exact: the weighted sum of squared norms is an exact sum.
  """

  whole_grads: Any
  split: tuple[str, ...]
  exact: bool

  def init(self, axes: tuple[str, ...] | None) -> tuple[Any, jax.Array]:
    sums = (accumulators.zeros(jnp.float32), accumulators.zeros(jnp.float32))
    if self.exact:
      sums = (accumulators.no_weights(jnp.float32, True, None).total, sums[1])
    if axes is not None:
      sums = step.cast_varying(sums, axes)
    return step.cast_varying(sums[0], self.split), sums[1]

  def __call__(
    self, sums: Any, out: Any, norms: Sequence[jax.Array], weight: Any, rows: int
  ) -> tuple[Any, jax.Array]:
    """One scalar per micro-step: `Σ_k w_k |g_k|²` and the count of `w_k != 0`."""
    w = jnp.asarray(rows if weight is None else weight, jnp.float32)
    norm = stats.sq_norm(out, self.whole_grads, self.split) + sum(norms, jnp.float32(0))
    sq_sum, count = sums
    if exact.is_acc(sq_sum):
      sq_sum = exact.add(sq_sum, norm, w)
    else:
      sq_sum = sq_sum + jnp.where(w != 0, w * norm, 0)
    return sq_sum, count + (w != 0).astype(jnp.float32)


class Inputs(NamedTuple):
  """How micro-batch k's arguments are made from the call's, on this device.

  Attributes:
    at: where the batch, key and state sit in the call's arguments.
    cut: `(K, split)`.
    rows: rows per micro-batch on this device.
    axes: inside `shard_map`, the axes the batch is split over (arguments
      cast to device-varying, keys folded per device); None on one device.
    global_order: micro-batches carry global indices (`deterministic=True`):
      keys fold the global index, device d starting after the devices before.
    count_varies: the count of real micro-batches may differ between devices.
  """

  at: step.Positions
  cut: tuple[int, Any]
  rows: int
  axes: tuple[str, ...] | None
  global_order: bool
  count_varies: bool

  def __call__(
    self,
    function: step.Function,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    num_real: Any = None,
  ) -> step.MicroInputs:
    """The call's arguments made ready for this device's loop."""
    first = None
    if self.global_order:
      first = 0
      if self.axes is not None:
        first = first_microbatch(self.axes, self.cut[0], num_real, self.count_varies)
    return step.prepare(function, self.at, args, kwargs, self.cut, self.axes, first)


class LoopPlan(NamedTuple):
  """Everything the local loop runs, decided by the plan.

  Attributes:
    inputs: how micro-batch k's arguments are made.
    step: the traced, rewritten micro-step.
    accumulators: one `Accumulator` per output leaf.
    scattered: per output of the program, how each micro-step scatters it
      (FSDP's sharded modes), or None for no scatter at all.
    weighing: how micro-batches are weighed, or None for not at all.
    driver: which loop runs them.
    measure: what the noise scale measures, or None.
  """

  inputs: Inputs
  step: step.MicroStep
  accumulators: Any
  scattered: list[Any] | None
  weighing: Weighing | None
  driver: Driver
  measure: Measure | None


class Carry(NamedTuple):
  """What the loop carries from micro-batch to micro-batch.

  Attributes:
    acc: per output leaf, its accumulator's carry.
    state: the threaded state, or None.
    total: the weights so far (`Weights`), or None when unweighted.
    stats: with `return_stats`, `(Σ_k w_k |g_k|², K')`, else None.
  """

  acc: Any
  state: Any
  total: Weights | None
  stats: tuple[Any, jax.Array] | None


def _gate(active: Any, new: Carry, old: Carry, accs: Any) -> Carry:
  """`new` where this device's micro-batch is real, else `old` kept.

  Scattered leaves always take `new`: they hold the other devices' sums too,
  to which this device added zeros. Weights and statistics are kept by the
  weight of 0 already.
  """
  keep = lambda n, o: n if n is None else jnp.where(active, n, o)
  acc = jax.tree.map(
    lambda a, n, o: n if isinstance(a, accumulators.Scattered) else keep(n, o),
    accs,
    new.acc,
    old.acc,
    is_leaf=accumulators.is_accumulator,
  )
  return new._replace(acc=acc, state=jax.tree.map(keep, new.state, old.state))


def _initial(loop: LoopPlan, state0: Any) -> Carry:
  """The carry before the first micro-batch, typed as the loop will make it."""
  out_shape = loop.step.out_shape
  acc = accumulators.init(loop.accumulators, out_shape, loop.inputs.cut[0])
  total = None
  if loop.weighing is not None:
    total = loop.weighing.init(loop.step.weight_shape)
  sums = None if loop.measure is None else loop.measure.init(loop.inputs.axes)
  return Carry(step.match_varying(acc, out_shape), state0, total, sums)


def run(
  loop: LoopPlan,
  function: step.Function,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  num_real: Any = None,
  consts: Sequence[Any] = (),
) -> Carry:
  """Runs the micro-step over this device's micro-batches: the carry after the last.

  `num_real` (an int32 scalar, traced or not) runs only the first this many
  micro-batches; None runs all K. `consts`: the arrays a lifted function
  closes over (`step.MicroStep.hoisted`), as this device holds them.
  """
  inputs = loop.inputs(function, args, kwargs, num_real)
  at = loop.inputs.at
  state0 = None if at.state is None else inputs.args[at.state]

  def body(carry: Carry, index: Any, active: Any) -> Carry:
    step_args = inputs.args_at(index, carry.state)
    weight = None if loop.weighing is None else loop.weighing(step_args, active)
    leaves = jax.tree.leaves((step_args, inputs.extras))
    out, state, norms = loop.step(leaves, index, loop.scattered, weight, consts)
    total, fold = carry.total, None
    if weight is not None:
      assert carry.total is not None
      total = accumulators.add_weight(carry.total, weight)
      fold = Fold(weight, carry.total, total)
    acc = accumulators.update(loop.accumulators, carry.acc, out, index, fold)
    sums = carry.stats
    if loop.measure is not None:
      sums = loop.measure(sums, out, norms, weight, loop.inputs.rows)
    new = Carry(acc, state, total, sums)
    return new if active is None else _gate(active, new, carry, loop.accumulators)

  return loop.driver.run(body, _initial(loop, state0), num_real)

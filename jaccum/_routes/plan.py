"""The plan: every decision one call needs, made once per trace.

`make(options, call)` is entered once per trace of an accumulated function.
It reads `Options` and the call's arguments, runs the rules of the table
that need them, traces the user's function where the loop will run it, and
returns a frozen `Plan`: the route; the loop's pieces (how micro-batch k is
cut and keyed, the traced and rewritten micro-step, one accumulator per
output leaf, the weighing, the driver, what the noise scale measures); the
one reduction over devices; and how the result is assembled. `run` hands it
to its route. Below the plan nothing reads an option and nothing validates.

`deterministic=True` is decided here into its effects: the global
micro-batch order and key index (`loop.Inputs.global_order`, and the
count's global meaning on a sharded batch), exact accumulators and weights
(whose wire is the integer psum), and the division rewrite of the traced
step (`decide`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaccum._core import (
  accumulators,
  loop,
  reduction,
  retype,
  rewrites,
  stats,
  step,
)
from jaccum._core.accumulators import Choice
from jaccum._core.microbatch import Split
from jaccum._routes import arguments, mesh, routes, rules
from jaccum._routes.options import Options


class Call(NamedTuple):
  """One call of an accumulated function.

  Attributes:
    args: the positional arguments.
    kwargs: the keyword arguments, whole to every micro-step.
    count: `num_real_microbatches`, as given (None: all K).
    reduce_state: `reduce_state`, as given.
  """

  args: tuple[Any, ...]
  kwargs: dict[str, Any]
  count: Any = None
  reduce_state: Any = None


class StatsOut(NamedTuple):
  """How the noise-scale estimates are made from the combined sums."""

  unit_weight: int
  num_terms: int
  exact_sums: bool

  def estimates(self, sums: Sequence[Any], total: Any, grad_sq_norm: Any) -> Any:
    return stats.from_sums(
      sums, total, self.unit_weight, self.num_terms, grad_sq_norm, self.exact_sums
    )


class Output(NamedTuple):
  """What the call returns, besides the reduced output.

  Attributes:
    num_terms: the micro-batches over all devices (an unweighted mean's K).
    state: `(out, state)` (`state_argnum`).
    stats: `(…, AccumulationStats)` (`return_stats`), how they are made.
    reduce_state: `(…, reduce_state)` (`reduce_fn`).
    grad_mask: bools like the output, True on gradient leaves.
  """

  num_terms: int
  state: bool
  stats: StatsOut | None
  reduce_state: bool
  grad_mask: Any

  def assemble(self, result: Any, state: Any, estimates: Any, reduce_state: Any):
    out = (result, state) if self.state else result
    out = out if self.stats is None else (out, estimates)
    return (out, reduce_state) if self.reduce_state else out


class Plan(NamedTuple):
  """Everything one call runs.

  Attributes:
    route: where the loop runs (a `routes` class, or `mesh.PerDevice`).
    function: the user's function.
    loop: the local loop's pieces.
    reduction: the one reduction over devices, or None on one device.
    count: the count of real micro-batches, checked (one per device where
      each runs its own), or None.
    output: how the result is assembled.
    layout: on the per-device route, where each output leaf lives after the
      reduction; None elsewhere.
  """

  route: Any
  function: step.Function
  loop: loop.LoopPlan
  reduction: reduction.Reduction | None
  count: Any
  output: Output
  layout: mesh.Layout | None = None


class Decisions(NamedTuple):
  """What each option decides, read once from `Options` (`decide`).

  Attributes:
    function: the user's function (`grad_fn`).
    argnums: `(batch_argnums, rng_argnum, state_argnum)`, resolved per call.
    num_microbatches: K.
    split: the micro-batch order.
    choice: `(reduce, accum_dtype)`, for each leaf's accumulator.
    exact: `deterministic=True`: exact accumulators and weights (whose wire
      is the integer psum), the global micro-batch order and key index, and
      a count's global meaning on a batch `accumulate` shards.
    rewrites: what the traced step goes through, besides the route's own:
      convolutions into XLA:CPU's layout (`conv_rewrite`), divisions as
      reciprocals (`deterministic`).
    weight_fn: how micro-batches are weighed, or None.
    grad_leaves: which outputs are gradients, or None to find them.
    stats: `return_stats`.
    driver: `(unroll, overlap_reduction)`.
    wire: `reduce_dtype`, or None.
    hook: `reduce_fn`, or None.
    where: `(axis_name, on_mesh)`: which route.
  """

  function: step.Function
  argnums: tuple[Any, Any, Any]
  num_microbatches: int
  split: Split
  choice: tuple[Any, Any]
  exact: bool
  rewrites: tuple[Callable[..., Any], ...]
  weight_fn: Callable[..., Any] | None
  grad_leaves: Any
  stats: bool
  driver: tuple[Any, bool]
  wire: Any
  hook: Callable[..., Any] | None
  where: tuple[Any, Any]


def decide(options: Options) -> Decisions:
  """Every option read, once: the pieces the plan hands the stages."""
  found: list[Callable[..., Any]] = []
  if options.conv_rewrite and jax.default_backend() == "cpu":
    # On CPU, convolutions in a loop body miss XLA's fast layout.
    found.append(rewrites.canonicalize_convolutions)
  if options.deterministic:
    found.append(rewrites.divisions_as_reciprocals)
  return Decisions(
    options.function,
    (options.batch_argnums, options.rng_argnum, options.state_argnum),
    options.num_microbatches,
    options.split,
    (options.reduce, options.accum_dtype),
    options.deterministic,
    tuple(found),
    options.weight_fn,
    options.grad_leaves,
    options.return_stats,
    (options.unroll, options.overlap_reduction),
    options.reduce_dtype,
    options.reduce_fn,
    (options.axis_name, options.on_mesh),
  )


def run(options: Options, call: Call) -> Any:
  """One call: its plan (made once per trace), run on its route."""
  plan = make(options, call)
  return plan.route.run(plan, call)


def make(options: Options, call: Call) -> Plan:
  """The plan of one call. Falls back to the whole batch's step where the
  function cannot run per device (with a warning naming the cause)."""
  d = decide(options)
  at = arguments.positions(*d.argnums, call.args, call.kwargs)
  cut = (d.num_microbatches, d.argnums[0])
  route = routes.choose(d.where, cut, d.function, d.hook is not None, at, call)
  try:
    return _planned(options, d, call, at, route)
  except Exception as error:
    if not isinstance(route, mesh.PerDevice) or not step.is_user_error(error):
      raise  # jaccum's own: the options or the output are wrong either way
    whole = routes.whole_batch(d.split, d.num_microbatches, at, call, route, error)
  if whole.reordered:  # each device's contiguous micro-batch k, strided
    d = d._replace(split="strided")
  try:
    plan = _planned(options, d, call, at, whole)
  except Exception as whole_batch_error:
    raise whole_batch_error from whole.cause
  routes.warn_whole_batch(whole)
  return plan


def local_loop(
  options: Options,
  at: step.Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  axes: tuple[str, ...] | None,
) -> tuple[loop.LoopPlan, loop.Carry]:
  """One loop over this device's rows, planned and run where it is called
  (`accumulate_coupled`'s two passes): its plan and its carry."""
  d = decide(options)
  rows = arguments.check_batch_size(d.num_microbatches, d.argnums[0], at, args)
  route: Any = routes.OneDevice(rows // d.num_microbatches)
  if axes is not None:
    devices = jax.lax.axis_size(axes)
    route = routes.InShardMap(rows // d.num_microbatches, axes, devices)
  planned = _planned(options, d, Call(tuple(args), kwargs), at, route)
  return planned.loop, loop.run(planned.loop, d.function, args, kwargs)


def _closures(names: Sequence[str], axes: tuple[str, ...]) -> None:
  raise ValueError(
    f"grad_fn differentiates arrays it reaches other than through its arguments "
    f"(closed over: {', '.join(names)}), and they are the same on every "
    f"device: inside shard_map JAX then sums their gradients over {axes} in "
    f"every micro-step, and the result would count each device's share again. "
    f"Pass these arrays to the accumulated function as arguments (positional "
    f"or keyword), or use jaccum.data_parallel, which accepts closures."
  )


def _traced(
  d: Decisions, call: Call, route: Any, inputs: loop.Inputs, count: Any
) -> tuple[Any, step.MicroStep]:
  """The user's function traced where the loop runs it, on micro-batch 0, and
  the route (lifted where the function could only be traced outside it)."""
  at, axes = inputs.at, route.axes
  sharded = route.fsdp.params if route.fsdp is not None else ()
  rewritten = d.rewrites
  if axes is not None:  # each device holds its rows: no constraint names them
    strip = functools.partial(rewrites.strip_constraints, axes=axes)
    rewritten = (strip, *rewritten)

  def trace_here(route, function, args, kwargs, local_count, consts):
    prepared = inputs(function, args, kwargs, local_count)
    state0 = None if at.state is None else prepared.args[at.state]
    lift = route.lift(consts)
    traced = step.trace(function, prepared, state0, d.weight_fn, sharded, lift)
    closures = []
    if axes is not None:
      batch = [prepared.args[i] for i in at.batch]
      closures = step.closures_summed(traced.closed, batch, axes)
    # Rewritten here too: a rewrite traces equations on the step's types.
    return step.rewritten(traced, rewritten), closures

  here = lambda route: functools.partial(trace_here, route)
  try:
    traced, closures = route.in_context(d.function, call, count, here(route))
  except retype.Retrace as retrace:
    ((outside,), cause) = retrace.outside, retrace.cause
    route = route.lifted(outside)
    try:
      traced, closures = route.in_context(d.function, call, count, here(route))
    except Exception as error:
      if step.is_user_error(error) and cause is not None:
        raise cause from error  # what the whole batch's route names
      raise
  if closures:
    assert axes is not None  # found only inside a shard_map
    _closures(closures, axes)
  return route, traced


def _scattered_in_loop(
  accs: Any, grad_mask: Any, route: Any, wire: Any, num_outputs: int
) -> tuple[Any, list[Any] | None]:
  """The gradients each micro-step reduce-scatters (FSDP's sharded modes):
  their accumulators, and per output of the program how it is split."""
  if route.fsdp is None or not any(h is not None for h in route.fsdp.grads):
    return accs, None
  flat, treedef = jax.tree.flatten(accs, is_leaf=accumulators.is_accumulator)
  outputs: list[Any] = [None] * num_outputs
  positions = [i for i, on in enumerate(jax.tree.leaves(grad_mask)) if on]
  for i, how in zip(positions, route.fsdp.grads, strict=True):
    if how is None:
      continue
    shard = route.shard_shape(flat[i].shape, how)
    new = accumulators.scattered(flat[i], how, wire, shard)
    if isinstance(new, accumulators.Scattered):
      flat[i], outputs[i] = new, new.how
  return jax.tree.unflatten(treedef, flat), outputs


def _planned(
  options: Options, d: Decisions, call: Call, at: step.Positions, route: Any
) -> Plan:
  """The plan of one call on `route`. `options` only reach the rules."""
  num_microbatches = d.num_microbatches
  count = route.count(call.count, num_microbatches, d.exact)
  count_varies = route.count_varies or (count is not None and np.ndim(count) == 1)
  state = None if at.state is None else call.args[at.state]
  sharded_mode = None
  if route.fsdp is not None:
    sharded_mode = "shard_all" if any(route.fsdp.params) else "shard_grads"
  whole_batch = None
  if isinstance(route, routes.WholeBatch) and route.cause is not None:
    cause = route.cause
    fix = routes.cause_and_fix(cause, route.axes_of_batch)
    whole_batch = (routes.failures(cause), fix)
  facts = rules.Facts(
    options,
    whole_batch=whole_batch,
    devices=route.devices,
    on_devices=route.on_devices,
    sharded_by_accumulate=route.sharded_by_accumulate,
    axes=route.axes or (),
    count=call.count is not None,
    count_varies=count_varies,
    state_arrays=bool(jax.tree.leaves(state)),
    sharded_mode=sharded_mode,
  )
  rules.check("plan", facts)
  inputs = loop.Inputs(
    at, (num_microbatches, d.split), route.rows, route.axes, d.exact, count_varies
  )
  route, traced = _traced(d, call, route, inputs, count)
  return _from_step(d, call, at, route, inputs, traced, count, facts)


def _from_step(
  d: Decisions,
  call: Call,
  at: step.Positions,
  route: Any,
  inputs: loop.Inputs,
  traced: step.MicroStep,
  count: Any,
  facts: rules.Facts,
) -> Plan:
  """The rest of the plan, from the traced micro-step's output."""
  exact, out_shape = inputs.global_order, traced.out_shape
  weighted = traced.weight_shape is not None or count is not None
  choice = Choice(*d.choice, route.rows, d.split, exact, weighted)
  accs = accumulators.choose(choice, out_shape)
  needed_by = "return_stats=True" if d.stats else None
  if needed_by is None and route.hows is not None:
    needed_by = "FSDP (param_specs)"
  params = arguments.params_of(d.function.bound_args, at, call.args)
  grad_mask = arguments.gradient_mask(out_shape, params, d.grad_leaves, accs, needed_by)
  accs, scattered = _scattered_in_loop(
    accs, grad_mask, route, d.wire, len(traced.closed.jaxpr.outvars)
  )
  flat = jax.tree.leaves(accs, is_leaf=accumulators.is_accumulator)
  layout = None
  if isinstance(route, mesh.PerDevice):
    layout = mesh.layout(accs, grad_mask, route)
  facts = facts._replace(
    collectives=frozenset(rewrites.collective_axes(traced.closed.jaxpr)),
    grad_modes=tuple(
      a.mode for a, on in zip(flat, jax.tree.leaves(grad_mask), strict=True) if on
    ),
    last_path=mesh.first_last_path(accs) if route.sharded_by_accumulate else None,
    scattered=layout is not None and any(layout.sharded),
  )
  rules.check("plan", facts)
  if isinstance(route, mesh.PerDevice):
    mesh.per_example_leaves(
      accs,
      route.rows,
      route.axes,
      lambda n: arguments.output_shapes_at(d.function, at, call.args, call.kwargs, n),
    )
  loop_plan = _loop(d, inputs, traced, accs, scattered, grad_mask, count, route)
  red = _reduction(d, route, accs, grad_mask, layout, call)
  num_terms = d.num_microbatches * route.devices
  stats_out = None
  if d.stats:
    exact_sums = any(isinstance(a, accumulators.Exact) for a in flat)
    stats_out = StatsOut(route.rows, num_terms, exact_sums)
  output = Output(
    num_terms, at.state is not None, stats_out, d.hook is not None, grad_mask
  )
  return Plan(route, d.function, loop_plan, red, count, output, layout)


def _loop(
  d: Decisions,
  inputs: loop.Inputs,
  traced: step.MicroStep,
  accs: Any,
  scattered: list[Any] | None,
  grad_mask: Any,
  count: Any,
  route: Any,
) -> loop.LoopPlan:
  """The loop's pieces that follow from the traced step."""
  weighing = None
  if traced.weight_shape is not None or count is not None:
    weight_dtype = (
      np.float32 if traced.weight_shape is None else traced.weight_shape.dtype
    )
    weighing = loop.Weighing(
      d.weight_fn,
      None if traced.weight_shape is not None else route.rows,
      accumulators.weights_dtype(weight_dtype, accs),
      inputs.global_order,
    )
  lockstep = None
  sharded = any(traced.gathered) or any(h is not None for h in scattered or ())
  if inputs.count_varies and route.axes is not None and sharded:
    # FSDP's collectives inside the loop need every device: the idle ones
    # join with a weight of 0.
    lockstep = route.axes
  driver = loop.Driver(d.num_microbatches, *d.driver, lockstep)
  measure = None
  if d.stats:
    whole = jax.tree.map(
      lambda on, a: on and not isinstance(a, accumulators.Scattered),
      grad_mask,
      accs,
      is_leaf=accumulators.is_accumulator,
    )
    split = stats.split_axes(traced.out_shape, grad_mask, route.axes)
    measure = loop.Measure(whole, split, inputs.global_order)
  return loop.LoopPlan(inputs, traced, accs, scattered, weighing, driver, measure)


def _reduction(
  d: Decisions,
  route: Any,
  accs: Any,
  grad_mask: Any,
  layout: mesh.Layout | None,
  call: Call,
) -> reduction.Reduction | None:
  """The one reduction over the route's devices, or None on one device."""
  if not route.on_devices:
    return None
  grad_part = None
  if d.hook is not None:
    grad_part = arguments.gradient_part(grad_mask)
    for acc, on in zip(
      jax.tree.leaves(accs, is_leaf=accumulators.is_accumulator),
      jax.tree.leaves(grad_mask),
      strict=True,
    ):
      if on and acc.mode not in ("mean", "sum", "float0"):
        raise ValueError(
          f"reduce_fn reduces gradients that are summed or averaged, got a leaf "
          f'reduced with "{acc.mode}".'
        )
    rows = route.devices if isinstance(route, mesh.PerDevice) else 1
    arguments.check_reduce_state(call.reduce_state, rows, route.axes)
  return reduction.Reduction(
    route.axes,
    d.num_microbatches * route.devices,
    d.wire,
    None if layout is None else layout.scatter,
    d.hook,
    grad_mask,
    grad_part,
  )

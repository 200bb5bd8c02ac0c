"""The local loop: K micro-steps folded into one carry, by a scan on this device.

Everything above this module decides where the loop runs (on one device,
per device under `shard_map`, or inside the user's `shard_map`); this module
only runs it. Each option is one small stage, decided once before the loop
and composed by `scan`:

================================================  ==============================
option                                            stage
================================================  ==============================
`split`, `rng_argnum`, `state_argnum`             `_step.MicroInputs.args_at`
`conv_rewrite`, closures, sharding constraints    `_step.trace`
FSDP's sharded modes (gather, scatter)            `_step.MicroStep.__call__`
`weight_fn`, `num_real_microbatches`              `Weighing`
`reduce`, `accum_dtype`                           `_reduce.update` (`_fold`)
`deterministic`: exact sums                       `_reduce.update`, `_exact`
`deterministic`: global micro-batch order         `_step.MicroInputs.first`
`return_stats`                                    `_measure`
a count per device with in-loop collectives       `_gate`
`unroll`, `overlap_reduction`, a count            `_drive`
================================================  ==============================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jaccum import (
  _collective,
  _compose,
  _config,
  _exact,
  _fsdp,
  _reduce,
  _stats,
  _step,
)
from jaccum._config import Config, Positions
from jaccum._grads import gradient_mask, params_of
from jaccum._microbatch import check_batch

ARRAY_TYPES = _step.ARRAY_TYPES
is_user_error = _step.is_user_error


class Carry(NamedTuple):
  """What the loop carries from micro-batch to micro-batch.

  Attributes:
    acc: per output leaf, its running reduction (`_reduce.update`).
    state: the threaded state, or None.
    total: the weights so far (`_reduce.Weights`), or None when unweighted.
    stats: with `return_stats`, `(Σ_k w_k |g_k|², K')`, else None; with
      `deterministic=True` the first is an exact sum (`_exact.Acc`).
  """

  acc: Any
  state: Any
  total: _reduce.Weights | None
  stats: tuple[Any, jax.Array] | None


class Local(NamedTuple):
  """One device's loop, before the devices are combined.

  Attributes:
    leaves: the reduction plan, a tree of `_reduce.Leaf` like the output.
    out_shape: one micro-step's output shapes.
    grad_mask: bools like the output, True on gradient leaves.
    acc: the carry after the last micro-batch.
    total: the weights (`_reduce.Weights`), or None without weights.
    state: the threaded state after the last micro-batch, or None.
    stats: with `return_stats`, `(Σ_k w_k |g_k|², K')` over this device's
      micro-batches (w_k the weight, or the rows without `weight_fn`; K'
      those of nonzero weight), else None.
    unit_weight: each micro-batch's weight without `weight_fn`: its rows.
  """

  leaves: Any
  out_shape: Any
  grad_mask: Any
  acc: Any
  total: _reduce.Weights | None
  state: Any
  stats: tuple[Any, jax.Array] | None
  unit_weight: int


class Weighing(NamedTuple):
  """How each micro-batch is weighed, decided once before the loop.

  With `weight_fn`, by its result. With a count of real micro-batches and
  no `weight_fn`, by its rows (`unit`), so that a mean divides by what ran,
  however many devices ran how many, and a count of 0 gives zeros. A
  micro-batch that runs only to keep devices in step (`active` False)
  weighs 0.
  """

  config: Config
  unit: int | None
  dtype: Any

  def init(self) -> _reduce.Weights:
    if self.config.deterministic:
      return _reduce.exact_weights(self.dtype, self.unit)
    return _reduce.Weights(_reduce.zeros(self.dtype), _reduce.zeros(self.dtype))

  def __call__(self, step_args: Sequence[Any], active: Any) -> jax.Array:
    if self.config.weight_fn is not None:
      weight = _step.call_weight(self.config, step_args)
    else:
      weight = jnp.asarray(self.unit, jnp.float32)
    return weight if active is None else jnp.where(active, weight, 0)


def _weighing(
  config: Config, step: _step.MicroStep, leaves: Any, rows: int, counted: bool
) -> Weighing | None:
  if step.weight_shape is None and not counted:
    return None
  weight_dtype = jnp.float32 if step.weight_shape is None else step.weight_shape.dtype
  return Weighing(
    config,
    None if step.weight_shape is not None else rows,
    _reduce.weights_dtype(weight_dtype, leaves),
  )


def _fold(
  leaves: Any, carry: Carry, out: Any, state: Any, weight: Any, index: Any
) -> Carry:
  """Micro-batch `index`'s output and state folded into the carry."""
  total = carry.total
  if weight is not None:
    assert total is not None
    total = _reduce.add_weight(total, weight)
  acc = _reduce.update(leaves, carry.acc, out, index, weight, carry.total, total)
  return Carry(acc, state, total, carry.stats)


def _measure(
  stats: tuple[Any, jax.Array],
  out: Any,
  whole_grads: Any,
  norms: Sequence[jax.Array],
  weight: Any,
  rows: int,
  split: Sequence[str],
) -> tuple[Any, jax.Array]:
  """One scalar per micro-step: all the gradient noise scale needs.

  `whole_grads` marks the gradients held whole in `out`; scattered ones
  (FSDP) were measured whole before their scatter (`norms`). Over the axes
  `split` the norm is this device's share, summed after the loop.
  """
  w = jnp.asarray(rows if weight is None else weight, jnp.float32)
  norm = _stats.sq_norm(out, whole_grads, split) + sum(norms, jnp.float32(0))
  sq_sum, count = stats
  if _exact.is_acc(sq_sum):
    sq_sum = _exact.add(sq_sum, norm, w)
  else:
    sq_sum = sq_sum + jnp.where(w != 0, w * norm, 0)
  return sq_sum, count + (w != 0).astype(jnp.float32)


def _gate(active: Any, new: Carry, old: Carry, leaves: Any) -> Carry:
  """`new` where this device's micro-batch is real, else `old` kept.

  Scattered leaves always take `new`: they hold the other devices' sums too,
  to which this device added zeros. Weights and statistics are kept by the
  weight of 0 already.
  """
  keep = lambda n, o: n if n is None else jnp.where(active, n, o)
  acc = jax.tree.map(
    lambda leaf, n, o: n if leaf.scattered is not None else keep(n, o),
    leaves,
    new.acc,
    old.acc,
    is_leaf=_reduce.is_plan,
  )
  return new._replace(acc=acc, state=jax.tree.map(keep, new.state, old.state))


def _drive(
  body: Callable[[Carry, Any, Any], Carry],
  carry: Carry,
  config: Config,
  num_real: Any,
  lockstep: tuple[str, ...] | None,
) -> Carry:
  """Runs `body` over the micro-batches: how many, and in which loop."""
  num_microbatches = config.num_microbatches
  if lockstep is not None:
    # Devices run as many micro-batches as the busiest; the others weigh 0.
    most = jax.lax.pmax(num_real, lockstep)
    return jax.lax.fori_loop(0, most, lambda i, c: body(c, i, i < num_real), carry)
  if num_real is not None:
    # A traced count: a while loop that runs only the real micro-batches, so
    # the others cost nothing (masking them would still compute them).
    return jax.lax.fori_loop(0, num_real, lambda i, c: body(c, i, None), carry)
  if num_microbatches == 1:
    # One micro-batch is the whole batch: no loop, so XLA schedules the step
    # as it would without accumulation (a scan of length 1 keeps a carry).
    return body(carry, jnp.int32(0), None)
  step = lambda c, i: (body(c, i, None), None)
  if config.overlap_reduction:
    # K - 1 micro-batches in the loop, the last one after it: each gradient
    # leaf is then final as soon as the last backward pass makes it, and its
    # reduction need not wait for the rest of that pass.
    carry, _ = jax.lax.scan(
      step, carry, jnp.arange(num_microbatches - 1), unroll=config.unroll
    )
    return body(carry, jnp.int32(num_microbatches - 1), None)
  carry, _ = jax.lax.scan(
    step, carry, jnp.arange(num_microbatches), unroll=config.unroll
  )
  return carry


def _initial_carry(
  leaves: Any,
  step: _step.MicroStep,
  state0: Any,
  weighing: Weighing | None,
  config: Config,
  axes: tuple[str, ...] | None,
  split: Sequence[str],
) -> Carry:
  """The carry before the first micro-batch, typed as the loop will make it.

  The noise scale's sum of squared norms varies over `split` too: there each
  device measures its slices of the gradients.
  """
  num_microbatches = config.num_microbatches
  acc = _reduce.init(leaves, step.out_shape, num_microbatches)
  total = None
  if weighing is not None:
    total = weighing.init()
    if step.weight_shape is not None:
      like = jax.tree.map(lambda _: step.weight_shape, total)
      total = _collective.match_varying(total, like)
  stats0 = None
  if config.return_stats:
    stats0 = (_reduce.zeros(jnp.float32), _reduce.zeros(jnp.float32))
    if config.deterministic:
      stats0 = (_reduce.exact_weights(jnp.float32).total, stats0[1])
    if axes is not None:
      stats0 = _collective.cast_varying(stats0, axes)
    stats0 = (_collective.cast_varying(stats0[0], split), stats0[1])
  return Carry(_collective.match_varying(acc, step.out_shape), state0, total, stats0)


def _lockstep(
  step: _step.MicroStep,
  axes: tuple[str, ...] | None,
  scattered: Sequence[Any] | None,
  count_varies: bool,
) -> tuple[str, ...] | None:
  """The axes devices must keep in step over, when their counts differ.

  FSDP's collectives inside the loop then need every device: the idle ones
  join with a weight of 0. `grad_fn`'s own collectives over them cannot be
  made exact that way, and are refused.
  """
  if not count_varies or axes is None:
    return None
  _compose.count_per_device_and_collectives(
    axes, _collective.collective_axes(step.closed.jaxpr)
  )
  sharded = any(step.gathered) or any(h is not None for h in scattered or ())
  return axes if sharded else None


def _deterministic_start(
  config: Config,
  axes: tuple[str, ...] | None,
  num_real: Any,
  count_varies: bool,
  fsdp: _fsdp.Plan | None,
  state: Any,
) -> Any:
  """With `deterministic=True`, the global index of this device's first micro-batch.

  Checked first: the micro-batches over all devices fit the exact sums, no
  FSDP mode scatters inside the loop, and no arrays thread as state.
  """
  if not config.deterministic:
    return 0
  if jax.tree.leaves(state):
    _compose.deterministic_and_state(config.state_argnum)
  if fsdp is not None:
    _compose.deterministic_and_sharded_loop(
      "shard_all" if any(fsdp.params) else "shard_grads"
    )
  num_devices = 1 if axes is None else jax.lax.axis_size(axes)
  _compose.deterministic_and_terms(
    config.num_microbatches, num_devices, _exact.MAX_PER_DEVICE, _exact.MAX_TERMS
  )
  if axes is None:
    return 0
  return _collective.first_microbatch(
    axes, config.num_microbatches, num_real, count_varies
  )


def scan(
  config: Config,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  *,
  axes: tuple[str, ...] | None = None,
  needs_grads: str | None = None,
  fsdp: _fsdp.Plan | None = None,
  num_real: Any = None,
  count_varies: bool = False,
  lift: _step.Lift | None = None,
) -> Local:
  """Runs `grad_fn` over K micro-batches of the batch arguments, on this device.

  Args:
    config: the checked options.
    at: where the batch, key and state sit in `args`.
    args: the positional arguments of the call.
    kwargs: its keyword arguments (passed whole to every micro-step).
    axes: inside `shard_map`/`pmap`, the axes the batch is split over:
      non-batch arguments are cast to device-varying (no psum in the loop)
      and the key is folded with the device index.
    needs_grads: what needs the gradient leaves found, if anything (e.g.
      "FSDP (param_specs)"): then not finding them is an error.
    fsdp: FSDP's sharded modes (`_fsdp.Plan`): params that arrive as shards,
      gradients reduce-scattered by every micro-step.
    num_real: run only the first this many micro-batches (an int scalar,
      traced or not, checked by `check_num_real`); None runs all K.
    count_varies: whether `num_real` may differ between the devices of
      `axes` (one count per device).
    lift: inside `data_parallel`'s `shard_map`, how to run a `grad_fn` that
      closes over arrays on the mesh (`_step.Lift`).
  """
  _compose.count_and_overlap(config, num_real)
  batch_size = check_batch(
    [args[i] for i in at.batch],
    config.num_microbatches,
    names=[f"args[{i}]" for i in at.batch],
    hint=_config.batch_hint(config, at),
  )
  rows = batch_size // config.num_microbatches
  state = None if at.state is None else args[at.state]
  first = _deterministic_start(config, axes, num_real, count_varies, fsdp, state)
  inputs = _step.prepare(config, at, args, kwargs, axes, first)
  state0 = None if at.state is None else inputs.args[at.state]
  step = _step.trace(config, inputs, state0, axes, fsdp.params if fsdp else (), lift)
  leaves = _reduce.plan(
    config.reduce,
    step.out_shape,
    config.accum_dtype,
    rows,
    config.split,
    exact=config.deterministic,
  )
  params = params_of(config, at, args)
  if fsdp is not None:  # argument 0, whole, as the micro-step saw it
    params = _fsdp.whole_params(args[0], fsdp.params)
  needed_by = "return_stats=True" if config.return_stats else needs_grads
  grad_mask = gradient_mask(
    step.out_shape, params, config.grad_leaves, leaves, needed_by
  )
  scattered = None
  if fsdp is not None and any(h is not None for h in fsdp.grads):
    num_outputs = len(step.closed.jaxpr.outvars)
    leaves, scattered = _fsdp.scattered_plan(
      leaves, grad_mask, fsdp.grads, num_outputs, config.reduce_dtype
    )
  if config.return_stats:
    _compose.stats_need_means(
      [
        leaf.mode
        for leaf, on in zip(
          jax.tree.leaves(leaves, is_leaf=_reduce.is_plan),
          jax.tree.leaves(grad_mask),
          strict=True,
        )
        if on
      ]
    )
  lockstep = _lockstep(step, axes, scattered, count_varies)
  weighing = _weighing(config, step, leaves, rows, num_real is not None)
  whole_grads = jax.tree.map(
    lambda on, leaf: on and leaf.scattered is None,
    grad_mask,
    leaves,
    is_leaf=_reduce.is_plan,
  )

  def body(carry: Carry, index: Any, active: Any) -> Carry:
    step_args = inputs.args_at(index, carry.state)
    weight = None if weighing is None else weighing(step_args, active)
    leaves_in = jax.tree.leaves((step_args, inputs.extras))
    out, state, norms = step(leaves_in, index, scattered, weight)
    new = _fold(leaves, carry, out, state, weight, index)
    if carry.stats is not None:
      stats = _measure(carry.stats, out, whole_grads, norms, weight, rows, split)
      new = new._replace(stats=stats)
    return new if active is None else _gate(active, new, carry, leaves)

  split = _stats.split_axes(step.out_shape, grad_mask, axes)
  carry = _initial_carry(leaves, step, state0, weighing, config, axes, split)
  carry = _drive(body, carry, config, num_real, lockstep)
  return Local(
    leaves,
    step.out_shape,
    grad_mask,
    carry.acc,
    carry.total,
    carry.state,
    carry.stats,
    rows,
  )


def output_shapes_at(
  config: Config,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  rows: int,
) -> Any:
  """The shapes of `grad_fn`'s output on a micro-batch of `rows` rows.

  Abstract (nothing runs): it tells per-example outputs, whose leading size
  follows the rows, from values that only happen to have that size.
  """
  call = list(args)
  for i in at.batch:
    call[i] = jax.tree.map(
      lambda x: (
        jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype)
        if isinstance(x, ARRAY_TYPES)
        else x
      ),
      args[i],
    )
  flat, treedef = jax.tree.flatten((call, kwargs))
  dynamic = [isinstance(x, (*ARRAY_TYPES, jax.ShapeDtypeStruct)) for x in flat]

  def micro_step(*values):
    it = iter(values)
    full = [next(it) if d else x for x, d in zip(flat, dynamic, strict=True)]
    step_args, step_kwargs = jax.tree.unflatten(treedef, full)
    out = config.grad_fn(
      *config.bound_args, *step_args, **{**config.bound_kwargs, **step_kwargs}
    )
    return out[0] if at.state is not None else out

  return jax.eval_shape(
    micro_step, *(x for x, d in zip(flat, dynamic, strict=True) if d)
  )


def check_num_real(num_real: Any, num_microbatches: int, per_device: int = 0) -> Any:
  """The count of real micro-batches, checked: an int in [0, K], or a traced one.

  A concrete int (Python, NumPy or a JAX array outside `jit`) outside [0, K]
  is an error now; a traced count (any count under `jit`) is clamped to
  [0, K] when it runs, in its own integer type (an int64 count above 2³¹ is
  K, not wrapped to int32 first). With `per_device` devices
  (`data_parallel`) it may also be one count per device, shape `[devices]`.
  """
  shape = np.shape(num_real)
  dtype = jnp.result_type(num_real)
  if not jnp.issubdtype(dtype, jnp.integer) or isinstance(num_real, bool):
    raise TypeError(
      f"num_real_microbatches must be an int (traced or not), got {dtype} "
      f"{num_real!r:.60}."
    )
  if shape not in ((),) + (((per_device,),) if per_device else ()):
    allowed = "a scalar" + (
      f" or one per device, shape ({per_device},)" if per_device else ""
    )
    raise ValueError(f"num_real_microbatches must be {allowed}, got shape {shape}.")
  if not isinstance(num_real, jax.core.Tracer):
    values = np.asarray(num_real)
    if values.min() < 0 or values.max() > num_microbatches:
      raise ValueError(
        f"num_real_microbatches={num_real!r} must be in [0, "
        f"num_microbatches={num_microbatches}]: the batch holds "
        f"{num_microbatches} micro-batches (its capacity), of which the first "
        "num_real_microbatches run."
      )
  clamped = jnp.clip(jnp.asarray(num_real), 0, num_microbatches)
  return clamped.astype(jnp.int32)


def check_axes_bound(axes: tuple[str, ...]) -> int:
  """The number of devices over `axes`, or a clear error outside shard_map/pmap."""
  try:
    return jax.lax.axis_size(axes)
  except NameError:
    named = axes[0] if len(axes) == 1 else axes
    raise ValueError(
      f"axis_name={named!r} is not bound here: "
      "accumulate(..., axis_name=...) runs inside jax.shard_map or jax.pmap over "
      "that axis. Under plain jit with a sharded batch, use "
      "jaccum.data_parallel(grad_fn, K, mesh=mesh)."
    ) from None


def check_two_sizes(config: Config, num_devices: int) -> None:
  if config.return_stats and config.num_microbatches * num_devices == 1:
    raise ValueError(
      "return_stats=True estimates the gradient noise from two batch sizes, the "
      "micro-batch and the whole batch; with num_microbatches=1 on one device "
      "there is only one. Use K >= 2, or several devices."
    )


def stats_of(
  local: Local,
  extras: Sequence[jax.Array],
  total: jax.Array | None,
  num_terms: int,
  grad_sq_norm: jax.Array,
) -> _stats.AccumulationStats:
  """The noise-scale estimates, once the devices' figures are combined."""
  weighted_sq_sum, num_weighted = (_exact.as_float(x) for x in extras)
  # Without weight_fn every micro-batch weighs its rows.
  weight = jnp.float32(local.unit_weight * num_terms) if total is None else total
  if any(p.exact for p in jax.tree.leaves(local.leaves, is_leaf=_reduce.is_plan)):
    # The same divisions on every route: XLA rounds a division by a constant
    # (a weight known when tracing) as a product with its reciprocal.
    weight, num_weighted = jax.lax.optimization_barrier((weight, num_weighted))
  return _stats.estimate(weighted_sq_sum, num_weighted, weight, grad_sq_norm)


def _combine_devices(
  config: Config, local: Local, num_terms: int, reduce_state: Any, num_real: Any
) -> tuple[Any, Any, Any, list[jax.Array], Any, Any]:
  """The one reduction over `config.axes`, and `reduce_fn` where it is given.

  With `deterministic=True`, `"last"` leaves come from the last device that
  ran a micro-batch (`num_real`: this device's count, None for all K).
  Returns `(acc, total, state, extras, final, reduce_state)`, combined.
  """
  assert config.axes is not None
  hooked = config.reduce_fn is not None
  last_ran = None
  if config.deterministic:
    last_ran = True if num_real is None else num_real > 0
  acc, total, state, extras = _collective.all_reduce(
    local.leaves,
    local.acc,
    local.total,
    local.state,
    config.axes,
    extras=list(local.stats or ()),
    wire_dtype=config.reduce_dtype,
    skip=jax.tree.leaves(local.grad_mask) if hooked else None,
    last_ran=last_ran,
  )
  final = None
  if hooked:
    _collective.check_reduce_state(reduce_state, 1, config.axes)
    acc, final, reduce_state = _collective.apply_reduce_fn(
      local.leaves,
      acc,
      local.total,
      total,
      local.grad_mask,
      num_terms,
      config.axes,
      config.reduce_fn,
      reduce_state,
    )
  return acc, total, state, extras, final, reduce_state


def run(
  config: Config,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  num_real: Any = None,
  reduce_state: Any = None,
) -> Any:
  """The loop on this device, then (with `config.axes`) one reduction over them."""
  num_terms = config.num_microbatches
  if config.axes is not None:
    num_terms *= check_axes_bound(config.axes)
  else:
    _compose.reduce_fn_needs_devices(config)
  check_two_sizes(config, num_terms // config.num_microbatches)
  count_varies = False
  if num_real is not None:
    # Inside the user's shard_map, a count may differ between devices.
    count_varies = bool(_collective.varying_axes(num_real) & set(config.axes or ()))
    num_real = check_num_real(num_real, config.num_microbatches)
    _compose.count_needs_split(config, config.axes, sharded=False)
  local = scan(
    config,
    at,
    args,
    kwargs,
    axes=config.axes,
    num_real=num_real,
    count_varies=count_varies,
  )
  weights, total, state = local.total, None, local.state
  extras, final = list(local.stats or ()), None
  if local.total is not None:
    total = _reduce.weight_sum(local.total)
  if config.axes is not None:
    acc, total, state, extras, final, reduce_state = _combine_devices(
      config, local, num_terms, reduce_state, num_real
    )
    weights = None  # combined: the weighted means are final
  else:
    acc = local.acc
  result = _reduce.finalize(
    local.leaves,
    acc,
    None if total is not None else num_terms,
    config.split,
    weights,
    final,
  )
  if num_real is not None:
    ran = num_real if config.axes is None else jax.lax.psum(num_real, config.axes)
    result = _reduce.none_ran(local.leaves, result, ran)
  out = result if at.state is None else (result, state)
  if config.return_stats:
    split = _stats.split_axes(local.out_shape, local.grad_mask, config.axes)
    grad_sq_norm = _stats.sq_norm(result, local.grad_mask, split)
    if split:  # each device measured its slices of the gradients
      grad_sq_norm, extras[0] = jax.lax.psum((grad_sq_norm, extras[0]), split)
    out = out, stats_of(local, extras, total, num_terms, grad_sq_norm)
  return out if config.reduce_fn is None else (out, reduce_state)

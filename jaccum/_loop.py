"""The local loop: one micro-step traced once, then run over K micro-batches by a scan.

Everything above this module decides where the loop runs (on one device,
per device under `vmap`, or inside the user's `shard_map`); this module only
runs it. The user's function is traced once, by `jax.make_jaxpr`, on the
first micro-batch's shapes: that gives the output structure the carry needs,
the closed-over arrays (the jaxpr's constants), and the program the scan body
evaluates, rewritten on CPU so that its convolutions take XLA's fast path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jaccum import _collective, _config, _conv_layout, _fsdp, _jaxpr, _reduce, _stats
from jaccum._config import Config, Positions, call_weight_fn
from jaccum._microbatch import check_batch, take_microbatch

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def mark_user_error(error: Exception) -> None:
  """Marks an error as raised while tracing the user's function, not by jaccum.

  `_parallel` runs the function per device under `shard_map` and, where JAX
  refuses it there, as the whole batch would run; jaccum's own errors (bad
  options, a missing gradient) must reach the user as they are instead.
  """
  error._jaccum_user_code = True  # pyright: ignore[reportAttributeAccessIssue]


def is_user_error(error: Exception) -> bool:
  return getattr(error, "_jaccum_user_code", False)


def _is_typed_key(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)


def _check_state_output(out: Any, state: Any) -> Any:
  """Checks that a micro-step returned `(out, new_state)` matching `state`."""
  if not isinstance(out, tuple | list) or len(out) != 2:
    raise TypeError(
      "with state_argnum set, grad_fn must return (out, new_state), "
      f"got {type(out).__name__} {jax.tree.structure(out)}."
    )
  new_state = out[1]
  if jax.tree.structure(new_state) != jax.tree.structure(state):
    raise TypeError(
      "with state_argnum set, grad_fn must return new_state with the "
      f"structure of the state argument {jax.tree.structure(state)}, "
      f"got {jax.tree.structure(new_state)}."
    )
  for (path, new), old in zip(
    jax.tree_util.tree_flatten_with_path(new_state)[0],
    jax.tree.leaves(state),
    strict=True,
  ):
    old_type = (jnp.shape(old), jnp.result_type(old))
    new_type = (jnp.shape(new), jnp.result_type(new))
    if old_type != new_type:
      raise TypeError(
        f"new_state{jax.tree_util.keystr(path)} must keep the state's shape and "
        f"dtype {old_type[0]} {old_type[1]}, got {new_type[0]} {new_type[1]}."
      )
  return out


def params_of(config: Config, at: Positions, args: Sequence[Any]) -> Any:
  """What the gradients are taken of, by default: the first non-batch argument."""
  skip = {*at.batch, at.rng, at.state}
  rest = [*config.bound_args, *(a for i, a in enumerate(args) if i not in skip)]
  return rest[0] if rest else None


def gradient_mask(
  out_shape: Any,
  params: Any,
  grad_leaves: Any,
  leaves: Any,
  needed_by: str | None = None,
) -> Any:
  """A tree of bools like `out_shape`, True on the gradient leaves.

  With `grad_leaves` (a bool prefix of the output) it says so. Otherwise the
  gradient is the whole output (`jax.grad`), or the one of its two elements
  (`value_and_grad`: the second; `grad(has_aux=True)`: the first) that has
  the structure and shapes of `params` and is averaged or summed in the plan
  `leaves` (a per-parameter maximum shaped like the params is not a
  gradient). When both elements could be (an aux shaped like the params, the
  loss beside the gradient of a scalar param), it never guesses: with
  `needed_by` (what needs the gradients, e.g. "return_stats=True") that is
  an error asking for `grad_leaves`, else no leaf is marked; likewise when
  nothing is found.
  """
  if grad_leaves is not None:
    try:
      mask = jax.tree.broadcast(grad_leaves, out_shape)
    except ValueError as e:
      raise ValueError(
        f"grad_leaves={grad_leaves!r} must be a bool or a pytree prefix of "
        f"grad_fn's output, whose structure is {jax.tree.structure(out_shape)}. "
        f"({e})"
      ) from None
    if needed_by and not any(jax.tree.leaves(mask)):
      raise ValueError(
        f"grad_leaves={grad_leaves!r} marks no output leaf as a gradient, but "
        f"{needed_by} needs the gradients: mark them True, e.g. "
        "grad_leaves=(False, True) for value_and_grad's (loss, grads)."
      )
    return mask
  modes = jax.tree.map(lambda leaf: leaf.mode, leaves, is_leaf=_reduce.is_plan)
  mask = jax.tree.map(lambda _: False, out_shape)
  layouts = []
  if params is not None:
    # The gradients have the params' structure (jax.grad), or that structure
    # with None wherever the params hold no floating array (Equinox's
    # filter_grad: its models hold functions and modules as leaves).
    differentiable = jax.tree.map(
      lambda p: (
        p
        if isinstance(p, (*ARRAY_TYPES, jax.ShapeDtypeStruct))
        and jnp.issubdtype(p.dtype, jnp.inexact)
        else None
      ),
      params,
    )
    layouts = [
      (jax.tree.structure(tree), [np.shape(p) for p in jax.tree.leaves(tree)])
      for tree in (params, differentiable)
      if all(
        isinstance(p, (*ARRAY_TYPES, jax.ShapeDtypeStruct, int, float))
        for p in jax.tree.leaves(tree)
      )
    ]

  def is_gradient(node, node_modes):
    leaves, treedef = jax.tree.flatten(node)
    return (treedef, [leaf.shape for leaf in leaves]) in layouts and all(
      m in ("mean", "sum", "float0") for m in jax.tree.leaves(node_modes)
    )

  if is_gradient(out_shape, modes):
    return jax.tree.map(lambda _: True, out_shape)
  hits = []
  if isinstance(out_shape, tuple | list) and len(out_shape) == 2:
    hits = [i for i in (0, 1) if is_gradient(out_shape[i], modes[i])]
  if len(hits) == 1:
    parts = [
      jax.tree.map(lambda _, hit=j == hits[0]: hit, part)
      for j, part in enumerate(out_shape)
    ]
    return type(out_shape)(parts)
  if needed_by is None:
    return mask
  where = (
    "both the first and the second element of grad_fn's output have"
    if hits
    else "none of grad_fn's output, its first or its second element has"
  )
  raise ValueError(
    f"{needed_by} needs to know which outputs are gradients, and {where} the "
    f"structure and shapes of the params (the first non-batch argument, "
    f"{jax.tree.structure(params)}), so jaccum will not guess. Mark them with "
    "grad_leaves, a bool or a pytree prefix of the output: e.g. "
    "grad_leaves=(True, False) for jax.grad(loss, has_aux=True)'s (grads, aux), "
    "grad_leaves=(False, True) for value_and_grad's (loss, grads)."
  )


def _scattered_plan(
  leaves: Any, grad_mask: Any, grads: list[Any], num_outputs: int
) -> tuple[Any, list[Any]]:
  """Marks the gradients FSDP scatters each micro-step, in the plan and by output.

  Returns the plan with those leaves' carries sharded, and for each output of
  the traced micro-step (the output's leaves come first) how it is split.
  """
  plans, treedef = jax.tree.flatten(leaves, is_leaf=_reduce.is_plan)
  outputs: list[Any] = [None] * num_outputs
  positions = [i for i, on in enumerate(jax.tree.leaves(grad_mask)) if on]
  for i, how in zip(positions, grads, strict=True):
    if how is None or plans[i].mode not in ("mean", "sum"):
      continue
    how = how._replace(dtype=plans[i].carry_dtype)  # summed in the carry's dtype
    outputs[i] = how
    shape = _fsdp.shard_shape(plans[i].shape, how)
    plans[i] = plans[i]._replace(shape=shape, scattered=how)
  return jax.tree.unflatten(treedef, plans), outputs


class Local(NamedTuple):
  """One device's loop, before the devices are combined.

  Attributes:
    leaves: the reduction plan, a tree of `_reduce.Leaf` like the output.
    out_shape: one micro-step's output shapes.
    grad_mask: bools like the output, True on gradient leaves.
    acc: the carry after the last micro-batch.
    total: the weights (`_reduce.Weights`), or None without `weight_fn`.
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
  stats: tuple[jax.Array, jax.Array] | None
  unit_weight: int


def _check_closures(closed: Any, batch: Any, axes: tuple[str, ...]) -> None:
  """Refuses closed-over arrays whose gradients JAX sums in every micro-step.

  Only inside a `shard_map` that types device-varying values (the batch
  varies over `axes`): there a differentiated array that is the same on every
  device gets a psum in its backward pass, which jaccum would count again.
  """
  if not any(_collective.varying_axes(x) for x in jax.tree.leaves(batch)):
    return  # pmap, or shard_map without type checks: no psum is inserted
  invariant = [
    f"{c.dtype}{list(c.shape)}"
    for c in closed.consts
    if isinstance(c, jax.Array)
    and jnp.issubdtype(c.dtype, jnp.inexact)
    and not set(axes) <= _collective.varying_axes(c)
  ]
  if invariant and _collective.sums_over(closed.jaxpr, axes):
    raise ValueError(
      f"grad_fn differentiates arrays it reaches other than through its arguments "
      f"(closed over: {', '.join(invariant)}), and they are the same on every "
      f"device: inside shard_map JAX then sums their gradients over {axes} in "
      f"every micro-step, and the result would count each device's share again. "
      f"Pass these arrays to the accumulated function as arguments (positional "
      f"or keyword), or use jaccum.data_parallel, which accepts closures."
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
  """
  num_microbatches, split = config.num_microbatches, config.split
  if num_real is not None and config.overlap_reduction:
    # With a count, which micro-batch is last is known only when the step runs
    # (a while loop runs the first n), so none can be traced after the loop:
    # refused here rather than silently run without overlap.
    raise ValueError(
      "overlap_reduction=True and num_real_microbatches do not combine: "
      "overlap_reduction runs the last of the K micro-batches after the loop, "
      "while with num_real_microbatches which one runs last depends on the "
      "count, known only when the step runs. Pass overlap_reduction=False to "
      "keep the count, or call without num_real_microbatches (all K "
      "micro-batches run) to keep the overlap."
    )
  batch_size = check_batch(
    [args[i] for i in at.batch],
    num_microbatches,
    names=[f"args[{i}]" for i in at.batch],
    hint=_config.batch_hint(config, at),
  )
  args = list(args)
  extras = (config.bound_args, {**config.bound_kwargs, **kwargs})
  if at.state is not None:
    args[at.state] = jax.tree.map(jnp.asarray, args[at.state])
  if axes is not None:
    # Device-varying params: no psum in each micro-step's backward pass.
    args = [
      a if i in at.batch else _collective.cast_varying(a, axes)
      for i, a in enumerate(args)
    ]
    extras = _collective.cast_varying(extras, axes)
    if at.rng is not None:
      args[at.rng] = _collective.fold_device(args[at.rng], axes)
    if at.state is not None:
      # Keys in the state too: devices draw different numbers.
      args[at.state] = jax.tree.map(
        lambda s: _collective.fold_device(s, axes) if _is_typed_key(s) else s,
        args[at.state],
      )

  def micro_args(index, state):
    step_args = list(args)
    for i in at.batch:
      step_args[i] = jax.tree.map(
        lambda x: take_microbatch(x, index, num_microbatches, split), args[i]
      )
    if at.rng is not None:
      step_args[at.rng] = jax.random.fold_in(args[at.rng], index)
    if at.state is not None:
      step_args[at.state] = state
    return step_args

  def micro_step(step_args, extras):
    bound_args, all_kwargs = extras
    # The weight first: FSDP's sharded modes weight each gradient as it is made.
    weight = None
    if config.weight_fn is not None:
      weight = call_weight_fn(config.weight_fn, step_args)
    try:
      out = config.grad_fn(*bound_args, *step_args, **all_kwargs)
    except Exception as error:
      mark_user_error(error)
      raise
    new_state = None
    if at.state is not None:
      out, new_state = _check_state_output(out, step_args[at.state])
    return out, new_state, weight

  state0 = None if at.state is None else args[at.state]
  flat, treedef = jax.tree.flatten((micro_args(0, state0), extras))
  dynamic = [isinstance(x, ARRAY_TYPES) for x in flat]
  # FSDP's "shard_all": the params (argument 0, the first leaves) arrive as
  # shards; the micro-step is traced on whole ones, as the user wrote it.
  sharded_inputs: list[_fsdp.Sharded | None] = [None] * len(flat)
  if fsdp is not None:
    sharded_inputs[: len(fsdp.params)] = fsdp.params
  examples = [
    x
    if how is None
    else jax.ShapeDtypeStruct(_fsdp.whole_shape(np.shape(x), how), jnp.result_type(x))
    for x, how in zip(flat, sharded_inputs, strict=True)
  ]

  def traced(*values):
    it = iter(values)
    full = [next(it) if d else x for x, d in zip(flat, dynamic, strict=True)]
    return micro_step(*jax.tree.unflatten(treedef, full))

  closed, shapes = jax.make_jaxpr(traced, return_shape=True)(
    *(x for x, d in zip(examples, dynamic, strict=True) if d)
  )
  out_shape, _, weight_shape = shapes
  out_tree = jax.tree.structure(shapes)
  if axes is not None:
    _check_closures(closed, [args[i] for i in at.batch], axes)
    closed = _jaxpr.strip_constraints(closed, axes)
  if (rewrite := default_rewrite(config)) is not None:
    closed = rewrite(closed)

  rows = batch_size // num_microbatches
  leaves = _reduce.plan(config.reduce, out_shape, config.accum_dtype, rows, split)
  params = params_of(config, at, args)
  if fsdp is not None:  # argument 0, whole, as the micro-step saw it
    params = jax.tree.unflatten(
      jax.tree.structure(args[0]), examples[: len(jax.tree.leaves(args[0]))]
    )
  grad_mask = gradient_mask(
    out_shape,
    params,
    config.grad_leaves,
    leaves,
    "return_stats=True" if config.return_stats else needs_grads,
  )
  fsdp_inputs = [h for h, d in zip(sharded_inputs, dynamic, strict=True) if d]
  fsdp_outputs: list[_fsdp.Sharded | None] = [None] * len(closed.jaxpr.outvars)
  if fsdp is not None:
    leaves, fsdp_outputs = _scattered_plan(
      leaves, grad_mask, fsdp.grads, len(fsdp_outputs)
    )
  use_fsdp = any(fsdp_inputs) or any(fsdp_outputs)
  total0 = None
  # With a count of real micro-batches and no weight_fn, every micro-batch
  # weighs its rows: the mean then divides by what ran, however many devices
  # ran how many, and a count of 0 gives zeros.
  unit_weights = num_real is not None and weight_shape is None
  if weight_shape is not None or unit_weights:
    weight_dtype = jnp.float32 if weight_shape is None else weight_shape.dtype
    dtype = _reduce.weights_dtype(weight_dtype, leaves)
    total0 = _reduce.Weights(_reduce.zeros(dtype), _reduce.zeros(dtype))
  stats0 = None
  if config.return_stats:
    summed = [
      leaf.mode
      for leaf, on in zip(
        jax.tree.leaves(leaves, is_leaf=_reduce.is_plan),
        jax.tree.leaves(grad_mask),
        strict=True,
      )
      if on and leaf.mode not in ("mean", "float0")
    ]
    if summed:
      raise ValueError(
        f"return_stats=True measures gradients that are means over each "
        f"micro-batch's examples (or weight units): the gradient leaves must be "
        f'reduced with "mean", got {sorted(set(summed))}. For a loss summed '
        f"over examples, divide it by the micro-batch's size (or, with "
        f'weight_fn, its total weight) and keep reduce="mean".'
      )
    stats0 = (_reduce.zeros(jnp.float32), _reduce.zeros(jnp.float32))
    if axes is not None:
      stats0 = _collective.cast_varying(stats0, axes)

  def body(carry, index):
    acc, state, total, stats = carry
    values = jax.tree.leaves((micro_args(index, state), extras))
    values = [x for x, d in zip(values, dynamic, strict=True) if d]
    scattered_norms = []
    # Shards tied to the iteration: XLA would hoist a gather of a
    # loop-invariant shard out of the loop, and keep it whole throughout.
    values = [
      _fsdp.tied(v, index) if how else v
      for v, how in zip(values, fsdp_inputs, strict=True)
    ]
    if use_fsdp:
      flat_out, scattered_norms = _fsdp.evaluate(
        closed.jaxpr,
        closed.consts,
        values,
        fsdp_inputs,
        fsdp_outputs,
        weight=len(fsdp_outputs) - 1 if weight_shape is not None else None,
      )
    else:
      flat_out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *values)
    out, state, weight = jax.tree.unflatten(out_tree, flat_out)
    # A weight_fn returning a Python number (len(x)) comes back as a literal.
    weight = None if weight is None else jnp.asarray(weight)
    if unit_weights:
      weight = jnp.float32(rows)
    before = total
    if weight is not None:
      total = _reduce.add_weight(total, weight)
    acc = _reduce.update(leaves, acc, out, index, weight, before, total)
    if stats is not None:
      # One scalar per micro-step: the gradient noise scale needs nothing else.
      w = jnp.asarray(rows if weight is None else weight, jnp.float32)
      sq_sum, count = stats
      # Scattered gradients: the norms of their whole values, taken before.
      whole = jax.tree.map(
        lambda on, leaf: on and leaf.scattered is None,
        grad_mask,
        leaves,
        is_leaf=_reduce.is_plan,
      )
      norm = _stats.sq_norm(out, whole) + sum(scattered_norms, jnp.float32(0))
      sq = jnp.where(w != 0, w * norm, 0)
      stats = (sq_sum + sq, count + (w != 0).astype(jnp.float32))
    return (acc, state, total, stats), None

  acc0 = _reduce.init(leaves, out_shape, num_microbatches)
  carry0 = (
    _collective.match_varying(acc0, out_shape),
    state0,
    None
    if total0 is None
    else _collective.match_varying(
      total0,
      jax.tree.map(lambda t: t if weight_shape is None else weight_shape, total0),
    ),
    stats0,
  )
  if num_real is not None:
    # A traced count: a while loop that runs only the real micro-batches, so
    # the others cost nothing (masking them would still compute them).
    (acc, state, total, stats) = jax.lax.fori_loop(
      0, num_real, lambda i, carry: body(carry, i)[0], carry0
    )
  elif num_microbatches == 1:
    # One micro-batch is the whole batch: no loop, so XLA schedules the step
    # as it would without accumulation (a scan of length 1 keeps a carry).
    (acc, state, total, stats), _ = body(carry0, jnp.int32(0))
  elif config.overlap_reduction:
    # K - 1 micro-batches in the loop, the last one after it: each gradient
    # leaf is then final as soon as the last backward pass makes it, and its
    # reduction need not wait for the rest of that pass.
    carry, _ = jax.lax.scan(
      body, carry0, jnp.arange(num_microbatches - 1), unroll=config.unroll
    )
    (acc, state, total, stats), _ = body(carry, jnp.int32(num_microbatches - 1))
  else:
    (acc, state, total, stats), _ = jax.lax.scan(
      body, carry0, jnp.arange(num_microbatches), unroll=config.unroll
    )
  return Local(leaves, out_shape, grad_mask, acc, total, state, stats, rows)


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

  A Python (or NumPy) int outside [0, K] is an error now; a traced count is
  clamped to [0, K] when it runs (nothing can be raised then). With
  `per_device` devices (`data_parallel`) it may also be one count per device,
  shape `[devices]`.
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
  return jnp.clip(jnp.asarray(num_real, jnp.int32), 0, num_microbatches)


def default_rewrite(config: Config) -> Callable[[Any], Any] | None:
  """The rewrite the traced micro-step gets on the default backend, if any.

  On CPU, convolutions in a loop body miss XLA's fast layout (see
  `_conv_layout`) unless `conv_rewrite=False`; other backends run the
  micro-step as traced.
  """
  if config.conv_rewrite and jax.default_backend() == "cpu":
    return _conv_layout.canonicalize_convolutions
  return None


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
  weighted_sq_sum, num_weighted = extras
  # Without weight_fn every micro-batch weighs its rows.
  weight = jnp.float32(local.unit_weight * num_terms) if total is None else total
  return _stats.estimate(weighted_sq_sum, num_weighted, weight, grad_sq_norm)


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
  check_two_sizes(config, num_terms // config.num_microbatches)
  if num_real is not None:
    num_real = check_num_real(num_real, config.num_microbatches)
  local = scan(config, at, args, kwargs, axes=config.axes, num_real=num_real)
  acc, weights, state = local.acc, local.total, local.state
  extras = list(local.stats or ())
  total = None if weights is None else weights.total
  final = None
  if config.axes is not None:
    hooked = config.reduce_fn is not None
    local_weights = weights
    acc, total, state, extras = _collective.all_reduce(
      local.leaves,
      acc,
      weights,
      state,
      config.axes,
      extras=extras,
      wire_dtype=config.reduce_dtype,
      skip=jax.tree.leaves(local.grad_mask) if hooked else None,
    )
    weights = None  # combined: the weighted means are final
    if hooked:
      acc, final, reduce_state = _collective.apply_reduce_fn(
        local.leaves,
        acc,
        local_weights,
        total,
        local.grad_mask,
        num_terms,
        config.axes,
        config.reduce_fn,
        reduce_state,
      )
  elif config.reduce_fn is not None:
    raise ValueError(
      "reduce_fn replaces the reduction over devices: it needs axis_name (inside "
      "shard_map or pmap) or jaccum.data_parallel."
    )
  result = _reduce.finalize(
    local.leaves,
    acc,
    None if total is not None else num_terms,
    config.split,
    weights,
    final,
  )
  out = result if at.state is None else (result, state)
  if config.return_stats:
    grad_sq_norm = _stats.sq_norm(result, local.grad_mask)
    out = out, stats_of(local, extras, total, num_terms, grad_sq_norm)
  return out if config.reduce_fn is None else (out, reduce_state)

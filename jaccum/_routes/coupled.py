"""`accumulate_coupled`: exact gradients of losses that couple the batch, in two passes.

A contrastive loss (CLIP, SigLIP, in-batch negatives) or a batch statistic
(mixture-of-experts load balancing) is not a sum over examples, so averaging
per-micro-batch gradients computes another objective. The gradient splits
at the per-row representations instead: the first pass computes every
micro-batch's `reps` and keeps only them, the loss and its cotangents for
`reps` are computed once on the whole batch's, and the second pass pulls
each micro-batch's cotangent back through the encoder, recomputed. Both
passes are local loops planned as `accumulate`'s are (`plan.local_loop`:
keys, slicing, device-varying casts and the accumulator's dtype); on many
devices the rows of
`reps` are gathered once between them and the gradients reduced once after.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jaccum._core import accumulators, reduction, rewrites, step
from jaccum._core.accumulators import Finish
from jaccum._core.microbatch import Split
from jaccum._core.step import Positions
from jaccum._routes import arguments, placement, plan, routes
from jaccum._routes import mesh as mesh_lib
from jaccum._routes import options as options_lib
from jaccum._routes.options import Options

P = jax.sharding.PartitionSpec


class _TracedOnce:
  """`fn` traced on its first call; every call, the first too, runs that program.

  The second pass calls the encoder again, under `jax.vjp`: running the
  program traced by the first keeps the user's function traced once per
  compilation (and once more, abstractly, by `_check_rows`), whatever K.
  `check(args, kwargs, out)` sees the first trace's tracers; `jaxpr` is the
  traced program, once called.
  """

  def __init__(self, fn: Callable[..., Any], check: Callable[..., None]):
    self._fn, self._check = fn, check
    self._program: Any = None

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    flat, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [isinstance(x, step.ARRAY_TYPES) for x in flat]
    values = [x for x, d in zip(flat, dynamic, strict=True) if d]
    if self._program is None:

      def traced(*values):
        it = iter(values)
        full = [next(it) if d else x for x, d in zip(flat, dynamic, strict=True)]
        call_args, call_kwargs = jax.tree.unflatten(treedef, full)
        out = self._fn(*call_args, **call_kwargs)
        self._check(call_args, call_kwargs, out)
        return out

      closed, shape = jax.make_jaxpr(traced, return_shape=True)(*values)
      self._program = closed, jax.tree.structure(shape)
    closed, out_tree = self._program
    out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *values)
    return jax.tree.unflatten(out_tree, out)

  @property
  def jaxpr(self) -> Any:
    return self._program[0].jaxpr


def _row_leaves(tree: Any, has_aux: bool) -> list[tuple[str, Any]]:
  """`(name, leaf)` for every leaf that needs one row per example."""
  parts = (("reps", tree[0]), ("row_aux", tree[1])) if has_aux else (("reps", tree),)
  return [
    (name + jax.tree_util.keystr(path), leaf)
    for name, part in parts
    for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0]
  ]


def _check_rows(
  out: Any, rows: int, at_twice: Callable[[], Any], has_aux: bool
) -> None:
  """Refuses a `reps` (or `row_aux`) leaf whose axis 0 is not the micro-batch's rows.

  A leaf of `rows` rows may only happen to have them: `at_twice()` (the
  output's shapes on a micro-batch of twice the rows, traced abstractly)
  tells; a function that cannot run on other sizes is taken at its word.
  """
  named = _row_leaves(out, has_aux)
  which = "reps and row_aux" if has_aux else "reps"
  for where, leaf in named:
    if np.shape(leaf)[:1] != (rows,):
      raise ValueError(
        f"{where} (encode_fn's output) has shape {np.shape(leaf)}; every leaf of "
        f"{which} must have the micro-batch's {rows} rows on axis 0, one per "
        f"example, so that they come back as the whole batch's rows in order. A "
        f"value that is not per row (a sum or a statistic over the micro-batch) "
        f"cannot be split back to its rows: return the per-row values and reduce "
        f"them in loss_fn."
      )
  try:
    twice = jax.tree.leaves(at_twice())
  except Exception:  # the function runs on `rows` rows only: cannot tell
    return
  for (where, _), bigger in zip(named, twice, strict=True):
    if np.shape(bigger)[:1] != (2 * rows,):
      raise ValueError(
        f"{where} (encode_fn's output) has {rows} rows on a micro-batch of "
        f"{rows}, but {np.shape(bigger)[:1]} on one of {2 * rows}: its axis 0 "
        f"only happens to match the micro-batch's rows. Every leaf of {which} "
        f"must have one row per example on axis 0; reduce values that are not "
        f"per row in loss_fn."
      )


def _check_state_only_read(state: Any, new_state: Any, state_argnum: int) -> None:
  """Refuses state that `encode_fn` changes: only read state can be exact."""
  if jax.tree.structure(new_state) != jax.tree.structure(state):
    raise TypeError(
      f"with state_argnum={state_argnum}, encode_fn must return (reps, state) "
      f"with the state's structure {jax.tree.structure(state)}, got "
      f"{jax.tree.structure(new_state)}."
    )
  flat = jax.tree_util.tree_flatten_with_path(new_state)[0]
  for (path, new), old in zip(flat, jax.tree.leaves(state), strict=True):
    if new is not old:
      raise ValueError(
        f"encode_fn changes the state at state_argnum={state_argnum} (new "
        f"state{jax.tree_util.keystr(path)} is not the state it was given). "
        f"accumulate_coupled runs encode_fn twice per micro-batch, and each "
        f"micro-batch's statistics (BatchNorm in training mode) are not the "
        f"whole batch's, so threaded state cannot be exact. Read the state "
        f"without updating it (BatchNorm with use_running_average=True), and "
        f"compute statistics of the whole batch in loss_fn from per-row reps."
      )


def _encoder(
  options: Options,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  rows: int,
  has_aux: bool,
) -> _TracedOnce:
  """`encode_fn` as both passes call it, its output checked on the first call."""
  num_bound = len(options.function.bound_args)
  returns = "(reps, row_aux)" if has_aux else "reps"

  def check(call_args, call_kwargs, out):
    if at.state is not None:
      if not isinstance(out, tuple | list) or len(out) != 2:
        raise TypeError(
          f"with state_argnum={at.state}, encode_fn must return ({returns}, "
          f"state), got {type(out).__name__} {jax.tree.structure(out)}."
        )
      out, new_state = out
      state = call_args[num_bound + at.state]
      _check_state_only_read(state, new_state, at.state)
    if has_aux and (not isinstance(out, tuple | list) or len(out) != 2):
      raise TypeError(
        f"with has_aux=True, encode_fn must return (reps, row_aux)"
        f"{', then the state' if at.state is not None else ''}: row_aux holds "
        f"per-row values that come back in the batch's order (None if there are "
        f"none); got {type(out).__name__} {jax.tree.structure(out)}."
      )
    _check_rows(
      out,
      rows,
      lambda: arguments.output_shapes_at(options.function, at, args, kwargs, 2 * rows),
      has_aux,
    )

  return _TracedOnce(options.function.fn, check)


def _pullback(
  encoder: _TracedOnce, num_bound: int, has_state: bool, has_aux: bool
) -> Callable[..., Any]:
  """The second pass's micro-step: a micro-batch's cotangent through `encode_fn`.

  Called with the encoder's arguments and, last, the floating leaves' rows
  of the cotangent; returns the gradient for the params (argument 0).
  """

  def pullback(*call_args, **kwargs):
    *call_args, cotangent = call_args

    def reps_of(params):
      step_args = [*call_args[:num_bound], params, *call_args[num_bound + 1 :]]
      out = encoder(*step_args, **kwargs)
      out = out[0] if has_state else out
      return out[0] if has_aux else out

    reps, vjp = jax.vjp(reps_of, call_args[num_bound])
    floating = iter(cotangent)
    full = [
      next(floating) if _is_floating(r) else np.zeros(r.shape, jax.dtypes.float0)
      for r in jax.tree.leaves(reps)
    ]
    (grads,) = vjp(jax.tree.unflatten(jax.tree.structure(reps), full))
    return grads

  return pullback


def _is_floating(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


# Collectives that move data between devices (pbroadcast only casts a type).
_MOVES_DATA = {n: p for n, p in rewrites.COLLECTIVES.items() if n != "pbroadcast"}


def _refuse_collectives(name: str, jaxpr: Any, axes: tuple[str, ...]) -> None:
  """Refuses `name`'s own collectives over the data axes (and, in `loss_fn`,
  the device index): jaccum gathers the reps and reduces over them itself."""
  watched = dict(_MOVES_DATA)
  if name == "loss_fn":  # every device computes the loss: it must be the same
    watched["axis_index"] = "axis_name"
  found = []
  for sub in rewrites.programs(jaxpr):
    for eqn in sub.eqns:
      param = watched.get(eqn.primitive.name)
      over = eqn.params.get(param, ()) if param else ()
      over = (over,) if isinstance(over, str) else over
      if set(over) & set(axes) and eqn.primitive.name not in found:
        found.append(eqn.primitive.name)
  if not found:
    return
  why = (
    "so a collective there counts rows, or the loss, more than once, and a "
    "device index makes the loss differ between devices. Remove it and write "
    "loss_fn as for one device on the whole batch (a ported trainer's "
    "all_gather of the embeddings, its pmean of the loss and gradients go)."
    if name == "loss_fn"
    else "but encode_fn must map each example on its own: it runs on each "
    "device's micro-batches, twice, and the gradients are reduced over the data "
    "axes once. Remove it: statistics over rows or devices belong in loss_fn."
  )
  raise ValueError(
    f"{name} runs {', '.join(found)} over the data axes {axes}: "
    f"accumulate_coupled gathers every device's reps over them itself, gives "
    f"loss_fn the whole batch's reps and reduces the gradients once, {why}"
  )


def _loss_and_cotangents(
  loss_fn: Callable[..., Any],
  has_aux: bool,
  params: Any,
  reps: Any,
  axes: tuple[str, ...] | None,
) -> tuple[jax.Array, Any, Any, list[jax.Array]]:
  """`loss_fn(params, reps)`, its aux (or None), its gradient for the params,
  and the floating leaves of its cotangent for `reps`."""

  def check(call_args, call_kwargs, out):
    if has_aux and (not isinstance(out, tuple | list) or len(out) != 2):
      raise TypeError(
        f"with has_aux=True, loss_fn must return (loss, aux), as for "
        f"jax.value_and_grad(has_aux=True); got {type(out).__name__} "
        f"{jax.tree.structure(out)}."
      )

  traced = _TracedOnce(loss_fn, check)
  try:
    if has_aux:
      pair = lambda params, reps: tuple(traced(params, reps))
      loss, vjp, aux = jax.vjp(pair, params, reps, has_aux=True)
    else:
      (loss, vjp), aux = jax.vjp(traced, params, reps), None
  except Exception as error:
    step.mark_user_error(error)
    raise
  if axes is not None:
    _refuse_collectives("loss_fn", traced.jaxpr, axes)
  if (
    not isinstance(loss, jax.Array)
    or loss.shape != ()
    or not jnp.issubdtype(loss.dtype, jnp.floating)
  ):
    got = jax.typeof(loss) if isinstance(loss, jax.Array) else type(loss).__name__
    raise TypeError(
      f"loss_fn(params, reps) must return a real floating scalar"
      f"{' beside its aux' if has_aux else ''}, got {got}."
    )
  direct, cotangents = vjp(jnp.ones_like(loss))
  pairs = zip(jax.tree.leaves(cotangents), jax.tree.leaves(reps), strict=True)
  floating = [g for g, r in pairs if _is_floating(r)]
  return loss, aux, direct, floating


class _Result(NamedTuple):
  """What both passes return.

  Attributes:
    loss: `loss_fn`'s value on the whole batch's reps.
    grads: its gradient for the params.
    aux: with `has_aux`, `(loss_fn's aux, encode_fn's row_aux)`: the first
      of the whole batch, the second this device's rows in order; else None.
  """

  loss: Any  # a jax.Array (a PartitionSpec in shard_map's out_specs)
  grads: Any
  aux: Any = None


def _from_device_zero(
  accs: Any, acc: Any, loss: jax.Array, aux: Any, axes: tuple[str, ...]
) -> tuple[Any, jax.Array, Any]:
  """The gradients summed over `axes`, and device 0's loss and aux.

  Every device computes the loss and its aux alike, from the same gathered
  reps: they enter the gradients' psum (one all-reduce) from device 0
  only, so they come back invariant and exact (x + 0 = x). Keys, which
  cannot be summed, are sent apart.
  """
  first_device = jax.lax.axis_index(axes) == 0
  flat, treedef = jax.tree.flatten(aux)
  keyed = [step.is_typed_key(x) for x in flat]
  to_sum = [
    x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
    for x, key in zip([loss, *flat], [False, *keyed], strict=True)
    if not key
  ]
  extras = [jnp.where(first_device, x, jnp.zeros_like(x)) for x in to_sum]
  combined = reduction.over_devices(
    reduction.Reduction(axes, 1), accs, acc, None, None, extras
  )
  acc = combined.acc
  loss, *sums = combined.sums
  sums = iter(sums)
  flat = [
    reduction.from_device(x, axes, 0) if key else next(sums).astype(x.dtype)
    for x, key in zip(flat, keyed, strict=True)
  ]
  return acc, loss, jax.tree.unflatten(treedef, flat)


def _two_passes(
  options: Options,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  loss_fn: Callable[..., Any],
  has_aux: bool,
  axes: tuple[str, ...] | None = None,
) -> _Result:
  """The loss and gradients over this device's rows; with `axes`, over all devices'.

  Inside `shard_map` (or `pmap`) over `axes`, every device gathers the
  batch's `reps` (one all-gather), computes the loss and its cotangents on
  all of them, pulls its own rows back, and one all-reduce sums the
  gradients. The loss, its aux and its direct gradient, the same on every
  device, enter that sum from device 0 only, so the result is invariant.
  """
  batch_size = arguments.check_batch_size(
    options.num_microbatches, options.batch_argnums, at, args
  )
  rows = batch_size // options.num_microbatches
  encoder = _encoder(options, at, args, kwargs, rows, has_aux)
  has_state = at.state is not None
  outputs = encoder if not has_state else lambda *a, **k: encoder(*a, **k)[0]
  passes = Positions(at.batch, at.rng, None)  # read-only state: an argument
  encode = options.replace(function=options.function._replace(fn=outputs))
  first, carry = plan.local_loop(
    encode.replace(reduce="concat"), passes, args, kwargs, axes
  )
  if axes is not None:
    _refuse_collectives("encode_fn", encoder.jaxpr, axes)
  reps = accumulators.finish(first.accumulators, carry.acc, Finish())
  reps, row_aux = reps if has_aux else (reps, None)
  if axes is not None:
    reps = jax.lax.all_gather(reps, axes, axis=0, tiled=True)
  params = args[0] if axes is None else step.cast_varying(args[0], axes)
  loss, aux, direct, cotangents = _loss_and_cotangents(
    loss_fn, has_aux, params, reps, axes
  )
  if axes is not None:
    device = jax.lax.axis_index(axes)
    cotangents = [
      jax.lax.dynamic_slice_in_dim(g, device * batch_size, batch_size)
      for g in cotangents
    ]
    # Computed alike on every device: counted once.
    direct = jax.tree.map(
      lambda x: jnp.where(device == 0, x, jnp.zeros_like(x)), direct
    )
  pullback = _pullback(encoder, len(options.function.bound_args), has_state, has_aux)
  second, carry = plan.local_loop(
    options.replace(function=options.function._replace(fn=pullback), reduce="sum"),
    passes._replace(batch=(*at.batch, len(args))),
    [*args, cotangents],
    kwargs,
    axes,
  )
  accs = second.accumulators
  acc = accumulators.update(accs, carry.acc, direct, jnp.int32(0), None)
  if axes is not None:
    acc, loss, aux = _from_device_zero(accs, acc, loss, aux, axes)
  grads = accumulators.finish(accs, acc, Finish())
  return _Result(loss, grads, (aux, row_aux) if has_aux else None)


def _on_mesh(
  options: Options,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  loss_fn: Callable[..., Any],
  has_aux: bool,
  mesh: Any,
  axes: tuple[str, ...],
) -> _Result:
  """Both passes on every device's rows under `shard_map`, as `data_parallel` runs.

  Without type checks (`check_vma=False`, as under `pmap`), the user's
  functions see local arrays as on one device. Where JAX refuses to run them
  per device (on an explicit mesh, a function closing over arrays placed on
  it), the passes run as the whole batch's step runs, with a warning.
  """
  devices, _, explicit = mesh_lib.check_mesh_and_batch(
    options.num_microbatches, options.batch_argnums, at, args, mesh, axes
  )
  if devices == 1 and mesh.size > 1:
    # As `data_parallel` does: XLA rejects an all-reduce over a manual axis
    # of one device whose operand is split over another axis (data=1,
    # model=2); with one device over the data axes, nothing is gathered.
    return _two_passes(options, at, args, kwargs, loss_fn, has_aux)
  # Params sharded over the data axes (on an explicit mesh) are gathered.
  call, placed, in_specs = placement.placed_call(
    options.function,
    at,
    args,
    kwargs,
    None,
    mesh=mesh,
    axes=axes,
    explicit=explicit,
    keep_sharded=False,
  )

  def per_device(*arrays):
    local_args, local_kwargs, bound_args, bound_kwargs = placement.refill(call, arrays)
    function = options.function.with_bound(bound_args, bound_kwargs)
    local = options.replace(function=function)
    return _two_passes(local, at, local_args, local_kwargs, loss_fn, has_aux, axes)

  both_passes = jax.shard_map(
    per_device,
    mesh=mesh,
    in_specs=tuple(in_specs),
    # row_aux: each device's rows, in the batch's order over the devices.
    out_specs=_Result(P(), P(), (P(), P(axes)) if has_aux else None),
    axis_names=set(axes),
    check_vma=False,
  )
  try:
    return both_passes(*placed)
  except Exception as error:
    if not step.is_user_error(error):
      raise
    per_device_error = error
  try:
    out = _two_passes(options, at, args, kwargs, loss_fn, has_aux)
  except Exception as whole_batch_error:
    raise whole_batch_error from per_device_error
  first_line = (str(per_device_error).strip().splitlines() or [""])[0]
  warnings.warn(
    f"jaccum could not run encode_fn and loss_fn on each device's rows under "
    f"shard_map ({type(per_device_error).__name__}: {first_line[:300]}), so both "
    f"passes run as the whole batch's step runs, sharded over {axes}: the result "
    f"is the same, but XLA may communicate inside the loops (check with "
    f"jaccum.inspect.collectives). "
    f"{routes.cause_and_fix(per_device_error, axes)}",
    stacklevel=3,
  )
  return out


def _check_params(args: Sequence[Any], at: Positions) -> None:
  """Argument 0 is what is differentiated: floating arrays, not the batch or key."""
  options = {"batch_argnums": at.batch, "rng_argnum": (at.rng,)}
  options["state_argnum"] = (at.state,)
  taken = [name for name, where in options.items() if 0 in where]
  if taken:
    raise ValueError(
      f"{taken[0]} points at argument 0, which accumulate_coupled differentiates "
      f"(the params, as jax.value_and_grad does): call it as f(params, batch, "
      f"...) and point {taken[0]} at another argument."
    )
  for path, leaf in jax.tree_util.tree_flatten_with_path(args[0])[0]:
    if not isinstance(leaf, step.ARRAY_TYPES) or not _is_floating(leaf):
      got = jax.typeof(leaf) if isinstance(leaf, jax.Array) else repr(leaf)[:60]
      raise TypeError(
        f"params leaf args[0]{jax.tree_util.keystr(path)} must be a floating "
        f"array: accumulate_coupled differentiates every leaf of argument 0, "
        f"as jax.value_and_grad does; got {got}. Pass other values as other "
        f"arguments."
      )


def _refuse_call_keywords(num_real_microbatches: Any, reduce_state: Any) -> None:
  """Refuses `accumulate`'s call-time keywords, which would reach `encode_fn`."""
  if num_real_microbatches is not None:
    count = num_real_microbatches
    got = jax.typeof(count) if isinstance(count, jax.Array) else f"{count!r:.60}"
    raise TypeError(
      f"accumulate_coupled does not take num_real_microbatches (got {got}): "
      "loss_fn sees the whole batch's reps, in static shapes, and the rows of "
      "micro-batches that do not run would have to leave the coupling (as "
      "negatives, from batch statistics), which only loss_fn can do. Mark the "
      "padding rows instead: pass a per-row mask in the batch, return it from "
      "encode_fn as a reps leaf (a bool or integer leaf is not differentiated), "
      "and make loss_fn leave the masked rows out (no negatives, no loss terms: "
      "see the coupled-losses guide); pad with rows encode_fn maps to finite "
      "values. Call without num_real_microbatches."
    )
  if reduce_state is not None:
    raise TypeError(
      "accumulate_coupled does not take reduce_state: it is the state of "
      "accumulate's reduce_fn, and accumulate_coupled reduces its gradients "
      "itself, once, by a psum. Call without reduce_state."
    )


def accumulate_coupled(
  encode_fn: Callable[..., Any],
  loss_fn: Callable[[Any, Any], jax.Array],
  num_microbatches: int,
  *,
  batch_argnums: int | Sequence[int] = 1,
  rng_argnum: int | None = None,
  state_argnum: int | None = None,
  split: Split = "strided",
  accum_dtype: Any = jnp.float32,
  axis_name: str | tuple[str, ...] | None = None,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  axis: str | tuple[str, ...] | None = None,
  unroll: int | bool = 1,
  conv_rewrite: bool = True,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """Exact `value_and_grad` of a loss that couples the batch, over K micro-batches.

  For losses that are not sums over examples: contrastive losses whose
  negatives are the rest of the batch (CLIP, SigLIP, retrieval with in-batch
  negatives), and batch statistics (a mixture of experts' load balancing).
  Plain `accumulate` of such a loss optimises another objective, each
  micro-batch seeing only its own negatives. Here the model splits into
  `encode_fn`, which maps each example to its representations on its own,
  and `loss_fn`, which couples them::

    def coupled(params, batch, *rest):
      reps = concat([encode_fn(params, batch_k, *rest) for k in range(K)])  # in order
      loss, vjp = jax.vjp(loss_fn, params, reps)
      direct, reps_cotangent = vjp(1.0)
      grads = direct + sum(
        jax.vjp(lambda p: encode_fn(p, batch_k, *rest), params)[1](reps_cotangent_k)[0]
        for k in range(K))                                 # summed in float32
      return loss, grads

  which is `jax.value_and_grad(lambda p, b: loss_fn(p, encode_fn(p, b)))(params,
  batch)` in exact arithmetic. The first pass keeps only `reps`, not the
  encoder's activations; the second recomputes each micro-batch's forward
  pass for its backward pass. Memory: the whole batch's `reps` and the
  loss's own temporaries (a B × B logits matrix for in-batch negatives) plus
  one micro-batch's activations. Work: one more forward pass than the whole
  batch (about 4/3 of its FLOPs). `encode_fn` is traced once (and once more,
  abstractly, to check that its output has one row per example).

  Many devices. With `mesh=`/`axis=` (as `data_parallel` takes them), a batch
  sharded on axis 0 over explicit mesh axes, or `axis_name` inside your own
  `shard_map`, each device runs both passes on its own rows: its `reps` are
  all-gathered once (rows × width), every device computes `loss_fn` on the
  whole batch's `reps` and pulls back its own rows' cotangents, and one
  all-reduce sums the gradients. No collective runs inside either loop. K is
  then micro-batches per device: N must be a multiple of devices × K.
  Write `encode_fn` and `loss_fn` as for one device: a collective of their
  own over the data axes (a ported trainer's `all_gather` of the embeddings
  or `pmean` of the loss) would count rows or the loss more than once, and
  is refused by name; collectives over other mesh axes (tensor parallel)
  are theirs.

  Args:
    encode_fn: `encode_fn(params, microbatch, *rest, **kwargs) -> reps`, called
      with the accumulated function's arguments, each batch argument cut to
      one micro-batch. `reps` is a pytree whose every leaf has the
      micro-batch's rows on axis 0 (embeddings, router probabilities, per-row
      losses; integer leaves such as labels pass through undifferentiated).
      Each row must depend on its own example only: statistics over rows
      belong in `loss_fn`.
    loss_fn: `loss_fn(params, reps) -> scalar`, with the whole batch's `reps`,
      rows in the batch's order whatever `split` is; it may use the params
      itself (a learnable temperature).
    num_microbatches: K, a static positive int that divides the batch size.
    batch_argnums: the positional argument(s) holding the batch. Argument 0 is
      the params, which are differentiated.
    rng_argnum: the positional argument holding a PRNG key: micro-batch k
      sees `fold_in(key, k)` (on device d > 0 of a mesh, folded with d first),
      the same key in both passes, so dropout is exact.
    state_argnum: the positional argument holding state that `encode_fn`
      returns as `(reps, state)`, e.g. Flax Linen's `mutable=` collections.
      Only state the encoder reads can be exact: any leaf it changes is an
      error. The call then returns `((loss, grads), state)`.
    split: `"strided"` (micro-batch k holds rows k, k + K, …) or
      `"contiguous"`; it decides which rows share a micro-batch (and a key),
      never the order in which `loss_fn` sees them.
    accum_dtype: gradients narrower than this are summed over the
      micro-batches in it and cast back at the end; `None` keeps each leaf's
      dtype.
    axis_name: for use inside your own `shard_map` (or `pmap`): the mesh
      axis (or axes) the batch is split over.
    mesh: the device mesh for the data-parallel route (as `data_parallel`);
      with `axis` and no mesh, the mesh set with `jax.set_mesh` or the
      batch's.
    axis: the mesh axis (or axes) of the data-parallel route; `"data"` when
      only `mesh` is given: pass it when your mesh names its batch axis
      otherwise (e.g. `axis="batch"`).
    unroll: passed to both passes' `lax.scan`.
    conv_rewrite: as for `accumulate`: on CPU, convolutions in the loops take
      XLA's fast layout.
    has_aux: both functions return a pair: `loss_fn` returns `(loss, aux)`,
      measurements of the whole batch's reps (accuracy from the logits, a
      temperature), returned as computed (on a mesh, device 0's, which every
      device computes alike); `encode_fn` returns `(reps, row_aux)` (then the
      state, with `state_argnum`), `row_aux` a pytree (None if empty) whose
      every leaf has one row per example, not differentiated, returned
      concatenated in the batch's order as `reps` are (on `axis_name`'s
      route, each device's own rows: give them `P(axis_name)` in your
      `out_specs`; never gathered). The call returns `((loss, (aux,
      row_aux)), grads)`: what `jax.value_and_grad(whole, has_aux=True)`
      returns for `def whole(p, b): reps, row_aux = encode_fn(p, b); loss,
      aux = loss_fn(p, reps); return loss, (aux, row_aux)`.

  Returns:
    A function `f(params, batch, *rest, **kwargs) -> (loss, grads)` (with
    `has_aux`, `((loss, (aux, row_aux)), grads)`; with `state_argnum`, that
    and the state: `(..., state)`), the gradients in the params' structure
    and dtypes, usable with or without `jit`. Keywords go to `encode_fn`,
    except `accumulate`'s call-time keywords, which are refused by name:
    `num_real_microbatches` (the rows of micro-batches that do not run would
    have to leave the coupling, negatives and batch statistics, which only
    `loss_fn` can do: pad the batch with rows `encode_fn` maps to finite
    values, return a per-row mask as a `reps` leaf, and leave the masked rows
    out in `loss_fn`; see the coupled-losses guide) and `reduce_state` (there
    is no `reduce_fn`).

  Raises:
    TypeError, ValueError: on bad options, when the returned function is
      traced on arguments that do not fit them, for a `reps` (or `row_aux`)
      leaf without one row per example on axis 0, a `loss_fn` that does not
      return a floating scalar (and an aux, with `has_aux`), state that
      `encode_fn` changes, a collective over the data axes in `encode_fn` or
      `loss_fn` (or the device index in `loss_fn`), and `accumulate`'s
      call-time keywords; the message names the argument or the leaf path.

  Examples:
    A contrastive loss with in-batch negatives: 8 micro-batches of 4 rows
    give the gradient of the whole batch of 32, all 32 × 32 pairs:

    >>> import jax, jax.numpy as jnp, optax, jaccum
    >>> def encode(params, batch):
    ...   return {"x": jnp.tanh(batch["x"] @ params["wx"]),
    ...           "y": jnp.tanh(batch["y"] @ params["wy"])}
    >>> def loss(params, reps):
    ...   logits = reps["x"] @ reps["y"].T * jnp.exp(params["t"])
    ...   labels = jnp.arange(logits.shape[0])
    ...   return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    >>> params = {"wx": jax.random.normal(k1, (5, 3)),
    ...           "wy": jax.random.normal(k2, (6, 3)), "t": jnp.float32(0.5)}
    >>> batch = {"x": jax.random.normal(k3, (32, 5)),
    ...          "y": jax.random.normal(k4, (32, 6))}
    >>> step = jax.jit(jaccum.accumulate_coupled(encode, loss, 8))
    >>> value, grads = step(params, batch)
    >>> whole = jax.jit(jax.value_and_grad(lambda p, b: loss(p, encode(p, b))))
    >>> whole_value, whole_grads = whole(params, batch)
    >>> bool(jnp.allclose(value, whole_value))
    True
    >>> all(jax.tree.leaves(jax.tree.map(jnp.allclose, grads, whole_grads)))
    True
  """
  for name, fn in (("encode_fn", encode_fn), ("loss_fn", loss_fn)):
    if not callable(fn):
      raise TypeError(f"{name} must be callable, got {fn!r:.60}.")
  if axis_name is not None and (mesh is not None or axis is not None):
    raise ValueError(
      "axis_name (inside your own shard_map) and mesh=/axis= (accumulate_coupled "
      "runs the shard_map) are two routes; pass one of them."
    )
  options = options_lib.make(
    encode_fn,
    num_microbatches,
    batch_argnums=batch_argnums,
    accum_dtype=accum_dtype,
    rng_argnum=rng_argnum,
    state_argnum=state_argnum,
    axis_name=axis_name,
    split=split,
    unroll=unroll,
    conv_rewrite=conv_rewrite,
  )
  has_aux = options_lib.check_bool(has_aux, "has_aux")
  mesh_axes = None
  if mesh is not None or axis is not None:
    mesh_axes = options_lib.axis_tuple("data" if axis is None else axis, "axis")
  axes = options.axis_name

  def coupled(
    *args: Any,
    num_real_microbatches: Any = None,
    reduce_state: Any = None,
    **kwargs: Any,
  ) -> Any:
    _refuse_call_keywords(num_real_microbatches, reduce_state)
    at = arguments.positions(
      options.batch_argnums, options.rng_argnum, options.state_argnum, args, kwargs
    )
    _check_params(args, at)
    if axes is not None:
      arguments.check_axes_bound(axes)
      out = _two_passes(options, at, args, kwargs, loss_fn, has_aux, axes)
    elif mesh_axes is not None:
      the_mesh = mesh if mesh is not None else placement.find_mesh(args, at)
      out = _on_mesh(options, at, args, kwargs, loss_fn, has_aux, the_mesh, mesh_axes)
    elif (route := arguments.explicit_batch_axes(args, at)) is not None:
      out = _on_mesh(options, at, args, kwargs, loss_fn, has_aux, *route)
    else:
      out = _two_passes(options, at, args, kwargs, loss_fn, has_aux)
    value = (out.loss, out.aux) if has_aux else out.loss
    return (
      (value, out.grads) if at.state is None else ((value, out.grads), args[at.state])
    )

  return coupled

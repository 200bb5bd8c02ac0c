"""Device-varying values and the one cross-device reduction after the loop.

Inside a `shard_map` that checks types (the default), JAX tracks which mesh
axes a value varies over. A gradient taken with respect to a device-invariant
(replicated) parameter of a loss on a device-varying batch is itself made
invariant by a `psum` that JAX inserts into the backward pass: inside a loop,
one all-reduce per micro-batch. Casting the parameters to varying before the
loop removes that psum; the loop then runs with no communication, and
`all_reduce` combines the devices once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from jaccum import _exact, _reduce, _wire


def varying_axes(x: Any) -> frozenset[str]:
  """The manual mesh axes over which `x` (an array or a ShapeDtypeStruct) varies."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", ()))


def cast_varying(tree: Any, axes: Sequence[str] | frozenset[str]) -> Any:
  """Casts every array leaf of `tree` to vary over `axes` (a no-op where it does).

  Only manual axes (`shard_map`, `pmap`) type values as varying; over a
  `vmap` axis nothing is cast.
  """
  manual = set(jax.sharding.get_abstract_mesh().manual_axes)

  def cast(x):
    if not isinstance(x, jax.Array):
      return x
    missing = tuple(a for a in axes if a in manual and a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def match_varying(tree: Any, like: Any) -> Any:
  """Casts `tree`'s array leaves to vary like the matching leaves of `like`.

  A scan carry must keep its type across iterations: an accumulator
  initialised from zeros is invariant, the micro-step outputs it absorbs may
  vary over the data axis. `like` is the primary tree: `tree` may hold None
  where nothing is carried.
  """
  return jax.tree.map(
    lambda y, x: x if x is None else cast_varying(x, varying_axes(y)), like, tree
  )


def _jaxprs(jaxpr: jex.Jaxpr) -> Iterator[jex.Jaxpr]:
  yield jaxpr
  for sub in jex.subjaxprs(jaxpr):
    yield from _jaxprs(sub)


def sums_over(jaxpr: jex.Jaxpr, axes: Sequence[str]) -> bool:
  """Whether `jaxpr` (or a program nested in it) sums over any of `axes`."""
  return any(
    eqn.primitive.name in ("psum", "psum_invariant")
    and set(eqn.params.get("axes", ())) & set(axes)
    for sub in _jaxprs(jaxpr)
    for eqn in sub.eqns
  )


_COLLECTIVES = {
  "psum": "axes",
  "psum_invariant": "axes",
  "pmax": "axes",
  "pmin": "axes",
  "pbroadcast": "axes",
  "all_gather": "axis_name",
  "all_gather_invariant": "axis_name",
  "reduce_scatter": "axis_name",
  "ppermute": "axis_name",
  "all_to_all": "axis_name",
  "ragged_all_to_all": "axis_name",
}


def collective_axes(jaxpr: jex.Jaxpr) -> set[str]:
  """The mesh axes that collectives in `jaxpr` (nested programs too) run over."""
  found: set[str] = set()
  for sub in _jaxprs(jaxpr):
    for eqn in sub.eqns:
      param = _COLLECTIVES.get(eqn.primitive.name)
      names = eqn.params.get(param, ()) if param else ()
      found.update((names,) if isinstance(names, str) else names)
  return found


def fold_device(key: jax.Array, axes: Sequence[str]) -> jax.Array:
  """`key` on device 0, `fold_in(key, d)` on device d > 0 of `axes`.

  Devices draw different numbers, and device 0 draws (and advances a key
  threaded as state) exactly as one device running the whole batch would, so
  the key that comes back after the loop is the unsharded one.
  """
  device = jax.lax.axis_index(tuple(axes))
  data = jax.random.key_data(key)
  folded = jax.random.key_data(jax.random.fold_in(key, device))
  return jax.random.wrap_key_data(
    jnp.where(device == 0, data, folded), impl=jax.random.key_impl(key)
  )


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


def _from_device(x: jax.Array, axes: tuple[str, ...], holder: Any) -> jax.Array:
  """The value of `x` on device `holder` of `axes`, on every device.

  Bit for bit for any dtype, keys too (a sum of one value and zeros).
  """
  mine = jax.lax.axis_index(axes) == holder
  if jnp.issubdtype(x.dtype, jnp.floating):
    return _float_from(axes, x, mine)
  is_key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  data = jax.random.key_data(x) if is_key else x
  as_int = data.astype(jnp.int32) if data.dtype == jnp.bool_ else data
  picked = jax.lax.psum(jnp.where(mine, as_int, jnp.zeros_like(as_int)), axes)
  picked = picked.astype(data.dtype)
  return (
    jax.random.wrap_key_data(picked, impl=jax.random.key_impl(x)) if is_key else picked
  )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _float_from(axes: tuple[str, ...], x: jax.Array, mine: jax.Array) -> jax.Array:
  """`_from_device` for floats: as integers of their width, so that -0.0 and
  NaNs keep their bits; its derivative is the picked device's."""
  as_int = jax.lax.bitcast_convert_type(x, f"int{8 * x.dtype.itemsize}")
  picked = jax.lax.psum(jnp.where(mine, as_int, jnp.zeros_like(as_int)), axes)
  return jax.lax.bitcast_convert_type(picked, x.dtype)


@_float_from.defjvp
def _float_from_jvp(axes, primals, tangents):
  x, mine = primals
  picked = jax.lax.psum(jnp.where(mine, tangents[0], jnp.zeros_like(tangents[0])), axes)
  return _float_from(axes, x, mine), picked


def _last_holder(axes: tuple[str, ...], ran: Any) -> jax.Array:
  """The highest-indexed device of `axes` that ran a micro-batch (-1: none)."""
  device = jax.lax.axis_index(axes)
  return jax.lax.pmax(jnp.where(ran, device, -1), axes)


def all_reduce(
  leaves: Any,
  acc: Any,
  weights: _reduce.Weights | None,
  state: Any,
  axes: tuple[str, ...],
  scatter: list[Any] | None = None,
  extras: Sequence[jax.Array] = (),
  *,
  wire_dtype: Any = None,
  skip: Sequence[bool] | None = None,
  last_ran: Any = None,
) -> tuple[Any, jax.Array | None, Any, list[jax.Array]]:
  """Combines the per-device accumulators, one fused all-reduce for the sums.

  `"sum"` and unweighted `"mean"` leaves are summed over devices. Weighted
  `"mean"` leaves hold each device's `Σ w out / Σ |w|`; they are combined as
  `Σ_d norm_d acc_d / Σ_d total_d` (`weights`), in float32 at least. These
  sums, the total weight and the floating state go into a single `psum` (XLA fuses its
  operands into one all-reduce); `"max"` and `"min"` leaves take a `pmax` and
  a `pmin`. `"concat"` and `"last"` leaves stay per device, but with
  `last_ran` (`deterministic=True`: whether this device ran a micro-batch)
  every device gets the `"last"` leaves of the highest-indexed device that
  did: the last micro-batch of the global order. Leaves given an
  `_fsdp.Sharded` in `scatter` (one entry per leaf; FSDP gradients) are
  reduce-scattered over its axes instead, so each device keeps the shard its
  parameters live on, and summed over the other data axes (HSDP's replicas);
  leaves the loop scattered already (`Leaf.scattered`) are only summed over
  the other axes. Floating state is averaged over devices (BatchNorm
  statistics, as synchronised BatchNorm does); other state (counters, keys,
  flags) takes device 0's value.

  `extras` are further scalars to sum over devices, in the same psum.

  JAX lowers a psum of many arrays to one all-reduce each, so each leaf's
  depends on that leaf alone (XLA may combine them later). `wire_dtype` (e.g.
  bfloat16) is what those leaves cross the wire in: each is cast for the
  reduction and back after it. Leaves marked in `skip` are
  returned as they are (a `reduce_fn` reduces them).

  Exact sums (`deterministic=True`: exact leaves, the weights, the
  statistics) go into the same psum as int32 bins aligned over `axes`, or are
  reduce-scattered as integers (`_exact.psum`, `_exact.scatter`), and come
  back as floats, or as `_exact.Total`s for `_reduce.finalize` to read: sums,
  or means divided once by the total.

  Returns:
    `(acc, total, state, extras)` combined over devices; `total` is the summed
    weight (None when unweighted).
  """
  plans, treedef = jax.tree.flatten(leaves, is_leaf=_reduce.is_plan)
  values = treedef.flatten_up_to(acc)
  hows = [None] * len(plans) if scatter is None else scatter
  weighted = weights is not None
  total = None if weights is None else weights.total

  def summand(i):
    # A scattered or exact leaf holds Σ w·out already; others Σ w·out / Σ |w|.
    p = plans[i]
    if weights is not None and p.mode == "mean" and not (p.scattered or p.exact):
      compute = jnp.promote_types(values[i].dtype, weights.norm.dtype)
      return values[i].astype(compute) * weights.norm.astype(compute)
    return values[i]

  skipped = [False] * len(plans) if skip is None else list(skip)
  summed = [
    i
    for i, p in enumerate(plans)
    if p.mode in ("mean", "sum")
    and hows[i] is None
    and p.scattered is None
    and not skipped[i]
  ]

  def on_the_wire(reduce, xs):
    """`reduce(xs)`, with each floating x cast to `wire_dtype` and back."""
    narrow = [
      x.astype(wire_dtype)
      if wire_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
      else x
      for x in xs
    ]
    sums = _wire.reduced(reduce, narrow)
    return [r.astype(x.dtype) for r, x in zip(sums, xs, strict=True)]

  # Sharded over some axes: scattered over those, summed over the rest.
  by_rest: dict[tuple[str, ...], list[int]] = {}
  for i, p in enumerate(plans):
    how = hows[i] if p.mode in ("mean", "sum") and not skipped[i] else None
    if how is not None and p.exact:  # summed over every axis, in integers
      values[i] = _exact.scatter(values[i], how, axes)
      continue
    if how is not None:
      (values[i],) = on_the_wire(lambda xs, how=how: [how.scatter(xs[0])], [summand(i)])
    how = how or p.scattered
    rest = () if how is None else tuple(a for a in axes if a not in how.axes)
    if rest:
      by_rest.setdefault(rest, []).append(i)
  for rest, indices in by_rest.items():
    parts = [summand(i) if hows[i] is None else values[i] for i in indices]
    sums = on_the_wire(lambda xs, rest=rest: jax.lax.psum(xs, rest), parts)
    for i, value in zip(indices, sums, strict=True):
      values[i] = value

  state_values, state_def = jax.tree.flatten(state)
  floating = [jnp.issubdtype(jnp.result_type(s), jnp.inexact) for s in state_values]
  fused = [summand(i) for i in summed]
  if wire_dtype is not None:
    fused = [
      x.astype(wire_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
      for x in fused
    ]
  leaf_dtypes = [summand(i).dtype for i in summed]
  to_sum = fused + [s for s, f in zip(state_values, floating, strict=True) if f]
  to_sum += list(extras)
  if weighted:
    to_sum.append(total)
  to_sum = _exact.psum(to_sum, axes) if to_sum else []
  num_devices = jax.lax.axis_size(axes)
  exact_total = to_sum.pop() if weighted else None
  total = _exact.as_float(exact_total)
  summed_extras = [_exact.as_float(x) for x in to_sum[len(to_sum) - len(extras) :]]
  for i, value, dtype in zip(summed, to_sum[: len(fused)], leaf_dtypes, strict=False):
    values[i] = value if _exact.is_exact(value) else value.astype(dtype)
  sums = iter(to_sum[len(fused) : len(to_sum) - len(extras)])
  _combine_the_rest(plans, values, skipped, axes, weights, exact_total, last_ran)
  state_values = [
    next(sums) / num_devices if f else _from_device(s, axes, 0)
    for s, f in zip(state_values, floating, strict=True)
  ]
  return (
    jax.tree.unflatten(treedef, values),
    total,
    jax.tree.unflatten(state_def, state_values),
    summed_extras,
  )


def _combine_the_rest(
  plans: Sequence[_reduce.Leaf],
  values: list[Any],
  skipped: Sequence[bool],
  axes: tuple[str, ...],
  weights: _reduce.Weights | None,
  total: Any,
  last_ran: Any,
) -> None:
  """`all_reduce`'s leaves after the sums, in place: maxima, minima, the
  global last micro-batch's leaves (`last_ran`), weighted means divided."""
  holder = None
  if last_ran is not None and any(p.mode == "last" for p in plans):
    holder = _last_holder(axes, last_ran)
  for i, p in enumerate(plans):
    if skipped[i]:
      continue
    if p.mode in ("max", "min"):
      extreme = jax.lax.pmax if p.mode == "max" else jax.lax.pmin
      values[i] = _wire.reduced(lambda x, f=extreme: f(x, axes), values[i])
    if p.mode == "last" and holder is not None:
      values[i] = _from_device(values[i], axes, holder)
    if total is not None and p.mode == "mean" and p.exact:
      divisor = _reduce.exact_divisor(weights, total)  # pyright: ignore[reportArgumentType]
      values[i] = _exact.divide(values[i], divisor).astype(p.carry_dtype)
    elif total is not None and p.mode == "mean":
      mean = _reduce.weighted_mean(values[i], _exact.as_float(total))
      values[i] = mean.astype(p.carry_dtype)


def gradient_part(mask: Any) -> int | None:
  """Where the gradients sit in the output: None for all of it, or an index.

  `reduce_fn` takes the gradients as one tree, which must be the whole output
  (`jax.grad`) or one element of a pair (`value_and_grad`'s second,
  `grad(has_aux=True)`'s first).
  """
  if all(jax.tree.leaves(mask)):
    return None
  if isinstance(mask, tuple | list) and len(mask) == 2:
    for i in (1, 0):
      if all(jax.tree.leaves(mask[i])) and not any(jax.tree.leaves(mask[1 - i])):
        return i
  raise ValueError(
    "reduce_fn takes the gradients as one tree: grad_fn's whole output, or one "
    "element of a pair (value_and_grad's second); mark them with grad_leaves, "
    f"got {mask}."
  )


_REDUCE_FN_RETURNS = (
  "reduce_fn(grads, axes, state) must return a pair (reduced_grads, new_state): "
  "reduced_grads shaped as it got grads, new_state shaped as it got state "
  "(return it unchanged, or None if there is none)"
)


def _types(tree: Any) -> list[tuple[tuple[int, ...], Any]]:
  return [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(tree)]


def _checked_reduce_output(out: Any, grads: Any, state: Any) -> tuple[Any, Any]:
  """`reduce_fn`'s `(reduced, new_state)`, or an error saying what it must be.

  A pair is unpacked only if it is one: a single gradient array of leading
  size 2 would unpack as its two rows.
  """
  if not isinstance(out, tuple) or len(out) != 2:
    shape = getattr(out, "shape", None)
    got = f"{type(out).__name__} {jax.tree.structure(out)}"
    if shape is not None:
      got = f"an array of shape {tuple(shape)}"
    raise TypeError(f"{_REDUCE_FN_RETURNS}; got {got}.")
  reduced, new_state = out
  for name, new, old in (
    ("reduced_grads", reduced, grads),
    ("new_state", new_state, state),
  ):
    if jax.tree.structure(new) != jax.tree.structure(old) or _types(new) != _types(old):
      raise TypeError(
        f"{_REDUCE_FN_RETURNS}; {name} is {jax.tree.structure(new)} of "
        f"{[f'{d}{list(sh)}' for sh, d in _types(new)]}, expected "
        f"{jax.tree.structure(old)} of {[f'{d}{list(sh)}' for sh, d in _types(old)]}."
      )
  return reduced, new_state


def check_reduce_state(reduce_state: Any, rows: int, axes: Sequence[str]) -> None:
  """Each `reduce_state` leaf needs a leading axis of one row per device."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(reduce_state)[0]:
    shape = jnp.shape(leaf)
    if shape[:1] != (rows,):
      raise ValueError(
        f"reduce_state{jax.tree_util.keystr(path)} has shape {shape}: each "
        f"reduce_state leaf needs a leading axis of one row per device of "
        f"{tuple(axes)}, {rows} here. Make the state for this many devices "
        f"(e.g. PowerSGD.init(grads_like, num_devices={rows}))."
      )


def apply_reduce_fn(
  leaves: Any,
  acc: Any,
  weights: _reduce.Weights | None,
  total: jax.Array | None,
  mask: Any,
  num_terms: int,
  axes: tuple[str, ...],
  reduce_fn: Any,
  reduce_state: Any,
) -> tuple[Any, list[bool], Any]:
  """The gradient leaves that `all_reduce` skipped, reduced by `reduce_fn`.

  Each device's share is what makes the exact result when summed over
  `axes`: its sum, its mean's sum over K·devices micro-batches, or its
  weighted sum over the total weight (`total`, summed over devices already).
  `reduce_fn(grads, axes, state)` returns their sum, or an estimate of it.
  `reduce_state` holds one row per device on a leading axis; `reduce_fn` sees
  and returns this device's row.

  Returns:
    `(acc, final, new_state)`: `acc` with the gradients reduced, which
    leaves are final (`_reduce.finalize` must not divide them again), and the
    new state, each leaf with its leading axis of one row.
  """
  plans, treedef = jax.tree.flatten(leaves, is_leaf=_reduce.is_plan)
  values = treedef.flatten_up_to(acc)
  on = jax.tree.leaves(mask)
  final = [False] * len(plans)
  for i, p in enumerate(plans):
    if not on[i] or p.mode == "float0":
      continue
    if p.mode not in ("mean", "sum") or p.scattered is not None:
      raise ValueError(
        f"reduce_fn reduces gradients that are summed or averaged, got a leaf "
        f'reduced with "{p.mode}".'
      )
    value = values[i]
    if p.mode == "mean" and weights is not None:
      assert total is not None
      compute = jnp.promote_types(value.dtype, weights.norm.dtype)
      safe = jnp.where(total != 0, total, 1).astype(compute)
      value = value.astype(compute) * weights.norm.astype(compute) / safe
    elif p.mode == "mean":
      value = value / num_terms
    values[i] = value
    final[i] = True
  part = gradient_part(mask)
  tree = jax.tree.unflatten(treedef, values)
  grads = tree if part is None else tree[part]
  state = jax.tree.map(lambda x: x[0], reduce_state)
  reduced, new_state = _checked_reduce_output(
    reduce_fn(grads, axes, state), grads, state
  )
  if part is None:
    tree = reduced
  else:
    tree = type(tree)(reduced if j == part else t for j, t in enumerate(tree))
  values = treedef.flatten_up_to(tree)
  values = [
    v.astype(p.carry_dtype) if done else v
    for v, p, done in zip(values, plans, final, strict=True)
  ]
  return (
    jax.tree.unflatten(treedef, values),
    final,
    jax.tree.map(lambda x: jnp.asarray(x)[None], new_state),
  )

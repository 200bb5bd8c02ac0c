"""The one reduction over devices, after the loop: every route uses it.

`over_devices` combines each device's carries: the sums (means, exact sums
as int32 bins, the weights, floating state, the noise scale's scalars) in
one fused psum, maxima and minima by `pmax`/`pmin`, FSDP gradients by a
reduce-scatter (or, scattered by the loop already, a sum over the other
data axes), per-example leaves kept per device. With `reduce_fn`, the
gradient leaves are left to it: each device hands its share of the exact
result and gets back their sum (or an estimate of it, compressed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaccum._core import accumulators, exact
from jaccum._core import wire as _wire
from jaccum._core.accumulators import Weights


class Reduction(NamedTuple):
  """How the devices combine, decided by the plan.

  Attributes:
    axes: the data axes, summed over.
    num_terms: the micro-batches over all devices (devices × K).
    wire: the dtype floating sums cross the wire in (`reduce_dtype`), or None.
    scatter: per output leaf, how an FSDP gradient is reduce-scattered after
      the loop (`"gather_once"`), or None; None for no such leaf.
    hook: `reduce_fn`, which reduces the gradient leaves itself, or None.
    grad_mask: bools like the output, True on gradient leaves.
    grad_part: where the gradients sit in the output for `reduce_fn`: None
      for all of it, or the index of one element of a pair.
  """

  axes: tuple[str, ...]
  num_terms: int
  wire: Any = None
  scatter: list[Any] | None = None
  hook: Callable[..., Any] | None = None
  grad_mask: Any = None
  grad_part: int | None = None


class Combined(NamedTuple):
  """The carries combined over devices.

  Attributes:
    acc: per output leaf, its combined carry (weighted means divided by the
      total weight already).
    total: the summed weight, or None when unweighted.
    state: floating state averaged, other state device 0's.
    sums: the noise scale's scalars, summed.
    done: per leaf, whether `reduce_fn` reduced it (its mean is final).
    reduce_state: `reduce_fn`'s new state, one row, or the one it got.
  """

  acc: Any
  total: Any
  state: Any
  sums: list[Any]
  done: list[bool] | None
  reduce_state: Any


def from_device(x: jax.Array, axes: tuple[str, ...], holder: Any) -> jax.Array:
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
  """`from_device` for floats: as integers of their width, so that -0.0 and
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


def _on_the_wire(wire: Any, reduce: Callable[[list[Any]], list[Any]], xs: list[Any]):
  """`reduce(xs)`, with each floating x cast to `wire` and back, in a form
  every backend compiles (`wire.reduced`)."""
  narrow = [
    x.astype(wire) if wire is not None and jnp.issubdtype(x.dtype, jnp.floating) else x
    for x in xs
  ]
  sums = _wire.reduced(reduce, narrow)
  return [r.astype(x.dtype) for r, x in zip(sums, xs, strict=True)]


def _scatters(
  plan: Reduction,
  accs: list[Any],
  values: list[Any],
  shares: list[Any],
  skipped: list[bool],
) -> None:
  """FSDP gradients scattered over their axes, and summed over the other data
  axes (HSDP's replicas); scattered in the loop already: summed over those."""
  hows = plan.scatter or [None] * len(accs)
  by_rest: dict[tuple[str, ...], list[int]] = {}
  for i, acc in enumerate(accs):
    how = hows[i] if acc.wire == "sum" and not skipped[i] else None
    if how is not None and isinstance(acc, accumulators.Exact):
      values[i] = exact.scatter(values[i], how, plan.axes)  # in integers
      continue
    if how is not None:
      (values[i],) = _on_the_wire(
        plan.wire, lambda xs, how=how: [how.scatter(xs[0])], [shares[i]]
      )
      shares[i] = values[i]
    how = how or getattr(acc, "how", None)
    rest = () if how is None else tuple(a for a in plan.axes if a not in how.axes)
    if rest:
      by_rest.setdefault(rest, []).append(i)
  for rest, indices in by_rest.items():
    sums = _on_the_wire(
      plan.wire,
      lambda xs, rest=rest: jax.lax.psum(xs, rest),
      [shares[i] for i in indices],
    )
    for i, value in zip(indices, sums, strict=True):
      values[i] = value


def _the_rest(
  plan: Reduction,
  accs: list[Any],
  values: list[Any],
  skipped: list[bool],
  weights: Weights | None,
  total: Any,
  ran: Any,
) -> None:
  """After the sums, in place: maxima, minima, the global last micro-batch's
  leaves, the sums' means divided by the total weight."""
  holder = None
  if any(a.wire == "last" for a in accs):
    holder = _last_holder(plan.axes, ran)
  for i, acc in enumerate(accs):
    if skipped[i]:
      continue
    if acc.wire in ("max", "min"):
      extreme = jax.lax.pmax if acc.wire == "max" else jax.lax.pmin
      values[i] = _wire.reduced(lambda x, f=extreme: f(x, plan.axes), values[i])
    elif acc.wire == "last":
      values[i] = from_device(values[i], plan.axes, holder)
    elif acc.wire in ("sum", "rest"):
      values[i] = acc.summed(values[i], total, weights)


def over_devices(
  plan: Reduction,
  accs_tree: Any,
  carry: Any,
  weights: Weights | None,
  state: Any,
  sums: Sequence[Any] = (),
  reduce_state: Any = None,
  ran: Any = True,
) -> Combined:
  """The carries of every device of `plan.axes`, combined: one fused psum.

  `"sum"` and unweighted `"mean"` leaves are summed over devices. Weighted
  means hold each device's `Σ w out / Σ |w|`; they are combined as
  `Σ_d norm_d acc_d / Σ_d total_d`, in float32 at least. These sums, the
  total weight, the floating state and `sums` go into a single psum (JAX
  lowers it to one all-reduce per array, each depending on that array
  alone; XLA may combine them); exact sums go into it as int32 bins aligned
  over the axes and come back exact (`exact.psum`, read where they are
  finished). Floating state is averaged over devices (BatchNorm statistics,
  as synchronised BatchNorm does); other state (counters, keys, flags) takes
  device 0's value. `ran`: whether this device ran a micro-batch, which
  says which device holds the global last (`accumulators.GlobalLast`).
  """
  axes = plan.axes
  accs, treedef = jax.tree.flatten(accs_tree, is_leaf=accumulators.is_accumulator)
  values = treedef.flatten_up_to(carry)
  skipped = list(jax.tree.leaves(plan.grad_mask)) if plan.hook else [False] * len(accs)
  hows = plan.scatter or [None] * len(accs)
  shares = [a.summand(v, weights) for a, v in zip(accs, values, strict=True)]
  _scatters(plan, accs, values, shares, skipped)
  summed = [
    i
    for i, a in enumerate(accs)
    if a.wire == "sum" and hows[i] is None and not skipped[i]
  ]
  state_values, state_def = jax.tree.flatten(state)
  floating = [jnp.issubdtype(jnp.result_type(s), jnp.inexact) for s in state_values]
  fused = [shares[i] for i in summed]
  if plan.wire is not None:  # never an exact sum: the two are refused together
    fused = [
      x.astype(plan.wire) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in fused
    ]
  to_sum = fused + [s for s, f in zip(state_values, floating, strict=True) if f]
  to_sum += list(sums)
  total = None if weights is None else weights.total
  if total is not None:
    to_sum.append(total)
  exact_sums = any(isinstance(x, exact.Acc) for x in to_sum)
  if exact_sums:  # as integers, in the same psum; read back where finished
    to_sum = exact.psum(to_sum, axes)
  elif to_sum:
    to_sum = _wire.reduced(lambda xs: jax.lax.psum(xs, axes), to_sum)
  read = exact.as_float if exact_sums else lambda x: x
  exact_total = to_sum.pop() if total is not None else None
  summed_sums = [read(x) for x in to_sum[len(to_sum) - len(sums) :]]
  for i, value in zip(summed, to_sum[: len(fused)], strict=False):
    kept = exact_sums and exact.is_exact(value)
    values[i] = value if kept else value.astype(shares[i].dtype)
  state_sums = iter(to_sum[len(fused) : len(to_sum) - len(sums)])
  _the_rest(plan, accs, values, skipped, weights, exact_total, ran)
  num_devices = jax.lax.axis_size(axes)
  state_values = [
    next(state_sums) / num_devices if f else from_device(s, axes, 0)
    for s, f in zip(state_values, floating, strict=True)
  ]
  combined = Combined(
    jax.tree.unflatten(treedef, values),
    read(exact_total),
    jax.tree.unflatten(state_def, state_values),
    summed_sums,
    None,
    reduce_state,
  )
  if plan.hook is None:
    return combined
  return _hooked(plan, accs_tree, carry, weights, combined)


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


def _hooked(
  plan: Reduction,
  accs_tree: Any,
  local: Any,
  weights: Weights | None,
  combined: Combined,
) -> Combined:
  """The gradient leaves that `over_devices` left, reduced by `reduce_fn`.

  Each device's share is what makes the exact result when summed over the
  axes: its sum, its mean's sum over devices × K micro-batches, or its
  weighted sum over the total weight (summed over devices already).
  `reduce_state` holds one row per device on a leading axis; `reduce_fn` sees
  and returns this device's row.
  """
  assert plan.hook is not None
  accs, treedef = jax.tree.flatten(accs_tree, is_leaf=accumulators.is_accumulator)
  values = treedef.flatten_up_to(combined.acc)
  on = jax.tree.leaves(plan.grad_mask)
  done = [False] * len(accs)
  for i, acc in enumerate(accs):
    if on[i] and not isinstance(acc, accumulators.Zeros):
      values[i] = acc.share(values[i], weights, combined.total, plan.num_terms)
      done[i] = True
  tree = jax.tree.unflatten(treedef, values)
  part = plan.grad_part
  grads = tree if part is None else tree[part]
  state = jax.tree.map(lambda x: x[0], combined.reduce_state)
  reduced, new_state = _checked_reduce_output(
    plan.hook(grads, plan.axes, state), grads, state
  )
  if part is None:
    tree = reduced
  else:
    tree = type(tree)(reduced if j == part else t for j, t in enumerate(tree))
  values = [
    v.astype(a.carry_dtype) if d else v
    for v, a, d in zip(treedef.flatten_up_to(tree), accs, done, strict=True)
  ]
  return combined._replace(
    acc=jax.tree.unflatten(treedef, values),
    done=done,
    reduce_state=jax.tree.map(lambda x: jnp.asarray(x)[None], new_state),
  )

"""Reducers: how K micro-batch outputs combine into one, in which dtype."""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
import warnings
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaccum import _exact
from jaccum._microbatch import Split, merge_microbatches

Reduction = Literal["mean", "sum", "concat", "last", "max", "min"]
REDUCTIONS = ("mean", "sum", "concat", "last", "max", "min")


def check_accum_dtype(accum_dtype: Any, name: str) -> np.dtype | None:
  """Returns the accumulator dtype (floating, or None); `name` is the argument's."""
  if accum_dtype is None:
    return None
  try:
    dtype = np.dtype(accum_dtype)
  except TypeError:
    raise TypeError(
      f"{name} must be a floating dtype or None, got {accum_dtype!r}."
    ) from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      f"{name} must be a floating dtype (e.g. jnp.float32) or None, got {dtype}."
    )
  return dtype


def check_weight(weight: Any, what: str) -> jax.Array:
  """Returns a weight as an array if it is a numeric scalar, else raises.

  Args:
    weight: the weight of one micro-batch.
    what: how the message starts, e.g. "weight_fn must return".
  """
  numeric = isinstance(weight, int | float | jax.Array | np.ndarray | np.generic)
  if not numeric or jnp.result_type(weight) == np.bool_:
    raise TypeError(
      f"{what} a numeric scalar (e.g. the number of real tokens), got "
      f"{type(weight).__name__} {weight!r:.60}."
    )
  if jnp.ndim(weight) != 0:
    raise ValueError(
      f"{what} a scalar, got shape {jnp.shape(weight)}; reduce it, e.g. `mask.sum()`."
    )
  return jnp.asarray(weight)


def check_reduce_spec(reduce: Any) -> None:
  """Checks every string in a `reduce` tree before anything is traced."""
  for path, mode in jax.tree_util.tree_flatten_with_path(reduce)[0]:
    if mode not in REDUCTIONS:
      where = f" at reduce{jax.tree_util.keystr(path)}" if path else ""
      raise ValueError(f"reduce must be one of {REDUCTIONS}, got {mode!r}{where}.")


class Leaf(NamedTuple):
  """How one output leaf is reduced: its mode, its own dtype, its carry dtype.

  A `float0` leaf (the gradient of an integer input) has mode `"float0"`: it
  carries nothing and comes back as the zeros the whole batch gives.

  `scattered` (an `_fsdp.Sharded`) marks a gradient that each micro-step
  reduce-scatters over those axes (FSDP's sharded modes): the carry holds
  this device's shard of its sum over them, `shape` is the shard's, and a
  weighted mean sums `w·out` (weighted before the sum over devices).

  `exact` (`deterministic=True`) marks a floating `"mean"` or `"sum"` leaf
  whose carry is an exact sum (`_exact.Acc`) of its terms, `w·out` when
  weighted: the same bits whatever K and the devices; `carry_dtype` is the
  float it is read back in.
  """

  mode: str
  dtype: np.dtype
  carry_dtype: np.dtype
  shape: tuple[int, ...]
  scattered: Any = None
  exact: bool = False


def plan(
  reduce: Any,
  out_shape: Any,
  accum_dtype: np.dtype | None,
  microbatch_size: int,
  split: str,
  exact: bool = False,
) -> Any:
  """Returns a tree of `Leaf` matching `out_shape`, or raises naming the leaf.

  Args:
    reduce: a reduction string or a pytree prefix of `out_shape` of them.
    out_shape: the shapes and dtypes of one micro-step's output.
    accum_dtype: floating leaves narrower than this accumulate in it.
    microbatch_size: rows per micro-batch, the leading size `"concat"` needs
      to put rows back in order.
    split: the micro-batch order, `"strided"` or `"contiguous"`.
    exact: sum floating `"mean"` and `"sum"` leaves exactly
      (`deterministic=True`).
  """
  try:
    modes = jax.tree.broadcast(reduce, out_shape)
  except ValueError as e:
    raise ValueError(
      f"reduce={reduce!r} must be a reduction string or a pytree prefix of "
      f"grad_fn's output, whose structure is {jax.tree.structure(out_shape)}. "
      f"({e})"
    ) from None

  def leaf_plan(path, mode, shape):
    where = "output" + jax.tree_util.keystr(path)
    dtype = np.dtype(shape.dtype)
    if dtype == jax.dtypes.float0:
      return Leaf("float0", dtype, dtype, shape.shape)
    floating = jnp.issubdtype(dtype, jnp.inexact)
    if mode == "mean" and not floating:
      raise TypeError(
        f'reduce="mean" needs a floating leaf, but {where} has dtype {dtype}; '
        'give it "sum", "max", "min", "last" or "concat" in a reduce tree.'
      )
    if mode == "sum" and dtype == np.bool_:
      raise TypeError(f'reduce="sum" cannot add booleans at {where}; cast it first.')
    if mode == "concat":
      if not shape.shape:
        raise TypeError(
          f'reduce="concat" needs per-example outputs with a leading axis, '
          f"but {where} is a scalar."
        )
      if split == "strided" and shape.shape[0] != microbatch_size:
        raise ValueError(
          f'reduce="concat" with split="strided" needs a leading axis of '
          f"{microbatch_size} (the micro-batch size) to restore the row "
          f"order, but {where} has shape {shape.shape}."
        )
    if exact and mode in ("mean", "sum") and floating:
      return _exact_leaf(mode, dtype, shape.shape, where)
    carry_dtype = dtype
    if (
      mode in ("mean", "sum")
      and accum_dtype is not None
      and jnp.issubdtype(dtype, jnp.floating)
      and dtype.itemsize < accum_dtype.itemsize
    ):
      carry_dtype = accum_dtype
    return Leaf(mode, dtype, carry_dtype, shape.shape)

  return jax.tree.map_with_path(leaf_plan, modes, out_shape)


def _exact_leaf(mode: str, dtype: np.dtype, shape: tuple[int, ...], where: str) -> Leaf:
  if jnp.issubdtype(dtype, jnp.complexfloating):
    raise TypeError(
      f"deterministic=True sums real floating leaves exactly, but {where} has "
      f"dtype {dtype}; return its real and imaginary parts as two leaves."
    )
  return Leaf(mode, dtype, _exact.compute_dtype(dtype), shape, exact=True)


def user_stacklevel() -> int:
  """The `stacklevel`, for a warning in the caller, that points at the user's line.

  A warning raised while jaccum traces the user's function sits below
  jaccum's, JAX's and Flax's frames (and the standard library's, which JAX
  calls through); how many depends on the route. The user's line is the
  first frame outside them.
  """
  modules = [sys.modules.get(name) for name in ("jaccum", "jax", "jaxlib", "flax")]
  library = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in modules
    if m is not None and m.__file__
  )
  stdlib = sysconfig.get_paths()["stdlib"]

  def ours(filename: str) -> bool:
    in_stdlib = filename.startswith(stdlib) and "site-packages" not in filename
    return filename.startswith(library) or in_stdlib or filename.startswith("<")

  frame, level = sys._getframe(1), 1
  while frame.f_back is not None and ours(frame.f_code.co_filename):
    frame, level = frame.f_back, level + 1
  return level


def warn_averaged_rows(aux: Any, modes: Any, rows: int, fix: str) -> None:
  """Warns for each aux leaf with one row per example that is averaged.

  Averaging per-example rows over micro-batches mixes different examples; it
  is almost never meant. `fix` is the `reduce` tree that keeps them.
  """
  for (path, leaf), mode in zip(
    jax.tree_util.tree_flatten_with_path(aux)[0], jax.tree.leaves(modes), strict=True
  ):
    if mode == "mean" and rows > 1 and jnp.shape(leaf)[:1] == (rows,):
      warnings.warn(
        f"aux{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, one row per "
        f"example of the micro-batch of {rows}, and is averaged over micro-batches "
        f'(reduce="mean"), which mixes different examples\' rows. To keep one row '
        f'per example in the batch\'s order, give it "concat": {fix}.',
        stacklevel=user_stacklevel(),
      )


def is_plan(x: Any) -> bool:
  return isinstance(x, Leaf)


def _full(
  shape: jax.ShapeDtypeStruct, value: Any, dtype: Any, lead: tuple[int, ...] = ()
):
  """A carry leaf like `shape`, keeping an explicit sharding (e.g. over "model").

  Under a mesh it is typed as replicated on that mesh rather than left
  without one: `vmap` with `spmd_axis_name` must be able to add the device
  axis to a carry that starts the same on every device.
  """
  sharding = getattr(shape, "sharding", None)
  if isinstance(sharding, jax.NamedSharding) and any(sharding.spec):
    sharding = sharding.update(spec=jax.P(*(None for _ in lead), *sharding.spec))
  elif not jax.sharding.get_abstract_mesh().empty:
    sharding = jax.P(*(None for _ in (*lead, *shape.shape)))
  else:
    sharding = None
  return jnp.full((*lead, *shape.shape), value, dtype, out_sharding=sharding)


def _full_like(like: jax.ShapeDtypeStruct) -> Any:
  """`full(shape, value, dtype)` typed as `_full` types a carry like `like`."""
  return lambda shape, value, dtype: _full(
    jax.ShapeDtypeStruct(shape, dtype, sharding=getattr(like, "sharding", None))
    if shape
    else jax.ShapeDtypeStruct((), dtype),
    value,
    dtype,
  )


def zeros(dtype: Any) -> jax.Array:
  """A scalar zero carry (typed on the mesh in context, as carries must be)."""
  return _full(jax.ShapeDtypeStruct((), dtype), 0, dtype)


def _extreme(dtype: np.dtype, highest: bool) -> Any:
  """The identity of max (the lowest value) or of min (the highest)."""
  if dtype == np.bool_:
    return highest
  if jnp.issubdtype(dtype, jnp.integer):
    info = jnp.iinfo(dtype)
    return info.max if highest else info.min
  return jnp.inf if highest else -jnp.inf


def init(leaves: Any, out_shape: Any, num_microbatches: int) -> Any:
  """The carry before the first micro-batch (None for `float0` leaves)."""

  def init_leaf(leaf: Leaf, shape):
    if leaf.mode == "float0":
      return None
    if leaf.exact:
      return _exact.zeros(leaf.shape, leaf.carry_dtype, _full_like(shape))
    if leaf.scattered is not None:
      # The shard keeps the gradient's explicit axes (tensor parallel, as in
      # P("data", "model")): the scatter hands it back typed so.
      shard = jax.ShapeDtypeStruct(
        leaf.shape, leaf.carry_dtype, sharding=getattr(shape, "sharding", None)
      )
      return _full(shard, 0, leaf.carry_dtype)
    if leaf.mode == "concat":
      return _full(shape, 0, leaf.dtype, lead=(num_microbatches,))
    if leaf.mode in ("max", "min"):
      return _full(shape, _extreme(leaf.dtype, leaf.mode == "min"), leaf.dtype)
    return _full(shape, 0, leaf.carry_dtype)

  return jax.tree.map(init_leaf, leaves, out_shape, is_leaf=is_plan)


class Weights(NamedTuple):
  """The weights so far, in float32 or wider (float64 for float64 leaves).

  Attributes:
    total: `Σ w`, the divisor of the weighted mean; with `deterministic=True`
      an exact sum (`_exact.Acc`).
    norm: `Σ |w|`, the scale a weighted `"mean"` carry is kept at. With
      `deterministic=True` (exact carries hold `Σ w·out` itself): None for
      `weight_fn`'s weights, or the `Unit` weight of a count without it,
      whose exact carries hold `Σ out`, as without a count.
  """

  total: Any
  norm: Any


@jax.tree_util.register_static  # a number known when tracing: no leaves
@dataclasses.dataclass(frozen=True)
class Unit:
  """The weight of each micro-batch of a count without `weight_fn`: its rows."""

  rows: int


def exact_weights(dtype: Any, unit: int | None = None) -> Weights:
  """No weights yet, summed exactly (`deterministic=True`); `unit`: see `Weights`."""
  scalar = jax.ShapeDtypeStruct((), dtype)
  norm = None if unit is None else Unit(unit)
  return Weights(_exact.zeros((), dtype, _full_like(scalar)), norm)


def exact_divisor(weights: Weights, total: Any) -> Any:
  """What an exact mean divides by: `Σ w` (`total`, an exact sum), or with unit
  weights the number of micro-batches, `Σ w / unit` (exact: integers), as
  without a count."""
  if weights.norm is None:
    return total
  return _exact.as_float(total) / weights.norm.rows


def weight_sum(weights: Weights) -> jax.Array:
  """`Σ w` as an array, read back from an exact sum."""
  return _exact.as_float(weights.total)


def weights_dtype(weight_dtype: Any, leaves: Any) -> np.dtype:
  """The dtype of `Weights`: the weight's, float32 and every mean carry's, promoted.

  A float64 model's weighted mean then divides in float64, not float32.
  """
  dtype = jnp.promote_types(weight_dtype, jnp.float32)
  for leaf in jax.tree.leaves(leaves, is_leaf=is_plan):
    if leaf.mode == "mean" and jnp.issubdtype(leaf.carry_dtype, jnp.floating):
      dtype = jnp.promote_types(dtype, leaf.carry_dtype)
  return np.dtype(dtype)


def add_weight(weights: Weights, weight: jax.Array) -> Weights:
  if _exact.is_acc(weights.total):
    return Weights(_exact.add(weights.total, weight), weights.norm)
  weight = weight.astype(weights.total.dtype)
  return Weights(weights.total + weight, weights.norm + jnp.abs(weight))


def update(
  leaves: Any,
  carry: Any,
  out: Any,
  index: jax.Array,
  weight: jax.Array | None = None,
  before: Weights | None = None,
  after: Weights | None = None,
) -> Any:
  """Folds micro-batch `index`'s output into the carry.

  Unweighted `"mean"` and `"sum"` leaves add up. A weighted `"mean"` leaf
  keeps `Σ w_k out_k / Σ |w_k|` over the micro-batches so far, updated as
  `acc · (norm_before / norm) + (w / norm) · out`: both factors are at most 1
  in size, so weights of any size (token counts) never enter a narrow dtype
  and a float16 carry cannot overflow, and any real weights, negative ones
  too, give the exact `Σ w out / Σ w` once `finish` scales by `norm / total`.
  `before` and `after` are the weights without and with `weight`.
  """

  def update_leaf(leaf: Leaf, acc, value):
    if leaf.mode == "float0":
      return acc
    value = jnp.asarray(value)  # a Python scalar output comes back as a literal
    if leaf.exact:  # `w·out` for a weighted mean; unit weights (`norm`) add `out`
      unit = after is None or after.norm is not None
      weighted = leaf.mode == "mean" and not unit and weight is not None
      return _exact.add(acc, value, weight if weighted else None)
    if leaf.scattered is not None:  # summed over devices, weighted already
      return acc + value.astype(leaf.carry_dtype)
    if leaf.mode == "concat":
      return jax.lax.dynamic_update_index_in_dim(acc, value, index, axis=0)
    if leaf.mode == "max":
      return jnp.maximum(acc, value)
    if leaf.mode == "min":
      return jnp.minimum(acc, value)
    if leaf.mode == "last":
      return value
    if leaf.mode == "mean" and weight is not None:
      assert before is not None and after is not None
      compute = jnp.promote_types(leaf.carry_dtype, after.norm.dtype)
      acc_c, value_c = acc.astype(compute), value.astype(compute)
      norm = jnp.where(after.norm != 0, after.norm, 1)
      keep = (before.norm / norm).astype(compute)
      share = (weight.astype(after.norm.dtype) / norm).astype(compute)
      # `where`, not a product: an all-padding micro-batch may hold NaN (0/0),
      # and weight 0 must mean "contributes nothing".
      new = jnp.where(weight != 0, acc_c * keep + share * value_c, acc_c)
      return new.astype(leaf.carry_dtype)
    return acc + value.astype(leaf.carry_dtype)

  return jax.tree.map(update_leaf, leaves, carry, out, is_leaf=is_plan)


def weighted_mean(
  acc: jax.Array, total: jax.Array, scaled_by: jax.Array | None = None
) -> jax.Array:
  """`acc · scaled_by / total` (`scaled_by` 1 if None), or zeros where `total` is 0."""
  scaled_by = jnp.ones_like(total) if scaled_by is None else scaled_by
  compute = jnp.promote_types(acc.dtype, total.dtype)
  safe = jnp.where(total != 0, total, 1)
  scale = (scaled_by.astype(total.dtype) / safe).astype(compute)
  return jnp.where(total != 0, acc.astype(compute) * scale, 0)


def none_ran(leaves: Any, result: Any, ran: jax.Array) -> Any:
  """`"max"` and `"min"` leaves as zeros where no micro-batch ran anywhere.

  Their carries start at the identity (∓inf, or an integer's extreme), which
  a count of 0 leaves in place; every other mode gives zeros by itself.
  """
  return jax.tree.map(
    lambda leaf, x: (
      jnp.where(ran > 0, x, jnp.zeros_like(x)) if leaf.mode in ("max", "min") else x
    ),
    leaves,
    result,
    is_leaf=is_plan,
  )


def finalize(
  leaves: Any,
  carry: Any,
  num_terms: int | None,
  split: Split,
  weights: Weights | None = None,
  final: Any = None,
) -> Any:
  """Turns the carry into the reduced output, in each leaf's own dtype.

  Args:
    leaves: the plan from `plan`.
    carry: the carry after the last micro-batch (and after the devices are
      combined).
    num_terms: the number of outputs summed into each unweighted `"mean"`
      leaf (K, times the devices once combined); None when weighted.
    split: the micro-batch order, to put `"concat"` rows back in place.
    weights: the weights, when weighted `"mean"` leaves still hold
      `Σ w out / Σ |w|` (one device's loop); None once the devices are
      combined, when they hold the mean.
    final: bools, one per leaf: leaves that hold their result already (a
      `reduce_fn` reduced them), only cast.
  """
  plans, treedef = jax.tree.flatten(leaves, is_leaf=is_plan)
  done = [False] * len(plans) if final is None else list(final)
  divisor = num_terms
  if weights is not None and _exact.is_acc(weights.total):
    divisor = exact_divisor(weights, weights.total)

  def finalize_leaf(leaf: Leaf, acc: Any, done: bool) -> Any:
    if leaf.mode == "float0":
      return np.zeros(leaf.shape, jax.dtypes.float0)
    if leaf.exact and leaf.mode == "mean" and divisor is not None and not done:
      return jnp.astype(_exact.divide(acc, divisor), leaf.dtype)
    acc = _exact.as_float(acc)  # an exact sum, read back once
    if leaf.mode == "concat":
      return merge_microbatches(acc, split)
    if leaf.mode == "mean" and num_terms is not None and not done:
      acc = acc / num_terms
    if leaf.mode == "mean" and weights is not None and not done:
      acc = weighted_mean(acc, weights.total, weights.norm)
    return jnp.astype(acc, leaf.dtype)

  values = treedef.flatten_up_to(carry)
  return jax.tree.unflatten(
    treedef,
    [finalize_leaf(*t) for t in zip(plans, values, done, strict=True)],
  )

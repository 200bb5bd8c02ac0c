"""Accumulators: one object per reduce mode, chosen once per output leaf.

Each mode of `reduce` (`"mean"`, a weighted mean, `"sum"`, `"concat"`,
`"last"`, `"max"`, `"min"`, an exact sum for `deterministic=True`, a gradient
FSDP scatters in the loop, the zeros of a `float0` leaf) is an `Accumulator`:
`init` makes the carry before the first micro-batch, `update` folds
micro-batch k in, `wire` says how the devices combine it (`reduction`), and
`finish` turns the carry into the result, in the leaf's own dtype. The plan
chooses one per leaf (`choose`); the loop and the device reduction call them
by tree, so adding a mode edits this module alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaccum._core import exact
from jaccum._core.microbatch import Split, merge_microbatches

Reduction = Literal["mean", "sum", "concat", "last", "max", "min"]
REDUCTIONS = ("mean", "sum", "concat", "last", "max", "min")
# How the devices combine a carry (`reduction.over_devices`): summed (in one
# fused psum, exact sums as integers), by maximum or minimum, kept per device,
# taken from the last device that ran a micro-batch, or (scattered in the loop
# already) summed over the other data axes only.
Wire = Literal["sum", "max", "min", "keep", "last", "rest", "none"]


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


def check_reduce_spec(reduce: Any) -> Any:
  """Checks every string in a `reduce` tree before anything is traced."""
  for path, mode in jax.tree_util.tree_flatten_with_path(reduce)[0]:
    if mode not in REDUCTIONS:
      where = f" at reduce{jax.tree_util.keystr(path)}" if path else ""
      raise ValueError(f"reduce must be one of {REDUCTIONS}, got {mode!r}{where}.")
  return reduce


def full(shape: jax.ShapeDtypeStruct, value: Any, dtype: Any, lead: tuple = ()):
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


def full_like(like: jax.ShapeDtypeStruct) -> Callable[..., jax.Array]:
  """`full(shape, value, dtype)` typed as `full` types a carry like `like`."""
  return lambda shape, value, dtype: full(
    jax.ShapeDtypeStruct(shape, dtype, sharding=getattr(like, "sharding", None))
    if shape
    else jax.ShapeDtypeStruct((), dtype),
    value,
    dtype,
  )


def zeros(dtype: Any) -> jax.Array:
  """A scalar zero carry (typed on the mesh in context, as carries must be)."""
  return full(jax.ShapeDtypeStruct((), dtype), 0, dtype)


class Fold(NamedTuple):
  """One micro-batch's weight, and the weights before and after it (`Weights`)."""

  weight: jax.Array
  before: Weights
  after: Weights


def finishing(num_terms: int | None, weights: Weights | None) -> Finish:
  """How to finish the carries of one device's loop, or of all devices combined
  (`weights` None). An exact mean divides by `num_terms`, or, weighted on one
  device, by its exact weights."""
  divisor: Any = num_terms
  if weights is not None and exact.is_acc(weights.total):
    divisor = exact_divisor(weights, weights.total)
  return Finish(num_terms, weights, divisor)


class Finish(NamedTuple):
  """What `finish` divides by, once the carries are complete.

  Attributes:
    num_terms: the outputs summed into each unweighted mean (K, times the
      devices once combined); None when weighted.
    weights: one device's weights, for weighted means not yet combined over
      devices (their carries hold `Σ w out / Σ |w|`); None once combined.
    divisor: an exact mean's divisor (`Σ w`, or the micro-batches), or None.
  """

  num_terms: int | None = None
  weights: Weights | None = None
  divisor: Any = None


@dataclasses.dataclass(frozen=True)
class Accumulator:
  """How one output leaf is reduced: its mode, its own dtype, its carry's.

  Attributes:
    dtype: the leaf's dtype (the result's).
    carry_dtype: the carry's (wider for bf16 means and sums).
    shape: the carry's shape (a shard's for a gradient scattered in the loop).
  """

  kind: ClassVar[str]
  wire: ClassVar[Wire] = "none"
  dtype: np.dtype
  carry_dtype: np.dtype
  shape: tuple[int, ...]

  @property
  def mode(self) -> str:
    """The `reduce` mode it implements, as the user named it."""
    return self.kind

  def init(self, like: jax.ShapeDtypeStruct, num_microbatches: int) -> Any:
    return full(like, 0, self.carry_dtype)

  def update(self, carry: Any, value: jax.Array, index: Any, fold: Fold | None) -> Any:
    return carry + value.astype(self.carry_dtype)

  def summand(self, carry: Any, weights: Weights | None) -> Any:
    """What this device sends to the sum over devices."""
    return carry

  def summed(self, value: Any, total: Any, weights: Weights | None) -> Any:
    """The combined carry, from the sum over devices (`total`: the summed
    weights, an exact sum with `deterministic=True`)."""
    return value

  def finish(self, carry: Any, how: Finish) -> Any:
    return jnp.astype(carry, self.dtype)

  def share(self, carry: Any, weights: Any, total: Any, num_terms: int) -> Any:
    """This device's share of the result, for a `reduce_fn` to sum: the carry
    itself for a sum (the plan hands `reduce_fn` means and sums alone)."""
    return carry

  @property
  def averages(self) -> bool:
    """Whether this is a mean (what the noise scale measures)."""
    return self.mode == "mean"

  @property
  def per_example(self) -> bool:
    """Whether it keeps rows (`"concat"`, `"last"`), which devices do not combine."""
    return self.wire == "keep"


@dataclasses.dataclass(frozen=True)
class Zeros(Accumulator):
  """A `float0` leaf (the gradient of an integer input): nothing is carried."""

  kind = "float0"

  def init(self, like, num_microbatches):
    return None

  def update(self, carry, value, index, fold):
    return carry

  def finish(self, carry, how):
    return np.zeros(self.shape, jax.dtypes.float0)


@dataclasses.dataclass(frozen=True)
class Sum(Accumulator):
  kind = "sum"
  wire = "sum"


@dataclasses.dataclass(frozen=True)
class Mean(Sum):
  """The mean of K outputs: their sum, divided by K (and the devices) at the end."""

  kind = "mean"

  def finish(self, carry, how):
    if how.num_terms is not None:
      carry = carry / how.num_terms
    return jnp.astype(carry, self.dtype)

  def share(self, carry, weights, total, num_terms):
    return carry / num_terms


@dataclasses.dataclass(frozen=True)
class WeightedMean(Mean):
  """`Σ w_k out_k / Σ w_k`, kept as `Σ w out / Σ |w|` so a narrow carry never overflows.

  Updated as `acc · (norm_before / norm) + (w / norm) · out`: both factors
  are at most 1 in size, so weights of any size (token counts) never enter a
  narrow dtype, and any real weights, negative ones too, give the exact mean
  once `finish` scales by `norm / total`.
  """

  def update(self, carry, value, index, fold):
    assert fold is not None
    before, after = fold.before, fold.after
    compute = jnp.promote_types(self.carry_dtype, after.norm.dtype)
    acc_c, value_c = carry.astype(compute), value.astype(compute)
    norm = jnp.where(after.norm != 0, after.norm, 1)
    keep = (before.norm / norm).astype(compute)
    share = (fold.weight.astype(after.norm.dtype) / norm).astype(compute)
    # `where`, not a product: an all-padding micro-batch may hold NaN (0/0),
    # and weight 0 must mean "contributes nothing".
    new = jnp.where(fold.weight != 0, acc_c * keep + share * value_c, acc_c)
    return new.astype(self.carry_dtype)

  def summand(self, carry, weights):
    assert weights is not None
    compute = jnp.promote_types(carry.dtype, weights.norm.dtype)
    return carry.astype(compute) * weights.norm.astype(compute)

  def summed(self, value, total, weights):
    if total is None:
      return value
    return weighted_mean(value, exact.as_float(total)).astype(self.carry_dtype)

  def share(self, carry, weights, total, num_terms):
    compute = jnp.promote_types(carry.dtype, weights.norm.dtype)
    safe = jnp.where(total != 0, total, 1).astype(compute)
    return carry.astype(compute) * weights.norm.astype(compute) / safe

  def finish(self, carry, how):
    if how.weights is not None:
      carry = weighted_mean(carry, how.weights.total, how.weights.norm)
    return jnp.astype(carry, self.dtype)


@dataclasses.dataclass(frozen=True)
class Concat(Accumulator):
  """Per-example outputs, put back in the batch's row order at the end."""

  kind = "concat"
  wire = "keep"
  split: Split = "strided"

  def init(self, like, num_microbatches):
    return full(like, 0, self.dtype, lead=(num_microbatches,))

  def update(self, carry, value, index, fold):
    return jax.lax.dynamic_update_index_in_dim(carry, value, index, axis=0)

  def finish(self, carry, how):
    return jnp.astype(merge_microbatches(carry, self.split), self.dtype)


@dataclasses.dataclass(frozen=True)
class Last(Accumulator):
  """The last micro-batch's output: each device's own (rows per example)."""

  kind = "last"
  wire = "keep"

  def update(self, carry, value, index, fold):
    return value


@dataclasses.dataclass(frozen=True)
class GlobalLast(Last):
  """`deterministic=True`'s `"last"`: the global order's last micro-batch (the
  last that ran), whole and the same on every device, any shape."""

  wire = "last"


def _extreme(dtype: np.dtype, highest: bool) -> Any:
  """The identity of max (the lowest value) or of min (the highest)."""
  if dtype == np.bool_:
    return highest
  if jnp.issubdtype(dtype, jnp.integer):
    info = jnp.iinfo(dtype)
    return info.max if highest else info.min
  return jnp.inf if highest else -jnp.inf


@dataclasses.dataclass(frozen=True)
class Max(Accumulator):
  """The elementwise maximum (any, on bools); zeros where nothing ran anywhere."""

  kind = "max"
  wire = "max"

  def init(self, like, num_microbatches):
    return full(like, _extreme(self.dtype, self.kind == "min"), self.dtype)

  def update(self, carry, value, index, fold):
    return jnp.maximum(carry, value)

  def none_ran(self, value: jax.Array, ran: jax.Array) -> jax.Array:
    """Its carry starts at the identity (∓inf), which a count of 0 leaves."""
    return jnp.where(ran > 0, value, jnp.zeros_like(value))


@dataclasses.dataclass(frozen=True)
class Min(Max):
  kind = "min"
  wire = "min"

  def update(self, carry, value, index, fold):
    return jnp.minimum(carry, value)


@dataclasses.dataclass(frozen=True)
class Exact(Accumulator):
  """A floating mean or sum summed exactly (`deterministic=True`): the same bits
  whatever K and the devices. Its carry is an `exact.Acc` of the terms, `w·out`
  when weighted by `weight_fn`; `carry_dtype` is the float it is read back in."""

  kind = "sum"
  wire = "sum"
  averaged: bool = False

  @property
  def mode(self) -> str:
    return "mean" if self.averaged else "sum"

  def init(self, like, num_microbatches):
    return exact.zeros(self.shape, self.carry_dtype, full_like(like))

  def update(self, carry, value, index, fold):
    # `w·out` for a mean weighted by weight_fn (0 where w is 0, NaN too);
    # unit weights (a count without weight_fn) add `out`, as without a count.
    weighted = self.averaged and fold is not None and fold.after.norm is None
    return exact.add(carry, value, fold.weight if fold and weighted else None)

  def summed(self, value, total, weights):
    if self.averaged and total is not None:
      assert weights is not None
      return exact.divide(value, exact_divisor(weights, total)).astype(self.carry_dtype)
    return value

  def finish(self, carry, how):
    if self.averaged and how.divisor is not None:
      return jnp.astype(exact.divide(carry, how.divisor), self.dtype)
    return jnp.astype(exact.as_float(carry), self.dtype)  # read back once


@dataclasses.dataclass(frozen=True)
class Scattered(Accumulator):
  """A gradient each micro-step reduce-scatters over devices (FSDP's sharded
  modes): the carry holds this device's shard of its sum over them, `w·out`
  summed when weighted (weighted before the sum over devices)."""

  kind = "sum"
  wire = "rest"
  how: Any = None  # an `fsdp.Sharded`
  averaged: bool = False

  @property
  def mode(self) -> str:
    return "mean" if self.averaged else "sum"

  def init(self, like, num_microbatches):
    # The shard keeps the gradient's explicit axes (tensor parallel, as in
    # P("data", "model")): the scatter hands it back typed so.
    sharding = getattr(like, "sharding", None)
    shard = jax.ShapeDtypeStruct(self.shape, self.carry_dtype, sharding=sharding)
    return full(shard, 0, self.carry_dtype)

  def summed(self, value, total, weights):
    if self.averaged and total is not None:
      return weighted_mean(value, exact.as_float(total)).astype(self.carry_dtype)
    return value

  def finish(self, carry, how):
    if self.averaged and how.num_terms is not None:
      carry = carry / how.num_terms
    return jnp.astype(carry, self.dtype)


def is_accumulator(x: Any) -> bool:
  return isinstance(x, Accumulator)


def _carry_dtype(mode: str, dtype: np.dtype, accum_dtype: np.dtype | None) -> np.dtype:
  if (
    mode in ("mean", "sum")
    and accum_dtype is not None
    and jnp.issubdtype(dtype, jnp.floating)
    and dtype.itemsize < accum_dtype.itemsize
  ):
    return accum_dtype
  return dtype


def _checked_mode(
  mode: str, dtype: np.dtype, shape: tuple, where: str, split: str, rows: int
) -> None:
  floating = jnp.issubdtype(dtype, jnp.inexact)
  if mode == "mean" and not floating:
    raise TypeError(
      f'reduce="mean" needs a floating leaf, but {where} has dtype {dtype}; '
      'give it "sum", "max", "min", "last" or "concat" in a reduce tree.'
    )
  if mode == "sum" and dtype == np.bool_:
    raise TypeError(f'reduce="sum" cannot add booleans at {where}; cast it first.')
  if mode == "concat":
    if not shape:
      raise TypeError(
        f'reduce="concat" needs per-example outputs with a leading axis, '
        f"but {where} is a scalar."
      )
    if split == "strided" and shape[0] != rows:
      raise ValueError(
        f'reduce="concat" with split="strided" needs a leading axis of '
        f"{rows} (the micro-batch size) to restore the row "
        f"order, but {where} has shape {shape}."
      )


class Choice(NamedTuple):
  """What `choose` needs to pick each leaf's accumulator.

  Attributes:
    reduce: a reduction string or a pytree prefix of the output of them.
    accum_dtype: floating means and sums narrower than this accumulate in it.
    rows: rows per micro-batch (what `"concat"` checks against).
    split: the micro-batch order (`"concat"` puts rows back in it).
    exact: floating means and sums are summed exactly (`deterministic=True`).
    weighted: micro-batches carry weights (`weight_fn`, or a count).
  """

  reduce: Any
  accum_dtype: np.dtype | None
  rows: int
  split: Split
  exact: bool
  weighted: bool


def choose(choice: Choice, out_shape: Any) -> Any:
  """A tree of `Accumulator` like `out_shape`, or an error naming the leaf."""
  try:
    modes = jax.tree.broadcast(choice.reduce, out_shape)
  except ValueError as e:
    raise ValueError(
      f"reduce={choice.reduce!r} must be a reduction string or a pytree prefix of "
      f"grad_fn's output, whose structure is {jax.tree.structure(out_shape)}. "
      f"({e})"
    ) from None

  def leaf(path, mode, shape):
    where = "output" + jax.tree_util.keystr(path)
    dtype = np.dtype(shape.dtype)
    if dtype == jax.dtypes.float0:
      return Zeros(dtype, dtype, shape.shape)
    _checked_mode(mode, dtype, shape.shape, where, choice.split, choice.rows)
    floating = jnp.issubdtype(dtype, jnp.inexact)
    if choice.exact and mode in ("mean", "sum") and floating:
      if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
          f"deterministic=True sums real floating leaves exactly, but {where} has "
          f"dtype {dtype}; return its real and imaginary parts as two leaves."
        )
      return Exact(dtype, exact.compute_dtype(dtype), shape.shape, mode == "mean")
    carry = _carry_dtype(mode, dtype, choice.accum_dtype)
    if mode == "last" and choice.exact:
      return GlobalLast(dtype, carry, shape.shape)
    kind = {
      "mean": WeightedMean if choice.weighted else Mean,
      "sum": Sum,
      "last": Last,
      "max": Max,
      "min": Min,
    }
    if mode == "concat":
      return Concat(dtype, carry, shape.shape, choice.split)
    return kind[mode](dtype, carry, shape.shape)

  return jax.tree.map_with_path(leaf, modes, out_shape)


def scattered(
  accumulator: Accumulator, how: Any, wire: Any, shape: tuple[int, ...]
) -> Accumulator:
  """`accumulator` for a gradient each micro-step reduce-scatters (`how`) into a
  shard of `shape`, sent in `wire` (`reduce_dtype`) and summed in the carry's
  dtype; other modes as they are."""
  if not isinstance(accumulator, Mean | Sum) or isinstance(accumulator, Exact):
    return accumulator
  how = how._replace(dtype=accumulator.carry_dtype, wire=wire)
  return Scattered(
    accumulator.dtype,
    accumulator.carry_dtype,
    shape,
    how,
    isinstance(accumulator, Mean),
  )


class Weights(NamedTuple):
  """The weights so far, in float32 or wider (float64 for float64 leaves).

  Attributes:
    total: `Σ w`, the divisor of the weighted mean; with `deterministic=True`
      an exact sum (`exact.Acc`).
    norm: `Σ |w|`, the scale a weighted mean's carry is kept at. With
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


def no_weights(dtype: Any, exact_sum: bool, unit: int | None) -> Weights:
  """The weights before the first micro-batch."""
  if not exact_sum:
    return Weights(zeros(dtype), zeros(dtype))
  scalar = jax.ShapeDtypeStruct((), dtype)
  norm = None if unit is None else Unit(unit)
  return Weights(exact.zeros((), dtype, full_like(scalar)), norm)


def add_weight(weights: Weights, weight: jax.Array) -> Weights:
  if exact.is_acc(weights.total):
    return Weights(exact.add(weights.total, weight), weights.norm)
  weight = weight.astype(weights.total.dtype)
  return Weights(weights.total + weight, weights.norm + jnp.abs(weight))


def exact_divisor(weights: Weights, total: Any) -> Any:
  """What an exact mean divides by: `Σ w` (`total`, an exact sum), or with unit
  weights the number of micro-batches, `Σ w / unit` (exact: integers), as
  without a count."""
  if weights.norm is None:
    return total
  return exact.as_float(total) / weights.norm.rows


def weight_sum(weights: Weights) -> jax.Array:
  """`Σ w` as an array, read back from an exact sum."""
  return exact.as_float(weights.total)


def weights_dtype(weight_dtype: Any, accumulators: Any) -> np.dtype:
  """The dtype of `Weights`: the weight's, float32 and every mean carry's, promoted.

  A float64 model's weighted mean then divides in float64, not float32.
  """
  dtype = jnp.promote_types(weight_dtype, jnp.float32)
  for acc in jax.tree.leaves(accumulators, is_leaf=is_accumulator):
    if acc.mode == "mean" and jnp.issubdtype(acc.carry_dtype, jnp.floating):
      dtype = jnp.promote_types(dtype, acc.carry_dtype)
  return np.dtype(dtype)


def weighted_mean(
  acc: jax.Array, total: jax.Array, scaled_by: jax.Array | None = None
) -> jax.Array:
  """`acc · scaled_by / total` (`scaled_by` 1 if None), or zeros where `total` is 0."""
  scaled_by = jnp.ones_like(total) if scaled_by is None else scaled_by
  compute = jnp.promote_types(acc.dtype, total.dtype)
  safe = jnp.where(total != 0, total, 1)
  scale = (scaled_by.astype(total.dtype) / safe).astype(compute)
  return jnp.where(total != 0, acc.astype(compute) * scale, 0)


def init(accumulators: Any, out_shape: Any, num_microbatches: int) -> Any:
  """The carry before the first micro-batch (None for `float0` leaves)."""
  return jax.tree.map(
    lambda a, like: a.init(like, num_microbatches),
    accumulators,
    out_shape,
    is_leaf=is_accumulator,
  )


def update(accumulators: Any, carry: Any, out: Any, index: Any, fold: Fold | None):
  """Micro-batch `index`'s output folded into the carry."""
  return jax.tree.map(
    lambda a, c, v: a.update(
      c, v if isinstance(a, Zeros) else jnp.asarray(v), index, fold
    ),
    accumulators,
    carry,
    out,
    is_leaf=is_accumulator,
  )


def finish(accumulators: Any, carry: Any, how: Finish, done: Any = None) -> Any:
  """The reduced output, in each leaf's own dtype.

  `done`: bools, one per leaf: leaves that hold their result already (a
  `reduce_fn` reduced them), only cast.
  """
  flat, treedef = jax.tree.flatten(accumulators, is_leaf=is_accumulator)
  values = treedef.flatten_up_to(carry)
  done = [False] * len(flat) if done is None else list(done)
  return jax.tree.unflatten(
    treedef,
    [
      jnp.astype(exact.as_float(v), a.dtype) if d else a.finish(v, how)
      for a, v, d in zip(flat, values, done, strict=True)
    ],
  )


def none_ran(accumulators: Any, result: Any, ran: jax.Array) -> Any:
  """Maxima and minima as zeros where no micro-batch ran on any device."""
  return jax.tree.map(
    lambda a, x: a.none_ran(x, ran) if isinstance(a, Max) else x,
    accumulators,
    result,
    is_leaf=is_accumulator,
  )

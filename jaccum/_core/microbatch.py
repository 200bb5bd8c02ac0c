"""Splitting a batch into micro-batches: validation, strided or contiguous order."""

from __future__ import annotations

import math
import operator
import warnings
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

Split = Literal["strided", "contiguous"]
SPLITS = ("strided", "contiguous")


def check_num_microbatches(num_microbatches: Any) -> int:
  """Returns `num_microbatches` as a Python int, or raises naming the problem."""
  if isinstance(num_microbatches, bool | np.bool_):
    raise TypeError(
      f"num_microbatches must be a positive int, got {num_microbatches!r}."
    )
  try:
    value = operator.index(num_microbatches)
  except jax.errors.TracerIntegerConversionError:
    raise TypeError(
      "num_microbatches must be a static Python int, got a traced value; it "
      "fixes the loop length, so pass it outside jit (or mark it static)."
    ) from None
  except TypeError:
    raise TypeError(
      f"num_microbatches must be a positive int, got {num_microbatches!r} "
      f"of type {type(num_microbatches).__name__}."
    ) from None
  if value < 1:
    raise ValueError(f"num_microbatches must be a positive int, got {value}.")
  return value


def check_split(split: Any) -> Split:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
  return split


def _divisors_near(batch_size: int, num_microbatches: int) -> list[int]:
  divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
  below = [d for d in divisors if d < num_microbatches][-1:]
  above = [d for d in divisors if d > num_microbatches][:1]
  return below + above


def _warn_list_of_examples(name: str, tree: Any) -> None:
  """Warns for a long list of same-shaped arrays: likely one example per entry.

  Tuples and short lists are left alone: `(x, y)` pairs often share a shape.
  """
  if not isinstance(tree, list) or len(tree) < 4:
    return
  shapes = {(getattr(x, "shape", None), getattr(x, "dtype", None)) for x in tree}
  if len(shapes) != 1:
    return
  ((shape, _),) = shapes
  if shape and shape[0] != len(tree):
    warnings.warn(
      f"{name} is a {type(tree).__name__} of {len(tree)} arrays of shape {shape}: "
      f"jaccum splits each leaf on its axis 0 (of size {shape[0]}), not the "
      f"{type(tree).__name__}. If it holds one example per entry, stack it first "
      f"(jnp.stack), so that axis 0 counts the examples.",
      stacklevel=4,
    )


def check_batch(
  batch: Any, num_microbatches: int, *, names: list[str] | None = None, hint: str = ""
) -> int:
  """Checks that a tree of batch arrays splits into `num_microbatches`.

  Args:
    batch: a sequence of pytrees whose leaves are batched on axis 0.
    num_microbatches: the number of micro-batches K.
    names: how to name each element of `batch` in errors, e.g. `"args[1]"`.
    hint: added to every error, e.g. which option picked these arguments.

  Returns:
    The common leading size N of every leaf.

  Raises:
    TypeError: a leaf is not an array, or is a scalar.
    ValueError: leading sizes differ, or N is not a multiple of K.
  """
  names = names or [f"tree[{i}]" for i in range(len(batch))]
  for name, tree in zip(names, batch, strict=True):
    _warn_list_of_examples(name, tree)
  first: tuple[str, int] | None = None
  for name, tree in zip(names, batch, strict=True):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      where = name + jax.tree_util.keystr(path)
      if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise TypeError(
          f"batch leaf {where} must be an array with a leading batch axis, "
          f"got {type(leaf).__name__} {leaf!r:.60}." + hint
        )
      if leaf.ndim == 0:
        raise TypeError(
          f"batch leaf {where} must have a leading batch axis, got a scalar "
          f"of shape (); pass it as a non-batch argument instead." + hint
        )
      if first is None:
        first = (where, leaf.shape[0])
      elif leaf.shape[0] != first[1]:
        raise ValueError(
          "batch leaves must share one leading size: "
          f"{first[0]} has {first[1]} rows but {where} has {leaf.shape[0]}." + hint
        )
  if first is None:
    raise ValueError(f"the batch arguments {', '.join(names)} hold no arrays.")
  batch_size = first[1]
  if num_microbatches > batch_size:
    raise ValueError(
      f"num_microbatches={num_microbatches} exceeds the batch size "
      f"{batch_size} of {first[0]}; each micro-batch needs at least one row." + hint
    )
  if batch_size % num_microbatches:
    raise ValueError(
      f"batch_size={batch_size} (of {first[0]}) must be divisible by "
      f"num_microbatches={num_microbatches}; pad the batch or pick a K that "
      f"divides it, e.g. {_divisors_near(batch_size, num_microbatches)}." + hint
    )
  return batch_size


def _strided_rows(x: jax.Array, num_microbatches: int) -> jax.Array:
  """Views `x` as `[N / K, K, ...]`: column `k` is strided micro-batch `k`.

  With explicit mesh axes JAX asks for the sharding of a reshape that splits a
  sharded axis; the batch sharding stays on the `N / K` axis, whose rows each
  come from one device, so nothing moves between devices.
  """
  shape = (x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:])
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  spec = getattr(sharding, "spec", None)
  if not spec or mesh is None or not mesh.are_all_axes_explicit:
    return x.reshape(shape)
  axes = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0] or ())
  devices = math.prod(mesh.shape[a] for a in axes)
  if shape[0] % devices:
    rows = x.shape[0] // devices
    raise ValueError(
      f"a batch of N={x.shape[0]} rows sharded over {devices} devices ({axes}) "
      f"splits into num_microbatches={num_microbatches} of {shape[0]} rows only if "
      f"each micro-batch holds a multiple of {devices} rows, one share per device; "
      f"K dividing {rows} (rows per device) works, e.g. "
      f"{[k for k in range(1, rows + 1) if rows % k == 0][-3:]}."
    )
  out_sharding = jax.NamedSharding(mesh, jax.P(spec[0], None, *spec[1:]))
  return jnp.reshape(x, shape, out_sharding=out_sharding)


def take_microbatch(
  x: jax.Array, index: jax.Array | int, num_microbatches: int, split: Split
) -> jax.Array:
  """Slices micro-batch `index` out of `x` without copying the rest of it.

  Slicing inside the loop (rather than pre-splitting into `[K, N/K, ...]`)
  keeps the strided order free: a pre-split strided batch is a transposed copy
  of the whole batch, this is a strided read of one micro-batch.
  """
  if split == "contiguous":
    size = x.shape[0] // num_microbatches
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=0)
  rows = _strided_rows(x, num_microbatches)
  return jax.lax.dynamic_index_in_dim(rows, index, axis=1, keepdims=False)


def split_microbatches(
  tree: Any, num_microbatches: int, *, split: Split = "strided"
) -> Any:
  """Splits every leaf of `tree` on axis 0 into `num_microbatches` micro-batches.

  Micro-batch `k` of the `"strided"` split holds rows `k, k + K, k + 2K, …`;
  a batch sharded over devices on axis 0 then stays sharded the same way in
  every micro-batch (no resharding). The `"contiguous"` split holds rows
  `k * N/K … (k + 1) * N/K - 1`.

  Args:
    tree: a pytree of arrays that share a leading batch size `N`.
    num_microbatches: the number of micro-batches `K`; must divide `N`.
    split: `"strided"` (default) or `"contiguous"`.

  Returns:
    A pytree of the same structure whose leaves have shape `[K, N // K, ...]`.

  Raises:
    TypeError: a leaf is not an array or has no batch axis.
    ValueError: leading sizes differ, `K` does not divide `N`, or `split` is unknown.

  Examples:
    >>> import jax.numpy as jnp, jaccum
    >>> jaccum.split_microbatches(jnp.arange(6), 2)
    Array([[0, 2, 4],
           [1, 3, 5]], dtype=int32)
    >>> jaccum.split_microbatches(jnp.arange(6), 2, split="contiguous")
    Array([[0, 1, 2],
           [3, 4, 5]], dtype=int32)
  """
  num_microbatches = check_num_microbatches(num_microbatches)
  split = check_split(split)
  check_batch([tree], num_microbatches, names=["tree"])

  def split_leaf(x):
    if split == "contiguous":
      return x.reshape(num_microbatches, -1, *x.shape[1:])
    return jnp.swapaxes(_strided_rows(x, num_microbatches), 0, 1)

  return jax.tree.map(split_leaf, tree)


def merge_microbatches(x: jax.Array, split: Split) -> jax.Array:
  """Inverse of `split_microbatches` for one `[K, N/K, ...]` leaf."""
  if split == "strided":
    x = jnp.swapaxes(x, 0, 1)
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

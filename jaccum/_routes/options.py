"""The door: a front's keywords, each converted and checked once, into `Options`.

`accumulate`, `data_parallel`, `accumulate_coupled`, `jaccum.nnx` and
`jaccum.linen` build one frozen `Options` when they are called (the wrappers
once per wrapper), and the rules that the options alone decide run here
(`rules.check_door`). Nothing below reads a keyword: the plan reads
`Options`, once per trace, and hands each stage its piece.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaccum._core import accumulators
from jaccum._core.microbatch import Split, check_num_microbatches, check_split
from jaccum._core.step import Function
from jaccum._routes import rules

FsdpMode = str  # "gather_once" | "shard_grads" | "shard_all"
FSDP_MODES = ("gather_once", "shard_grads", "shard_all")


def _argnum(value: Any, name: str) -> int | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(f"{name} must be an int or None, got {value!r}.")
  return int(value)


def _batch_argnums(batch_argnums: Any) -> tuple[int, ...]:
  argnums = (
    (batch_argnums,) if isinstance(batch_argnums, int | np.integer) else batch_argnums
  )
  if (
    isinstance(batch_argnums, bool)
    or not isinstance(argnums, Sequence)
    or not argnums
    or any(isinstance(i, bool) or not isinstance(i, int | np.integer) for i in argnums)
  ):
    raise TypeError(
      f"batch_argnums must be an int or a non-empty sequence of ints, "
      f"got {batch_argnums!r}."
    )
  return tuple(int(i) for i in argnums)


def _unroll(unroll: Any) -> int | bool:
  if isinstance(unroll, bool) or (isinstance(unroll, int | np.integer) and unroll >= 1):
    return unroll if isinstance(unroll, bool) else int(unroll)
  raise TypeError(
    f"unroll must be a positive int or a bool (as for lax.scan), got {unroll!r}."
  )


def _grad_leaves(grad_leaves: Any) -> Any:
  for path, flag in jax.tree_util.tree_flatten_with_path(grad_leaves)[0]:
    if not isinstance(flag, bool | np.bool_):
      where = f" at grad_leaves{jax.tree_util.keystr(path)}" if path else ""
      raise TypeError(
        f"grad_leaves must be None or a pytree prefix of grad_fn's output made "
        f"of bools, got {flag!r}{where}."
      )
  return grad_leaves


def _reduce_fn(reduce_fn: Any) -> Callable[..., Any] | None:
  if reduce_fn is not None and not callable(reduce_fn):
    raise TypeError(
      "reduce_fn must be None or callable as reduce_fn(grads, axes, state) -> "
      f"(reduced_grads, new_state), got {reduce_fn!r}."
    )
  return reduce_fn


def _weight_fn(weight_fn: Any) -> Callable[..., Any] | None:
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn must be callable or None, got {weight_fn!r}.")
  return weight_fn


def check_bool(value: Any, name: str) -> bool:
  if not isinstance(value, bool | np.bool_):
    raise TypeError(f"{name} must be True or False, got {value!r}.")
  return bool(value)


def axis_tuple(axis_name: Any, name: str = "axis_name") -> tuple[str, ...]:
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  if (
    not isinstance(names, Sequence)
    or not names
    or not all(isinstance(n, str) for n in names)
  ):
    raise TypeError(
      f"{name} must be a mesh axis name or a tuple of them, got {axis_name!r}."
    )
  return tuple(names)


def _fsdp_mode(fsdp_mode: Any) -> str:
  if fsdp_mode not in FSDP_MODES:
    raise ValueError(f"fsdp_mode must be one of {FSDP_MODES}, got {fsdp_mode!r}.")
  return fsdp_mode


def function_of(fn: Any, name: str = "grad_fn") -> Function:
  """`fn` as a `Function`: a `functools.partial` unwrapped into its parts."""
  if not callable(fn):
    raise TypeError(f"{name} must be callable, got {fn!r}.")
  if isinstance(fn, functools.partial):
    return Function(fn.func, tuple(fn.args), dict(fn.keywords))
  return Function(fn)


@dataclasses.dataclass(frozen=True)
class Mesh:
  """`data_parallel`'s options: the loop runs on every device of `axes`.

  Attributes:
    mesh: the device mesh, or None for the one in context or the batch's.
    axes: the data axes the batch is split over.
    param_specs: FSDP specs of the params (argument 0), or None.
    fsdp_mode: what stays sharded inside the loop.
  """

  mesh: Any
  axes: tuple[str, ...]
  param_specs: Any = None
  fsdp_mode: str = "gather_once"


@dataclasses.dataclass(frozen=True)
class Options:
  """`accumulate`'s options (and `data_parallel`'s, in `on_mesh`), checked.

  `split` is the one in effect: `"strided"` by default, `"contiguous"` with
  `deterministic=True`; `split_named` says whether the caller named it.
  """

  function: Function
  num_microbatches: int
  batch_argnums: tuple[int, ...] = (1,)
  reduce: Any = "mean"
  weight_fn: Callable[..., Any] | None = None
  accum_dtype: np.dtype | None = None
  rng_argnum: int | None = None
  state_argnum: int | None = None
  axis_name: tuple[str, ...] | None = None
  split: Split = "strided"
  split_named: bool = False
  unroll: int | bool = 1
  grad_leaves: Any = None
  return_stats: bool = False
  conv_rewrite: bool = True
  overlap_reduction: bool = False
  reduce_dtype: np.dtype | None = None
  reduce_fn: Callable[..., Any] | None = None
  deterministic: bool = False
  on_mesh: Mesh | None = None

  def replace(self, **changes: Any) -> Options:
    return dataclasses.replace(self, **changes)


def make(
  grad_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  batch_argnums: int | Sequence[int] = 1,
  reduce: Any = "mean",
  weight_fn: Callable[..., Any] | None = None,
  accum_dtype: Any = np.float32,
  rng_argnum: int | None = None,
  state_argnum: int | None = None,
  axis_name: str | tuple[str, ...] | None = None,
  split: Split | None = None,
  unroll: int | bool = 1,
  grad_leaves: Any = None,
  return_stats: bool = False,
  conv_rewrite: bool = True,
  overlap_reduction: bool = False,
  reduce_dtype: Any = None,
  reduce_fn: Callable[..., Any] | None = None,
  deterministic: bool = False,
  on_mesh: Mesh | None = None,
) -> Options:
  """Every keyword of `accumulate` converted and checked, and the door's rules."""
  function = function_of(grad_fn)
  deterministic = check_bool(deterministic, "deterministic")
  default_split = "contiguous" if deterministic else "strided"
  options = Options(
    function=function,
    num_microbatches=check_num_microbatches(num_microbatches),
    batch_argnums=_batch_argnums(batch_argnums),
    reduce=accumulators.check_reduce_spec(reduce),
    weight_fn=_weight_fn(weight_fn),
    accum_dtype=accumulators.check_accum_dtype(accum_dtype, "accum_dtype"),
    rng_argnum=_argnum(rng_argnum, "rng_argnum"),
    state_argnum=_argnum(state_argnum, "state_argnum"),
    axis_name=None if axis_name is None else axis_tuple(axis_name),
    split=check_split(split if split is not None else default_split),
    split_named=split is not None,
    unroll=_unroll(unroll),
    grad_leaves=None if grad_leaves is None else _grad_leaves(grad_leaves),
    return_stats=check_bool(return_stats, "return_stats"),
    conv_rewrite=check_bool(conv_rewrite, "conv_rewrite"),
    overlap_reduction=check_bool(overlap_reduction, "overlap_reduction"),
    reduce_dtype=accumulators.check_accum_dtype(reduce_dtype, "reduce_dtype"),
    reduce_fn=_reduce_fn(reduce_fn),
    deterministic=deterministic,
    on_mesh=on_mesh,
  )
  rules.check_door(options)
  return options


def on_mesh(
  mesh: Any, axis: Any, param_specs: Any, fsdp_mode: Any, accumulate_kwargs: dict
) -> Mesh:
  """`data_parallel`'s own options, checked."""
  if "axis_name" in accumulate_kwargs:
    raise TypeError("data_parallel takes `axis`, not `axis_name`.")
  return Mesh(mesh, axis_tuple(axis, "axis"), param_specs, _fsdp_mode(fsdp_mode))

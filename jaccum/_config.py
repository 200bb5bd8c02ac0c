"""`accumulate`'s options, checked once, and where they point in a call's arguments."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaccum import _compose, _reduce
from jaccum._microbatch import Split, check_num_microbatches, check_split


def _check_argnum(value: Any, name: str) -> int | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(f"{name} must be an int or None, got {value!r}.")
  return int(value)


def _check_batch_argnums(batch_argnums: Any) -> tuple[int, ...]:
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


def _check_unroll(unroll: Any) -> int | bool:
  if isinstance(unroll, bool) or (isinstance(unroll, int | np.integer) and unroll >= 1):
    return unroll if isinstance(unroll, bool) else int(unroll)
  raise TypeError(
    f"unroll must be a positive int or a bool (as for lax.scan), got {unroll!r}."
  )


def _check_grad_leaves(grad_leaves: Any) -> Any:
  for path, flag in jax.tree_util.tree_flatten_with_path(grad_leaves)[0]:
    if not isinstance(flag, bool | np.bool_):
      where = f" at grad_leaves{jax.tree_util.keystr(path)}" if path else ""
      raise TypeError(
        f"grad_leaves must be None or a pytree prefix of grad_fn's output made "
        f"of bools, got {flag!r}{where}."
      )
  return grad_leaves


def _check_reduce_fn(reduce_fn: Any) -> Callable[..., Any] | None:
  if reduce_fn is not None and not callable(reduce_fn):
    raise TypeError(
      "reduce_fn must be None or callable as reduce_fn(grads, axes, state) -> "
      f"(reduced_grads, new_state), got {reduce_fn!r}."
    )
  return reduce_fn


def _check_bool(value: Any, name: str) -> bool:
  if not isinstance(value, bool | np.bool_):
    raise TypeError(f"{name} must be True or False, got {value!r}.")
  return bool(value)


def _normalize(argnum: int, num_args: int, name: str, kwargs: dict[str, Any]) -> int:
  if not -num_args <= argnum < num_args:
    hint = ""
    if kwargs:
      hint = (
        f" Keyword arguments ({', '.join(kwargs)}) are never split into "
        "micro-batches; pass the batch positionally."
      )
    raise ValueError(
      f"{name}={argnum} is out of range for a call with {num_args} positional "
      f"argument{'s' if num_args != 1 else ''}.{hint}"
    )
  return argnum % num_args


def is_key(x: Any) -> bool:
  """Whether `x` is a PRNG key: a typed key, or a legacy raw uint32[2] (or [4])."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return x.ndim == 0
  return dtype == np.uint32 and getattr(x, "shape", None) in ((2,), (4,))


class Config(NamedTuple):
  """`accumulate`'s options, checked.

  `grad_fn` is the function to call; a `functools.partial` is unwrapped into
  `grad_fn` and its `bound_args` and `bound_kwargs`, so that arrays bound in it
  travel as arguments (device-varying under `shard_map`), not as constants.
  """

  grad_fn: Callable[..., Any]
  bound_args: tuple[Any, ...]
  bound_kwargs: dict[str, Any]
  num_microbatches: int
  batch_argnums: tuple[int, ...]
  reduce: Any
  weight_fn: Callable[..., Any] | None
  accum_dtype: np.dtype | None
  rng_argnum: int | None
  state_argnum: int | None
  axes: tuple[str, ...] | None
  split: Split
  unroll: int | bool
  grad_leaves: Any
  return_stats: bool
  conv_rewrite: bool
  overlap_reduction: bool = False
  reduce_dtype: np.dtype | None = None
  reduce_fn: Callable[..., Any] | None = None
  deterministic: bool = False
  split_named: bool = False


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


def check_mesh_axes(axes: tuple[str, ...], mesh: Any) -> None:
  """Raises, naming the fix, where `axes` (the batch's axes) are not the mesh's.

  `axis` defaults to "data", so a mesh that names its batch axis otherwise
  (Flax's tutorials use "batch") meets it unasked: the message says so.
  """
  missing = [a for a in axes if a not in mesh.axis_names]
  if not missing:
    return
  names = tuple(mesh.axis_names)
  fix = (
    "axis defaults to 'data': pass axis= naming the mesh axes the batch is split "
    f"over, e.g. axis={names[0]!r}"
    if axes == ("data",) and names
    else f"pass axis= naming the mesh axes the batch is split over, among {names}"
  )
  raise ValueError(f"axis={axes} names {missing}, not axes of the mesh {mesh}; {fix}.")


def make_config(
  grad_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  batch_argnums: int | Sequence[int] = 1,
  reduce: Any = "mean",
  weight_fn: Callable[..., Any] | None = None,
  accum_dtype: Any = jnp.float32,
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
) -> Config:
  """Checks every option of `accumulate` that can be checked without arguments.

  `split=None` is `"strided"`, or `"contiguous"` with `deterministic=True`
  (micro-batch m is then rows m·R .. (m+1)·R - 1 whatever K and the devices);
  `split_named` records whether the caller chose (a count needs it chosen).
  """
  if not callable(grad_fn):
    raise TypeError(f"grad_fn must be callable, got {grad_fn!r}.")
  _reduce.check_reduce_spec(reduce)
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn must be callable or None, got {weight_fn!r}.")
  deterministic = _check_bool(deterministic, "deterministic")
  default_split = "contiguous" if deterministic else "strided"
  fn, bound_args, bound_kwargs = grad_fn, (), {}
  if isinstance(grad_fn, functools.partial):
    fn, bound_args, bound_kwargs = grad_fn.func, grad_fn.args, grad_fn.keywords
  config = Config(
    grad_fn=fn,
    bound_args=tuple(bound_args),
    bound_kwargs=dict(bound_kwargs),
    num_microbatches=check_num_microbatches(num_microbatches),
    batch_argnums=_check_batch_argnums(batch_argnums),
    reduce=reduce,
    weight_fn=weight_fn,
    accum_dtype=_reduce.check_accum_dtype(accum_dtype, "accum_dtype"),
    rng_argnum=_check_argnum(rng_argnum, "rng_argnum"),
    state_argnum=_check_argnum(state_argnum, "state_argnum"),
    axes=None if axis_name is None else axis_tuple(axis_name),
    split=check_split(split if split is not None else default_split),
    unroll=_check_unroll(unroll),
    grad_leaves=None if grad_leaves is None else _check_grad_leaves(grad_leaves),
    return_stats=_check_bool(return_stats, "return_stats"),
    conv_rewrite=_check_bool(conv_rewrite, "conv_rewrite"),
    overlap_reduction=_check_bool(overlap_reduction, "overlap_reduction"),
    reduce_dtype=_reduce.check_accum_dtype(reduce_dtype, "reduce_dtype"),
    reduce_fn=_check_reduce_fn(reduce_fn),
    deterministic=deterministic,
    split_named=split is not None,
  )
  _compose.check_options(config, split)
  return config


class Positions(NamedTuple):
  """Where the batch, the key and the state sit in one call's arguments."""

  batch: tuple[int, ...]
  rng: int | None
  state: int | None


def positions(
  config: Config, args: Sequence[Any], kwargs: dict[str, Any] | None = None
) -> Positions:
  """Resolves (possibly negative) argnums against a call; checks they are sane."""
  num_args, kwargs = len(args), kwargs or {}
  batch = tuple(
    _normalize(i, num_args, "batch_argnums", kwargs) for i in config.batch_argnums
  )
  rng, state = (
    None if argnum is None else _normalize(argnum, num_args, name, kwargs)
    for argnum, name in (
      (config.rng_argnum, "rng_argnum"),
      (config.state_argnum, "state_argnum"),
    )
  )
  for name, other in (("rng_argnum", rng), ("state_argnum", state)):
    if other is not None and other in batch:
      raise ValueError(
        f"{name}={other} is also in batch_argnums={config.batch_argnums}; the "
        "batch, the key and the state must be different arguments."
      )
  if rng is not None and rng == state:
    raise ValueError(f"rng_argnum and state_argnum are both {rng}.")
  check_no_stateful_graph_nodes(args, kwargs)
  if rng is not None and not is_key(args[rng]):
    got = getattr(args[rng], "aval", None) or type(args[rng]).__name__
    raise TypeError(
      f"rng_argnum={config.rng_argnum} must point at a PRNG key (jax.random.key "
      f"or jax.random.PRNGKey), got {got}."
    )
  return Positions(batch, rng, state)


def check_no_stateful_graph_nodes(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
  """Refuses Flax NNX modules whose state would not be threaded (use jaccum.nnx).

  `jax.grad` or `nnx.grad` of a loss on an `nnx.Module` updates its
  BatchNorm statistics and `nnx.Rngs` counts in place. Plain `accumulate`
  traces the micro-step once, so every micro-batch would start from the
  same statistics and keys and the updates would be lost: the running
  statistics would never move. Modules holding only `nnx.Param`s are fine.
  """
  nnx = sys.modules.get("flax.nnx")  # only if the user imported Flax NNX
  if nnx is None:
    return
  named = [(f"args[{i}]", a) for i, a in enumerate(args)]
  named += [(f"{k}=", v) for k, v in kwargs.items()]
  for name, value in named:
    for node in jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, nnx.Module)):
      if not isinstance(node, nnx.Module):
        continue
      kinds = sorted(
        {
          type(v).__name__
          for _, v in nnx.graph.iter_graph(node)
          if isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param)
        }
      )
      if kinds:
        raise ValueError(
          f"{name} holds a Flax NNX {type(node).__name__} with state that "
          f"changes as it runs ({', '.join(kinds)} variables, e.g. BatchNorm "
          f"statistics or nnx.Rngs counts). Plain jaccum.accumulate traces the "
          f"micro-step "
          f"once, so every micro-batch would start from the same state and its "
          f"updates would be lost. Use jaccum.nnx.value_and_grad(loss_fn, K) or "
          f"jaccum.nnx.grad, which thread the model's state through the "
          f"micro-batches."
        )


def batch_hint(config: Config, at: Positions) -> str:
  """Says which option made these arguments the batch, for batch errors."""
  names = ", ".join(f"args[{i}]" for i in at.batch)
  argnums = config.batch_argnums
  shown = argnums[0] if len(argnums) == 1 else argnums
  return (
    f" ({names} {'is' if len(at.batch) == 1 else 'are'} the batch because "
    f"batch_argnums={shown}{' (the default)' if argnums == (1,) else ''}; if the "
    f"batch is another argument, e.g. loss(batch, params), pass "
    f"batch_argnums=its position.)"
  )


def call_weight_fn(weight_fn: Callable[..., Any], args: Sequence[Any]) -> jax.Array:
  """`weight_fn(*args)`, checked: a clear error if its signature cannot take them."""
  try:
    inspect.signature(weight_fn).bind(*args)
  except TypeError as e:
    raise TypeError(
      f"weight_fn receives every positional argument of the call, cut to one "
      f"micro-batch: weight_fn(*micro_args) with {len(args)} arguments; its "
      f"signature does not accept them ({e})."
    ) from None
  except ValueError:
    pass  # no signature to check (a builtin): just call it
  return _reduce.check_weight(weight_fn(*args), "weight_fn must return")

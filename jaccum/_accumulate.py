"""`accumulate`: run a gradient function over K micro-batches in one `lax.scan`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaccum import _collective, _reduce
from jaccum._microbatch import (
  Split,
  check_batch,
  check_num_microbatches,
  check_split,
  take_microbatch,
)


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


def _normalize(argnum: int, num_args: int, name: str) -> int:
  if not -num_args <= argnum < num_args:
    raise ValueError(
      f"{name}={argnum} is out of range for a call with {num_args} positional "
      f"argument{'s' if num_args != 1 else ''}."
    )
  return argnum % num_args


def _is_key(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return x.ndim == 0
  # Legacy raw keys from `jax.random.PRNGKey`: uint32[2] (or [4] for rbg).
  return dtype == np.uint32 and getattr(x, "shape", None) in ((2,), (4,))


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


class Config(NamedTuple):
  """`accumulate`'s options, checked; `data_parallel` adds FSDP scattering."""

  grad_fn: Callable[..., Any]
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
  # For FSDP: `scatter(out_shape)` gives, per output leaf, the dimension to
  # reduce-scatter over `axes` (or None to all-reduce it).
  scatter: Callable[[Any], Any] | None = None


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
  split: Split = "strided",
  unroll: int | bool = 1,
) -> Config:
  """Checks every option of `accumulate` that can be checked without arguments."""
  if not callable(grad_fn):
    raise TypeError(f"grad_fn must be callable, got {grad_fn!r}.")
  _reduce.check_reduce_spec(reduce)
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn must be callable or None, got {weight_fn!r}.")
  return Config(
    grad_fn=grad_fn,
    num_microbatches=check_num_microbatches(num_microbatches),
    batch_argnums=_check_batch_argnums(batch_argnums),
    reduce=reduce,
    weight_fn=weight_fn,
    accum_dtype=_reduce.check_accum_dtype(accum_dtype, "accum_dtype"),
    rng_argnum=_check_argnum(rng_argnum, "rng_argnum"),
    state_argnum=_check_argnum(state_argnum, "state_argnum"),
    axes=None if axis_name is None else _collective.axis_tuple(axis_name),
    split=check_split(split),
    unroll=unroll,
  )


class Positions(NamedTuple):
  """Where the batch, the key and the state sit in one call's arguments."""

  batch: tuple[int, ...]
  rng: int | None
  state: int | None


def positions(config: Config, args: Sequence[Any]) -> Positions:
  """Resolves (possibly negative) argnums against a call; checks they are sane."""
  num_args = len(args)
  batch = tuple(_normalize(i, num_args, "batch_argnums") for i in config.batch_argnums)
  rng, state = (
    None if argnum is None else _normalize(argnum, num_args, name)
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
  if rng is not None and not _is_key(args[rng]):
    got = getattr(args[rng], "aval", None) or type(args[rng]).__name__
    raise TypeError(
      f"rng_argnum={config.rng_argnum} must point at a PRNG key (jax.random.key "
      f"or jax.random.PRNGKey), got {got}."
    )
  return Positions(batch, rng, state)


def run(config: Config, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  """One call of an accumulated function: split, scan, reduce, finalize."""
  at = positions(config, args)
  num_microbatches, split = config.num_microbatches, config.split
  batch_size = check_batch(
    [args[i] for i in at.batch],
    num_microbatches,
    names=[f"args[{i}]" for i in at.batch],
  )
  if config.axes is None and (batch_axes := _explicit_batch_axes(args, at)):
    # Under plain jit, a batch sharded over explicit mesh axes takes the same
    # collective-free path as `data_parallel`. Imported here because
    # `_parallel` builds on this module.
    from jaccum import _parallel

    return _parallel.run_sharded(config._replace(axes=batch_axes), args, kwargs)

  if config.axes is not None:
    # Device-varying params: no psum in each micro-step's backward pass.
    args = tuple(
      a if i in at.batch else _collective.cast_varying(a, config.axes)
      for i, a in enumerate(args)
    )
    if at.rng is not None:
      device = jax.lax.axis_index(config.axes)
      args = (
        *args[: at.rng],
        jax.random.fold_in(args[at.rng], device),
        *args[at.rng + 1 :],
      )

  def micro_step(index, state):
    step_args = list(args)
    for i in at.batch:
      step_args[i] = jax.tree.map(
        lambda x: take_microbatch(x, index, num_microbatches, split), args[i]
      )
    if at.rng is not None:
      step_args[at.rng] = jax.random.fold_in(args[at.rng], index)
    if at.state is not None:
      step_args[at.state] = state
    out = config.grad_fn(*step_args, **kwargs)
    if at.state is not None:
      out, state = _check_state_output(out, args[at.state])
    weight = None
    if config.weight_fn is not None:
      weight = _reduce.check_weight(
        config.weight_fn(*step_args), "weight_fn must return"
      )
    return out, state, weight

  state0 = None if at.state is None else args[at.state]
  out_shape, state_shape, weight_shape = jax.eval_shape(lambda: micro_step(0, state0))
  leaves = _reduce.plan(
    config.reduce, out_shape, config.accum_dtype, batch_size // num_microbatches, split
  )

  total0 = None
  if weight_shape is not None:
    mean_dtypes = [
      leaf.carry_dtype
      for leaf in jax.tree.leaves(leaves, is_leaf=_reduce.is_plan)
      if leaf.mode == "mean"
    ]
    total0 = jnp.zeros(
      (), jnp.result_type(weight_shape.dtype, jnp.float32, *mean_dtypes)
    )

  def body(carry, index):
    acc, state, total = carry
    out, state, weight = micro_step(index, state)
    acc = _reduce.update(leaves, acc, out, weight, index)
    if weight is not None:
      total = total + weight.astype(total.dtype)
    return (acc, state, total), None

  acc0 = _reduce.init(leaves, out_shape, num_microbatches)
  carry0 = _collective.match_varying(
    (acc0, state0, total0), (out_shape, state_shape, weight_shape)
  )
  (acc, state, total), _ = jax.lax.scan(
    body, carry0, jnp.arange(num_microbatches), unroll=config.unroll
  )
  # Unweighted, the total is K itself, a constant the division can fold.
  total = num_microbatches if total is None else total
  if config.axes is not None:
    scatter = None if config.scatter is None else config.scatter(out_shape)
    acc, total, state = _collective.all_reduce(
      leaves, acc, total, state, config.axes, scatter
    )
  result = _reduce.finalize(leaves, acc, total, split)
  return result if at.state is None else (result, state)


def _explicit_batch_axes(args: Sequence[Any], at: Positions) -> tuple[str, ...] | None:
  """The explicit mesh axes every batch leaf is sharded over on axis 0, if any."""
  found = set()
  for i in at.batch:
    for leaf in jax.tree.leaves(args[i]):
      sharding = getattr(jax.typeof(leaf), "sharding", None)
      spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
      if not spec or spec[0] is None or mesh is None:
        return None
      axes = _collective.spec_axes(spec[0])
      types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
      if any(types[a] != jax.sharding.AxisType.Explicit for a in axes):
        return None
      found.add(axes)
  return found.pop() if len(found) == 1 else None


def accumulate(
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
  split: Split = "strided",
  unroll: int | bool = 1,
) -> Callable[..., Any]:
  """Runs `grad_fn` over `num_microbatches` micro-batches and combines the outputs.

  The returned function takes the same arguments as `grad_fn` and returns the
  same structure. The arguments in `batch_argnums` are split on axis 0 into K
  micro-batches; the others (params, …) go whole to every micro-step. The loop
  is one `lax.scan`, so compile time does not grow with K, and each
  micro-batch is sliced out of the batch inside the loop, so memory holds one
  micro-batch's work plus one accumulator. It computes, for `"mean"` leaves::

    def accumulated(*args):
      for k in range(K):
        micro_args = args with each batch argument cut to micro-batch k
        out_k, w_k = grad_fn(*micro_args), weight_fn(*micro_args)  # w_k = 1 without
      return sum(w_k * out_k) / sum(w_k)                           # 0 if sum(w_k) == 0

  For a loss that is a mean over examples, `"mean"` makes every leaf equal to
  `grad_fn` on the whole batch; for a mean over tokens, `weight_fn` returning
  each micro-batch's token count does the same however unevenly tokens fall.

  Args:
    grad_fn: any function, typically `jax.grad(loss)` or
      `jax.value_and_grad(loss, has_aux=True)`.
    num_microbatches: the number of micro-batches K, a static positive int
      that divides the batch size N.
    batch_argnums: the positional argument(s) holding the batch; all their
      leaves must share the leading size N.
    reduce: how to combine each output leaf: `"mean"`, `"sum"`, `"concat"`
      (per-example outputs, returned in the original row order), `"last"` or
      `"max"`; a string for all leaves or a pytree prefix of the output.
    weight_fn: `weight_fn(*micro_args) -> scalar`; turns every `"mean"` leaf
      into the weighted mean `Σ w_k out_k / Σ w_k`. A micro-batch of weight 0
      contributes nothing, even if its output is NaN; a total of 0 gives zeros.
    accum_dtype: floating `"mean"`/`"sum"` leaves narrower than this are
      accumulated in it and cast back at the end; `None` keeps each leaf's
      dtype.
    rng_argnum: the positional argument holding a PRNG key; micro-batch k gets
      `jax.random.fold_in(key, k)`.
    state_argnum: the positional argument holding state that `grad_fn`
      updates (e.g. BatchNorm `batch_stats`): `grad_fn` returns
      `(out, new_state)`, micro-batch k+1 sees the state micro-batch k
      returned, and the result is `(reduced_out, final_state)`.
    axis_name: for use inside `shard_map` (or `pmap`): the mesh axis (or
      axes) the batch is split over. Each device accumulates its own K
      micro-batches with no communication in the loop (non-batch arguments
      are cast to device-varying first, so no psum enters the backward pass),
      then one all-reduce combines the devices: weighted means with weights
      summed over devices, sums, maxima. `"concat"` and `"last"` leaves stay
      per device. Keys differ per device and per micro-batch. Threaded state
      is made identical on every device at the end: floating leaves are
      averaged over devices (synchronised BatchNorm), others take the maximum.
    split: `"strided"` (micro-batch k holds rows k, k+K, …: a batch sharded
      over devices stays sharded with no data movement) or `"contiguous"`.
    unroll: passed to `lax.scan`.

  Returns:
    A function with `grad_fn`'s signature, usable with or without `jit`.
    Put it inside your jitted train step: called eagerly, it traces and
    compiles its loop again on every call.

  Raises:
    TypeError, ValueError: on bad arguments, when `accumulate` is called or
      when the returned function is traced; the message names the argument or
      the leaf path.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> def loss(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> w = jnp.ones(3)
    >>> batch = {"x": jnp.arange(24.0).reshape(8, 3), "y": jnp.arange(8.0)}
    >>> grads = jax.jit(jaccum.accumulate(jax.grad(loss), 4))(w, batch)
    >>> bool(jnp.allclose(grads, jax.grad(loss)(w, batch)))
    True
  """
  config = make_config(
    grad_fn,
    num_microbatches,
    batch_argnums=batch_argnums,
    reduce=reduce,
    weight_fn=weight_fn,
    accum_dtype=accum_dtype,
    rng_argnum=rng_argnum,
    state_argnum=state_argnum,
    axis_name=axis_name,
    split=split,
    unroll=unroll,
  )

  @functools.wraps(grad_fn)
  def accumulated(*args, **kwargs):
    return run(config, args, kwargs)

  return accumulated

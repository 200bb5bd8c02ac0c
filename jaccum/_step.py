"""The micro-step: `grad_fn` traced once, then run on micro-batch k of the batch.

`MicroInputs` makes micro-batch k's arguments from the call's: the batch
arguments cut to their slice (`split`), the key folded with k
(`rng_argnum`), the state threaded in (`state_argnum`). `trace` traces the
user's function once, by `jax.make_jaxpr`, on micro-batch 0's shapes: that
gives the output structure the carry needs, the closed-over arrays (the
jaxpr's constants), and the program the loop evaluates, rewritten where the
loop needs it (the data axes out of sharding constraints; on CPU,
convolutions into XLA's fast layout). Inside `data_parallel`'s `shard_map`,
a function JAX will not trace there (it closes over arrays on an explicit
mesh) is traced outside it instead and run retyped (`Lift`, `_retype`).
`MicroStep` evaluates that program on micro-batch k, whole or, for FSDP's
sharded modes, with params gathered where used and gradients scattered where
made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jaccum import _collective, _conv_layout, _fsdp, _jaxpr, _retype
from jaccum._config import Config, Positions, call_weight_fn
from jaccum._microbatch import Split, take_microbatch

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


def is_typed_key(x: Any) -> bool:
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


class MicroInputs(NamedTuple):
  """The call's arguments, and how micro-batch k's are cut out of them.

  Attributes:
    args: the positional arguments, prepared for this device.
    extras: `(bound_args, kwargs)`: a `functools.partial`'s bound arguments
      and all keyword arguments, whole to every micro-step.
    at: where the batch, the key and the state sit in `args`.
    num_microbatches: K.
    split: `"strided"` or `"contiguous"`.
    first: the global index of this device's micro-batch 0, which its key
      is folded with (`deterministic=True`: d·K on device d without a
      count); 0 otherwise.
  """

  args: list[Any]
  extras: tuple[tuple[Any, ...], dict[str, Any]]
  at: Positions
  num_microbatches: int
  split: Split
  first: Any = 0

  def args_at(self, index: Any, state: Any) -> list[Any]:
    """Micro-batch `index`'s positional arguments, with `state` threaded in."""
    at, step_args = self.at, list(self.args)
    for i in at.batch:
      step_args[i] = jax.tree.map(
        lambda x: take_microbatch(x, index, self.num_microbatches, self.split),
        self.args[i],
      )
    if at.rng is not None:
      step_args[at.rng] = jax.random.fold_in(self.args[at.rng], self.first + index)
    if at.state is not None:
      step_args[at.state] = state
    return step_args

  def leaves_at(self, index: Any, state: Any) -> list[Any]:
    """Every leaf of micro-batch `index`'s call: arguments, then extras."""
    return jax.tree.leaves((self.args_at(index, state), self.extras))


def prepare(
  config: Config,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  axes: tuple[str, ...] | None,
  first: Any = 0,
) -> MicroInputs:
  """The call's arguments made ready for this device's loop.

  With `axes` (inside `shard_map`/`pmap`), non-batch arguments are cast to
  device-varying (so no psum enters each micro-step's backward pass), and
  keys (the `rng_argnum` one, typed keys in the state) are folded with the
  device index, so that devices draw different numbers; with
  `deterministic=True` the key is instead folded with each micro-batch's
  global index (`first` + its index here).
  """
  args = list(args)
  extras = (config.bound_args, {**config.bound_kwargs, **kwargs})
  if axes is not None:
    args = [
      a if i in at.batch else _collective.cast_varying(a, axes)
      for i, a in enumerate(args)
    ]
    extras = _collective.cast_varying(extras, axes)
    if at.rng is not None and not config.deterministic:
      args[at.rng] = _collective.fold_device(args[at.rng], axes)
    if at.state is not None:
      args[at.state] = jax.tree.map(
        lambda s: _collective.fold_device(s, axes) if is_typed_key(s) else s,
        args[at.state],
      )
  return MicroInputs(args, extras, at, config.num_microbatches, config.split, first)


class MicroStep(NamedTuple):
  """The traced micro-step and how to run it on one micro-batch.

  Attributes:
    closed: the program: micro-batch leaves in, `(out, new_state)` out.
    dynamic: per leaf of the call, whether it is an array (a program input).
    out_tree: the structure of `(out, new_state)`.
    out_shape: one micro-step's output shapes.
    weight_shape: `weight_fn`'s result's shape, or None without it.
    gathered: per program input, how it arrives split over devices
      (`"shard_all"` params) or None; gathered where used.
  """

  closed: Any
  dynamic: list[bool]
  out_tree: Any
  out_shape: Any
  weight_shape: Any
  gathered: list[_fsdp.Sharded | None]

  def __call__(
    self,
    leaves: Sequence[Any],
    index: Any,
    scattered: Sequence[_fsdp.Sharded | None] | None,
    weight: Any,
  ) -> tuple[Any, Any, list[jax.Array]]:
    """`(out, new_state, norms)` on one micro-batch's leaves.

    `scattered` says which outputs each micro-step reduce-scatters (FSDP),
    weighted by `weight` before the sum over devices; `norms` are their
    whole values' squared norms, in order, for the noise scale.
    """
    values = [x for x, d in zip(leaves, self.dynamic, strict=True) if d]
    norms: list[jax.Array] = []
    if any(self.gathered) or scattered is not None:
      # Shards tied to the iteration: XLA would hoist a gather of a
      # loop-invariant shard out of the loop, and keep it whole throughout.
      values = [
        _fsdp.tied(v, index) if how else v
        for v, how in zip(values, self.gathered, strict=True)
      ]
      outputs = list(scattered or [None] * len(self.closed.jaxpr.outvars))
      flat_out, norms = _fsdp.evaluate(
        self.closed.jaxpr, self.closed.consts, values, self.gathered, outputs, weight
      )
    else:
      flat_out = jax.core.eval_jaxpr(self.closed.jaxpr, self.closed.consts, *values)
    out, state = jax.tree.unflatten(self.out_tree, flat_out)
    return out, state, norms


def default_rewrite(config: Config) -> Callable[[Any], Any] | None:
  """The rewrite the traced micro-step gets on the default backend, if any.

  On CPU, convolutions in a loop body miss XLA's fast layout (see
  `_conv_layout`) unless `conv_rewrite=False`; other backends run the
  micro-step as traced.
  """
  if config.conv_rewrite and jax.default_backend() == "cpu":
    return _conv_layout.canonicalize_convolutions
  return None


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


class Lift(NamedTuple):
  """How the per-device loop runs a `grad_fn` that cannot be traced inside it.

  Attributes:
    mesh: the mesh outside the loop's `shard_map`, to trace `grad_fn` in
      where it fails inside (`_retype.lift`, which raises `_retype.Retrace`).
    outside: on the second run, the micro-step traced outside.
    consts: its closed-over arrays, as the `shard_map` hands them in.
  """

  mesh: Any
  outside: _retype.Outside | None = None
  consts: Sequence[Any] = ()


def _traced(
  micro_step: Callable[..., Any], examples: Sequence[Any], lift: Lift | None
) -> tuple[Any, Any]:
  """`(program, (out_shape, state_shape))` of the micro-step on `examples`.

  With a `Lift`, a micro-step that fails inside is traced outside and the
  `shard_map` asked to run again (`_retype.Retrace`); on that run, the
  program traced outside is run retyped, `grad_fn` not traced again.
  """
  if lift is not None and lift.outside is not None:
    program = lift.outside.program(lift.consts)

    def retyped(*values):
      try:
        return program(*values)
      except Exception as error:
        mark_user_error(error)  # the user's program, retyped: fall back as for it
        raise

    return jax.make_jaxpr(retyped, return_shape=True)(*examples)
  try:
    return jax.make_jaxpr(micro_step, return_shape=True)(*examples)
  except Exception as error:
    if lift is None or not is_user_error(error):
      raise
    raise _retype.Retrace(
      [_retype.lift(micro_step, examples, lift.mesh, error)], error
    ) from error


def trace(
  config: Config,
  inputs: MicroInputs,
  state0: Any,
  axes: tuple[str, ...] | None,
  sharded_params: Sequence[_fsdp.Sharded | None] = (),
  lift: Lift | None = None,
) -> MicroStep:
  """Traces `grad_fn` (and `weight_fn`) once on micro-batch 0's shapes.

  `sharded_params`, for `"shard_all"`: how each leaf of the params (argument
  0, the call's first leaves) arrives split over devices; the micro-step is
  traced on whole ones, as the user wrote it. `lift`: inside the per-device
  loop's `shard_map`, how to run a `grad_fn` that closes over arrays on the
  mesh (`_retype`).
  """
  at = inputs.at
  flat, treedef = jax.tree.flatten((inputs.args_at(0, state0), inputs.extras))
  dynamic = [isinstance(x, ARRAY_TYPES) for x in flat]
  how = [*sharded_params, *[None] * (len(flat) - len(sharded_params))]
  examples = [
    x
    if h is None
    else jax.ShapeDtypeStruct(_fsdp.whole_shape(np.shape(x), h), jnp.result_type(x))
    for x, h in zip(flat, how, strict=True)
  ]

  def unflatten(values):
    it = iter(values)
    full = [next(it) if d else x for x, d in zip(flat, dynamic, strict=True)]
    return jax.tree.unflatten(treedef, full)

  def micro_step(*values):
    step_args, (bound_args, all_kwargs) = unflatten(values)
    try:
      out = config.grad_fn(*bound_args, *step_args, **all_kwargs)
    except Exception as error:
      mark_user_error(error)
      raise
    if at.state is None:
      return out, None
    return _check_state_output(out, step_args[at.state])

  dynamic_examples = [x for x, d in zip(examples, dynamic, strict=True) if d]
  closed, (out_shape, _) = _traced(micro_step, dynamic_examples, lift)
  weight_shape = None
  if config.weight_fn is not None:
    weight_shape = jax.eval_shape(
      lambda *values: call_weight(config, unflatten(values)[0]), *dynamic_examples
    )
  if axes is not None:
    _check_closures(closed, [inputs.args[i] for i in at.batch], axes)
    closed = _jaxpr.strip_constraints(closed, axes)
  if (rewrite := default_rewrite(config)) is not None:
    closed = rewrite(closed)
  if config.deterministic:
    closed = _jaxpr.divisions_as_reciprocals(closed)
  gathered = [h for h, d in zip(how, dynamic, strict=True) if d]
  out_tree = jax.tree.structure((out_shape, None if at.state is None else state0))
  return MicroStep(closed, dynamic, out_tree, out_shape, weight_shape, gathered)


def call_weight(config: Config, step_args: Sequence[Any]) -> jax.Array:
  """`weight_fn(*micro_args)` as an array (a Python number comes back as one)."""
  assert config.weight_fn is not None
  return jnp.asarray(call_weight_fn(config.weight_fn, step_args))

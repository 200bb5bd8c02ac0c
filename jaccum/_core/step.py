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
mesh) is traced outside it instead and run retyped (`Lift`, `retype`).
`MicroStep` evaluates that program on micro-batch k, whole or, for FSDP's
sharded modes, with params gathered where used and gradients scattered where
made.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jaccum._core import fsdp, retype, rewrites
from jaccum._core.accumulators import check_weight
from jaccum._core.microbatch import Split, take_microbatch

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


# Device-varying types. Inside a `shard_map` that checks types (the default),
# JAX tracks which mesh axes a value varies over. A gradient taken with respect
# to a device-invariant (replicated) parameter of a loss on a device-varying
# batch is made invariant by a `psum` that JAX inserts into the backward pass:
# inside a loop, one all-reduce per micro-batch. Casting the parameters to
# varying before the loop removes that psum.


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


class Positions(NamedTuple):
  """Where the batch, the key and the state sit in one call's arguments."""

  batch: tuple[int, ...]
  rng: int | None
  state: int | None


class Function(NamedTuple):
  """The user's function, a `functools.partial` unwrapped: its bound arguments
  travel as arguments (device-varying under `shard_map`), not as constants."""

  fn: Callable[..., Any]
  bound_args: tuple[Any, ...] = ()
  bound_kwargs: dict[str, Any] = {}  # noqa: RUF012  (never mutated)

  def with_bound(self, bound_args: Any, bound_kwargs: Any) -> Function:
    return self._replace(bound_args=tuple(bound_args), bound_kwargs=dict(bound_kwargs))


def mark_user_error(error: Exception) -> None:
  """Marks an error as raised while tracing the user's function, not by jaccum.

  The per-device route runs the function per device under `shard_map` and, where JAX
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
  function: Function,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  cut: tuple[int, Split],
  axes: tuple[str, ...] | None = None,
  first: Any = None,
) -> MicroInputs:
  """The call's arguments made ready for this device's loop.

  `cut` is `(K, split)`. With `axes` (inside `shard_map`/`pmap`), non-batch
  arguments are cast to device-varying (so no psum enters each micro-step's
  backward pass), and keys (the `rng_argnum` one, typed keys in the state)
  are folded with the device index, so that devices draw different numbers.
  With `first` (the global index of this device's first micro-batch), the
  key is instead folded with each micro-batch's global index.
  """
  args = list(args)
  extras = (function.bound_args, {**function.bound_kwargs, **kwargs})
  if axes is not None:
    args = [a if i in at.batch else cast_varying(a, axes) for i, a in enumerate(args)]
    extras = cast_varying(extras, axes)
    if at.rng is not None and first is None:
      args[at.rng] = fold_device(args[at.rng], axes)
    if at.state is not None:
      args[at.state] = jax.tree.map(
        lambda s: fold_device(s, axes) if is_typed_key(s) else s,
        args[at.state],
      )
  num_microbatches, split = cut
  return MicroInputs(
    args, extras, at, num_microbatches, split, 0 if first is None else first
  )


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
    hoisted: how many arrays the function closes over come first among the
      program's inputs (a lifted function: `Lift`), handed in by the loop.
  """

  closed: Any
  dynamic: list[bool]
  out_tree: Any
  out_shape: Any
  weight_shape: Any
  gathered: list[fsdp.Sharded | None]
  hoisted: int = 0

  def __call__(
    self,
    leaves: Sequence[Any],
    index: Any,
    scattered: Sequence[fsdp.Sharded | None] | None,
    weight: Any,
    consts: Sequence[Any] = (),
  ) -> tuple[Any, Any, list[jax.Array]]:
    """`(out, new_state, norms)` on one micro-batch's leaves.

    `scattered` says which outputs each micro-step reduce-scatters (FSDP),
    weighted by `weight` before the sum over devices; `norms` are their
    whole values' squared norms, in order, for the noise scale. `consts`:
    the `hoisted` arrays.
    """
    values = [*consts, *(x for x, d in zip(leaves, self.dynamic, strict=True) if d)]
    norms: list[jax.Array] = []
    if any(self.gathered) or scattered is not None:
      # Gathers tied to the iteration where nothing else ties them: XLA would
      # hoist a gather of a loop-invariant shard out of the loop, and keep it
      # whole throughout.
      outputs = list(scattered or [None] * len(self.closed.jaxpr.outvars))
      flat_out, norms = fsdp.evaluate(
        self.closed.jaxpr,
        self.closed.consts,
        values,
        self.gathered,
        outputs,
        weight,
        tie=index,
      )
    else:
      flat_out = jax.core.eval_jaxpr(self.closed.jaxpr, self.closed.consts, *values)
    out, state = jax.tree.unflatten(self.out_tree, flat_out)
    return out, state, norms


def closures_summed(closed: Any, batch: Any, axes: tuple[str, ...]) -> list[str]:
  """Closed-over arrays whose gradients JAX sums over `axes` in every micro-step.

  Only inside a `shard_map` that types device-varying values (the batch
  varies over `axes`): there a differentiated array that is the same on every
  device gets a psum in its backward pass, which jaccum would count again.
  Returns them as `dtype[shape]` strings (none: empty).
  """
  if not any(varying_axes(x) for x in jax.tree.leaves(batch)):
    return []  # pmap, or shard_map without type checks: no psum is inserted
  invariant = [
    f"{c.dtype}{list(c.shape)}"
    for c in closed.consts
    if isinstance(c, jax.Array)
    and jnp.issubdtype(c.dtype, jnp.inexact)
    and not set(axes) <= varying_axes(c)
  ]
  return invariant if invariant and rewrites.sums_over(closed.jaxpr, axes) else []


class Lift(NamedTuple):
  """How the per-device loop runs a function that cannot be traced inside it.

  Attributes:
    mesh: the mesh outside the loop's `shard_map`, to trace the function in
      where it fails inside (`retype.lift`, which raises `retype.Retrace`).
    outside: once lifted, the micro-step traced outside.
    consts: its closed-over arrays, as the `shard_map` hands them in.
  """

  mesh: Any
  outside: retype.Outside | None = None
  consts: Sequence[Any] = ()


def _traced(
  micro_step: Callable[..., Any], examples: Sequence[Any], lift: Lift | None
) -> tuple[Any, Any, int]:
  """`(program, (out_shape, state_shape), hoisted)` of the micro-step.

  With a `Lift`, a micro-step that fails inside is traced outside and the
  plan asked to trace again (`retype.Retrace`); then the program traced
  outside runs retyped, the function not traced again, its `hoisted`
  closed-over arrays the program's first inputs.
  """
  if lift is not None and lift.outside is not None:
    program = lift.outside.program

    def retyped(consts, *values):
      try:
        return program(consts)(*values)
      except Exception as error:
        mark_user_error(error)  # the user's program, retyped: fall back as for it
        raise

    consts = list(lift.consts)
    closed, shape = jax.make_jaxpr(retyped, return_shape=True)(consts, *examples)
    return closed, shape, len(consts)
  try:
    return *jax.make_jaxpr(micro_step, return_shape=True)(*examples), 0
  except Exception as error:
    if lift is None or not is_user_error(error):
      raise
    raise retype.Retrace(
      [retype.lift(micro_step, examples, lift.mesh, error)], error
    ) from error


def trace(
  function: Function,
  inputs: MicroInputs,
  state0: Any,
  weight_fn: Callable[..., Any] | None = None,
  sharded_params: Sequence[fsdp.Sharded | None] = (),
  lift: Lift | None = None,
) -> MicroStep:
  """Traces the function (and `weight_fn`) once on micro-batch 0's shapes.

  `sharded_params`, for `"shard_all"`: how each leaf of the params (argument
  0, the call's first leaves) arrives split over devices; the micro-step is
  traced on whole ones, as the user wrote it. `lift`: inside the per-device
  loop's `shard_map`, how to run a function that closes over arrays on the
  mesh (`retype`). The program is returned as traced: `rewritten` applies
  the plan's rewrites.
  """
  at = inputs.at
  flat, treedef = jax.tree.flatten((inputs.args_at(0, state0), inputs.extras))
  dynamic = [isinstance(x, ARRAY_TYPES) for x in flat]
  how = [*sharded_params, *[None] * (len(flat) - len(sharded_params))]
  examples = [
    x
    if h is None
    else jax.ShapeDtypeStruct(fsdp.whole_shape(np.shape(x), h), jnp.result_type(x))
    for x, h in zip(flat, how, strict=True)
  ]

  def unflatten(values):
    it = iter(values)
    full = [next(it) if d else x for x, d in zip(flat, dynamic, strict=True)]
    return jax.tree.unflatten(treedef, full)

  def micro_step(*values):
    step_args, (bound_args, all_kwargs) = unflatten(values)
    try:
      out = function.fn(*bound_args, *step_args, **all_kwargs)
    except Exception as error:
      mark_user_error(error)
      raise
    if at.state is None:
      return out, None
    return _check_state_output(out, step_args[at.state])

  dynamic_examples = [x for x, d in zip(examples, dynamic, strict=True) if d]
  closed, (out_shape, _), hoisted = _traced(micro_step, dynamic_examples, lift)
  weight_shape = None
  if weight_fn is not None:
    weight_shape = jax.eval_shape(
      lambda *values: call_weight(weight_fn, unflatten(values)[0]), *dynamic_examples
    )
  gathered: list[fsdp.Sharded | None] = [None] * hoisted
  gathered += [h for h, d in zip(how, dynamic, strict=True) if d]
  out_tree = jax.tree.structure((out_shape, None if at.state is None else state0))
  return MicroStep(
    closed, dynamic, out_tree, out_shape, weight_shape, gathered, hoisted
  )


def rewritten(step: MicroStep, rewrites: Sequence[Callable[[Any], Any]]) -> MicroStep:
  """`step` with its program passed through each rewrite in turn."""
  closed = step.closed
  for rewrite in rewrites:
    closed = rewrite(closed)
  return step._replace(closed=closed)


def call_weight(weight_fn: Callable[..., Any], args: Sequence[Any]) -> jax.Array:
  """`weight_fn(*args)` as an array, checked: a clear error if its signature
  cannot take the arguments, or it returns anything but a numeric scalar."""
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
  return jnp.asarray(check_weight(weight_fn(*args), "weight_fn must return"))

"""What one call's arguments say: positions, the count, which outputs are gradients.

The plan reads the call through these, once per trace: where the batch, the
key and the state sit (`positions`), the count of real micro-batches
(`check_count`), and which output leaves are gradients (`gradient_mask`,
told by `grad_leaves` or found, never guessed between two candidates).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jaccum._core import accumulators
from jaccum._core.microbatch import check_batch
from jaccum._core.rewrites import spec_axes
from jaccum._core.step import ARRAY_TYPES, Function, Positions

P = jax.sharding.PartitionSpec


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


def positions(
  batch_argnums: tuple[int, ...],
  rng_argnum: int | None,
  state_argnum: int | None,
  args: Sequence[Any],
  kwargs: dict[str, Any] | None = None,
) -> Positions:
  """Resolves (possibly negative) argnums against a call; checks they are sane."""
  num_args, kwargs = len(args), kwargs or {}
  batch = tuple(_normalize(i, num_args, "batch_argnums", kwargs) for i in batch_argnums)
  rng, state = (
    None if argnum is None else _normalize(argnum, num_args, name, kwargs)
    for argnum, name in ((rng_argnum, "rng_argnum"), (state_argnum, "state_argnum"))
  )
  for name, other in (("rng_argnum", rng), ("state_argnum", state)):
    if other is not None and other in batch:
      raise ValueError(
        f"{name}={other} is also in batch_argnums={batch_argnums}; the "
        "batch, the key and the state must be different arguments."
      )
  if rng is not None and rng == state:
    raise ValueError(f"rng_argnum and state_argnum are both {rng}.")
  check_no_stateful_graph_nodes(args, kwargs)
  if rng is not None and not is_key(args[rng]):
    got = getattr(args[rng], "aval", None) or type(args[rng]).__name__
    raise TypeError(
      f"rng_argnum={rng_argnum} must point at a PRNG key (jax.random.key "
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


def batch_hint(batch_argnums: tuple[int, ...], at: Positions) -> str:
  """Says which option made these arguments the batch, for batch errors."""
  names = ", ".join(f"args[{i}]" for i in at.batch)
  argnums = batch_argnums
  shown = argnums[0] if len(argnums) == 1 else argnums
  return (
    f" ({names} {'is' if len(at.batch) == 1 else 'are'} the batch because "
    f"batch_argnums={shown}{' (the default)' if argnums == (1,) else ''}; if the "
    f"batch is another argument, e.g. loss(batch, params), pass "
    f"batch_argnums=its position.)"
  )


def spec_of(x: Any) -> P | None:
  """The sharding of `x` if it is laid out over explicit mesh axes, else None."""
  if not isinstance(x, jax.Array):
    return None
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or not mesh.are_all_axes_explicit:
    return None
  return getattr(sharding, "spec", None)


def explicit_batch_axes(
  args: Sequence[Any], at: Positions
) -> tuple[Any, tuple[str, ...]] | None:
  """`(mesh, axes)` when a batch leaf is sharded on axis 0 over explicit mesh axes.

  Batch leaves that are replicated go along (they are resharded to the same
  axes); leaves sharded on axis 0 over different axes are an error.
  """
  found: dict[tuple[str, ...], str] = {}
  mesh = None
  for i in at.batch:
    for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
      spec = spec_of(leaf)
      if spec and spec[0] is not None:
        found.setdefault(spec_axes(spec[0]), f"args[{i}]{jax.tree_util.keystr(path)}")
        mesh = jax.typeof(leaf).sharding.mesh
  if len(found) > 1:
    raise ValueError(
      "batch leaves must be sharded on axis 0 over the same mesh axes, got "
      + ", ".join(f"{where} over {axes}" for axes, where in found.items())
      + "."
    )
  return (mesh, next(iter(found))) if found else None


def check_batch_size(
  num_microbatches: int,
  batch_argnums: tuple[int, ...],
  at: Positions,
  args: Sequence[Any],
) -> int:
  """The batch's rows, checked to split into K micro-batches (`batch_argnums`
  as given, for the message)."""
  return check_batch(
    [args[i] for i in at.batch],
    num_microbatches,
    names=[f"args[{i}]" for i in at.batch],
    hint=batch_hint(batch_argnums, at),
  )


def check_count(num_real: Any, num_microbatches: int, per_device: int = 0) -> Any:
  """The count of real micro-batches, checked: an int in [0, K], or a traced one.

  A concrete int (Python, NumPy or a JAX array outside `jit`) outside [0, K]
  is an error now; a traced count (any count under `jit`) is clamped to
  [0, K] when it runs, in its own integer type (an int64 count above 2³¹ is
  K, not wrapped to int32 first). With `per_device` devices
  (`data_parallel`) it may also be one count per device, shape `[devices]`.
  """
  shape = np.shape(num_real)
  dtype = jnp.result_type(num_real)
  if not jnp.issubdtype(dtype, jnp.integer) or isinstance(num_real, bool):
    raise TypeError(
      f"num_real_microbatches must be an int (traced or not), got {dtype} "
      f"{num_real!r:.60}."
    )
  if shape not in ((),) + (((per_device,),) if per_device else ()):
    allowed = "a scalar" + (
      f" or one per device, shape ({per_device},)" if per_device else ""
    )
    raise ValueError(f"num_real_microbatches must be {allowed}, got shape {shape}.")
  if not isinstance(num_real, jax.core.Tracer):
    values = np.asarray(num_real)
    if values.min() < 0 or values.max() > num_microbatches:
      raise ValueError(
        f"num_real_microbatches={num_real!r} must be in [0, "
        f"num_microbatches={num_microbatches}]: the batch holds "
        f"{num_microbatches} micro-batches (its capacity), of which the first "
        "num_real_microbatches run."
      )
  clamped = jnp.clip(jnp.asarray(num_real), 0, num_microbatches)
  return clamped.astype(jnp.int32)


def check_axes_bound(axes: tuple[str, ...]) -> int:
  """The number of devices over `axes`, or a clear error outside shard_map/pmap."""
  try:
    return jax.lax.axis_size(axes)
  except NameError:
    named = axes[0] if len(axes) == 1 else axes
    raise ValueError(
      f"axis_name={named!r} is not bound here: "
      "accumulate(..., axis_name=...) runs inside jax.shard_map or jax.pmap over "
      "that axis. Under plain jit with a sharded batch, use "
      "jaccum.data_parallel(grad_fn, K, mesh=mesh)."
    ) from None


def output_shapes_at(
  function: Function,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  rows: int,
) -> Any:
  """The shapes of `grad_fn`'s output on a micro-batch of `rows` rows.

  Abstract (nothing runs): it tells per-example outputs, whose leading size
  follows the rows, from values that only happen to have that size.
  """
  call = list(args)
  for i in at.batch:
    call[i] = jax.tree.map(
      lambda x: (
        jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype)
        if isinstance(x, ARRAY_TYPES)
        else x
      ),
      args[i],
    )
  flat, treedef = jax.tree.flatten((call, kwargs))
  dynamic = [isinstance(x, (*ARRAY_TYPES, jax.ShapeDtypeStruct)) for x in flat]

  def micro_step(*values):
    it = iter(values)
    full = [next(it) if d else x for x, d in zip(flat, dynamic, strict=True)]
    step_args, step_kwargs = jax.tree.unflatten(treedef, full)
    out = function.fn(
      *function.bound_args, *step_args, **{**function.bound_kwargs, **step_kwargs}
    )
    return out[0] if at.state is not None else out

  return jax.eval_shape(
    micro_step, *(x for x, d in zip(flat, dynamic, strict=True) if d)
  )


def params_of(bound_args: Sequence[Any], at: Positions, args: Sequence[Any]) -> Any:
  """What the gradients are taken of, by default: the first non-batch argument."""
  skip = {*at.batch, at.rng, at.state}
  rest = [*bound_args, *(a for i, a in enumerate(args) if i not in skip)]
  return rest[0] if rest else None


def gradient_mask(
  out_shape: Any,
  params: Any,
  grad_leaves: Any,
  accs: Any,
  needed_by: str | None = None,
) -> Any:
  """A tree of bools like `out_shape`, True on the gradient leaves.

  With `grad_leaves` (a bool prefix of the output) it says so. Otherwise the
  gradient is the whole output (`jax.grad`), or the one of its two elements
  (`value_and_grad`: the second; `grad(has_aux=True)`: the first) that has
  the structure and shapes of `params` and is averaged or summed by its
  accumulators `accs` (a per-parameter maximum shaped like the params is not a
  gradient). When both elements could be (an aux shaped like the params, the
  loss beside the gradient of a scalar param), it never guesses: with
  `needed_by` (what needs the gradients, e.g. "return_stats=True") that is
  an error asking for `grad_leaves`, else no leaf is marked; likewise when
  nothing is found.
  """
  if grad_leaves is not None:
    try:
      mask = jax.tree.broadcast(grad_leaves, out_shape)
    except ValueError as e:
      raise ValueError(
        f"grad_leaves={grad_leaves!r} must be a bool or a pytree prefix of "
        f"grad_fn's output, whose structure is {jax.tree.structure(out_shape)}. "
        f"({e})"
      ) from None
    if needed_by and not any(jax.tree.leaves(mask)):
      raise ValueError(
        f"grad_leaves={grad_leaves!r} marks no output leaf as a gradient, but "
        f"{needed_by} needs the gradients: mark them True, e.g. "
        "grad_leaves=(False, True) for value_and_grad's (loss, grads)."
      )
    return mask
  modes = jax.tree.map(lambda a: a.mode, accs, is_leaf=accumulators.is_accumulator)
  mask = jax.tree.map(lambda _: False, out_shape)
  layouts = []
  if params is not None:
    # The gradients have the params' structure (jax.grad), or that structure
    # with None wherever the params hold no floating array (Equinox's
    # filter_grad: its models hold functions and modules as leaves).
    differentiable = jax.tree.map(
      lambda p: (
        p
        if isinstance(p, (*ARRAY_TYPES, jax.ShapeDtypeStruct))
        and jnp.issubdtype(p.dtype, jnp.inexact)
        else None
      ),
      params,
    )
    layouts = [
      (jax.tree.structure(tree), [np.shape(p) for p in jax.tree.leaves(tree)])
      for tree in (params, differentiable)
      if all(
        isinstance(p, (*ARRAY_TYPES, jax.ShapeDtypeStruct, int, float))
        for p in jax.tree.leaves(tree)
      )
    ]

  def is_gradient(node, node_modes):
    leaves, treedef = jax.tree.flatten(node)
    return (treedef, [leaf.shape for leaf in leaves]) in layouts and all(
      m in ("mean", "sum", "float0") for m in jax.tree.leaves(node_modes)
    )

  if is_gradient(out_shape, modes):
    return jax.tree.map(lambda _: True, out_shape)
  hits = []
  if isinstance(out_shape, tuple | list) and len(out_shape) == 2:
    hits = [i for i in (0, 1) if is_gradient(out_shape[i], modes[i])]
  if len(hits) == 1:
    parts = [
      jax.tree.map(lambda _, hit=j == hits[0]: hit, part)
      for j, part in enumerate(out_shape)
    ]
    return type(out_shape)(parts)
  if needed_by is None:
    return mask
  where = (
    "both the first and the second element of grad_fn's output have"
    if hits
    else "none of grad_fn's output, its first or its second element has"
  )
  raise ValueError(
    f"{needed_by} needs to know which outputs are gradients, and {where} the "
    f"structure and shapes of the params (the first non-batch argument, "
    f"{jax.tree.structure(params)}), so jaccum will not guess. Mark them with "
    "grad_leaves, a bool or a pytree prefix of the output: e.g. "
    "grad_leaves=(True, False) for jax.grad(loss, has_aux=True)'s (grads, aux), "
    "grad_leaves=(False, True) for value_and_grad's (loss, grads)."
  )


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

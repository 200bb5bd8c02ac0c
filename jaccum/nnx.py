"""Flax NNX integration: accumulated `nnx.value_and_grad` and `nnx.grad`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

try:
  from flax import nnx
except ModuleNotFoundError as e:  # Flax is an optional dependency of jaccum.
  if e.name != "flax":
    raise
  raise ImportError('jaccum.nnx needs Flax: pip install "jaccum[flax]"') from e

from jaccum._core.rewrites import spec_axes
from jaccum._core.step import Function
from jaccum._routes import options as options_lib
from jaccum._routes import placement, plan, private, rules, wrappers
from jaccum._routes.accumulate import FsdpMode

__all__ = ["dp_value_and_grad", "grad", "value_and_grad"]

P = jax.sharding.PartitionSpec


def _split_loss(out: Any, has_aux: bool) -> tuple[Any, Any]:
  """Returns `(loss, aux)` from `loss_fn`'s output, or raises saying what is wrong."""
  if has_aux and (not isinstance(out, tuple | list) or len(out) != 2):
    raise TypeError(
      "with has_aux=True, loss_fn must return (loss, aux), got "
      f"{type(out).__name__} {jax.tree.structure(out)}."
    )
  if not has_aux and isinstance(out, tuple | list):
    raise TypeError(
      f"loss_fn returned a {type(out).__name__} of {len(out)}, not a scalar loss; "
      "if it returns (loss, aux), pass has_aux=True."
    )
  loss, aux = out if has_aux else (out, None)
  shape, dtype = getattr(loss, "shape", None), getattr(loss, "dtype", None)
  if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    got = type(loss).__name__ if shape is None else f"shape {shape} {dtype}"
    raise TypeError(
      f"loss_fn must return a floating scalar loss of shape (), got {got} on a "
      "micro-batch; reduce it, e.g. `.mean()`."
    )
  return loss, aux


def _check_no_shared_variables(named_nodes: list[tuple[str, Any]]) -> None:
  """Refuses graph nodes that hold the same variables (as `nnx.grad` does).

  An `nnx.Rngs` the model holds, or a submodule of the model, passed again as
  an argument would be split, threaded and written back as two copies: the
  same keys drawn twice, a gradient lost through one of them.
  """
  owner: dict[int, tuple[str, str]] = {}
  for name, node in named_nodes:
    for path, value in nnx.graph.iter_graph(node):
      if not isinstance(value, nnx.Variable):
        continue
      where = "/".join(map(str, path))
      first = owner.setdefault(id(value), (name, where))
      if first[0] != name:
        raise ValueError(
          f"{name} shares variables with {first[0]} ({type(value).__name__} at "
          f"{name}: {where!r} is {first[0]}: {first[1]!r}): jaccum.nnx threads "
          "each graph node's state through the micro-batches separately, so a "
          "shared variable would advance twice, as two copies (nnx.grad refuses "
          "this too: 'Inconsistent aliasing'). Pass it once: through the model "
          "(and use model.rngs, model.submodule in loss_fn), or as an argument "
          "the model does not hold."
        )


def _refuse_threaded_for_deterministic(states: Sequence[Any]) -> None:
  """`deterministic=True` × variables that would thread: named, not `state_argnum`.

  `accumulate` would refuse the state it is handed at a position the user
  never passed; the variables' paths say what to change.
  """
  found = [
    f"{'/'.join(map(str, path))} ({type(variable).__name__})"
    for state in states
    for path, variable in nnx.to_flat_state(state)
    if jax.tree.leaves(variable)
  ]
  rules.check("nnx", found)


class _Mesh(NamedTuple):
  """`data_parallel`'s options, when `f` runs on a mesh (None: as `accumulate`)."""

  mesh: Any
  axis: str | tuple[str, ...]
  param_specs: Any
  fsdp_mode: str


def _on_mesh(mesh: Any, axis: Any, param_specs: Any, fsdp_mode: str) -> _Mesh | None:
  """`data_parallel`'s route when any of its options is given, else None."""
  if mesh is None and param_specs is None and fsdp_mode == "gather_once":
    return None
  return _Mesh(mesh, axis, param_specs, fsdp_mode)


def _specs_of(params: Any) -> Any:
  """Each param's `PartitionSpec`, from its sharding metadata (`with_partitioning`).

  Variables without it are replicated (`P()`).
  """

  def spec(variable: Any) -> P:
    metadata = variable.get_metadata()
    sharding = metadata.get("out_sharding", metadata.get("sharding"))
    if isinstance(sharding, jax.sharding.NamedSharding):
      return sharding.spec
    if isinstance(sharding, P):
      return sharding
    if isinstance(sharding, tuple | list):
      return P(*sharding)
    return P()

  return jax.tree.map(spec, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _warn_unsplit_axes(params: Any) -> None:
  """Warns when the variables name mesh axes and `mesh=` is left out.

  The mesh is the one their sharding metadata holds, else the one
  `jax.set_mesh` set (metadata that names axes only).
  """
  named, meshes = set(), []
  for variable in jax.tree.leaves(
    params, is_leaf=lambda x: isinstance(x, nnx.Variable)
  ):
    if not isinstance(variable, nnx.Variable):
      continue
    metadata = variable.get_metadata()
    sharding = metadata.get("out_sharding", metadata.get("sharding"))
    if isinstance(sharding, jax.sharding.NamedSharding):
      meshes.append(sharding.mesh)
    elif metadata.get("mesh") is not None:
      meshes.append(metadata["mesh"])
  for spec in jax.tree.leaves(_specs_of(params), is_leaf=lambda x: isinstance(x, P)):
    named.update(a for entry in spec for a in spec_axes(entry))
  mesh = meshes[0] if meshes else jax.sharding.get_abstract_mesh()
  placement.warn_unsplit_axes("jaccum.nnx", named, mesh)


def _checked_options(accumulate_kwargs: dict[str, Any]) -> dict[str, Any]:
  """`accumulate`'s options as jaccum.nnx takes them, or an error naming one."""
  options = dict(accumulate_kwargs)
  for name in ("state_argnum", "grad_leaves"):
    if name in options:
      raise TypeError(
        f"{name} is not an option of jaccum.nnx: the model's non-parameter state "
        "(BatchNorm statistics, nnx.Rngs counts) is threaded and its gradients "
        "are located already."
      )
  for name in ("batch_argnums", "rng_argnum"):
    nums = options.get(name)
    if nums == 0 or (isinstance(nums, Sequence) and 0 in nums):
      raise ValueError(f"{name}={nums!r} must not include 0, the model's position.")
  if (weight_fn := options.get("weight_fn")) is not None and not callable(weight_fn):
    raise TypeError(f"weight_fn must be callable or None, got {weight_fn!r}.")
  return options


class _Call(NamedTuple):
  """One call's arguments, sorted: graph nodes out, positions resolved.

  Positions count as in the user's call `f(model, *args)`, the model at 0:
  `node_at` are the graph nodes among `args` (threaded like the model's
  state, their slots None), `batch` the batch argnums, `key` the key's.
  """

  args: list[Any]
  kwargs: dict[str, Any]
  node_at: list[int]
  nodes: tuple[list[Any], dict[str, Any]]
  batch: tuple[int, ...]
  key: int | None


def _sorted_call(
  model: Any, args: Sequence[Any], kwargs: dict[str, Any], options: dict[str, Any]
) -> _Call:
  if not isinstance(model, nnx.Module):
    raise TypeError(
      "the first argument must be the nnx.Module to differentiate, "
      f"loss_fn(model, *batch), got {type(model).__name__}."
    )
  if not args:
    raise ValueError("called with the model only; pass the batch after it.")
  node_at = [i for i, a in enumerate(args, start=1) if nnx.graph.is_graph_node(a)]
  node_kw = [k for k, v in kwargs.items() if nnx.graph.is_graph_node(v)]
  _check_no_shared_variables(
    [("the model", model)]
    + [(f"args[{i}]", args[i - 1]) for i in node_at]
    + [(f"{k}=", kwargs[k]) for k in node_kw]
  )
  size = len(args) + 1
  rng_argnum = options.get("rng_argnum")
  key = None if rng_argnum is None else rng_argnum % size
  given = options.get("batch_argnums")
  if given is None:
    batch = tuple(i for i in range(1, size) if i != key and i not in node_at)
  else:
    batch = (given,) if isinstance(given, int) else tuple(given)
  for i in batch:
    slot = i % size if -size <= i < size else None
    if slot == 0 or slot in node_at:
      what = "the model's" if slot == 0 else f"the {type(args[slot - 1]).__name__}'s"
      raise ValueError(
        f"batch_argnums={given!r} resolves to position {slot}, {what}, in the "
        f"call f(model, *args) with {len(args)} arguments after the model; "
        "count the batch's positions from the model at 0."
      )
  # Resolved to positive positions: the state is appended after the arguments.
  batch = tuple(i % size if -size <= i < size else i for i in batch)
  return _Call(
    [None if i in node_at else a for i, a in enumerate(args, start=1)],
    {k: v for k, v in kwargs.items() if k not in node_kw},
    node_at,
    ([args[i - 1] for i in node_at], {k: kwargs[k] for k in node_kw}),
    batch,
    key,
  )


def _warn_per_example_aux(
  aux: Any, out: Any, reduce: Any, return_value: bool, rows: int
) -> None:
  try:
    modes = jax.tree.broadcast(reduce, out)
  except ValueError:
    return  # accumulate names the bad reduce tree
  wrappers.warn_averaged_rows(
    aux,
    modes[0][1] if return_value else modes[1],
    rows,
    'e.g. reduce=(("mean", "concat"), "mean") for value_and_grad('
    "has_aux=True) returning (loss, logits)",
  )


def _micro_step(
  loss_fn: Callable[..., Any],
  has_aux: bool,
  return_value: bool,
  wrt: Any,
  graphdef: Any,
  nodes_def: Any,
  call: _Call,
  reduce: Any,
) -> Callable[..., Any]:
  """`step(params, *args, state)`: one micro-batch's nnx value and gradients.

  The params come first (FSDP shards argument 0) and the threaded state
  `(other, rest, nodes_state)` last, so the arguments in between keep the
  positions they have in the user's call.
  """

  def step(params, *args_and_state, **kwargs):
    *args, (other, rest, nodes_state) = args_and_state

    def loss_of(params, other):
      # Fresh variables (copy=True) belong to this trace, so BatchNorm and
      # nnx.Rngs may update them.
      module = nnx.merge(graphdef, params, other, rest, copy=True)
      node_args, node_kwargs = nnx.merge(nodes_def, nodes_state, copy=True)
      it = iter(node_args)
      full_args = [
        next(it) if a is None and i in call.node_at else a
        for i, a in enumerate(args, start=1)
      ]
      loss, aux = _split_loss(
        loss_fn(module, *full_args, **kwargs, **node_kwargs), has_aux
      )
      _, _, new_other, new_rest = nnx.split(module, nnx.All(wrt, nnx.Param), wrt, ...)
      _, new_nodes = nnx.split((node_args, node_kwargs))
      new_state = (new_other, new_rest, new_nodes)
      state = (other, rest, nodes_state)
      if jax.tree.structure(new_state) != jax.tree.structure(state):
        raise TypeError(
          "loss_fn must not add or remove model variables (e.g. with sow): "
          "their state is carried from micro-batch to micro-batch; before "
          f"{jax.tree.structure(state)}, after {jax.tree.structure(new_state)}."
        )
      return loss, (aux, new_state)

    grad_fn = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)
    (loss, (aux, new_state)), (param_grads, other_grads) = grad_fn(params, other)
    grads = nnx.merge_state(param_grads, other_grads)
    # nnx's output structure, so a `reduce` tree reads the same.
    if return_value:
      out = ((loss, aux), grads) if has_aux else (loss, grads)
    else:
      out = (grads, aux) if has_aux else grads
    if has_aux:
      rows = next(
        (jnp.shape(x)[0] for i in call.batch for x in jax.tree.leaves(args[i - 1])), 0
      )
      _warn_per_example_aux(aux, out, reduce, return_value, rows)
    return out, new_state

  return step


def _options(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  options: dict[str, Any],
  grad_leaves: Any,
) -> options_lib.Options:
  """`accumulate`'s options as every call of the wrapper uses them, checked once.

  The positions (the batch, the key, the threaded state) depend on each
  call's arguments and are set per call.
  """
  options = dict(options)
  if (weight_fn := options.get("weight_fn")) is not None:
    # The user's weight_fn sees the micro-batch: not the params, the graph
    # nodes or the state.
    options["weight_fn"] = lambda params, *args: weight_fn(
      *(a for a in args[:-1] if a is not None)
    )
  options.pop("batch_argnums", None)
  options.pop("rng_argnum", None)
  return options_lib.make(
    loss_fn, num_microbatches, state_argnum=0, grad_leaves=grad_leaves, **options
  )


def _with_specs(on_mesh: _Mesh | None, params: Any) -> options_lib.Mesh | None:
  """The mesh route with each param's spec: given, or its sharding metadata's."""
  if on_mesh is None:
    return None
  if on_mesh.param_specs is None:
    on_mesh = on_mesh._replace(param_specs=_specs_of(params))
  return options_lib.on_mesh(
    on_mesh.mesh, on_mesh.axis, on_mesh.param_specs, on_mesh.fsdp_mode, {}
  )


def _transform(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  has_aux: bool,
  return_value: bool,
  wrt: Any,
  on_mesh: _Mesh | None,
  accumulate_kwargs: dict[str, Any],
) -> Callable[..., Any]:
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}.")
  options = _checked_options(accumulate_kwargs)
  # The gradients' place in nnx's output structure, for FSDP and the stats.
  if return_value:
    grad_leaves = ((False, False), True) if has_aux else (False, True)
  else:
    grad_leaves = (True, False) if has_aux else True
  base = _options(loss_fn, num_microbatches, options, grad_leaves)
  if on_mesh is not None:  # checked now rather than at the first call
    options_lib.on_mesh(on_mesh.mesh, on_mesh.axis, None, on_mesh.fsdp_mode, {})

  def accumulated(model: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    call = _sorted_call(model, args, kwargs, options)
    graphdef, params, other, rest = nnx.split(model, nnx.All(wrt, nnx.Param), wrt, ...)
    if not jax.tree.leaves((params, other)):
      raise ValueError(f"the model holds no variables matching wrt={wrt!r}.")
    nodes_def, nodes_state = nnx.split(call.nodes)
    if on_mesh is None and base.axis_name is None:
      _warn_unsplit_axes(params)
    if base.deterministic:
      _refuse_threaded_for_deterministic([other, rest, nodes_state])
    step = _micro_step(
      loss_fn, has_aux, return_value, wrt, graphdef, nodes_def, call, base.reduce
    )
    this = base.replace(
      function=Function(step),
      batch_argnums=call.batch,
      rng_argnum=call.key,
      state_argnum=len(call.args) + 1,
      on_mesh=_with_specs(on_mesh, params),
    )
    arguments = (params, *call.args, (other, rest, nodes_state))
    result = plan.run(this, plan.Call(arguments, call.kwargs))
    stats = None
    if base.return_stats:
      result, stats = result
    out, (new_other, new_rest, new_nodes) = result
    nnx.update(model, new_other, new_rest)
    nnx.update(call.nodes, new_nodes)
    return out if stats is None else (out, stats)

  return accumulated


def value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  has_aux: bool = False,
  wrt: Any = nnx.Param,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  axis: str | tuple[str, ...] = "data",
  param_specs: Any = None,
  fsdp_mode: FsdpMode = "gather_once",
  **accumulate_kwargs: Any,
) -> Callable[..., Any]:
  """Accumulated `nnx.value_and_grad`: `f(model, *batch)` over K micro-batches.

  Splits the model into the variables in `wrt` and the rest, runs `loss_fn`
  on each micro-batch with `jaccum.accumulate`, and returns what
  `nnx.value_and_grad(loss_fn, has_aux=has_aux)(model, *batch)` returns:
  `(loss, grads)` or `((loss, aux), grads)`, with `grads` an `nnx.State` of
  the `wrt` variables that `nnx.Optimizer.update(model, grads)` takes. The
  rest of the model's state, and the state of any graph node passed as an
  argument (an `nnx.Rngs`, positional or keyword, as Flax's MNIST tutorial
  does), is threaded through the micro-batches in order and written back:
  BatchNorm statistics end as after K sequential forward passes, and
  `nnx.Rngs` counts advance, so each micro-batch draws fresh dropout masks.
  `wrt` variables that the model updates itself (`nnx.BatchStat` in `wrt`)
  are both differentiated and threaded, as `nnx.grad` does. `loss_fn` must
  not add variables (`sow`). Works with or without `nnx.jit`, and on a batch
  sharded over an explicit mesh (see `jaccum.accumulate`); the params reach
  every micro-step as an argument, so inside `shard_map` with `axis_name`
  their gradients are not summed per micro-batch. On many devices under
  `nnx.jit`, pass `mesh=` (as Flax's miniGPT tutorial builds it): the model
  as it is, its variables sharded as their metadata says.

  An `aux` leaf that holds one row per example is averaged over micro-batches
  by default, which is rarely what is wanted: a warning names it. Keep its
  rows with a `reduce` tree, e.g. `reduce=(("mean", "concat"), "mean")` for
  `((loss, logits), grads)`.

  Args:
    loss_fn: `loss_fn(model, *batch, **kwargs) -> loss` (or `(loss, aux)`),
      with `loss` a float scalar, e.g. a mean over the examples.
    num_microbatches: the number of micro-batches K; it divides the batch.
    has_aux: whether `loss_fn` returns `(loss, aux)`; `aux` is reduced like
      the loss (`"mean"` unless `reduce` says otherwise).
    wrt: an nnx filter of the variables to differentiate, as in
      `nnx.Optimizer(model, tx, wrt=...)`.
    mesh: run on this mesh as `jaccum.data_parallel` does: each device over
      its own rows of the batch, nothing communicated over `axis` inside
      the loop, one reduction after it (None: as `jaccum.accumulate` does,
      or on the mesh `jax.set_mesh` set if `param_specs` or `fsdp_mode` is
      given). Left out while the variables' sharding metadata names mesh
      axes and an auto axis of the mesh is named by none (likely the
      batch's: XLA would all-reduce over it in every micro-step), a warning
      names that axis.
    axis: the mesh axis (or axes) the batch is split over; defaults to
      `"data"`: pass it when your mesh names its batch axis otherwise (e.g.
      `axis="batch"`).
    param_specs: a `PartitionSpec` per `wrt` variable (a prefix of the
      `nnx.State` of them); None reads each variable's sharding metadata
      (`nnx.with_partitioning`), `P()` where it has none. Entries naming
      `axis` shard a variable as FSDP; other axes (tensor parallel) are kept,
      never gathered.
    fsdp_mode: `"gather_once"`, `"shard_grads"` or `"shard_all"`, as for
      `jaccum.data_parallel`.
    **accumulate_kwargs: passed to `jaccum.accumulate`. Argument numbers
      count as in the call `f(model, *batch)`, the model being 0:
      `batch_argnums` defaults to every positional argument after the model
      but `rng_argnum` (a key each micro-batch gets its own fold of) and graph
      nodes; keyword arguments go whole to every micro-batch.
      `weight_fn(*micro_batch)` receives the positional arguments after the
      model but graph nodes, cut to one micro-batch, and returns its weight,
      e.g. its number of real tokens for a per-token-mean loss. `reduce` is a
      string or a prefix of the output structure above. `return_stats=True`
      adds the gradient noise scale of `grads` (`jaccum.AccumulationStats`).

  Returns:
    A function `f(model, *batch, **kwargs)` returning `(value, grads)`, or
    `((value, grads), stats)` with `return_stats`.

  Raises:
    TypeError: the first argument is not an `nnx.Module`, `loss_fn` returns
      something other than a float scalar (or `(loss, aux)` with `has_aux`),
      or an option is not one of `jaccum.accumulate`'s.
    ValueError: the batch does not split into K micro-batches, or nothing in
      the model matches `wrt`.

  Examples:
    >>> import jax.numpy as jnp, optax, jaccum.nnx
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> def loss_fn(model, x, y):
    ...   return jnp.mean((model(x)[:, 0] - y) ** 2)
    >>> x, y = jnp.arange(24.0).reshape(8, 3) / 10, jnp.arange(8.0)
    >>> loss, grads = jaccum.nnx.value_and_grad(loss_fn, 4)(model, x, y)
    >>> whole_loss, whole_grads = nnx.value_and_grad(loss_fn)(model, x, y)
    >>> bool(jnp.allclose(grads["kernel"][...], whole_grads["kernel"][...]))
    True
    >>> @nnx.jit
    ... def train_step(model, optimizer, x, y):
    ...   loss, grads = jaccum.nnx.value_and_grad(loss_fn, 4)(model, x, y)
    ...   optimizer.update(model, grads)
    ...   return loss
    >>> losses = [float(train_step(model, optimizer, x, y)) for _ in range(3)]
    >>> losses[2] < losses[0]
    True
  """
  on_mesh = _on_mesh(mesh, axis, param_specs, fsdp_mode)
  return _transform(
    loss_fn, num_microbatches, has_aux, True, wrt, on_mesh, accumulate_kwargs
  )


def grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  has_aux: bool = False,
  wrt: Any = nnx.Param,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  axis: str | tuple[str, ...] = "data",
  param_specs: Any = None,
  fsdp_mode: FsdpMode = "gather_once",
  **accumulate_kwargs: Any,
) -> Callable[..., Any]:
  """Accumulated `nnx.grad`: like `value_and_grad`, returning `grads` only.

  Returns `grads`, or `(grads, aux)` with `has_aux`, as `nnx.grad` does; the
  arguments, state threading and errors are those of `value_and_grad`.

  Examples:
    >>> import jax.numpy as jnp, jaccum.nnx
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
    >>> x = jnp.arange(12.0).reshape(6, 2)
    >>> grads = jaccum.nnx.grad(loss_fn, 3)(model, x)
    >>> bool(jnp.allclose(grads["bias"][...], nnx.grad(loss_fn)(model, x)["bias"][...]))
    True
  """
  on_mesh = _on_mesh(mesh, axis, param_specs, fsdp_mode)
  return _transform(
    loss_fn, num_microbatches, has_aux, False, wrt, on_mesh, accumulate_kwargs
  )


def _params_alone(model: nnx.Module, wrt: Any) -> tuple[Any, Any, Any]:
  """`(graphdef, params, rest)`, refusing variables outside `wrt` that hold arrays.

  Such variables change as the model runs (BatchNorm statistics, nnx.Rngs
  counts): threaded through the examples, they would couple them.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(
      "the first argument must be the nnx.Module to differentiate, "
      f"loss_fn(model, *batch), got {type(model).__name__}."
    )
  graphdef, params, rest = nnx.split(model, wrt, ...)
  found = [
    f"{'/'.join(map(str, path))} ({type(variable).__name__})"
    for path, variable in nnx.to_flat_state(rest)
    if jax.tree.leaves(variable)
  ]
  if found:
    raise ValueError(
      f"jaccum.nnx.dp_value_and_grad takes a model of parameters alone, but it "
      f"holds other variables: {', '.join(found)}. Batch statistics "
      f"(BatchNorm) mix the examples of a batch, so that no example's gradient "
      f"is its own and clipping it bounds nothing; a stateful nnx.Rngs would be "
      f"threaded through the examples. Use a per-example normalisation "
      f"(LayerNorm, GroupNorm) and draw dropout from a key passed as an "
      f"argument (rng_argnum)."
    )
  if not jax.tree.leaves(params):
    raise ValueError(f"the model holds no variables matching wrt={wrt!r}.")
  return graphdef, params, rest


def dp_value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  l2_clip_norm: float,
  noise_multiplier: float,
  normalize_by: float | None = None,
  norms: str = "auto",
  return_norms: bool = False,
  wrt: Any = nnx.Param,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  axis: str | tuple[str, ...] = "data",
  param_specs: Any = None,
  fsdp_mode: FsdpMode = "gather_once",
  **accumulate_kwargs: Any,
) -> Callable[..., Any]:
  """`jaccum.dp_value_and_grad` for an NNX model: `f(model, *batch)`.

  `loss_fn(model, *batch, **kwargs)` returns one loss per example (shape
  `[rows]`); the model holds parameters alone (the `wrt` variables): a
  variable that changes as the model runs (BatchNorm statistics, an
  `nnx.Rngs`) is refused by name, since it couples the examples. Every
  positional argument after the model is the batch unless `batch_argnums`
  says otherwise (counted from the model at 0). The meaning of the result,
  the options and the errors are those of `jaccum.dp_value_and_grad`;
  `mesh`, `axis`, `param_specs` and `fsdp_mode` are those of
  `jaccum.nnx.value_and_grad`.

  Args:
    loss_fn: `loss_fn(model, *batch, **kwargs) -> [rows]`.
    num_microbatches: K.
    l2_clip_norm: C > 0.
    noise_multiplier: σ >= 0.
    normalize_by: the noised sum is divided by it (None: the rows given).
    norms: `"auto"` or `"vmap"`.
    return_norms: also return each example's gradient norm.
    wrt: an nnx filter of the parameters.
    mesh: run as `jaccum.data_parallel` on this mesh.
    axis: the mesh axis (or axes) the batch is split over.
    param_specs: `PartitionSpec`s of the `wrt` variables (None: their
      sharding metadata).
    fsdp_mode: as for `jaccum.data_parallel`.
    **accumulate_kwargs: `jaccum.dp_value_and_grad`'s other options.

  Returns:
    `f(model, *batch, noise_key=None, example_mask=None,
    num_real_microbatches=None, **kwargs) -> (loss, grads)` (or `(loss,
    grads, norms)`), `grads` an `nnx.State` of the `wrt` variables, as
    `nnx.Optimizer.update(model, grads)` takes it.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaccum.nnx
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> def loss_fn(model, x, y):  # one loss per example
    ...   return (model(x)[:, 0] - y) ** 2
    >>> x, y = jnp.arange(24.0).reshape(8, 3) / 10, jnp.arange(8.0)
    >>> step = jaccum.nnx.dp_value_and_grad(
    ...   loss_fn, 4, l2_clip_norm=1.0, noise_multiplier=1.0)
    >>> loss, grads = step(model, x, y, noise_key=jax.random.key(0))
    >>> grads["kernel"][...].shape
    (3, 1)
  """
  on_mesh = _on_mesh(mesh, axis, param_specs, fsdp_mode)
  given = accumulate_kwargs.pop("batch_argnums", None)
  base = private.make_options(
    loss_fn,
    num_microbatches,
    l2_clip_norm=l2_clip_norm,
    noise_multiplier=noise_multiplier,
    normalize_by=normalize_by,
    batch_argnums=1 if given is None else given,
    norms=norms,
    return_norms=return_norms,
    options=dict(accumulate_kwargs),
  )
  if on_mesh is not None:  # checked now rather than at the first call
    options_lib.on_mesh(on_mesh.mesh, on_mesh.axis, None, on_mesh.fsdp_mode, {})

  def step(
    model: nnx.Module,
    *args: Any,
    noise_key: Any = None,
    example_mask: Any = None,
    num_real_microbatches: Any = None,
    **kwargs: Any,
  ) -> Any:
    graphdef, params, rest = _params_alone(model, wrt)
    nodes = [
      type(a).__name__ for a in (*args, *kwargs.values()) if nnx.graph.is_graph_node(a)
    ]
    if nodes:
      raise ValueError(
        f"jaccum.nnx.dp_value_and_grad takes arrays after the model, got graph "
        f"nodes ({', '.join(nodes)}): their state would be threaded through the "
        f"examples. Pass a key for dropout (rng_argnum) instead of nnx.Rngs."
      )
    if not args:
      raise ValueError("called with the model only; pass the batch after it.")

    def pure_loss(params, *args, **kwargs):
      return loss_fn(nnx.merge(graphdef, params, rest, copy=True), *args, **kwargs)

    batch = (
      tuple(range(1, len(args) + 1)) if given is None else base.accumulate.batch_argnums
    )
    if given is None and base.accumulate.rng_argnum is not None:
      batch = tuple(
        i for i in batch if i != base.accumulate.rng_argnum % (len(args) + 1)
      )
    this = base.replace(
      clipping=base.clipping._replace(loss_fn=pure_loss),
      accumulate=base.accumulate.replace(
        batch_argnums=batch, on_mesh=_with_specs(on_mesh, params)
      ),
    )
    return private.run(
      this, (params, *args), kwargs, noise_key, example_mask, num_real_microbatches
    )

  return step

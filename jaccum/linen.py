"""Flax Linen integration: an accumulated `jax.value_and_grad` for Linen train steps."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.core
import jax.numpy as jnp

from jaccum._core.rewrites import spec_axes
from jaccum._core.step import Function
from jaccum._routes import options as options_lib
from jaccum._routes import placement, plan, rules, wrappers
from jaccum._routes.accumulate import FsdpMode

__all__ = ["value_and_grad"]

# Fixed by the call f(params, batch_stats, batch[, rng]), so not options here.
_FIXED = ("batch_argnums", "rng_argnum", "state_argnum", "grad_leaves")


def _is_stats_slot(node: Any, batch_stats: Any) -> bool:
  """Whether `node` holds the new `batch_stats`: bare, or as `apply` returns them."""
  stats_def = jax.tree.structure(batch_stats)
  if jax.tree.structure(node) == stats_def:
    return True
  return (
    isinstance(node, Mapping)
    and list(node) == ["batch_stats"]
    and jax.tree.structure(node["batch_stats"]) == stats_def
  )


def _take_stats(aux: Any, batch_stats: Any) -> tuple[Any, Any, Any]:
  """Finds the new `batch_stats` in `aux`; returns (slot, new stats, aux without).

  The slot is `(index, treedef)`: `index` is None when `aux` itself holds the
  statistics, else their position in the `aux` tuple; `treedef` rebuilds
  what stood there (the bare tree, or `{"batch_stats": ...}`) from the
  statistics' leaves. In `aux without`, None stands where they were.
  """
  candidates = [(None, aux)]
  if isinstance(aux, tuple | list):
    candidates += list(enumerate(aux))
  found = [(i, node) for i, node in candidates if _is_stats_slot(node, batch_stats)]
  if len(found) != 1:
    what = "none" if not found else f"{len(found)} (ambiguous)"
    raise TypeError(
      "with batch_stats to thread, loss_fn must return (loss, aux) with the updated "
      "statistics in aux: aux itself or one element of the aux tuple must be "
      "either a tree like batch_stats or {'batch_stats': ...} as "
      "`apply(..., mutable=['batch_stats'])` returns it, e.g. "
      f"`return loss, (new_model_state, logits)`; found {what} in aux of "
      f"structure {jax.tree.structure(aux)}."
    )
  index, node = found[0]
  leaves, slot_def = jax.tree.flatten(node)
  new_stats = jax.tree.unflatten(jax.tree.structure(batch_stats), leaves)
  if index is None:
    rest = None
  else:
    rest = type(aux)(None if i == index else a for i, a in enumerate(aux))
  return (index, slot_def), new_stats, rest


def _put_stats(rest: Any, slot: tuple[Any, Any], stats: Any) -> Any:
  """Puts the final statistics back where `_take_stats` found them."""
  index, slot_def = slot
  node = jax.tree.unflatten(slot_def, jax.tree.leaves(stats))
  if index is None:
    return node
  return type(rest)(node if i == index else a for i, a in enumerate(rest))


def _warn_per_example_aux(rest: Any, reduce: Any, rows: int) -> None:
  """Warns for aux leaves with one row per example that are averaged."""
  try:
    modes = jax.tree.broadcast(reduce, ((0.0, rest), 0.0))[0][1]
  except ValueError:
    return  # accumulate names the bad reduce tree
  wrappers.warn_averaged_rows(
    rest,
    modes,
    rows,
    'pass reduce=(("mean", "concat"), "mean") (loss, aux, grads); the '
    "batch_stats in aux are threaded whatever their mode says",
  )


def _warn_unsplit_axes(params: Any) -> None:
  """Warns when the params name mesh axes and `mesh=` is left out.

  Under `jit` the names are those of `nn.with_partitioning`'s boxes (kept in
  the params, as Flax's SPMD guide does); called eagerly, those of arrays
  placed on a mesh too. The mesh is the boxes' or the arrays', else the one
  `jax.set_mesh` set.
  """
  meta = sys.modules.get("flax.core.meta")  # boxes exist only if Flax is loaded
  boxed = meta.Partitioned if meta is not None else ()
  named, meshes = set(), []
  for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, boxed)):
    if isinstance(leaf, boxed):
      spec = leaf.get_partition_spec()
      if hasattr(leaf, "rules"):  # logical names: the mesh axes the rules map to
        spmd = sys.modules["flax.linen.spmd"]
        spec = spmd.logical_to_mesh_axes(leaf.names, leaf.rules)
      meshes += [leaf.mesh] if leaf.mesh is not None else []
    elif isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      sharding = leaf.sharding
      if not isinstance(sharding, jax.sharding.NamedSharding):
        continue
      spec = sharding.spec
      meshes.append(sharding.mesh)
    else:
      continue
    named.update(a for entry in spec for a in spec_axes(entry))
  mesh = meshes[0] if meshes else jax.sharding.get_abstract_mesh()
  placement.warn_unsplit_axes("jaccum.linen", named, mesh)


def value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  has_aux: bool = False,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  axis: str | tuple[str, ...] = "data",
  param_specs: Any = None,
  fsdp_mode: FsdpMode = "gather_once",
  **accumulate_kwargs: Any,
) -> Callable[..., Any]:
  """Accumulated `jax.value_and_grad` for Linen: `f(params, batch_stats, batch[, rng])`.

  The Linen counterpart of `jaccum.nnx.value_and_grad`, for train steps
  written as in Flax's examples: a `loss_fn(params, batch_stats, batch, rng)`
  that applies the model with `mutable=['batch_stats']` and the key as its
  dropout key, and returns `(loss, aux)` with the updated statistics in
  `aux`. The batch is split into K micro-batches; `batch_stats` is threaded
  through them in order (micro-batch k+1 sees the statistics micro-batch k
  returned), each micro-batch gets its own key (`fold_in(rng, k)`), and the
  result is what `jax.value_and_grad(loss_fn, has_aux=has_aux)` returns on
  the whole batch: `(loss, grads)` or `((loss, aux), grads)`, with the
  final statistics where `loss_fn` put them in `aux`. So in a Flax train
  step only the gradient line changes::

    aux, grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, state.batch_stats, batch)
    # becomes
    aux, grads = jaccum.linen.value_and_grad(loss_fn, K, has_aux=True)(
        state.params, state.batch_stats, batch)

  The new statistics are found in `aux` by their structure: `aux` itself,
  or one element of the `aux` tuple, is either a tree like `batch_stats` or
  the `{'batch_stats': ...}` that `apply(..., mutable=['batch_stats'])`
  returns. `loss_fn` must read the statistics from its argument, not from a
  closure (`state.batch_stats`), or every micro-batch starts from the old
  ones. BatchNorm's running averages thus take K updates per step, one per
  micro-batch of N/K rows (see `jaccum.accumulate`'s `state_argnum`).

  Other `aux` leaves are averaged over micro-batches unless `reduce` says
  otherwise; one that holds a row per example (logits) is averaged with a
  warning. Keep its rows in the batch's order with
  `reduce=(("mean", "concat"), "mean")`: loss mean, aux concat, grads mean.
  The statistics' slot in `aux` takes any mode; they are threaded.

  Under `pmap` (or `shard_map`) pass `axis_name`: the gradients and the loss
  are then combined over devices once, after the loop, and the statistics
  are averaged over devices as Flax's examples do with `lax.pmean`; both
  `pmean` calls of the example become redundant. Under plain `jit` on a
  mesh, pass `mesh=` (and `axis=`, `param_specs=`, `fsdp_mode=`): the step
  then runs as `jaccum.data_parallel` runs it, each device over its own
  rows, params sharded over other axes (tensor parallel) kept so, over the
  data axes sharded as FSDP.

  Args:
    loss_fn: `loss_fn(params, batch_stats, batch, rng, **kwargs)`, or without
      `rng`, returning a float scalar loss (a mean over the micro-batch's
      examples), or `(loss, aux)` with `has_aux`.
    num_microbatches: the number of micro-batches K; it divides the batch.
    has_aux: whether `loss_fn` returns `(loss, aux)`. With `has_aux=False`
      the statistics come back unchanged, as the whole batch would drop
      them.
    mesh: run on this mesh as `jaccum.data_parallel` does (None: as
      `jaccum.accumulate` does, or on the mesh `jax.set_mesh` set if
      `param_specs` or `fsdp_mode` is given). Left out while params boxed by
      `nn.with_partitioning` name mesh axes and an auto axis of the mesh is
      named by none (likely the batch's: XLA would all-reduce over it in
      every micro-step), a warning names that axis.
    axis: the mesh axis (or axes) the batch is split over; defaults to
      `"data"`: pass it when your mesh names its batch axis otherwise (e.g.
      `axis="batch"`).
    param_specs: a `PartitionSpec` per leaf of `params` (or a prefix);
      entries naming `axis` shard a leaf as FSDP, other axes (tensor
      parallel) are kept.
    fsdp_mode: `"gather_once"`, `"shard_grads"` or `"shard_all"`, as for
      `jaccum.data_parallel`.
    **accumulate_kwargs: passed to `jaccum.accumulate` (`reduce`,
      `weight_fn`, `accum_dtype`, `axis_name`, `split`, `unroll`, …).
      `reduce` is a prefix of `((loss, aux), grads)` (or `(loss, grads)`);
      `weight_fn(batch)` receives the micro-batch; with `return_stats` the
      result is `(value_and_grad, stats)`. The argument positions
      are fixed by the call, so `batch_argnums`, `rng_argnum`,
      `state_argnum` and `grad_leaves` are not options.

  Returns:
    `f(params, batch_stats, batch, rng=None, **kwargs)`: the batch is split on
    axis 0 (every leaf shares the leading size N), `rng` (if given, by
    position or by keyword; `loss_fn` receives it positionally) is folded
    per micro-batch, other keyword arguments go whole to every micro-batch.

  Raises:
    TypeError: an option fixed by the call is given, the call does not have
      3 or 4 positional arguments, or `aux` does not hold the new statistics
      (exactly once) while there are statistics to thread.

  Examples:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaccum.linen
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x, train):
    ...     x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
    ...     return nn.Dense(1)(x)[:, 0]
    >>> def loss_fn(params, batch_stats, batch):
    ...   pred, new_model_state = Net().apply(
    ...     {"params": params, "batch_stats": batch_stats}, batch["x"], train=True,
    ...     mutable=["batch_stats"])
    ...   return jnp.mean((pred - batch["y"]) ** 2), (new_model_state, pred)
    >>> batch = {"x": jnp.arange(24.0).reshape(8, 3), "y": jnp.arange(8.0)}
    >>> variables = Net().init(jax.random.key(0), batch["x"], train=False)
    >>> grad_fn = jaccum.linen.value_and_grad(
    ...   loss_fn, 2, has_aux=True, reduce=(("mean", "concat"), "mean"))
    >>> (loss, (new_model_state, pred)), grads = jax.jit(grad_fn)(
    ...   variables["params"], variables["batch_stats"], batch)
    >>> pred.shape  # one prediction per example, in the batch's order
    (8,)

    Micro-batch 0 holds rows 0, 2, 4, 6 (mean of x[:, 0]: 9), micro-batch 1
    rows 1, 3, 5, 7 (mean 12); the running mean takes both, in order:

    >>> new_model_state["batch_stats"]["BatchNorm_0"]["mean"][0]  # ((0 + 9)/2 + 12)/2
    Array(8.25, dtype=float32)
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}.")
  options = dict(accumulate_kwargs)
  for name in _FIXED:
    if name in options:
      raise TypeError(
        f"{name} is not an option of jaccum.linen.value_and_grad: the call "
        "f(params, batch_stats, batch[, rng]) fixes the positions (batch 2, key 3, "
        "statistics 1, gradients of params); use jaccum.accumulate for others."
      )
  if (weight_fn := options.get("weight_fn")) is not None:
    if not callable(weight_fn):
      raise TypeError(f"weight_fn must be callable or None, got {weight_fn!r}.")
    options["weight_fn"] = lambda params, batch_stats, batch, *key: weight_fn(batch)
  grad_leaves = ((False, False), True) if has_aux else (False, True)
  on_mesh = None
  if mesh is not None or param_specs is not None or fsdp_mode != "gather_once":
    on_mesh = options_lib.on_mesh(mesh, axis, param_specs, fsdp_mode, options)
  # Built once: every call differs only in the key's position and the step.
  base = options_lib.make(
    loss_fn,
    num_microbatches,
    **options,
    batch_argnums=2,
    state_argnum=1,
    grad_leaves=grad_leaves,
    on_mesh=on_mesh,
  )
  reduce = base.reduce

  def accumulated(params: Any, batch_stats: Any, *args: Any, **kwargs: Any) -> Any:
    if "rng" in kwargs:
      # The key by keyword is still the key: each micro-batch gets its fold.
      if len(args) != 1:
        raise TypeError(
          "rng was passed both by position and by keyword: call it as "
          "f(params, batch_stats, batch, rng) or f(params, batch_stats, batch, "
          "rng=rng)."
        )
      args = (*args, kwargs.pop("rng"))
    if len(args) not in (1, 2):
      raise TypeError(
        "call it as f(params, batch_stats, batch) or f(params, batch_stats, batch, "
        f"rng), the arguments of loss_fn; got {2 + len(args)} positional arguments."
      )
    if on_mesh is None and base.axis_name is None:
      _warn_unsplit_axes(params)
    threads = bool(jax.tree.leaves(batch_stats))
    if base.deterministic:
      rules.check("linen", threads)
    slots: list[Any] = []  # where the statistics sat in aux, found when traced

    def step(params, batch_stats, batch, *key, **kwargs):
      def loss_of(params):
        return loss_fn(params, batch_stats, batch, *key, **kwargs)

      if not has_aux:
        loss, grads = jax.value_and_grad(loss_of)(params)
        return (loss, grads), batch_stats
      (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
      new_stats, rest = batch_stats, aux
      if threads:
        slot, new_stats, rest = _take_stats(aux, batch_stats)
        slots.append(slot)
      rows = next((jnp.shape(x)[0] for x in jax.tree.leaves(batch)), 0)
      _warn_per_example_aux(rest, reduce, rows)
      return ((loss, rest), grads), new_stats

    this = base.replace(
      function=Function(step), rng_argnum=3 if len(args) == 2 else None
    )
    call = plan.Call((params, batch_stats, *args), kwargs)
    result, stats = plan.run(this, call), None
    if base.return_stats:
      result, stats = result
    out, new_stats = result
    if has_aux:
      (loss, rest), grads = out
      aux = _put_stats(rest, slots[-1], new_stats) if threads else rest
      out = (loss, aux), grads
    return out if stats is None else (out, stats)

  return accumulated

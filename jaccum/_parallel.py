"""`data_parallel`: accumulation over a device mesh with one reduction per step."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaccum import _accumulate, _collective
from jaccum._accumulate import Config

P = jax.sharding.PartitionSpec


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def data_parallel(
  grad_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  axis: str | tuple[str, ...] = "data",
  param_specs: Any = None,
  **accumulate_kwargs: Any,
) -> Callable[..., Any]:
  """Accumulates over K micro-batches on every device, then reduces once.

  Call the returned function under `jit` with global arrays whose batch is
  sharded over `axis`. It wraps `jax.shard_map` so that each device runs
  `accumulate(grad_fn, K, axis_name=axis)` on its own rows: the effective
  batch is devices × K × micro-batch, nothing communicates inside the loop,
  and one all-reduce combines the devices after it. This holds for meshes
  with auto and explicit axis types and for multi-axis meshes (only `axis` is
  made manual; other axes, e.g. `"model"`, keep their sharding).

  With `param_specs` (FSDP / ZeRO style), the first argument (the params)
  arrives sharded as those specs say: each sharded leaf is all-gathered once
  before the loop, the accumulator stays local, and the gradients of those
  leaves leave through one reduce-scatter, sharded like the params.

  Args:
    grad_fn: as for `accumulate`.
    num_microbatches: micro-batches per device, K.
    mesh: the device mesh; defaults to the mesh set with `jax.set_mesh`, else
      the mesh of the batch's sharding.
    axis: the mesh axis (or axes) the batch is sharded over.
    param_specs: `PartitionSpec`s for the first argument (a pytree prefix of
      it), for FSDP; `None` replicates it.
    **accumulate_kwargs: any other option of `accumulate` (`batch_argnums`,
      `reduce`, `weight_fn`, `rng_argnum`, `state_argnum`, …).

  Returns:
    A function with `grad_fn`'s signature. `"mean"`, `"sum"` and `"max"`
    leaves come back replicated, gradients of FSDP-sharded params sharded
    like them, `"concat"` and `"last"` leaves sharded over `axis`.

  Raises:
    TypeError, ValueError: as `accumulate` does, and if `axis` is not a mesh
      axis or the batch does not split into devices × K micro-batches.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> x = jnp.arange(32.0 * len(jax.devices())).reshape(-1, 2) / 100
    >>> step = jax.jit(jaccum.data_parallel(jax.grad(loss), 2, mesh=mesh))
    >>> bool(jnp.allclose(step(jnp.ones(2), x), jax.grad(loss)(jnp.ones(2), x)))
    True
  """
  if "axis_name" in accumulate_kwargs:
    raise TypeError("data_parallel takes `axis`, not `axis_name`.")
  config = _accumulate.make_config(
    grad_fn, num_microbatches, axis_name=axis, **accumulate_kwargs
  )

  def parallel(*args, **kwargs):
    return run_sharded(config, args, kwargs, mesh=mesh, param_specs=param_specs)

  return parallel


def _find_mesh(args: tuple[Any, ...], at: _accumulate.Positions):
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty:
    return mesh
  for i in at.batch:
    for leaf in jax.tree.leaves(args[i]):
      leaf_mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
      if leaf_mesh is not None and not leaf_mesh.empty:
        return leaf_mesh
  raise ValueError(
    "data_parallel needs a mesh: pass mesh=..., call it under jax.set_mesh(mesh), "
    "or pass a batch sharded over the mesh."
  )


def _sharded_dim(spec: P, axes: tuple[str, ...]) -> int | None:
  """The dimension a `PartitionSpec` shards over `axes`, if any."""
  for dim, entry in enumerate(spec):
    names = _collective.spec_axes(entry)
    if names == axes:
      return dim
    if set(names) & set(axes):
      raise ValueError(
        f"param_specs entry {spec} shards dimension {dim} over {names}; FSDP "
        f"shards a dimension over exactly the data axes {axes}."
      )
  return None


def _grad_specs(out: Any, params: Any, params_specs: Any) -> list[Any]:
  """Per leaf of `out`: the spec of the param it is the gradient of, else None.

  A gradient is any subtree of `out` with the params' structure and shapes,
  e.g. the output of `jax.grad` or the second element of `value_and_grad`.
  """
  params_def = jax.tree.structure(params)
  shapes = [jax.numpy.shape(p) for p in jax.tree.leaves(params)]
  specs = jax.tree.leaves(params_specs, is_leaf=_is_spec)

  def is_grads(node):
    leaves, treedef = jax.tree.flatten(node)
    return treedef == params_def and [x.shape for x in leaves] == shapes

  per_leaf = []
  for node in jax.tree.leaves(out, is_leaf=is_grads):
    per_leaf.extend(specs if is_grads(node) else [None])
  return per_leaf


def run_sharded(
  config: Config,
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  *,
  mesh: Any = None,
  param_specs: Any = None,
) -> Any:
  """Runs `accumulate` under `shard_map` over `config.axes`, one reduction after."""
  axes = config.axes
  assert axes is not None
  at = _accumulate.positions(config, args)
  mesh = mesh if mesh is not None else _find_mesh(args, at)
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"axis={axes} names {missing}, not axes of the mesh {mesh}.")
  num_devices = math.prod(mesh.shape[a] for a in axes)
  per_step = num_devices * config.num_microbatches
  batch_size = _accumulate.check_batch(
    [args[i] for i in at.batch], 1, names=[f"args[{i}]" for i in at.batch]
  )
  if batch_size % per_step:
    raise ValueError(
      f"batch_size={batch_size} must be divisible by devices × num_microbatches = "
      f"{num_devices} × {config.num_microbatches} = {per_step}."
    )

  params_specs = None
  if param_specs is not None:
    params_specs = jax.tree.broadcast(param_specs, args[0], is_leaf=_is_spec)
    for spec in jax.tree.leaves(params_specs, is_leaf=_is_spec):
      _sharded_dim(spec, axes)  # raises on a spec FSDP cannot serve
  in_specs = tuple(
    P(axes)
    if i in at.batch
    else (param_specs if i == 0 and param_specs is not None else P())
    for i in range(len(args))
  )
  explicit = all(
    t == jax.sharding.AxisType.Explicit
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if n in axes
  )
  if explicit:
    # Explicit axes: shard_map takes inputs only in the layout it is told;
    # put the batch there (a no-op when it already is).
    batch_sharding = jax.NamedSharding(mesh, P(axes))
    args = tuple(
      jax.tree.map(lambda x: jax.sharding.reshard(x, batch_sharding), a)
      if i in at.batch
      else a
      for i, a in enumerate(args)
    )

  def gather(params):
    return jax.tree.map(
      lambda x, spec: (
        x
        if (dim := _sharded_dim(spec, axes)) is None
        else jax.lax.all_gather(x, axes, axis=dim, tiled=True)
      ),
      params,
      params_specs,
    )

  scatter = None
  if params_specs is not None:
    scatter = lambda out: [
      None if spec is None else _sharded_dim(spec, axes)
      for spec in _grad_specs(out, args[0], params_specs)
    ]

  local_config = config._replace(scatter=scatter)

  def body(*local_args):
    if params_specs is not None:
      local_args = (gather(local_args[0]), *local_args[1:])
    return _accumulate.run(local_config, local_args, kwargs)

  # The output layout depends on each leaf's reduction, so trace one device's
  # accumulation abstractly first.
  rows = batch_size // num_devices
  flat, treedef = jax.tree.flatten(args)
  in_batch = [i in at.batch for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
  arrays = [i for i, x in enumerate(flat) if isinstance(x, jax.Array | np.ndarray)]

  def one_device(*abstract):
    # Shapes without shardings: a sharded global array would make this trace
    # reason about layouts that only exist outside shard_map.
    local = list(flat)
    for i, x in zip(arrays, abstract, strict=True):
      local[i] = x
    local_args = jax.tree.unflatten(treedef, local)
    return _accumulate.run(config._replace(axes=None), local_args, kwargs)

  local_batch = [
    jax.ShapeDtypeStruct(
      (rows, *flat[i].shape[1:]) if in_batch[i] else flat[i].shape,
      flat[i].dtype,
    )
    for i in arrays
  ]
  local_out = jax.eval_shape(one_device, *local_batch)
  out = local_out if at.state is None else local_out[0]
  modes = jax.tree.leaves(jax.tree.broadcast(config.reduce, out))
  specs = [P(axes) if m in ("concat", "last") else P() for m in modes]
  if params_specs is not None:
    grad_specs = _grad_specs(out, args[0], params_specs)
    specs = [s if g is None else g for s, g in zip(specs, grad_specs, strict=True)]
  out_specs = jax.tree.unflatten(jax.tree.structure(out), specs)
  if at.state is not None:
    out_specs = (out_specs, jax.tree.map(lambda _: P(), local_out[1]))

  sharded = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    axis_names=set(axes),
  )
  return sharded(*args)

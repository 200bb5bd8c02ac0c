"""`pipeline`: micro-batches flowing through model stages, one stage per device.

The S stages of a model live on the S positions of a mesh axis. A step splits
each device's rows into K micro-batches, which flow through the stages in a
`lax.scan` over ticks: at tick t, stage s works on micro-batch t - s and hands
its output to stage s + 1 with a `ppermute`. Each stage's parameter gradients
are accumulated over the K micro-batches by the backward pass of that loop, so
the micro-batches are the accumulation.

Two schedules, each with or without rematerialisation (F: a stage's forward
on one micro-batch, B: its backward):

- `"gpipe"`: `jax.grad` differentiates the forward loop, whose backward runs
  after all the forwards. It stores the activations of all K + S - 1 ticks
  (with `remat`, only their stage inputs, and recomputes the rest: 2F + B).
- `"1f1b"`: the forward loop stores nothing. A custom VJP re-runs each
  micro-batch's forward just before its backward, one of each per stage and
  tick, and keeps what the backward needs for at most 2S - 1 micro-batches,
  however large K is: the `jax.vjp` residuals (2F + B), or with `remat` only
  the stage inputs (3F + B).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Var

from jaccum import _collective
from jaccum._microbatch import check_num_microbatches

P = jax.sharding.PartitionSpec
Schedule = Literal["gpipe", "1f1b"]
SCHEDULES = ("gpipe", "1f1b")


def pipeline(
  stage_fn: Callable[[Any, Any], Any],
  num_microbatches: int,
  *,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
  axis: str = "stage",
  schedule: Schedule = "gpipe",
  remat: bool = False,
) -> Callable[[Any, Any], Any]:
  """Runs S stages of a model as a pipeline over K micro-batches.

  `f = pipeline(stage_fn, K, mesh=mesh)` computes, in exact arithmetic::

    def f(stage_params, x):
      for s in range(S):  # S = mesh.shape[axis]
        x = stage_fn(jax.tree.map(lambda p: p[s], stage_params), x)
      return x

  but stage s runs only on the devices at position s of `axis`, keeps its
  parameters there, and works on K micro-batches one after another. Only
  activations (and, backwards, their cotangents) pass between neighbouring
  stages. The other mesh axes (e.g. `"data"`) shard the batch: each device
  group pipelines its own rows, and `jax.grad` reduces the parameter
  gradients over them once per step, after the loop.

  The embedding, head and loss are ordinary JAX around `f`; `jax.grad`
  through `f` gives each stage's gradients summed over the K micro-batches,
  which is the whole-batch gradient. A stage is idle for a fraction
  (S - 1) / (K + S - 1) of the step (the bubble), so a larger K helps.

  Args:
    stage_fn: `stage_fn(params_s, x_mb) -> y_mb`, one stage on one
      micro-batch; `y_mb` has `x_mb`'s structure, shapes and dtypes. It sees
      stage s's slice of `stage_params` (the leading stage axis removed).
    num_microbatches: micro-batches per step and per data shard, K.
    mesh: the device mesh. `axis` holds the stages; every other axis shards
      the batch.
    axis: the mesh axis of the stages.
    schedule: `"gpipe"` (autodiff of the forward loop: what a stage stores
      grows with K) or `"1f1b"` (a backward that re-runs each micro-batch's
      forward just before its backward: a stage stores what at most 2S - 1
      micro-batches need, at the cost of one more forward).
    remat: store only each stage's micro-batch inputs and recompute the rest
      in the backward pass (`jax.checkpoint`), one more forward again.

  Returns:
    `f(stage_params, x)`. Every leaf of `stage_params` has a leading dimension
    S, sharded over `axis`. `x` is a pytree of arrays with a common leading
    batch size N, a multiple of (the batch-axes' size × K). The result has
    `x`'s structure, sharded like it over the batch axes.

  Raises:
    ValueError: `axis` is not a mesh axis, a `stage_params` leaf's leading
      size is not S, N does not split into data shards × K micro-batches,
      `stage_fn` changes its input's structure, shape or dtype, or the
      schedule is unknown.
    TypeError: `num_microbatches` is not a positive int.

  Examples:
    One stage of `tanh(x @ w)` per device, two micro-batches, against the
    sequential model:

    >>> import jax, jax.numpy as jnp, jaccum
    >>> num_stages = jax.device_count()
    >>> mesh = jax.make_mesh((num_stages,), ("stage",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> stage = lambda w, x: jnp.tanh(x @ w)
    >>> ws = jnp.stack([jnp.eye(3) * (s + 2) / 4 for s in range(num_stages)])
    >>> x = jnp.arange(12.0).reshape(4, 3) / 12
    >>> f = jax.jit(jaccum.pipeline(stage, 2, mesh=mesh))
    >>> sequential = x
    >>> for w in ws:
    ...   sequential = stage(w, sequential)
    >>> bool(jnp.allclose(f(ws, x), sequential))
    True
  """
  num_microbatches = check_num_microbatches(num_microbatches)
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
  if axis not in mesh.axis_names:
    raise ValueError(
      f"axis={axis!r} is not an axis of the mesh, whose axes are "
      f"{tuple(mesh.axis_names)}; pass axis= one of them, or build the mesh "
      f"with a {axis!r} axis."
    )
  num_stages = mesh.shape[axis]
  batch_axes = tuple(a for a in mesh.axis_names if a != axis)
  num_shards = math.prod(mesh.shape[a] for a in batch_axes)
  if schedule == "gpipe":
    checkpointed = jax.checkpoint(stage_fn) if remat else stage_fn
    run = functools.partial(_forward_loop, checkpointed)
  else:
    run = functools.partial(_one_f_one_b, stage_fn, remat=remat)
  batch_spec = P(batch_axes) if batch_axes else P()

  def apply(stage_params: Any, x: Any) -> Any:
    _check_stage_params(stage_params, num_stages, axis)
    batch_size = _check_batch(x, num_microbatches, num_shards, batch_axes)
    rows = batch_size // num_shards // num_microbatches

    def local(params, x):
      # Each stage holds a leading slice of length 1 of every parameter.
      params = jax.tree.map(lambda p: p[0], params)
      # Inside shard_map the parameters do not vary over the batch axes and x
      # does not vary over the stage axis. Used as they are in the loop, JAX
      # would cast them to varying at each use, and the transpose of each
      # cast is a psum: an all-reduce of the parameter gradients in every
      # tick of the backward loop. Casting once here puts those psums after
      # the loop instead: one reduction of the gradients over the batch axes
      # per step, and one of x's cotangent over the stages (nonzero on stage
      # 0 only). We keep check_vma on rather than turning it off: off, JAX
      # would neither check that the result really is replicated over the
      # stages nor show in the types where the reductions go.
      everywhere = (axis, *batch_axes)
      params = _collective.cast_varying(params, everywhere)
      x = _collective.cast_varying(x, everywhere)
      xs = jax.tree.map(lambda a: a.reshape(num_microbatches, rows, *a.shape[1:]), x)
      ys = run(params, xs, axis, num_stages)
      # The result lives on the last stage; hand it to every stage (outside
      # the loop), so that it leaves shard_map replicated over `axis`.
      last = jax.lax.axis_index(axis) == num_stages - 1
      ys = jax.tree.map(lambda y: jnp.where(last, y, jnp.zeros_like(y)), ys)
      ys = jax.lax.psum(ys, axis)
      return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), ys)

    if _any_explicit(mesh):
      # shard_map over explicit axes takes its inputs only in the layout its
      # specs name; move them there (a no-op when they already are).
      stage_params = _reshard(stage_params, jax.NamedSharding(mesh, P(axis)))
      x = _reshard(x, jax.NamedSharding(mesh, batch_spec))
    sharded = jax.shard_map(
      local, mesh=mesh, in_specs=(P(axis), batch_spec), out_specs=batch_spec
    )
    return sharded(stage_params, x)

  return apply


# --- the schedules: local to one device, inside shard_map ---------------------


def _take(xs: Any, index: jax.Array) -> Any:
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, False), xs)


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _zeros_like(tree: Any) -> Any:
  """Zeros with `tree`'s shapes, dtypes and device-varying axes."""
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
  return _collective.match_varying(zeros, tree)


def _shift(tree: Any, axis: str, num_stages: int, step: int) -> Any:
  """Sends every stage's `tree` to stage s + step; the stage at the end gets 0."""
  pairs = [(s, s + step) for s in range(num_stages) if 0 <= s + step < num_stages]
  return jax.lax.ppermute(tree, axis, pairs)


def _in_range(index: jax.Array, num_microbatches: int) -> jax.Array:
  return (index >= 0) & (index < num_microbatches)


def _forward_loop(
  stage_fn: Callable[[Any, Any], Any], params: Any, xs: Any, axis: str, num_stages: int
) -> Any:
  """K + S - 1 ticks; at tick t stage s maps micro-batch t - s.

  Returns `[K, ...]`: the outputs of the stage this device holds, of which
  the last stage's are the pipeline's.
  """
  num_microbatches = jax.tree.leaves(xs)[0].shape[0]
  stage = jax.lax.axis_index(axis)

  def tick(received, t):
    fresh = _take(xs, jnp.minimum(t, num_microbatches - 1))
    inputs = _select(stage == 0, fresh, received)
    # A stage runs `stage_fn` in its idle ticks too and its outputs there go
    # unused (their cotangents are zero). Skipping them with `lax.cond` would
    # make autodiff store the cond's operands, the parameters included, once
    # per tick. Idle ticks see real data, never placeholders (before a
    # stage's first micro-batch arrives, the first micro-batch's input passed
    # through the stages that ran; after its last, the last micro-batch's
    # activations again), so `stage_fn` is not asked for values and
    # derivatives at points like 0, where it may have none.
    outputs = stage_fn(params, inputs)
    _check_stage_output(inputs, outputs)
    return _shift(outputs, axis, num_stages, 1), outputs

  first = _take(xs, jnp.int32(0))
  ticks = jnp.arange(num_microbatches + num_stages - 1)
  _, outputs = jax.lax.scan(tick, first, ticks)
  return jax.tree.map(lambda y: y[num_stages - 1 :], outputs)


def _one_f_one_b(
  stage_fn: Callable[[Any, Any], Any],
  params: Any,
  xs: Any,
  axis: str,
  num_stages: int,
  remat: bool,
) -> Any:
  """The forward loop, differentiated by a backward that stores O(S), not O(K).

  The backward loop runs K + 2S - 2 ticks. At tick t stage s re-runs the
  forward of micro-batch t - s (from the batch on stage 0, from the previous
  stage's output elsewhere) and keeps what its backward needs in a ring of
  2S - 1 slots: the residuals of `jax.vjp`, or with `remat` only the input.
  In the same tick it runs the backward of micro-batch t - (2S - 2 - s) from
  what was kept for it, and sends the input's cotangent to stage s - 1. A
  micro-batch waits 2(S - 1 - s) ticks on stage s between its forward and its
  backward, so 2S - 1 slots hold all those in flight.
  """

  @jax.custom_vjp
  def run(params, xs):
    return _forward_loop(stage_fn, params, xs, axis, num_stages)

  def run_fwd(params, xs):
    # Nothing but the inputs is kept: the backward recomputes the rest.
    return run(params, xs), (params, xs)

  def run_bwd(residuals, output_cotangents):
    params, xs = residuals
    num_microbatches = jax.tree.leaves(xs)[0].shape[0]
    num_slots = 2 * num_stages - 1
    stage = jax.lax.axis_index(axis)
    first, last = stage == 0, stage == num_stages - 1
    lag = 2 * num_stages - 2 - stage  # ticks from a forward to its backward
    clip = lambda i: jnp.clip(i, 0, num_microbatches - 1)
    everywhere = _collective.varying_axes(jax.tree.leaves(xs)[0])
    microbatch = _take(xs, jnp.int32(0))

    # Without remat the ring keeps the residuals of `jax.vjp(stage_fn, ...)`:
    # the function it returns is a pytree whose leaves are its residuals.
    # Those computed from the parameters alone (the parameters themselves,
    # slices and transposes of them, constants) are the same for every
    # micro-batch: they are computed once, before the loop, and kept once.
    def vjp_residuals(params, inputs):
      outputs, vjp = jax.vjp(stage_fn, params, inputs)
      leaves, treedef[0] = jax.tree.flatten(vjp)
      return outputs, leaves

    treedef: list[Any] = [None]
    per_microbatch: list[bool] = []
    shared: list[Any] = []
    if not remat:
      per_microbatch = _depends_on_inputs(
        lambda p, a: vjp_residuals(p, a)[1], params, microbatch
      )
      leaves = vjp_residuals(params, microbatch)[1]
      shared = [r for r, d in zip(leaves, per_microbatch, strict=True) if not d]
      kept_like = [
        _collective.cast_varying(jnp.zeros(r.shape, r.dtype), everywhere)
        for r, d in zip(leaves, per_microbatch, strict=True)
        if d
      ]
    else:
      kept_like = microbatch

    def keep(params, inputs):
      outputs, leaves = vjp_residuals(params, inputs)
      kept = [r for r, d in zip(leaves, per_microbatch, strict=True) if d]
      return outputs, _collective.cast_varying(kept, everywhere)

    # Cotangents travel as lists of their floating leaves; integer leaves of
    # the activations (e.g. token ids passed along) have float0 cotangents.
    def backward(params, kept, cotangent):
      if remat:
        _, vjp = jax.vjp(stage_fn, params, kept)
      else:
        kept_leaves, shared_leaves = iter(kept), iter(shared)
        leaves = [next(kept_leaves if d else shared_leaves) for d in per_microbatch]
        vjp = jax.tree.unflatten(treedef[0], leaves)
      param_grads, input_grads = vjp(_with_float0(cotangent, microbatch))
      return _inexact(param_grads), _inexact(input_grads)

    def tick(carry, t):
      received, cotangent_received, ring, grads = carry
      # Forward of micro-batch t - s.
      index = t - stage
      inputs = _select(first, _take(xs, clip(index)), received)
      if remat:
        # The last stage's output goes nowhere; its backward recomputes it.
        outputs = jax.lax.cond(
          _in_range(index, num_microbatches) & ~last,
          lambda p, a: stage_fn(p, a),
          lambda p, a: a,
          params,
          inputs,
        )
        kept = inputs
      else:
        outputs, kept = jax.lax.cond(
          _in_range(index, num_microbatches),
          keep,
          lambda p, a: (a, kept_like),
          params,
          inputs,
        )
      # A slot is reused only after the backward that needed it (see above).
      ring = jax.tree.map(
        lambda r, a: jax.lax.dynamic_update_index_in_dim(r, a, index % num_slots, 0),
        ring,
        kept,
      )
      # Backward of micro-batch t - lag.
      index = t - lag
      cotangent = _select(
        last, _take(output_cotangents, clip(index)), cotangent_received
      )
      param_grads, input_grads = jax.lax.cond(
        _in_range(index, num_microbatches),
        backward,
        lambda p, k, c: (_zeros_like(_inexact(p)), _zeros_like(c)),
        params,
        _take(ring, index % num_slots),
        cotangent,
      )
      grads = jax.tree.map(jnp.add, grads, param_grads)
      carry = (
        _shift(outputs, axis, num_stages, 1),
        _shift(input_grads, axis, num_stages, -1),
        ring,
        grads,
      )
      return carry, input_grads

    ring = jax.tree.map(lambda a: jnp.broadcast_to(a, (num_slots, *a.shape)), kept_like)
    ring = _collective.match_varying(ring, kept_like)
    output_cotangents = _inexact(output_cotangents)
    carry = (
      microbatch,
      _zeros_like(_inexact(microbatch)),
      ring,
      _zeros_like(_inexact(params)),
    )
    ticks = jnp.arange(num_microbatches + 2 * num_stages - 2)
    (_, _, _, grads), input_grads = jax.lax.scan(tick, carry, ticks)
    # Stage 0 finishes micro-batch k's backward at tick k + 2S - 2.
    input_grads = [
      jnp.where(first, g[2 * num_stages - 2 :], jnp.zeros_like(g[:1]))
      for g in input_grads
    ]
    return _with_float0(grads, params), _with_float0(input_grads, xs)

  run.defvjp(run_fwd, run_bwd)
  return run(params, xs)


def _inexact(tree: Any) -> list[Any]:
  """The leaves of `tree` that carry cotangents: the floating ones."""
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def _with_float0(inexact: list[Any], like: Any) -> Any:
  """`like`'s tree with `inexact` at its floating leaves, float0 zeros elsewhere."""
  values = iter(inexact)
  return jax.tree.map(
    lambda x: (
      next(values)
      if jnp.issubdtype(x.dtype, jnp.inexact)
      else np.zeros(x.shape, jax.dtypes.float0)
    ),
    like,
  )


def _depends_on_inputs(
  fn: Callable[[Any, Any], Any], params: Any, inputs: Any
) -> list[bool]:
  """For each leaf of `fn(params, inputs)`: does it depend on `inputs`?"""
  jaxpr = jax.make_jaxpr(fn)(params, inputs).jaxpr
  dependent = set(jaxpr.invars[len(jax.tree.leaves(params)) :])
  for eqn in jaxpr.eqns:
    if any(isinstance(v, Var) and v in dependent for v in eqn.invars):
      dependent.update(eqn.outvars)
  return [isinstance(v, Var) and v in dependent for v in jaxpr.outvars]


# --- checks, at trace time ----------------------------------------------------


def _check_stage_params(stage_params: Any, num_stages: int, axis: str) -> None:
  leaves = jax.tree_util.tree_flatten_with_path(stage_params)[0]
  if not leaves:
    raise ValueError("stage_params holds no arrays.")
  for path, leaf in leaves:
    where = "stage_params" + jax.tree_util.keystr(path)
    shape = getattr(leaf, "shape", None)
    if shape is None or not hasattr(leaf, "dtype"):
      raise TypeError(f"{where} must be an array, got {type(leaf).__name__}.")
    if not shape or shape[0] != num_stages:
      found = shape[0] if shape else "none (a scalar)"
      raise ValueError(
        f"{where} has shape {tuple(shape)}: its leading size {found} must be "
        f"the number of stages, the size {num_stages} of mesh axis {axis!r}. "
        "Stack the S stages' parameters on a leading axis."
      )


def _check_batch(
  x: Any, num_microbatches: int, num_shards: int, batch_axes: tuple[str, ...]
) -> int:
  leaves = jax.tree_util.tree_flatten_with_path(x)[0]
  if not leaves:
    raise ValueError("x holds no arrays.")
  first = None
  for path, leaf in leaves:
    where = "x" + jax.tree_util.keystr(path)
    shape = getattr(leaf, "shape", None)
    if not shape:
      raise TypeError(f"{where} must be an array with a leading batch axis.")
    if first is None:
      first = (where, shape[0])
    elif shape[0] != first[1]:
      raise ValueError(
        f"x's leaves must share one batch size: {first[0]} has {first[1]} rows "
        f"but {where} has {shape[0]}."
      )
  assert first is not None
  where, batch_size = first
  per_step = num_shards * num_microbatches
  if batch_size % per_step:
    raise ValueError(
      f"batch_size={batch_size} (of {where}) must be divisible by data shards × "
      f"num_microbatches = {num_shards} × {num_microbatches} = {per_step} (the "
      f"data shards are the mesh axes {batch_axes}); pad the batch or pick a "
      "K that divides it."
    )
  return batch_size


def _check_stage_output(inputs: Any, outputs: Any) -> None:
  """`stage_fn` must return its input's structure, shapes and dtypes."""
  if jax.tree.structure(outputs) != jax.tree.structure(inputs):
    raise ValueError(
      "stage_fn must return a tree like its input, as the next stage takes it: "
      f"input {jax.tree.structure(inputs)}, output {jax.tree.structure(outputs)}."
    )
  flat_inputs = jax.tree_util.tree_flatten_with_path(inputs)[0]
  for (path, a), b in zip(flat_inputs, jax.tree.leaves(outputs), strict=True):
    a, b = jax.typeof(a), jax.typeof(b)
    if (a.shape, a.dtype) != (b.shape, b.dtype):
      raise ValueError(
        "stage_fn must return its input's shape and dtype, as the next stage "
        f"takes it: on a micro-batch, input x{jax.tree_util.keystr(path)} is "
        f"{a.dtype.name}{list(a.shape)} but stage_fn returns "
        f"{b.dtype.name}{list(b.shape)}."
      )


def _any_explicit(mesh: Any) -> bool:
  return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def _reshard(tree: Any, sharding: jax.sharding.NamedSharding) -> Any:
  return jax.tree.map(lambda a: jax.sharding.reshard(a, sharding), tree)

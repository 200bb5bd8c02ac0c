"""What the pipeline's schedules share: the layout, the traced user functions, trees.

`Layout` holds the static facts the loops need; `trace_user_functions`
traces `stage_fn` and `loss_fn` once, inside the `shard_map`, into programs
the loops run (`Traced`); the rest moves trees of micro-batches, chunks and
accumulators between the loops' slots, and lays the inputs out on the mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, Var, jaxpr_as_fun

from jaccum._core import retype
from jaccum._pipeline.tables import (
  PipelineSchedule,
  _Ticks,
)

P = jax.sharding.PartitionSpec


class Layout(NamedTuple):
  """The static facts the loops need."""

  schedule: PipelineSchedule
  axis: str
  data_axes: tuple[str, ...]
  remat: bool
  accum: np.dtype | None
  key_impl: Any  # a typed key's implementation, None for a raw uint32 key

  @property
  def ticks(self) -> _Ticks:
    """The schedule's arithmetic, which the GPipe and 1F1B loops trace."""
    plan = self.schedule
    return _Ticks(
      plan.num_stages,
      plan.num_virtual_stages,
      plan.num_microbatches,
      plan.schedule == "zb-v",
    )

  @property
  def all_axes(self) -> tuple[str, ...]:
    return (self.axis, *self.data_axes)

  def wrap_key(self, key: Any) -> Any:
    if key is None or self.key_impl is None:
      return key
    return jax.random.wrap_key_data(key, impl=self.key_impl)

  def key(self, key: Any, microbatch: Any, chunk: Any) -> Any:
    """Stage l's key on micro-batch m: `fold_in(fold_in(key, m), l)`."""
    if key is None:
      return None
    ticks = self.ticks
    data = jax.lax.axis_index(self.data_axes) if self.data_axes else 0
    stage = ticks.stage(jax.lax.axis_index(self.axis), chunk)
    index = data * ticks.num_microbatches + microbatch
    return jax.random.fold_in(jax.random.fold_in(key, index), stage)

  def accum_dtype(self, dtype: Any) -> Any:
    """`dtype`, or `accum_dtype` where that is a wider float. Other dtypes
    (integers, PRNG keys, which NumPy cannot even name) stay as they are."""
    accum = self.accum
    if accum is None or not is_float(dtype):
      return dtype
    dtype = np.dtype(dtype)
    return accum if dtype.itemsize < accum.itemsize else dtype

  def widen(self, tree: Any) -> Any:
    """`tree`'s floating leaves in `accum_dtype` where that is wider."""
    return jax.tree.map(lambda a: cast(a, self.accum_dtype(dtype(a))), tree)


class Args(NamedTuple):
  """What a device's loops take: its chunks' params and state `[V, ...]`.

  The params come in `accum_dtype`, the key as data. The 1F1B custom VJP
  takes them as its input, and gives their cotangents in the same tree.
  """

  params: Any
  stage_consts: Any  # a list of arrays
  head_consts: Any
  x: Any
  targets: Any
  key: Any
  state: Any


# --- the user's functions, traced once ------------------------------------------


class Traced(NamedTuple):
  """A function traced once into a program, run without tracing it again.

  The traced values it closed over (a shared scale, the head's weights:
  anything from the enclosing `jit` or `grad`) are `consts`, passed in
  explicitly. The loops accumulate their gradients, the custom VJP takes
  them as inputs (closing over them would leak tracers), and they cross
  into `shard_map` replicated.
  """

  closed: ClosedJaxpr
  hoisted: tuple[int, ...]
  out_tree: Any

  @property
  def consts(self) -> list[Any]:
    return [self.closed.consts[i] for i in self.hoisted]

  @property
  def out_dtype(self) -> np.dtype:
    return np.dtype(self.closed.out_avals[0].dtype)

  def __call__(self, consts: Sequence[Any], *args: Any) -> Any:
    values = list(self.closed.consts)
    for i, value in zip(self.hoisted, consts, strict=True):
      values[i] = value
    program = jaxpr_as_fun(ClosedJaxpr(self.closed.jaxpr, values))
    return jax.tree.unflatten(self.out_tree, program(*jax.tree.leaves(args)))


class Lift(NamedTuple):
  """How the user's functions are traced, on the first run of the `shard_map`
  (`lifted` None) or on the second, with what they close over as inputs.

  Attributes:
    mesh: the pipeline's mesh, to trace a function in where it fails inside.
    lifted: on the second run, the functions as the first traced them.
    consts: their closed-over arrays, as `shard_map` hands them in.
  """

  mesh: Any
  lifted: list[retype.Outside] | None
  consts: Sequence[Any]


def _trace(
  fn: Callable[..., Any], example: Sequence[Any], lift: Lift, index: int
) -> tuple[Traced | None, Any, retype.Outside]:
  """`fn` (the `index`th of the user's functions) traced on `example`.

  Returns `(traced, out_shape, outside)`. On the first run `fn` is traced
  inside `shard_map`, or where that fails (it closes over arrays on an
  explicit mesh), outside it (`retype.lift`; `traced` is then None);
  `outside` holds what it closes over. On the second, the first run's
  program runs retyped with those as `lift.consts`, `fn` not traced again.
  """
  if lift.lifted is not None:
    outside = lift.lifted[index]
    before = sum(len(o.hoisted) for o in lift.lifted[:index])
    fn = outside.program(lift.consts[before : before + len(outside.hoisted)])
  try:
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*example)
  except Exception as error:
    if lift.lifted is not None:
      raise
    outside = retype.lift(fn, example, lift.mesh, error)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in outside.closed.out_avals]
    return None, jax.tree.unflatten(outside.out_tree, shapes), outside
  hoisted = tuple(i for i, c in enumerate(closed.consts) if isinstance(c, Tracer))
  out_tree = jax.tree.structure(out_shape)
  lifted = tuple(i for i, c in enumerate(closed.consts) if retype.is_hoisted(c))
  traced = Traced(closed, hoisted, out_tree)
  return traced, out_shape, retype.Outside(closed, lifted, out_tree)


def trace_user_functions(
  stage_fn: Callable[..., Any],
  loss_fn: Callable[..., Any] | None,
  inputs: tuple[Any, ...],
  layout: Layout,
  lift: Lift,
) -> tuple[Traced, Traced | None]:
  """Traces `stage_fn` as `(params, x, key, state) -> (y, state)`, and `loss_fn`.

  Inside `shard_map`, on what one device holds (`inputs`: its chunks' params,
  their dtypes, its rows of x and targets, the key as data, its state): the
  programs then have the device's types. What the functions close over
  (arrays, values traced outside) crosses into `shard_map` as inputs: the
  first run raises `retype.Retrace` with it, the second gets it (`lift`).
  """
  params, param_dtypes, x, targets, key, state = inputs

  def stage_call(params, x, key, state):
    kwargs = {} if key is None else {"rng": key}
    if state is None:
      return stage_fn(params, x, **kwargs), None
    out = stage_fn(params, x, state=state, **kwargs)
    if not (isinstance(out, tuple) and len(out) == 2):
      raise ValueError(
        "stage_fn, called with state=, must return (y, new_state); got "
        f"{type(out).__name__}."
      )
    return out

  rows = jax.tree.leaves(x)[0].shape[0] // layout.ticks.num_microbatches

  def shapes(tree, shape, dtypes=None):
    dtypes = jax.tree.map(dtype, tree) if dtypes is None else dtypes
    return jax.tree.map(
      lambda a, d: jax.ShapeDtypeStruct(shape(a.shape), d), tree, dtypes
    )

  micro = lambda tree: shapes(tree, lambda s: (rows, *s[1:]))
  per_stage = lambda tree, dtypes=None: shapes(tree, lambda s: s[1:], dtypes)
  key = layout.wrap_key(key)
  key = None if key is None else jax.ShapeDtypeStruct(key.shape, key.dtype)
  example = (per_stage(params, param_dtypes), micro(x), key, per_stage(state))
  stage, (y, new_state), stage_outside = _trace(stage_call, example, lift, 0)
  _check_stage_output(micro(x), y)
  if state is not None:
    _check_new_state(per_stage(state), new_state)
  outsides, head = [stage_outside], None
  if loss_fn is not None:
    head, value, head_outside = _trace(loss_fn, (micro(x), micro(targets)), lift, 1)
    outsides.append(head_outside)
    _check_loss(value)
  if lift.lifted is None and any(o.hoisted for o in outsides):
    raise retype.Retrace(outsides, None)
  assert stage is not None and (head is not None or loss_fn is None)
  return stage, head


def _check_loss(value: Any) -> None:
  if not (
    isinstance(value, jax.ShapeDtypeStruct)
    and value.shape == ()
    and jnp.issubdtype(value.dtype, jnp.floating)
  ):
    raise TypeError(
      "loss_fn must return a floating scalar, the loss of one micro-batch; "
      f"got {value}."
    )


# --- GPipe: the forward loop, differentiated by JAX ------------------------------


_MOVES = frozenset(
  {
    "broadcast_in_dim",
    "concatenate",
    "convert_element_type",
    "copy",
    "dynamic_slice",
    "expand_dims",
    "gather",
    "name",
    "pad",
    "reshape",
    "rev",
    "slice",
    "squeeze",
    "transpose",
  }
)


def save_arithmetic(prim: Any, *_: Any, **__: Any) -> bool:
  """A `jax.checkpoint` policy: keep what took arithmetic, redo data movement."""
  return prim.name not in _MOVES


def total_loss(
  layout: Layout,
  dtype: np.dtype,
  loss: Callable[[Any, Any], Any],
  outputs: Any,
  targets: Any,
) -> jax.Array:
  """Σ_k loss(outputs[k], targets[k]) on the last stage's devices, 0 elsewhere.

  One `lax.cond` around a loop over the micro-batches, after the forward
  loop: the other devices skip the head, and autodiff keeps what the head's
  backward needs once, not once per tick.
  """
  total_dtype = layout.accum_dtype(dtype)

  def losses(outputs, targets):
    def body(total, k):
      value = loss(take(outputs, k), take(targets, k))
      return total + value.astype(total_dtype), None

    zero = jnp.zeros((), total_dtype)
    return jax.lax.scan(body, zero, jnp.arange(layout.ticks.num_microbatches))[0]

  nothing = lambda *_: jnp.zeros((), total_dtype)
  last = jax.lax.axis_index(layout.axis) == layout.ticks.last_device
  return jax.lax.cond(last, losses, nothing, outputs, targets).astype(dtype)


# --- 1F1B and ZB-H1: forwards and backwards in one loop, the loss in the last stage


class Accumulators(NamedTuple):
  """The loops' sums over micro-batches, each floating leaf in `accum_dtype` or
  wider.

  `x` and `targets` are the input cotangents, one slot per micro-batch.
  """

  loss: jax.Array
  params: list[Any]
  stage_consts: list[Any]
  head_consts: list[Any]
  x: list[Any]
  targets: list[Any]


def zero_accumulators(layout: Layout, head: Traced, args: Args) -> Accumulators:
  widen = layout.widen
  K = layout.ticks.num_microbatches
  return Accumulators(
    loss=jnp.zeros((), layout.accum_dtype(head.out_dtype)),
    params=zeros(widen(floats(args.params))),
    stage_consts=zeros(widen(floats(args.stage_consts))),
    head_consts=zeros(widen(floats(args.head_consts))),
    x=zeros(floats(split(args.x, K))),
    targets=zeros(floats(split(args.targets, K))),
  )


def gradients(acc: Accumulators) -> tuple[list[Any], ...]:
  """The gradients of `Args`' first five fields; only the first stage wrote
  input cotangents, only the last target ones."""
  return (
    acc.params,
    acc.stage_consts,
    acc.head_consts,
    [unsplit(g) for g in acc.x],
    [unsplit(g) for g in acc.targets],
  )


def add_grads(
  sums: tuple[list[Any], list[Any]],
  chunk: Any,
  param_grads: list[Any],
  const_grads: list[Any],
  num_chunks: int,
) -> tuple[list[Any], list[Any]]:
  """`(param sums, constant sums)` with a micro-batch's gradients added."""
  param_sums, const_sums = sums
  return (
    _add_chunk(param_sums, chunk, param_grads, num_chunks),
    [a + g.astype(a.dtype) for a, g in zip(const_sums, const_grads, strict=True)],
  )


class Residuals:
  """A device's stage as the gradient loops run it: its forward, keeping what
  its backward needs, and that backward.

  Without remat what is kept are the residuals of `jax.vjp`, the leaves of
  the function it returns. Those computed from the parameters and constants
  alone (the weights, their transposes) are the same for every micro-batch
  of a chunk: `shared` holds them, computed before the loop once per chunk;
  the others (`per_microbatch`) are kept per micro-batch. With remat, what
  is kept is the stage's input and state, from which the backward recomputes
  the residuals.
  """

  def __init__(
    self, layout: Layout, stage: Traced, param_dtypes: Any, args: Args
  ) -> None:
    V = layout.ticks.num_chunks
    self.layout, self.stage, self.param_dtypes = layout, stage, param_dtypes
    self.consts = args.stage_consts
    self.key = layout.wrap_key(args.key)
    self.xs = split(args.x, layout.ticks.num_microbatches)
    self.first_input = take(self.xs, jnp.int32(0))
    self.treedef: Any = None
    zero = jnp.int32(0)
    self.example = example = (
      take_chunk(args.params, zero, V),
      self.first_input,
      layout.key(self.key, zero, zero),
      take_chunk(args.state, zero, V),
    )
    leaves = lambda *a: self.leaves(*a)[2]
    self.per_microbatch = _depends_on_inputs(leaves, example, 1)
    by_chunk = [leaves(take_chunk(args.params, v, V), *example[1:]) for v in range(V)]
    self.all_like = by_chunk[0]
    self.shared = [
      jnp.stack([chunk[i] for chunk in by_chunk])
      for i, depends in enumerate(self.per_microbatch)
      if not depends
    ]
    if layout.remat:
      self.kept_like: Any = (self.first_input, example[3])
    else:
      self.kept_like = self.kept(by_chunk[0])

  def vjp(self, params: Any, x: Any, key: Any, state: Any) -> Any:
    f = lambda p, c, x: self.stage(c, p, x, key, state)
    return jax.vjp(f, cast(params, self.param_dtypes), self.consts, x, has_aux=True)

  def leaves(self, params: Any, x: Any, key: Any, state: Any) -> Any:
    """`(y, new state, residuals)`: the leaves of the function `jax.vjp` returns."""
    y, fn, new_state = self.vjp(params, x, key, state)
    leaves, self.treedef = jax.tree.flatten(fn)
    return y, new_state, leaves

  def kept(self, leaves: list[Any]) -> list[Any]:
    """The residuals kept per micro-batch, of all of them."""
    return [r for r, d in zip(leaves, self.per_microbatch, strict=True) if d]

  def merged(self, kept: list[Any], shared: list[Any]) -> list[Any]:
    """All the residuals, from those kept per micro-batch and the shared ones."""
    kept_iter, shared_iter = iter(kept), iter(shared)
    return [next(kept_iter if d else shared_iter) for d in self.per_microbatch]

  def forward(self, params: Any, x: Any, key: Any, state: Any) -> Any:
    """`(y, new state, what to keep)`: the kept residuals, or with remat the
    stage's input and state."""
    if self.layout.remat:
      y, new_state = self.stage(
        self.consts, cast(params, self.param_dtypes), x, key, state
      )
      return y, new_state, (x, state)
    y, new_state, leaves = self.leaves(params, x, key, state)
    return y, new_state, self.kept(leaves)

  def backward_fn(self, params: Any, kept: Any, shared: list[Any], key: Any) -> Any:
    """The function `jax.vjp` returned, from what the forward kept."""
    if self.layout.remat:
      x, state = kept
      return self.vjp(params, x, key, state)[1]
    return jax.tree.unflatten(self.treedef, self.merged(kept, shared))


def head_branches(layout: Layout, head: Traced) -> tuple[Callable[..., Any], ...]:
  """The loss and its gradient on one micro-batch, and the same in an idle tick.

  Each returns `(loss, y's cotangent, head constants' and targets'
  gradients)`, the constants' widened to their sums' dtype.
  """
  loss_dtype = layout.accum_dtype(head.out_dtype)
  widen = layout.widen

  def head_grads(head_consts, y, targets):
    value, fn = jax.vjp(lambda c, y, t: head(c, y, t), head_consts, y, targets)
    const_grads, y_grads, target_grads = fn(jnp.ones((), head.out_dtype))
    grads = floats(y_grads), widen(floats(const_grads)), floats(target_grads)
    return value.astype(loss_dtype), *grads

  def idle_head(head_consts, y, targets):
    grads = (
      zeros(floats(y)),
      zeros(widen(floats(head_consts))),
      zeros(floats(targets)),
    )
    return jnp.zeros((), loss_dtype), *grads

  return head_grads, idle_head


def _depends_on_inputs(
  fn: Callable[..., Any], example: tuple[Any, ...], num_fixed: int
) -> list[bool]:
  """For each leaf of `fn(*example)`: does it depend on `example[num_fixed:]`?"""
  jaxpr = jax.make_jaxpr(fn)(*example).jaxpr
  fixed = len(jax.tree.leaves(example[:num_fixed]))
  dependent = set(jaxpr.invars[fixed:])
  for eqn in jaxpr.eqns:
    if any(isinstance(v, Var) and v in dependent for v in eqn.invars):
      dependent.update(eqn.outvars)
  return [isinstance(v, Var) and v in dependent for v in jaxpr.outvars]


# --- across devices -------------------------------------------------------------


def batch_spec(layout: Layout) -> P:
  return P(layout.data_axes) if layout.data_axes else P()


def specs(layout: Layout) -> tuple[P, ...]:
  """`shard_map`'s specs for `(params, x, targets, key, state)`."""
  batch, stages = batch_spec(layout), P(None, layout.axis)
  return (stages, batch, batch, P(), stages)


def placed(mesh: Any, specs: tuple[P, ...], inputs: tuple[Any, ...]) -> tuple[Any, ...]:
  """`inputs` moved where `shard_map` over explicit axes takes them."""
  if not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return inputs
  return tuple(
    jax.tree.map(
      lambda a, s=spec: jax.sharding.reshard(a, jax.NamedSharding(mesh, s)), tree
    )
    for tree, spec in zip(inputs, specs, strict=True)
  )


def shift(tree: Any, layout: Layout, step: int) -> Any:
  """Sends every device's `tree` to device s + step: round the ring with
  interleaved stages (V > 1, not ZB-V's V)."""
  S = layout.ticks.num_stages
  if layout.ticks.cyclic:
    pairs = [(s, (s + step) % S) for s in range(S)]
  else:
    pairs = [(s, s + step) for s in range(S) if 0 <= s + step < S]
  return jax.lax.ppermute(tree, layout.axis, pairs)


def from_last_stage(layout: Layout, outputs: Any) -> Any:
  """The last stage's `outputs` on every stage (zeros elsewhere, so a psum).

  Booleans go through int32, the dtype psum gives them, and come back bool.
  """

  def broadcast(y):
    summed = jax.lax.psum(
      y.astype(jnp.int32) if y.dtype == jnp.bool_ else y, layout.axis
    )
    return summed.astype(y.dtype)

  return jax.tree.map(broadcast, outputs)


def combine_state(layout: Layout, state: Any) -> Any:
  """One state from each data shard's: floating leaves averaged, others the first's."""
  if not layout.data_axes:
    return state
  axes = layout.data_axes
  first = jax.lax.axis_index(axes) == 0

  def combine(x):
    if is_float(x.dtype):
      return jax.lax.pmean(x, axes)
    is_key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(x) if is_key else x
    wide = data.astype(jnp.int32) if data.dtype == jnp.bool_ else data
    summed = jax.lax.psum(jnp.where(first, wide, jnp.zeros_like(wide)), axes)
    summed = summed.astype(data.dtype)
    return (
      jax.random.wrap_key_data(summed, impl=jax.random.key_impl(x))
      if is_key
      else summed
    )

  return jax.tree.map(combine, state)


# --- trees ----------------------------------------------------------------------


def is_float(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.inexact)


def dtype(x: Any) -> Any:
  """`x`'s dtype: a NumPy one, or a PRNG key's, which NumPy cannot name."""
  return x.dtype if hasattr(x, "dtype") else np.dtype(jnp.result_type(x))


def floats(tree: Any) -> list[Any]:
  """The leaves of `tree` that carry cotangents: the floating ones."""
  return [x for x in jax.tree.leaves(tree) if is_float(dtype(x))]


def with_float0(floats: Sequence[Any], like: Any) -> Any:
  """`like`'s tree with `floats` at its floating leaves, float0 zeros elsewhere."""
  values = iter(floats)
  return jax.tree.map(
    lambda x: (
      next(values) if is_float(dtype(x)) else np.zeros(jnp.shape(x), jax.dtypes.float0)
    ),
    like,
  )


def zeros_like(tree: Any) -> Any:
  """`tree` with every leaf zeros, made as `zeros` makes them."""
  return jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), dtype(a)), tree)


def zeros(leaves: Sequence[Any]) -> list[Any]:
  """Zeros like each leaf, laid out by the context: a value closed over keeps
  the layout of the mesh outside `shard_map`, which `zeros_like` would copy."""
  return [jnp.zeros(jnp.shape(a), dtype(a)) for a in leaves]


def cast(tree: Any, dtypes: Any) -> Any:
  return jax.tree.map(lambda a, d: a if a.dtype == d else a.astype(d), tree, dtypes)


def stop(tree: Any) -> Any:
  return jax.tree.map(jax.lax.stop_gradient, tree)


def take(tree: Any, index: Any) -> Any:
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, False), tree)


def put(tree: Any, index: Any, values: Any, where: Any) -> Any:
  """`tree[index] = values` where `where`, else unchanged."""

  def put(a, value):
    value = jnp.where(where, value, jax.lax.dynamic_index_in_dim(a, index, 0, False))
    return jax.lax.dynamic_update_index_in_dim(a, value, index, 0)

  return jax.tree.map(put, tree, values)


def select(pred: Any, on_true: Any, on_false: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def take_chunk(tree: Any, chunk: Any, num_chunks: int) -> Any:
  """Chunk `chunk` of a `[V, ...]` tree (static with V = 1)."""
  if num_chunks == 1:
    return jax.tree.map(lambda a: a[0], tree)
  return take(tree, chunk)


def put_chunk(tree: Any, chunk: Any, values: Any, num_chunks: int) -> Any:
  if num_chunks == 1:
    return jax.tree.map(lambda v: v[None], values)
  return jax.tree.map(
    lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, chunk, 0), tree, values
  )


def _add_chunk(
  acc: list[Any], chunk: Any, values: list[Any], num_chunks: int
) -> list[Any]:
  """`acc[chunk] += values`, each value cast to its sum's dtype."""
  if num_chunks == 1:
    return [a + v[None].astype(a.dtype) for a, v in zip(acc, values, strict=True)]
  return [a.at[chunk].add(v.astype(a.dtype)) for a, v in zip(acc, values, strict=True)]


def local_chunks(tree: Any) -> Any:
  """`[V, 1, ...]` (a device's share of `[V, S, ...]`) as `[V, ...]`."""
  return jax.tree.map(lambda a: a[:, 0], tree)


def device_chunks(tree: Any) -> Any:
  """`[V, ...]` as `[V, 1, ...]`, a device's share of `[V, S, ...]`."""
  return jax.tree.map(lambda a: a[:, None], tree)


def split(tree: Any, num_microbatches: int) -> Any:
  return jax.tree.map(
    lambda a: a.reshape(num_microbatches, a.shape[0] // num_microbatches, *a.shape[1:]),
    tree,
  )


def unsplit(tree: Any) -> Any:
  return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), tree)


def stack_chunks(tree: Any, name: str, ticks: _Ticks, axis: str) -> Any:
  """`tree` with leading `[V, S]` (a `[S]` tree gets a leading 1), or raises."""
  S, V = ticks.num_stages, ticks.num_chunks
  lead = (S,) if V == 1 else (V, S)
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not leaves and name == "stage_params":
    raise ValueError("stage_params holds no arrays.")
  for path, leaf in leaves:
    where = name + jax.tree_util.keystr(path)
    shape = getattr(leaf, "shape", None)
    if shape is None or not hasattr(leaf, "dtype"):
      raise TypeError(f"{where} must be an array, got {type(leaf).__name__}.")
    if tuple(shape[: len(lead)]) != lead:
      if V == 1:
        found = shape[0] if shape else "none (a scalar)"
        raise ValueError(
          f"{where} has shape {tuple(shape)}: its leading size {found} must be "
          f"the number of stages, the size {S} of mesh axis {axis!r}. Stack "
          "the S stages' leaves on a leading axis."
        )
      order = (
        "stage s at [0, s] and stage 2S − 1 − s at [1, s], ZB-V's V"
        if ticks.v_shape
        else "stage v·S + s at [v, s]"
      )
      raise ValueError(
        f"{where} has shape {tuple(shape)}: with num_virtual_stages={V} its "
        f"leading sizes must be (V, S) = {lead}, {order} (S is the size of "
        f"mesh axis {axis!r})."
      )
  return tree if V > 1 else jax.tree.map(lambda a: a[None], tree)


def unstack_chunks(tree: Any, ticks: _Ticks) -> Any:
  return tree if ticks.num_chunks > 1 else jax.tree.map(lambda a: a[0], tree)


# --- checks, at trace time ----------------------------------------------------


def _check_stage_output(inputs: Any, outputs: Any) -> None:
  """`stage_fn` must return its input's structure, shapes and dtypes."""
  if jax.tree.structure(outputs) != jax.tree.structure(inputs):
    raise ValueError(
      "stage_fn must return a tree like its input, as the next stage takes it: "
      f"input {jax.tree.structure(inputs)}, output {jax.tree.structure(outputs)}."
    )
  flat_inputs = jax.tree_util.tree_flatten_with_path(inputs)[0]
  for (path, a), b in zip(flat_inputs, jax.tree.leaves(outputs), strict=True):
    if (a.shape, a.dtype) != (b.shape, b.dtype):
      raise ValueError(
        "stage_fn must return its input's shape and dtype, as the next stage "
        f"takes it: on a micro-batch, input x{jax.tree_util.keystr(path)} is "
        f"{a.dtype.name}{list(a.shape)} but stage_fn returns "
        f"{b.dtype.name}{list(b.shape)}."
      )


def _check_new_state(state: Any, new_state: Any) -> None:
  """`stage_fn`'s new state must be like the state it got."""
  if jax.tree.structure(new_state) != jax.tree.structure(state):
    raise ValueError(
      "stage_fn must return a new state with its state's structure: got "
      f"{jax.tree.structure(state)}, returned {jax.tree.structure(new_state)}."
    )
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  for (path, a), b in zip(flat, jax.tree.leaves(new_state), strict=True):
    if (a.shape, a.dtype) != (b.shape, b.dtype):
      raise ValueError(
        f"stage_fn must return a new state like its state: state"
        f"{jax.tree_util.keystr(path)} is {a.dtype.name}{list(a.shape)} but the "
        f"new one is {b.dtype.name}{list(b.shape)}."
      )

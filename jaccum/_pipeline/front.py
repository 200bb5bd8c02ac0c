"""`pipeline`: micro-batches flowing through model stages, one stage per device.

The S stages of a model live on the S positions of a mesh axis; with
`num_virtual_stages=V`, each device holds V of the L = S·V stages (device s
holds stages s, S + s, …, as in Megatron's interleaved schedule and MaxText's
circular pipeline). Each data shard's rows are cut into K micro-batches,
which flow through the stages in a `lax.scan` over the ticks of a schedule
(`pipeline_schedule`): in a tick every device runs at most one stage forward
(F) and, in 1F1B, one backward; ZB-H1 runs one of F, B (the backward to the
stage's input) and W (to its weights). Then each device hands activations to
the next device and cotangents to the previous one with a `ppermute`.

Everything runs in one `shard_map` over the stage and data axes, under
`jit`. `stage_fn` and `loss_fn` are traced once, inside it, into programs
that the loops run; the traced values they close over (a scale shared by all
stages, a tied table, the head's weights) are explicit inputs of those
programs, so their gradients accumulate like the stage parameters'. What
they close over also crosses into the `shard_map` as its inputs (a second
run of it, `_retype`): JAX does not let a `shard_map` body use an array
typed on the mesh outside it, and where a function uses one (an explicit
mesh) it is traced outside the `shard_map` and its program retyped.
Gradients accumulate in `accum_dtype` (float32) whatever the parameters'
dtype, and `shard_map`'s transpose sums each over the devices once.

- `"gpipe"`: `jax.grad` differentiates the forward loop, whose backward runs
  after all the forwards.
- `"1f1b"` (with `loss_fn`): one loop, in which the last stage computes each
  micro-batch's loss right after its forward, so that micro-batch's backward
  starts while later ones still go forward. A custom VJP: its forward rule
  runs that loop and returns the gradients, its backward rule scales them.
- `"zb-h1"` (with `loss_fn`): the same custom VJP around a loop that runs,
  per tick, what the schedule's table says: F, B or W. The stage's backward
  program is cut in two (`_pipeline_backward`): B sends the input's
  cotangent on at once, W follows when the device would otherwise idle.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, Var, jaxpr_as_fun

from jaccum._core import retype as _retype
from jaccum._core.accumulators import check_accum_dtype
from jaccum._core.microbatch import check_num_microbatches
from jaccum._pipeline import backward as _pipeline_backward
from jaccum._pipeline.tables import (
  KINDS,
  PipelineSchedule,
  ScheduleName,
  _Ticks,
  check_positive_int,
  check_schedule,
  pipeline_schedule,
  zero_bubble_tables,
)

P = jax.sharding.PartitionSpec


def pipeline(
  stage_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
  axis: str = "stage",
  data_axes: str | Sequence[str] = (),
  schedule: ScheduleName = "gpipe",
  remat: bool = False,
  loss_fn: Callable[[Any, Any], Any] | None = None,
  num_virtual_stages: int = 1,
  accum_dtype: Any = jnp.float32,
) -> Callable[..., Any]:
  """Runs the stages of a model as a pipeline over K micro-batches.

  `f = pipeline(stage_fn, K, mesh=mesh)` computes, in exact arithmetic::

    def f(stage_params, x):
      for l in range(L):  # L = S stages, S = mesh.shape[axis]
        x = stage_fn(jax.tree.map(lambda p: p[l], stage_params), x)
      return x

  but stage s runs only on the devices at position s of `axis`, keeps its
  parameters there, and works on K micro-batches one after another; only
  activations (and, backwards, their cotangents) pass between neighbouring
  stages. The mesh axes in `data_axes` shard the batch: each data shard
  pipelines its own rows, and the gradients are reduced over them once per
  step, after the loop. `jax.grad` through `f` gives each stage's gradients
  summed over the micro-batches: the whole batch's.

  With `loss_fn`, the last stage also computes the loss, micro-batch by
  micro-batch, and `f(stage_params, x, targets)` returns::

    sum(loss_fn(y[m], targets[m]) for m in range(D * K))

  where y[m] is the last stage's output on micro-batch m of the D × K of the
  whole batch (D data shards). Micro-batch m holds rows m·R to (m + 1)·R − 1
  (R = N / (D × K)): each data shard cuts its block of rows into K in order.
  The head and the loss then run once per micro-batch, on the last stage,
  instead of on the output that every stage holds; and `"1f1b"` and
  `"zb-h1"` can start a micro-batch's backward right after its forward.

  Schedules, with F a stage's forward on one micro-batch and B its backward
  (B ≈ 2F; `"zb-h1"` runs it as B, to the stage's input, and W, to its
  weights, each ≈ F):

  - `"gpipe"`: F + B per micro-batch and stage; a stage keeps the
    activations of all K + S − 1 ticks for the backward, growing with K
    (with `remat`: 2F + B, and only each tick's stage input). Needs no
    `loss_fn`, and forward mode (`jax.jvp`) works through it. Wins at small
    K, and where the loss cannot run inside the pipeline.
  - `"1f1b"`: F + B; a device keeps the residuals of a bounded number of
    micro-batches however large K is (with `remat`: 2F + B, and only their
    stage inputs). With V = 1, at most 2S − 1 (stage s needs
    2(S − 1 − s) + 1). With V > 1, chunk v (stage v·S + s, 1/V of the
    device's work) keeps 2S for v < (V − 1)/2, 2S − 1 for v = (V − 1)/2 and
    S for v ≥ V/2: S·⌈3V/2⌉ − (V mod 2) chunk residuals in all (8 + 4 for
    S = 4, V = 2). Needs `loss_fn`; reverse mode only on the loss, though
    its gradient differentiates again (`jax.hessian`, Hessian-vector
    products). From K ≈ 2S on: the least compute, or with `remat` the least
    memory, which does not grow with K.
  - `"zb-h1"`: F + B + W (= F + B), the zero-bubble schedule ZB-H1 of Qi et
    al.: B runs as soon as the next stage's cotangent arrives, W later, in
    ticks where the device would otherwise idle. A device keeps, per
    micro-batch, the residuals B and W need from F to B or W, and what W
    needs of B from B to W: at most S micro-batches at once, whatever K
    (with `remat`: 2F + B + W; the stage input from F to B, and what W needs
    from B to W). Needs `loss_fn` and V = 1; as `"1f1b"`, reverse mode only
    on the loss, its gradient differentiable again. The least idle time:
    3K + S − 1 ticks of F, B or W for K ≥ S.

  In lockstep ticks GPipe and 1F1B take (K + S − 1)(F + B); a stage is idle
  for the bubble, (S − 1) / (K + S − 1) of that. With `num_virtual_stages=V`
  each device runs V stages, each 1/V of the work, and a micro-batch goes
  round the devices V times: the bubble falls to (S − 1) / (V·K + S − 1).
  ZB-H1 idles (S − 1) / (3K + S − 1) of its ticks (F = B = W), a third of
  1F1B's bubble; `pipeline_schedule` draws any of them.

  Args:
    stage_fn: `stage_fn(params_l, x_mb) -> y_mb`, one stage on one
      micro-batch; `y_mb` has `x_mb`'s structure, shapes and dtypes. It sees
      stage l's slice of `stage_params` (the leading stage axes removed).
      When `f` gets `rng`, it is called with `rng=key`; when `f` gets
      `state`, with `state=state_l`, and returns `(y_mb, new_state_l)`. The
      traced arrays it closes over get gradients like arguments.
    num_microbatches: micro-batches per step and per data shard, K.
    mesh: the device mesh; each of its axes of size > 1 is `axis` or one of
      `data_axes`.
    axis: the mesh axis of the stages.
    data_axes: the mesh axes that shard the batch (e.g. `"data"`).
    schedule: `"gpipe"`, `"1f1b"` or `"zb-h1"`, above.
    remat: keep only each stage's micro-batch inputs for the backward and
      recompute the rest (`jax.checkpoint`): one more forward.
    loss_fn: `loss_fn(y_mb, targets_mb) -> scalar`, the loss of one
      micro-batch, run by the last stage; the traced arrays it closes over
      (the head's weights) get gradients like arguments. For a mean over the
      batch, make it a sum over its rows and divide `f`'s result by the
      number of rows (or tokens).
    num_virtual_stages: stages per device, V (L = S·V stages in all); 1
      with `"zb-h1"`.
    accum_dtype: floating gradients narrower than this (bfloat16) are
      accumulated in it and cast back at the end (the stage parameters' are
      also summed over devices in it); `None` keeps their dtype. The summed
      loss is accumulated in it too.

  Returns:
    `f(stage_params, x, targets=None, *, rng=None, state=None)`. Every leaf
    of `stage_params` has leading dimensions `[S]`, or `[V, S]` with V > 1
    (stage v·S + s at `[v, s]`), sharded over `axis` on the S dimension.
    `x` (and `targets`) are pytrees of arrays with a common leading batch
    size N, a multiple of D × K. `f` returns `y`, with `x`'s structure and
    dtypes, sharded like `x` over the data axes and replicated over `axis`;
    with `loss_fn`, the summed loss.

    With `rng=key`, stage l on micro-batch m gets
    `jax.random.fold_in(jax.random.fold_in(key, m), l)`: a different key for
    every stage and micro-batch. With `state=` (a tree with `stage_params`'
    leading dimensions: BatchNorm statistics, counters), each stage's state
    is threaded through its micro-batches in order, once per micro-batch
    (never in the bubble), and `f` returns `(y_or_loss, new_state)`. With
    several data shards each advances its own copy; floating state comes
    back averaged over them, other state as the first shard left it. State
    gets no gradient.

  Raises:
    ValueError: `num_microbatches` or `num_virtual_stages` is below 1, an
      axis or option is unknown, a mesh axis is neither `axis` nor a data
      axis, a leading size is not the number of stages, N does not split
      into D × K micro-batches, `stage_fn` changes its input's structure,
      shape or dtype, `"1f1b"` or `"zb-h1"` has no `loss_fn`, or `"zb-h1"`
      has V > 1.
    TypeError: `num_microbatches` or `num_virtual_stages` is not an int (or
      is a bool), `loss_fn` does not return a floating scalar, `targets` is
      given without `loss_fn`, `rng` is not a key.

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

    The loss in the last stage, and the 1F1B and zero-bubble schedules:

    >>> loss = lambda y, t: jnp.sum((y - t) ** 2)
    >>> def sequential_loss(ws):
    ...   y = x
    ...   for w in ws:
    ...     y = stage(w, y)
    ...   return loss(y, jnp.ones_like(x))
    >>> for schedule in ("1f1b", "zb-h1"):
    ...   f = jaccum.pipeline(stage, 2, mesh=mesh, schedule=schedule, loss_fn=loss)
    ...   grads = jax.jit(jax.grad(f))(ws, x, jnp.ones_like(x))
    ...   print(bool(jnp.allclose(grads, jax.grad(sequential_loss)(ws), atol=1e-6)))
    True
    True
  """
  num_microbatches = check_num_microbatches(num_microbatches)
  num_chunks = check_positive_int(num_virtual_stages, "num_virtual_stages")
  accum = check_accum_dtype(accum_dtype, "accum_dtype")
  check_schedule(schedule, num_chunks)
  if schedule != "gpipe" and loss_fn is None:
    raise ValueError(
      f'schedule="{schedule}" needs loss_fn=: a micro-batch\'s backward starts '
      "right after its loss, which the last stage must therefore compute. Pass "
      'the head and loss as loss_fn=, or use "gpipe" (remat=True for less '
      "memory)."
    )
  data_axes = _check_axes(mesh, axis, data_axes)
  num_shards = math.prod(mesh.shape[a] for a in data_axes)
  # The schedule the loops run, as `pipeline_schedule` returns it.
  plan = pipeline_schedule(
    mesh.shape[axis],
    num_microbatches,
    schedule=schedule,
    num_virtual_stages=num_chunks,
  )
  ticks = _Ticks(plan.num_stages, num_chunks, num_microbatches)

  def apply(
    stage_params: Any,
    x: Any,
    targets: Any = None,
    *,
    rng: jax.Array | None = None,
    state: Any = None,
  ) -> Any:
    if loss_fn is None and targets is not None:
      raise TypeError(
        "targets is what loss_fn takes beside the last stage's output, but "
        "this pipeline has no loss_fn: pass loss_fn= to pipeline(), or drop "
        "targets."
      )
    params = _stack_chunks(stage_params, "stage_params", ticks, axis)
    chunked_state = (
      None if state is None else _stack_chunks(state, "state", ticks, axis)
    )
    batch = {"x": x} if loss_fn is None else {"x": x, "targets": targets}
    _check_batch(batch, num_microbatches, num_shards, data_axes)
    key_data, key_impl = (None, None) if rng is None else _check_key(rng)
    layout = _Layout(plan, axis, data_axes, bool(remat), accum, key_impl)
    param_dtypes = jax.tree.map(_dtype, params)

    def local(lifted, params, x, targets, key, state, *consts):
      params, state = _local_chunks(params), _local_chunks(state)
      stage, head = _trace_user_functions(
        stage_fn,
        loss_fn,
        (params, param_dtypes, x, targets, key, state),
        layout,
        _Lift(mesh, lifted, consts),
      )
      args = _Args(
        params=params,
        stage_consts=stage.consts,
        head_consts=[] if head is None else head.consts,
        x=x,
        targets=targets,
        key=key,
        state=state,
      )
      if schedule != "gpipe":
        assert head is not None
        out, state = _gradient_loop(layout, stage, head, param_dtypes, args)
      else:
        out, state = _gpipe(layout, stage, head, param_dtypes, args)
      out = out if head is None else out[None]  # each device's share
      return out, _combine_state(layout, _device_chunks(state))

    # Parameters enter in `accum_dtype` and are cast to their own dtype where
    # a stage uses them: their gradients are accumulated in it, and summed
    # over the data shards in it by `shard_map`'s transpose.
    widened = layout.widen(params)
    inputs = (widened, x, targets, key_data, chunked_state)
    specs = _specs(layout)
    # A loss comes out as each device's share, summed after `shard_map`:
    # summed inside, its cotangent would reach the backward through a psum,
    # and XLA could not fold away a multiplication by 1.
    out_spec = _batch_spec(layout) if loss_fn is None else P(layout.all_axes)

    out, new_state = _sharded(local, mesh, specs, (out_spec, specs[-1]), inputs)
    if loss_fn is not None:
      out = jnp.sum(out)
    if state is None:
      return out
    return out, _unstack_chunks(new_state, ticks)

  return apply


def _sharded(
  local: Callable[..., Any],
  mesh: Any,
  specs: tuple[P, ...],
  out_specs: Any,
  inputs: tuple[Any, ...],
) -> Any:
  """`local(lifted, *inputs)` on every device, under a jitted `shard_map`.

  Run again where the first run asks (`_retype.Retrace`), with what the
  user's functions close over as more inputs, whole on every device.
  """

  def run(lifted, consts=()):
    in_specs = (*specs, *[P()] * len(consts))
    # jit: JAX's eager shard_map cannot differentiate a custom VJP inside it.
    sharded = jax.jit(
      jax.shard_map(
        functools.partial(local, lifted),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=False,
      )
    )
    return sharded(*_placed(mesh, in_specs, (*inputs, *consts)))

  try:
    return run(None)
  except _retype.Retrace as retrace:
    return run(retrace.outside, [c for o in retrace.outside for c in o.consts])


class _Layout(NamedTuple):
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
    return _Ticks(plan.num_stages, plan.num_virtual_stages, plan.num_microbatches)

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
    stage = chunk * ticks.num_stages + jax.lax.axis_index(self.axis)
    index = data * ticks.num_microbatches + microbatch
    return jax.random.fold_in(jax.random.fold_in(key, index), stage)

  def accum_dtype(self, dtype: Any) -> Any:
    """`dtype`, or `accum_dtype` where that is a wider float. Other dtypes
    (integers, PRNG keys, which NumPy cannot even name) stay as they are."""
    accum = self.accum
    if accum is None or not _is_float(dtype):
      return dtype
    dtype = np.dtype(dtype)
    return accum if dtype.itemsize < accum.itemsize else dtype

  def widen(self, tree: Any) -> Any:
    """`tree`'s floating leaves in `accum_dtype` where that is wider."""
    return jax.tree.map(lambda a: _cast(a, self.accum_dtype(_dtype(a))), tree)


class _Args(NamedTuple):
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


class _Traced(NamedTuple):
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


class _Lift(NamedTuple):
  """How the user's functions are traced, on the first run of the `shard_map`
  (`lifted` None) or on the second, with what they close over as inputs.

  Attributes:
    mesh: the pipeline's mesh, to trace a function in where it fails inside.
    lifted: on the second run, the functions as the first traced them.
    consts: their closed-over arrays, as `shard_map` hands them in.
  """

  mesh: Any
  lifted: list[_retype.Outside] | None
  consts: Sequence[Any]


def _trace(
  fn: Callable[..., Any], example: Sequence[Any], lift: _Lift, index: int
) -> tuple[_Traced | None, Any, _retype.Outside]:
  """`fn` (the `index`th of the user's functions) traced on `example`.

  Returns `(traced, out_shape, outside)`. On the first run `fn` is traced
  inside `shard_map`, or where that fails (it closes over arrays on an
  explicit mesh), outside it (`_retype.lift`; `traced` is then None);
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
    outside = _retype.lift(fn, example, lift.mesh, error)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in outside.closed.out_avals]
    return None, jax.tree.unflatten(outside.out_tree, shapes), outside
  hoisted = tuple(i for i, c in enumerate(closed.consts) if isinstance(c, Tracer))
  out_tree = jax.tree.structure(out_shape)
  lifted = tuple(i for i, c in enumerate(closed.consts) if _retype.is_hoisted(c))
  traced = _Traced(closed, hoisted, out_tree)
  return traced, out_shape, _retype.Outside(closed, lifted, out_tree)


def _trace_user_functions(
  stage_fn: Callable[..., Any],
  loss_fn: Callable[..., Any] | None,
  inputs: tuple[Any, ...],
  layout: _Layout,
  lift: _Lift,
) -> tuple[_Traced, _Traced | None]:
  """Traces `stage_fn` as `(params, x, key, state) -> (y, state)`, and `loss_fn`.

  Inside `shard_map`, on what one device holds (`inputs`: its chunks' params,
  their dtypes, its rows of x and targets, the key as data, its state): the
  programs then have the device's types. What the functions close over
  (arrays, values traced outside) crosses into `shard_map` as inputs: the
  first run raises `_retype.Retrace` with it, the second gets it (`lift`).
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
    dtypes = jax.tree.map(_dtype, tree) if dtypes is None else dtypes
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
    raise _retype.Retrace(outsides, None)
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


def _gpipe(
  layout: _Layout,
  stage: _Traced,
  head: _Traced | None,
  param_dtypes: Any,
  args: _Args,
) -> tuple[Any, Any]:
  """A device's forward loop (and head); `jax.grad` makes the backward loop.

  Returns the output (replicated over the stages) or the device's share of
  the summed loss, and the device's state. Closed-over values are used in
  `accum_dtype` too, so that their gradients accumulate in it.
  """
  num_microbatches = layout.ticks.num_microbatches
  widen = layout.widen
  stage_consts, head_consts = widen(args.stage_consts), widen(args.head_consts)

  def run(params, x, key, state):
    consts = _cast(stage_consts, [c.dtype for c in args.stage_consts])
    return stage(consts, _cast(params, param_dtypes), x, key, state)

  xs = _split(args.x, num_microbatches)
  key = layout.wrap_key(args.key)
  outputs, state = _forward_loop(layout, run, args.params, xs, key, args.state)
  if head is None:
    return _unsplit(_from_last_stage(layout, outputs)), state
  traced = head

  def loss(y, t):
    return traced(_cast(head_consts, [c.dtype for c in args.head_consts]), y, t)

  targets = _split(args.targets, num_microbatches)
  return _total_loss(layout, traced.out_dtype, loss, outputs, targets), state


def _forward_loop(
  layout: _Layout,
  run: Callable[..., Any],
  params: Any,
  xs: Any,
  key: Any,
  state: Any,
) -> tuple[Any, Any]:
  """All forward ticks; returns the last stage's outputs `[K, ...]` and the state.

  The outputs are filled in on the device holding the last stage, and are
  zeros elsewhere.
  """
  ticks = layout.ticks
  S, V, K = ticks.num_stages, ticks.num_chunks, ticks.num_microbatches
  device = jax.lax.axis_index(layout.axis)

  # With V > 1 a tick's parameters are a chunk chosen by the tick: autodiff
  # would keep it, and every slice or transpose the stage takes of it, for
  # the backward once per tick. Kept instead is only what took arithmetic
  # to compute; the backward slices the chunk again from the stack of all
  # chunks, which the loop does not change and autodiff keeps once.
  def run_chunk(params, chunk, x, key, state):
    return run(_take_chunk(params, chunk, V), x, key, state)

  if layout.remat:
    run_chunk = jax.checkpoint(run_chunk)
  elif V > 1:
    run_chunk = jax.checkpoint(run_chunk, policy=_save_arithmetic)

  def tick(carry, t):
    received, outputs, state = carry
    microbatch, chunk, active = ticks.forward(t, device)
    microbatch = jnp.clip(microbatch, 0, K - 1)
    inputs = _select((device == 0) & (chunk == 0), _take(xs, microbatch), received)
    # A device runs `stage_fn` in its idle ticks too, and what it computes
    # there goes nowhere (its cotangent is zero). Skipping it with
    # `lax.cond` would make autodiff keep the cond's operands, the
    # parameters included, once per tick. Idle ticks see real data, never
    # placeholders (the first micro-batch's input before a device's first
    # micro-batch arrives, activations of the last one after its last), so
    # `stage_fn` is not asked for values and derivatives at points like 0,
    # where it may have none.
    old_state = _take_chunk(state, chunk, V)
    step_key = layout.key(key, microbatch, chunk)
    y, new_state = run_chunk(params, chunk, inputs, step_key, _stop(old_state))
    last = active & (device == S - 1) & (chunk == V - 1)
    outputs = _put(outputs, microbatch, y, last)
    new_state = _select(active, _stop(new_state), old_state)
    state = _put_chunk(state, chunk, new_state, V)
    return (_shift(y, layout, +1), outputs, state), None

  outputs = jax.tree.map(jnp.zeros_like, xs)
  carry = (_take(xs, jnp.int32(0)), outputs, state)
  steps = jnp.arange(ticks.num_forward_ticks)
  (_, outputs, state), _ = jax.lax.scan(tick, carry, steps)
  return outputs, state


# Primitives that only move or retype data: recomputing them costs no arithmetic.
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


def _save_arithmetic(prim: Any, *_: Any, **__: Any) -> bool:
  """A `jax.checkpoint` policy: keep what took arithmetic, redo data movement."""
  return prim.name not in _MOVES


def _total_loss(
  layout: _Layout,
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
      value = loss(_take(outputs, k), _take(targets, k))
      return total + value.astype(total_dtype), None

    zero = jnp.zeros((), total_dtype)
    return jax.lax.scan(body, zero, jnp.arange(layout.ticks.num_microbatches))[0]

  nothing = lambda *_: jnp.zeros((), total_dtype)
  last = jax.lax.axis_index(layout.axis) == layout.ticks.num_stages - 1
  return jax.lax.cond(last, losses, nothing, outputs, targets).astype(dtype)


# --- 1F1B and ZB-H1: forwards and backwards in one loop, the loss in the last stage


def _gradient_loop(
  layout: _Layout,
  stage: _Traced,
  head: _Traced,
  param_dtypes: Any,
  args: _Args,
) -> tuple[jax.Array, Any]:
  """A device's 1F1B or ZB-H1: a custom VJP whose forward rule computes the
  gradients.

  Undifferentiated it is GPipe's forward loop and head. Differentiated, its
  forward rule runs the schedule's loop (`_one_f_one_b_loop` or
  `_zero_bubble_loop`), which returns this device's share of the gradients
  of the summed loss; the backward rule scales them by the loss's cotangent,
  and `shard_map`'s transpose sums them over the devices. Returns the summed
  loss and the device's state.
  """
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), _dtype(a)), args)
  loop = _zero_bubble_loop if layout.schedule.schedule == "zb-h1" else _one_f_one_b_loop

  @jax.custom_vjp
  def run(args):
    return _gpipe(layout, stage, head, param_dtypes, args)

  def run_fwd(args):
    loss, state, grads = loop(layout, stage, head, param_dtypes, args)
    return (loss, state), grads

  def run_bwd(grads, cotangents):
    scale = cotangents[0]

    def scaled(grads, like):
      floating = [a for a in jax.tree.leaves(like) if _is_float(a.dtype)]
      grads = [
        (g * scale.astype(g.dtype)).astype(a.dtype)
        for g, a in zip(grads, floating, strict=True)
      ]
      return _with_float0(grads, like)

    def zeros(like):
      floats = [jnp.zeros(a.shape, a.dtype) for a in _floats(like)]
      return _with_float0(floats, like)

    cotangent = _Args(
      *(scaled(g, a) for g, a in zip(grads, like[:5], strict=True)),
      key=zeros(like.key),
      state=zeros(like.state),
    )
    return (cotangent,)

  run.defvjp(run_fwd, run_bwd)
  return run(args)


class _Accumulators(NamedTuple):
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


def _zero_accumulators(layout: _Layout, head: _Traced, args: _Args) -> _Accumulators:
  widen = layout.widen
  K = layout.ticks.num_microbatches
  return _Accumulators(
    loss=jnp.zeros((), layout.accum_dtype(head.out_dtype)),
    params=_zeros(widen(_floats(args.params))),
    stage_consts=_zeros(widen(_floats(args.stage_consts))),
    head_consts=_zeros(widen(_floats(args.head_consts))),
    x=_zeros(_floats(_split(args.x, K))),
    targets=_zeros(_floats(_split(args.targets, K))),
  )


def _gradients(acc: _Accumulators) -> tuple[list[Any], ...]:
  """The gradients of `_Args`' first five fields; only the first stage wrote
  input cotangents, only the last target ones."""
  return (
    acc.params,
    acc.stage_consts,
    acc.head_consts,
    [_unsplit(g) for g in acc.x],
    [_unsplit(g) for g in acc.targets],
  )


def _add_grads(
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


class _Residuals:
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
    self, layout: _Layout, stage: _Traced, param_dtypes: Any, args: _Args
  ) -> None:
    V = layout.ticks.num_chunks
    self.layout, self.stage, self.param_dtypes = layout, stage, param_dtypes
    self.consts = args.stage_consts
    self.key = layout.wrap_key(args.key)
    self.xs = _split(args.x, layout.ticks.num_microbatches)
    self.first_input = _take(self.xs, jnp.int32(0))
    self.treedef: Any = None
    zero = jnp.int32(0)
    self.example = example = (
      _take_chunk(args.params, zero, V),
      self.first_input,
      layout.key(self.key, zero, zero),
      _take_chunk(args.state, zero, V),
    )
    leaves = lambda *a: self.leaves(*a)[2]
    self.per_microbatch = _depends_on_inputs(leaves, example, 1)
    by_chunk = [leaves(_take_chunk(args.params, v, V), *example[1:]) for v in range(V)]
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
    return jax.vjp(f, _cast(params, self.param_dtypes), self.consts, x, has_aux=True)

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
        self.consts, _cast(params, self.param_dtypes), x, key, state
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


def _head_branches(layout: _Layout, head: _Traced) -> tuple[Callable[..., Any], ...]:
  """The loss and its gradient on one micro-batch, and the same in an idle tick.

  Each returns `(loss, y's cotangent, head constants' and targets'
  gradients)`, the constants' widened to their sums' dtype.
  """
  loss_dtype = layout.accum_dtype(head.out_dtype)
  widen = layout.widen

  def head_grads(head_consts, y, targets):
    value, fn = jax.vjp(lambda c, y, t: head(c, y, t), head_consts, y, targets)
    const_grads, y_grads, target_grads = fn(jnp.ones((), head.out_dtype))
    grads = _floats(y_grads), widen(_floats(const_grads)), _floats(target_grads)
    return value.astype(loss_dtype), *grads

  def idle_head(head_consts, y, targets):
    grads = (
      _zeros(_floats(y)),
      _zeros(widen(_floats(head_consts))),
      _zeros(_floats(targets)),
    )
    return jnp.zeros((), loss_dtype), *grads

  return head_grads, idle_head


def _one_f_one_b_loop(
  layout: _Layout, stage: _Traced, head: _Traced, param_dtypes: Any, args: _Args
) -> tuple[jax.Array, Any, tuple[list[Any], ...]]:
  """The 1F1B loop on one device: its share of the loss, its state, and its
  share of the gradients of `_Args`' first five fields (their floating leaves).

  In each tick a device runs the forward of one micro-batch through one of
  its chunks and the backward of another (`_Ticks`). The device holding the
  last stage runs `loss_fn` and its gradient right after that stage's
  forward, and the backward in the same tick; any other stage runs a
  micro-batch's backward 2(L − 1 − l) ticks after its forward, from what the
  forward kept in a ring of slots (`_Residuals`).
  """
  ticks = layout.ticks
  residuals = _Residuals(layout, stage, param_dtypes, args)
  sizes = ticks.ring_sizes()
  ring = jax.tree.map(
    lambda a: jnp.zeros((sum(sizes), *a.shape), a.dtype), residuals.kept_like
  )
  first_input = residuals.first_input
  carry = (
    first_input,
    _zeros(_floats(first_input)),
    ring,
    args.state,
    _zero_accumulators(layout, head, args),
  )
  tick = _one_f_one_b_tick(layout, residuals, head, args, sizes)
  steps = jnp.arange(ticks.num_1f1b_ticks)
  (*_, state, acc), _ = jax.lax.scan(tick, carry, steps)
  return acc.loss.astype(head.out_dtype), state, _gradients(acc)


def _one_f_one_b_backward(residuals: _Residuals) -> tuple[Callable[..., Any], ...]:
  """A micro-batch's backward through a chunk, and the same in an idle tick.

  Cotangents travel as lists of their floating leaves; integer leaves of the
  activations (token ids passed along) have float0 cotangents. The gradients
  are added to the sums inside the branch: an idle tick leaves them as they
  are, and no gradient-sized result leaves the `cond`.
  """
  V = residuals.layout.ticks.num_chunks

  def backward(params, kept, shared, key, cotangent, chunk, sums):
    fn = residuals.backward_fn(params, kept, shared, key)
    param_grads, const_grads, input_grads = fn(
      _with_float0(cotangent, residuals.first_input)
    )
    grads = _floats(param_grads), _floats(const_grads)
    return _add_grads(sums, chunk, *grads, V), _floats(input_grads)

  def idle_backward(params, kept, shared, key, cotangent, chunk, sums):
    return sums, [jnp.zeros_like(a) for a in cotangent]

  return backward, idle_backward


def _one_f_one_b_tick(
  layout: _Layout,
  residuals: _Residuals,
  head: _Traced,
  args: _Args,
  sizes: tuple[int, ...],
) -> Callable[..., Any]:
  """The body of the 1F1B loop: one tick's forward, loss and backward."""
  ticks = layout.ticks
  S, V, K = ticks.num_stages, ticks.num_chunks, ticks.num_microbatches
  device = jax.lax.axis_index(layout.axis)
  params, xs, key = args.params, residuals.xs, residuals.key
  targets = _split(args.targets, K)
  head_grads, idle_head = _head_branches(layout, head)
  backward, idle_backward = _one_f_one_b_backward(residuals)
  # With remat the backward recomputes every residual, these too.
  shared = [] if layout.remat else residuals.shared

  def idle_forward(params, x, key, state):
    return x, state, jax.tree.map(jnp.zeros_like, residuals.kept_like)

  offsets = jnp.array(np.cumsum((0, *sizes[:-1])), jnp.int32)
  modulus = jnp.array(sizes, jnp.int32)
  slot = lambda microbatch, chunk: offsets[chunk] + microbatch % modulus[chunk]

  def tick(carry, t):
    received, cotangent_received, ring, state, acc = carry
    # Forward of micro-batch kf through chunk vf; what the backward needs
    # goes into the ring (an idle forward writes zeros where a micro-batch
    # after the last would go).
    kf, vf, forward_on = ticks.forward(t, device)
    ring_slot = slot(kf, vf)
    kf = jnp.clip(kf, 0, K - 1)
    inputs = _select((device == 0) & (vf == 0), _take(xs, kf), received)
    old_state = _stop(_take_chunk(state, vf, V))
    y, new_state, kept = jax.lax.cond(
      forward_on,
      residuals.forward,
      idle_forward,
      _take_chunk(params, vf, V),
      inputs,
      layout.key(key, kf, vf),
      old_state,
    )
    state = _put_chunk(state, vf, _stop(new_state), V)
    ring = jax.tree.map(
      lambda r, a: jax.lax.dynamic_update_index_in_dim(r, a, ring_slot, 0), ring, kept
    )
    # On the last stage, the loss and its gradient right after the forward.
    end = forward_on & (device == S - 1) & (vf == V - 1)
    value, y_grads, head_const_grads, target_grads = jax.lax.cond(
      end, head_grads, idle_head, args.head_consts, y, _take(targets, kf)
    )
    # Backward of micro-batch kb through chunk vb, from its ring slot (on
    # the last stage, the one this tick's forward just wrote).
    kb, vb, backward_on = ticks.backward(t, device)
    same_tick = (device == S - 1) & (vb == V - 1)
    kept_b = _take(ring, slot(kb, vb))
    kb = jnp.clip(kb, 0, K - 1)
    shared_b = _take_chunk(shared, vb, V)
    sums, input_grads = jax.lax.cond(
      backward_on,
      backward,
      idle_backward,
      _take_chunk(params, vb, V),
      kept_b,
      shared_b,
      layout.key(key, kb, vb),
      _select(same_tick, y_grads, cotangent_received),
      vb,
      (acc.params, acc.stage_consts),
    )
    first = backward_on & (device == 0) & (vb == 0)
    acc = _Accumulators(
      loss=acc.loss + value,
      params=sums[0],
      stage_consts=sums[1],
      head_consts=jax.tree.map(jnp.add, acc.head_consts, head_const_grads),
      x=_put(acc.x, kb, input_grads, first),
      targets=_put(acc.targets, kf, target_grads, end),
    )
    sends = (_shift(y, layout, +1), _shift(input_grads, layout, -1))
    return (*sends, ring, state, acc), None

  return tick


class _WeightSplit:
  """The stage's backward as B and W (`_pipeline_backward.split`), and where
  what each reads waits.

  B reads some residuals and the output's cotangent, and hands W the values
  W reads of it (`carried`: the cotangents of the layers' outputs); W reads
  those and residuals of its own. Per micro-batch, the residuals W reads wait
  from F to W (ring `fw`), those only B reads from F to B (`fb`), and what B
  hands W from B to W (`bw`). With remat, `fb` holds the stage's input and
  state, from which B recomputes the residuals, and B hands W the residuals
  it reads with `carried`. Residuals of the parameters alone are `shared`.
  """

  def __init__(self, residuals: _Residuals) -> None:
    self.residuals, self.remat = residuals, residuals.layout.remat
    first_input = residuals.first_input
    like = lambda tree: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(jnp.shape(a), _dtype(a)), tree
    )
    counts: list[int] = []

    def program(leaves, cotangent):
      fn = jax.tree.unflatten(residuals.treedef, leaves)
      grads = [_floats(g) for g in fn(_with_float0(cotangent, first_input))]
      counts[:] = [len(g) for g in grads]
      return [g for group in grads for g in group]

    closed = jax.make_jaxpr(program)(
      like(residuals.all_like), like(_floats(first_input))
    )
    self.num_param_grads, num_const_grads, self.num_input_grads = counts
    is_b = [False] * (self.num_param_grads + num_const_grads)
    # The cotangent waits until B: W gets what it reads of it through B.
    self.num_residuals = num = len(residuals.all_like)
    self.split = _pipeline_backward.split(
      closed,
      is_b + [True] * self.num_input_grads,
      through_b=range(num, len(closed.jaxpr.invars)),
    )
    per_microbatch = residuals.per_microbatch
    w_reads = set(self.split.w_inputs)
    self.w_kept = [i for i in self.split.w_inputs if per_microbatch[i]]
    self.b_kept = [
      i
      for i in self.split.b_inputs
      if i < num and per_microbatch[i] and i not in w_reads
    ]
    self.shared_at = [i for i, d in enumerate(per_microbatch) if not d]
    carried_like = [
      jax.ShapeDtypeStruct(a.shape, a.dtype)
      for a in self.split.b.out_avals[self.num_input_grads :]
    ]
    kept = lambda at: [residuals.all_like[i] for i in at]
    if self.remat:
      self.like = (
        (first_input, residuals.kept_like[1]),
        [],
        (kept(self.w_kept), carried_like),
      )
    else:
      self.like = (kept(self.b_kept), kept(self.w_kept), carried_like)

  def forward(self, params: Any, x: Any, key: Any, state: Any) -> Any:
    """F: `(y, new state, what waits for B, what waits for W)`."""
    if self.remat:
      y, new_state, kept = self.residuals.forward(params, x, key, state)
      return y, new_state, kept, []
    y, new_state, leaves = self.residuals.leaves(params, x, key, state)
    at = lambda indices: [leaves[i] for i in indices]
    return y, new_state, at(self.b_kept), at(self.w_kept)

  def input_backward(
    self, params: Any, fb: Any, fw: Any, shared: Any, key: Any, cotangent: Any
  ) -> tuple[list[Any], Any]:
    """B: `(the input's cotangent, what waits for W)`."""
    if self.remat:
      x, state = fb
      leaves = self.residuals.leaves(params, x, key, state)[2]
      fw = [leaves[i] for i in self.w_kept]
      by_index = dict(enumerate(leaves))
    else:
      by_index = self._by_index(fw, shared) | dict(zip(self.b_kept, fb, strict=True))
    by_index |= dict(enumerate(cotangent, start=self.num_residuals))
    reads = [by_index[i] for i in self.split.b_inputs]
    out = jaxpr_as_fun(self.split.b)(*reads)
    input_grads, carried = out[: self.num_input_grads], out[self.num_input_grads :]
    return input_grads, ((fw, carried) if self.remat else carried)

  def shared(self, params: Any) -> list[Any]:
    """The residuals of the parameters alone: kept from before the loop, or
    with remat recomputed (they take no arithmetic: weights, transposes)."""
    if not self.remat:
      return _take_chunk(self.residuals.shared, 0, 1)
    leaves = self.residuals.leaves(params, *self.residuals.example[1:])[2]
    return [leaves[i] for i in self.shared_at]

  def weight_backward(
    self, fw: Any, bw: Any, shared: Any
  ) -> tuple[list[Any], list[Any]]:
    """W: `(the parameters' gradients, the constants')`."""
    kept, carried = bw if self.remat else (fw, bw)
    by_index = self._by_index(kept, shared)
    reads = [by_index[i] for i in self.split.w_inputs]
    grads = jaxpr_as_fun(self.split.w)(*reads, *carried)
    return grads[: self.num_param_grads], grads[self.num_param_grads :]

  def _by_index(self, w_kept: list[Any], shared: list[Any]) -> dict[int, Any]:
    by_index = dict(zip(self.w_kept, w_kept, strict=True))
    return by_index | dict(zip(self.shared_at, shared, strict=True))


class _Rings(NamedTuple):
  """What waits on a device in the ZB-H1 loop, micro-batch k in slot k % size.

  `x` and `cotangent` are inboxes: what the neighbours sent, until the F or
  B that uses it; on the last stage the loss's cotangent waits in
  `cotangent` from F to B. `fb`, `fw`, `bw`: as `_WeightSplit` says.
  """

  x: Any
  cotangent: Any
  fb: Any
  fw: Any
  bw: Any


class _TickOut(NamedTuple):
  """What a ZB-H1 tick's F, B, W or idle branch returns."""

  y: Any  # sent to the next stage
  input_grads: Any  # sent to the previous stage
  state: Any
  fb: Any
  fw: Any
  bw: Any
  head: Any  # `_head_branches`' result
  sums: Any


def _zero_bubble_loop(
  layout: _Layout, stage: _Traced, head: _Traced, param_dtypes: Any, args: _Args
) -> tuple[jax.Array, Any, tuple[list[Any], ...]]:
  """The ZB-H1 loop on one device; it returns what `_one_f_one_b_loop` does.

  In each tick a device runs one of F, B and W, as the schedule's table says
  (`zero_bubble_tables`): F keeps what B and W need, the last stage's F also
  the loss and its cotangent; B computes the input's cotangent, sent on at
  once, and hands W what it needs; W adds the weights' gradients to the
  sums. What waits between them, and what arrives before the tick that uses
  it, waits in rings (`_Rings`).
  """
  residuals = _Residuals(layout, stage, param_dtypes, args)
  split = _WeightSplit(residuals)
  tables = zero_bubble_tables(layout.schedule)
  first_input = residuals.first_input

  def ring(like, size):
    return jax.tree.map(lambda a: jnp.zeros((size, *a.shape), a.dtype), like)

  rings = _Rings(
    *(
      ring(like, tables.sizes[name])
      for name, like in zip(
        _Rings._fields, (first_input, _floats(first_input), *split.like), strict=True
      )
    )
  )
  arrived = (first_input, _zeros(_floats(first_input)))
  carry = (arrived, rings, args.state, _zero_accumulators(layout, head, args))
  tick = _zero_bubble_tick(layout, split, head, args, tables)
  steps = jnp.arange(len(tables.table))
  (_, _, state, acc), _ = jax.lax.scan(tick, carry, steps)
  return acc.loss.astype(head.out_dtype), state, _gradients(acc)


def _zero_bubble_branches(
  layout: _Layout, split: _WeightSplit, head: _Traced, args: _Args
) -> Callable[..., _TickOut]:
  """What a device runs in a tick: idle, F, B or W, by `work` (0, then the
  indices of `KINDS` + 1).

  It takes `(work, params, x, key, state, rings, k, head_consts, targets,
  sums)`: the stage's parameters, micro-batch k's input (for F) and key, the
  stage's state, the rings (read here, written by the loop), k's targets and
  the gradients' sums; and returns a `_TickOut`.
  """
  head_grads, idle_head = _head_branches(layout, head)
  last = jax.lax.axis_index(layout.axis) == layout.ticks.num_stages - 1
  first_input = split.residuals.first_input
  like = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(jnp.shape(a), _dtype(a)),
    (first_input, _floats(first_input), *split.like),
  )

  # What a branch does not compute it returns as zeros: XLA would copy what
  # passed through it unchanged.
  def out(**computed):
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
    names = ("y", "input_grads", "fb", "fw", "bw")
    fields = dict(zip(names, map(zeros, like), strict=True))
    return _TickOut(**(fields | computed))

  def slot(ring, k):
    leaves = jax.tree.leaves(ring)
    return _take(ring, k % leaves[0].shape[0]) if leaves else ring

  def idle(params, x, key, state, rings, k, head_consts, targets, sums):
    return out(state=state, head=idle_head(head_consts, x, targets), sums=sums)

  def forward(params, x, key, state, rings, k, head_consts, targets, sums):
    y, new_state, fb, fw = split.forward(params, x, key, state)
    loss = jax.lax.cond(last, head_grads, idle_head, head_consts, y, targets)
    return out(y=y, state=new_state, fb=fb, fw=fw, head=loss, sums=sums)

  def input_backward(params, x, key, state, rings, k, head_consts, targets, sums):
    fb, fw, ct = slot(rings.fb, k), slot(rings.fw, k), slot(rings.cotangent, k)
    shared = [] if split.remat else split.shared(params)
    input_grads, bw = split.input_backward(params, fb, fw, shared, key, ct)
    head_out = idle_head(head_consts, x, targets)
    return out(input_grads=input_grads, state=state, bw=bw, head=head_out, sums=sums)

  def weight_backward(params, x, key, state, rings, k, head_consts, targets, sums):
    fw, bw = slot(rings.fw, k), slot(rings.bw, k)
    grads = split.weight_backward(fw, bw, split.shared(params))
    head_out = idle_head(head_consts, x, targets)
    return out(state=state, head=head_out, sums=_add_grads(sums, 0, *grads, 1))

  # W adds to the sums in place in a two-way `cond` whose other branch passes
  # them through: XLA keeps them in one buffer, where a four-way `switch`
  # would copy them. XLA's cost analysis counts either as one branch.
  def not_weight(work, *operands):
    return jax.lax.switch(work, [idle, forward, input_backward], *operands)

  def run(work, *operands):
    is_w = work == len(KINDS)
    return jax.lax.cond(
      is_w, lambda w, *o: weight_backward(*o), not_weight, work, *operands
    )

  return run


def _zero_bubble_tick(
  layout: _Layout,
  split: _WeightSplit,
  head: _Traced,
  args: _Args,
  tables: Any,
) -> Callable[..., Any]:
  """The body of the ZB-H1 loop: store what arrived, run the tick's work,
  keep what it computed, send."""
  residuals = split.residuals
  S, K = layout.ticks.num_stages, layout.ticks.num_microbatches
  device = jax.lax.axis_index(layout.axis)
  table = jnp.asarray(tables.table)
  sizes = _Rings(*(tables.sizes[name] for name in _Rings._fields))
  run = _zero_bubble_branches(layout, split, head, args)
  targets = _split(args.targets, K)
  num_kinds = len(KINDS) + 1

  def arrival(t, source, kind):
    """The micro-batch whose `kind`'s output `source` sent last tick, or -1."""
    code = table[jnp.maximum(t - 1, 0), jnp.clip(source, 0, S - 1)]
    sent = (t > 0) & (source >= 0) & (source < S) & (code % num_kinds == kind)
    return jnp.where(sent, code // num_kinds, -1)

  def tick(carry, t):
    (x_arrived, ct_arrived), rings, state, acc = carry
    code = table[t, device]
    work, k = code % num_kinds, code // num_kinds
    k_x, k_ct = arrival(t, device - 1, 1), arrival(t, device + 1, 2)
    rings = rings._replace(
      x=_put(rings.x, k_x % sizes.x, x_arrived, k_x >= 0),
      cotangent=_put(rings.cotangent, k_ct % sizes.cotangent, ct_arrived, k_ct >= 0),
    )
    x = _select(device == 0, _take(residuals.xs, k), _take(rings.x, k % sizes.x))
    old_state = _stop(_take_chunk(state, 0, 1))
    out = run(
      work,
      _take_chunk(args.params, 0, 1),
      x,
      layout.key(residuals.key, k, 0),
      old_state,
      rings,
      k,
      args.head_consts,
      _take(targets, k),
      (acc.params, acc.stage_consts),
    )
    is_f, is_b = work == 1, work == 2
    end = is_f & (device == S - 1)
    value, y_grads, head_const_grads, target_grads = out.head
    rings = rings._replace(
      cotangent=_put(rings.cotangent, k % sizes.cotangent, y_grads, end),
      fb=_put(rings.fb, k % sizes.fb, out.fb, is_f),
      fw=_put(rings.fw, k % sizes.fw, out.fw, is_f),
      bw=_put(rings.bw, k % sizes.bw, out.bw, is_b),
    )
    new_state = _select(is_f, _stop(out.state), old_state)
    acc = _Accumulators(
      loss=acc.loss + value,
      params=out.sums[0],
      stage_consts=out.sums[1],
      head_consts=jax.tree.map(jnp.add, acc.head_consts, head_const_grads),
      x=_put(acc.x, k, out.input_grads, is_b & (device == 0)),
      targets=_put(acc.targets, k, target_grads, end),
    )
    sends = (_shift(out.y, layout, +1), _shift(out.input_grads, layout, -1))
    return (sends, rings, _put_chunk(state, 0, new_state, 1), acc), None

  return tick


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


def _batch_spec(layout: _Layout) -> P:
  return P(layout.data_axes) if layout.data_axes else P()


def _specs(layout: _Layout) -> tuple[P, ...]:
  """`shard_map`'s specs for `(params, x, targets, key, state)`."""
  batch, stages = _batch_spec(layout), P(None, layout.axis)
  return (stages, batch, batch, P(), stages)


def _placed(
  mesh: Any, specs: tuple[P, ...], inputs: tuple[Any, ...]
) -> tuple[Any, ...]:
  """`inputs` moved where `shard_map` over explicit axes takes them."""
  if not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return inputs
  return tuple(
    jax.tree.map(
      lambda a, s=spec: jax.sharding.reshard(a, jax.NamedSharding(mesh, s)), tree
    )
    for tree, spec in zip(inputs, specs, strict=True)
  )


def _shift(tree: Any, layout: _Layout, step: int) -> Any:
  """Sends every device's `tree` to device s + step: round the ring with V > 1."""
  S = layout.ticks.num_stages
  if layout.ticks.num_chunks > 1:
    pairs = [(s, (s + step) % S) for s in range(S)]
  else:
    pairs = [(s, s + step) for s in range(S) if 0 <= s + step < S]
  return jax.lax.ppermute(tree, layout.axis, pairs)


def _from_last_stage(layout: _Layout, outputs: Any) -> Any:
  """The last stage's `outputs` on every stage (zeros elsewhere, so a psum).

  Booleans go through int32, the dtype psum gives them, and come back bool.
  """

  def broadcast(y):
    summed = jax.lax.psum(
      y.astype(jnp.int32) if y.dtype == jnp.bool_ else y, layout.axis
    )
    return summed.astype(y.dtype)

  return jax.tree.map(broadcast, outputs)


def _combine_state(layout: _Layout, state: Any) -> Any:
  """One state from each data shard's: floating leaves averaged, others the first's."""
  if not layout.data_axes:
    return state
  axes = layout.data_axes
  first = jax.lax.axis_index(axes) == 0

  def combine(x):
    if _is_float(x.dtype):
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


def _is_float(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.inexact)


def _dtype(x: Any) -> Any:
  """`x`'s dtype: a NumPy one, or a PRNG key's, which NumPy cannot name."""
  return x.dtype if hasattr(x, "dtype") else np.dtype(jnp.result_type(x))


def _floats(tree: Any) -> list[Any]:
  """The leaves of `tree` that carry cotangents: the floating ones."""
  return [x for x in jax.tree.leaves(tree) if _is_float(_dtype(x))]


def _with_float0(floats: Sequence[Any], like: Any) -> Any:
  """`like`'s tree with `floats` at its floating leaves, float0 zeros elsewhere."""
  values = iter(floats)
  return jax.tree.map(
    lambda x: (
      next(values)
      if _is_float(_dtype(x))
      else np.zeros(jnp.shape(x), jax.dtypes.float0)
    ),
    like,
  )


def _zeros(leaves: Sequence[Any]) -> list[Any]:
  """Zeros like each leaf, laid out by the context: a value closed over keeps
  the layout of the mesh outside `shard_map`, which `zeros_like` would copy."""
  return [jnp.zeros(jnp.shape(a), _dtype(a)) for a in leaves]


def _cast(tree: Any, dtypes: Any) -> Any:
  return jax.tree.map(lambda a, d: a if a.dtype == d else a.astype(d), tree, dtypes)


def _stop(tree: Any) -> Any:
  return jax.tree.map(jax.lax.stop_gradient, tree)


def _take(tree: Any, index: Any) -> Any:
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, False), tree)


def _put(tree: Any, index: Any, values: Any, where: Any) -> Any:
  """`tree[index] = values` where `where`, else unchanged."""

  def put(a, value):
    value = jnp.where(where, value, jax.lax.dynamic_index_in_dim(a, index, 0, False))
    return jax.lax.dynamic_update_index_in_dim(a, value, index, 0)

  return jax.tree.map(put, tree, values)


def _select(pred: Any, on_true: Any, on_false: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _take_chunk(tree: Any, chunk: Any, num_chunks: int) -> Any:
  """Chunk `chunk` of a `[V, ...]` tree (static with V = 1)."""
  if num_chunks == 1:
    return jax.tree.map(lambda a: a[0], tree)
  return _take(tree, chunk)


def _put_chunk(tree: Any, chunk: Any, values: Any, num_chunks: int) -> Any:
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


def _local_chunks(tree: Any) -> Any:
  """`[V, 1, ...]` (a device's share of `[V, S, ...]`) as `[V, ...]`."""
  return jax.tree.map(lambda a: a[:, 0], tree)


def _device_chunks(tree: Any) -> Any:
  """`[V, ...]` as `[V, 1, ...]`, a device's share of `[V, S, ...]`."""
  return jax.tree.map(lambda a: a[:, None], tree)


def _split(tree: Any, num_microbatches: int) -> Any:
  return jax.tree.map(
    lambda a: a.reshape(num_microbatches, a.shape[0] // num_microbatches, *a.shape[1:]),
    tree,
  )


def _unsplit(tree: Any) -> Any:
  return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), tree)


def _stack_chunks(tree: Any, name: str, ticks: _Ticks, axis: str) -> Any:
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
      raise ValueError(
        f"{where} has shape {tuple(shape)}: with num_virtual_stages={V} its "
        f"leading sizes must be (V, S) = {lead}, stage v·S + s at [v, s] (S "
        f"is the size of mesh axis {axis!r})."
      )
  return tree if V > 1 else jax.tree.map(lambda a: a[None], tree)


def _unstack_chunks(tree: Any, ticks: _Ticks) -> Any:
  return tree if ticks.num_chunks > 1 else jax.tree.map(lambda a: a[0], tree)


# --- checks, at trace time ----------------------------------------------------


def _check_axes(
  mesh: Any, axis: str, data_axes: str | Sequence[str]
) -> tuple[str, ...]:
  names = tuple(mesh.axis_names)
  if axis not in names:
    raise ValueError(
      f"axis={axis!r} is not an axis of the mesh, whose axes are {names}; "
      f"pass axis= one of them, or build the mesh with a {axis!r} axis."
    )
  data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
  for name in data_axes:
    if name not in names or name == axis or data_axes.count(name) > 1:
      raise ValueError(
        f"data_axes={data_axes!r} must name distinct mesh axes other than "
        f"axis={axis!r}; the mesh's axes are {names}."
      )
  for name in names:
    if name != axis and name not in data_axes and mesh.shape[name] > 1:
      raise ValueError(
        f"mesh axis {name!r} (size {mesh.shape[name]}) is neither axis="
        f"{axis!r}, which holds the stages, nor one of data_axes={data_axes}, "
        f"which shard the batch. Pass data_axes=({name!r}, ...) to shard the "
        "batch over it. A stage cannot be split over a mesh axis (tensor "
        "parallelism); build the mesh without it."
      )
  return data_axes


def _check_key(rng: Any) -> tuple[jax.Array, Any]:
  """The key as data (uint32), and its implementation (None for a raw key)."""
  dtype = getattr(rng, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return jax.random.key_data(rng), jax.random.key_impl(rng)
  if dtype == jnp.uint32:
    return rng, None
  raise TypeError(
    f"rng must be a PRNG key (jax.random.key(seed)), got {type(rng).__name__} "
    f"of dtype {dtype}."
  )


def _check_batch(
  batch: dict[str, Any],
  num_microbatches: int,
  num_shards: int,
  data_axes: tuple[str, ...],
) -> int:
  first = None
  for name, tree in batch.items():
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      where = name + jax.tree_util.keystr(path)
      shape = getattr(leaf, "shape", None)
      if not shape:
        raise TypeError(f"{where} must be an array with a leading batch axis.")
      if first is None:
        first = (where, shape[0])
      elif shape[0] != first[1]:
        raise ValueError(
          f"x's and targets' leaves must share one batch size: {first[0]} has "
          f"{first[1]} rows but {where} has {shape[0]}."
        )
  if first is None:
    raise ValueError("x holds no arrays.")
  where, batch_size = first
  per_step = num_shards * num_microbatches
  if batch_size % per_step:
    raise ValueError(
      f"batch_size={batch_size} (of {where}) must be divisible by data shards × "
      f"num_microbatches = {num_shards} × {num_microbatches} = {per_step} (the "
      f"data shards are the mesh axes {data_axes}); pad the batch or pick a K "
      "that divides it."
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

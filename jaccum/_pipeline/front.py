"""`pipeline`: micro-batches flowing through model stages, one stage per device.

The S stages of a model live on the S positions of a mesh axis; with
`num_virtual_stages=V`, each device holds V of the L = S·V stages (device s
holds stages s, S + s, …, as in Megatron's interleaved schedule and MaxText's
circular pipeline). Each data shard's rows are cut into K micro-batches,
which flow through the stages in a `lax.scan` over the ticks of a schedule
(`pipeline_schedule`): in a tick every device runs at most one stage forward
(F) and, in 1F1B, one backward; ZB-H1 and ZB-V run one of F, B (the backward
to the stage's input) and W (to its weights). Then each device hands
activations to the next device and cotangents to the previous one with a
`ppermute` (ZB-V, whose chunk 1 runs back up the devices, sends each the
other way too).

Everything runs in one `shard_map` over the stage and data axes, under
`jit`. `stage_fn` and `loss_fn` are traced once, inside it, into programs
that the loops run; the traced values they close over (a scale shared by all
stages, a tied table, the head's weights) are explicit inputs of those
programs, so their gradients accumulate like the stage parameters'. What
they close over also crosses into the `shard_map` as its inputs (a second
run of it, `retype`): JAX does not let a `shard_map` body use an array
typed on the mesh outside it, and where a function uses one (an explicit
mesh) it is traced outside the `shard_map` and its program retyped.
Gradients accumulate in `accum_dtype` (float32) whatever the parameters'
dtype, and `shard_map`'s transpose sums each over the devices once.

The schedules live in their own modules, sharing `common`:

- `"gpipe"` (`gpipe`): `jax.grad` differentiates the forward loop, whose
  backward runs after all the forwards.
- `"1f1b"` (`one_f_one_b`, with `loss_fn`): one loop, in which the last
  stage computes each micro-batch's loss right after its forward, so that
  micro-batch's backward starts while later ones still go forward. A custom
  VJP: its forward rule runs that loop and returns the gradients, its
  backward rule scales them.
- `"zb-h1"` and `"zb-v"` (`zero_bubble`, with `loss_fn`): the same custom
  VJP around a loop that runs, per tick, what the schedule's table says: F,
  B or W. The stage's backward program is cut in two (`backward`): B sends
  the input's cotangent on at once, W follows when the device would
  otherwise idle.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaccum._core import retype
from jaccum._core.accumulators import check_accum_dtype
from jaccum._core.microbatch import check_num_microbatches
from jaccum._pipeline import common, gpipe, one_f_one_b, zero_bubble
from jaccum._pipeline.tables import (
  PipelineSchedule,
  ScheduleName,
  _Ticks,
  check_positive_int,
  check_schedule,
  pipeline_schedule,
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
  instead of on the output that every stage holds; and `"1f1b"`, `"zb-h1"`
  and `"zb-v"` can start a micro-batch's backward right after its forward.

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
    (with `remat`: 3F + B + W, B and W each recomputing the forward, which
    for S ≥ 3 and K ≥ 2S makes the lockstep step one F longer, as nearly
    every tick runs a B, as long, on some device, but up to a fifth longer
    at S = 2; the stage input from F to W, and the cotangents B hands W
    from B to W). Needs `loss_fn` and V = 1; as
    `"1f1b"`, reverse mode only on the loss, its gradient differentiable
    again. The least idle time with one stage per device: 3K + S − 1 ticks
    of F, B or W for K ≥ S.
  - `"zb-v"`: F + B + W, the zero-bubble schedule ZB-V of Qi et al., with
    `num_virtual_stages=2` placed in a V: device s holds stages s and
    2S − 1 − s, so chunk 0 runs down the devices, chunk 1 back up, and the
    last stage and its loss are on device 0. Each pass is half a stage's; a
    device keeps at most 2S chunk micro-batches between F and W (S whole
    stages, as ZB-H1), its rings 2S chunk slots for what F keeps, whatever
    K. 6K + S − 1 ticks of half a stage for K ≥ S (up to S = 4; a few more
    at K close to S beyond), the fewest any such schedule takes. Needs
    `loss_fn` and V = 2; as `"1f1b"`, reverse mode only on the loss.

  In lockstep ticks GPipe and 1F1B take (K + S − 1)(F + B); a stage is idle
  for the bubble, (S − 1) / (K + S − 1) of that. With `num_virtual_stages=V`
  each device runs V stages, each 1/V of the work, and a micro-batch goes
  round the devices V times: the bubble falls to (S − 1) / (V·K + S − 1).
  ZB-H1 idles (S − 1) / (3K + S − 1) of its ticks (F = B = W), a third of
  1F1B's bubble, ZB-V (S − 1) / (6K + S − 1), a sixth: only the ticks before
  the last device's first forward. `pipeline_schedule` draws any of them.

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
    schedule: `"gpipe"`, `"1f1b"`, `"zb-h1"` or `"zb-v"`, above.
    remat: keep only each stage's micro-batch inputs for the backward and
      recompute the rest (`jax.checkpoint`): one more forward.
    loss_fn: `loss_fn(y_mb, targets_mb) -> scalar`, the loss of one
      micro-batch, run by the last stage; the traced arrays it closes over
      (the head's weights) get gradients like arguments. For a mean over the
      batch, make it a sum over its rows and divide `f`'s result by the
      number of rows (or tokens).
    num_virtual_stages: stages per device, V (L = S·V stages in all); 1
      with `"zb-h1"`, 2 with `"zb-v"`.
    accum_dtype: floating gradients narrower than this (bfloat16) are
      accumulated in it and cast back at the end (the stage parameters' are
      also summed over devices in it); `None` keeps their dtype. The summed
      loss is accumulated in it too.

  Returns:
    `f(stage_params, x, targets=None, *, rng=None, state=None)`. Every leaf
    of `stage_params` has leading dimensions `[S]`, or `[V, S]` with V > 1,
    sharded over `axis` on the S dimension: `[v, s]` is what device s runs
    as its chunk v, stage v·S + s, or with `"zb-v"` stage s at `[0, s]` and
    stage 2S − 1 − s at `[1, s]` (from stages `[2S, ...]` in order:
    `jnp.stack([p[:S], p[S:][::-1]])`), so that no parameter moves.
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
      shape or dtype, `"1f1b"`, `"zb-h1"` or `"zb-v"` has no `loss_fn`,
      `"zb-h1"` has V > 1, or `"zb-v"` has V other than 2.
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

    ZB-V: 2S stages, two per device in a V (stage s and 2S − 1 − s on device
    s), so chunk 1's stages are stacked in reverse:

    >>> ws8 = jnp.stack([jnp.eye(3) * (l + 2) / 8 for l in range(2 * num_stages)])
    >>> zb_v = jaccum.pipeline(stage, 2, mesh=mesh, schedule="zb-v",
    ...                        num_virtual_stages=2, loss_fn=loss)
    >>> v_shaped = jnp.stack([ws8[:num_stages], ws8[num_stages:][::-1]])
    >>> grads = jax.jit(jax.grad(zb_v))(v_shaped, x, jnp.ones_like(x))
    >>> expected = jax.grad(sequential_loss)(ws8)
    >>> v_expected = jnp.stack([expected[:num_stages], expected[num_stages:][::-1]])
    >>> bool(jnp.allclose(grads, v_expected, atol=1e-6))
    True
  """
  options = _options(
    stage_fn,
    num_microbatches,
    mesh=mesh,
    axis=axis,
    data_axes=data_axes,
    schedule=schedule,
    remat=remat,
    loss_fn=loss_fn,
    num_virtual_stages=num_virtual_stages,
    accum_dtype=accum_dtype,
  )

  def apply(
    stage_params: Any,
    x: Any,
    targets: Any = None,
    *,
    rng: jax.Array | None = None,
    state: Any = None,
  ) -> Any:
    return _apply(options, stage_params, x, targets, rng, state)

  return apply


@dataclasses.dataclass(frozen=True)
class Options:
  """`pipeline`'s keywords, each converted and checked once, at the door.

  Attributes:
    stage_fn: one stage on one micro-batch.
    loss_fn: the last stage's loss of one micro-batch, or None.
    num_microbatches: K, per data shard.
    mesh: the device mesh.
    axis: the stages' mesh axis.
    data_axes: the mesh axes that shard the batch.
    num_shards: the devices over `data_axes`.
    table: the schedule the loops run, as `pipeline_schedule` returns it.
    ticks: its layout of chunks over the devices.
    remat: keep only each stage's inputs for the backward.
    accum: the dtype gradients and the loss accumulate in, or None.
  """

  stage_fn: Callable[..., Any]
  loss_fn: Callable[..., Any] | None
  num_microbatches: int
  mesh: Any
  axis: str
  data_axes: tuple[str, ...]
  num_shards: int
  table: PipelineSchedule
  ticks: _Ticks
  remat: bool
  accum: np.dtype | None


def _options(
  stage_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  mesh: Any,
  axis: str,
  data_axes: str | Sequence[str],
  schedule: ScheduleName,
  remat: bool,
  loss_fn: Callable[..., Any] | None,
  num_virtual_stages: int,
  accum_dtype: Any,
) -> Options:
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
  table = pipeline_schedule(
    mesh.shape[axis],
    num_microbatches,
    schedule=schedule,
    num_virtual_stages=num_chunks,
  )
  return Options(
    stage_fn,
    loss_fn,
    num_microbatches,
    mesh,
    axis,
    data_axes,
    math.prod(mesh.shape[a] for a in data_axes),
    table,
    _Ticks(table.num_stages, num_chunks, num_microbatches, schedule == "zb-v"),
    bool(remat),
    accum,
  )


def _apply(
  options: Options, stage_params: Any, x: Any, targets: Any, rng: Any, state: Any
) -> Any:
  """The pipeline on one call's arguments (`pipeline`'s `f`)."""
  o = options
  if o.loss_fn is None and targets is not None:
    raise TypeError(
      "targets is what loss_fn takes beside the last stage's output, but "
      "this pipeline has no loss_fn: pass loss_fn= to pipeline(), or drop "
      "targets."
    )
  params = common.stack_chunks(stage_params, "stage_params", o.ticks, o.axis)
  chunked_state = (
    None if state is None else common.stack_chunks(state, "state", o.ticks, o.axis)
  )
  batch = {"x": x} if o.loss_fn is None else {"x": x, "targets": targets}
  _check_batch(batch, o.num_microbatches, o.num_shards, o.data_axes)
  key_data, key_impl = (None, None) if rng is None else _check_key(rng)
  layout = common.Layout(o.table, o.axis, o.data_axes, o.remat, o.accum, key_impl)
  param_dtypes = jax.tree.map(common.dtype, params)
  # Parameters enter in `accum_dtype` and are cast to their own dtype where
  # a stage uses them: their gradients are accumulated in it, and summed
  # over the data shards in it by `shard_map`'s transpose.
  inputs = (layout.widen(params), x, targets, key_data, chunked_state)
  specs = common.specs(layout)
  # A loss comes out as each device's share, summed after `shard_map`:
  # summed inside, its cotangent would reach the backward through a psum,
  # and XLA could not fold away a multiplication by 1.
  out_spec = common.batch_spec(layout) if o.loss_fn is None else P(layout.all_axes)
  local = functools.partial(_local, o, layout, param_dtypes)
  out, new_state = _sharded(local, o.mesh, specs, (out_spec, specs[-1]), inputs)
  if o.loss_fn is not None:
    out = jnp.sum(out)
  if state is None:
    return out
  return out, common.unstack_chunks(new_state, o.ticks)


def _local(
  options: Options,
  layout: common.Layout,
  param_dtypes: Any,
  lifted: Any,
  params: Any,
  x: Any,
  targets: Any,
  key: Any,
  state: Any,
  *consts: Any,
) -> tuple[Any, Any]:
  """One device's part of the pipeline, inside the `shard_map`."""
  params, state = common.local_chunks(params), common.local_chunks(state)
  stage, head = common.trace_user_functions(
    options.stage_fn,
    options.loss_fn,
    (params, param_dtypes, x, targets, key, state),
    layout,
    common.Lift(options.mesh, lifted, consts),
  )
  args = common.Args(
    params=params,
    stage_consts=stage.consts,
    head_consts=[] if head is None else head.consts,
    x=x,
    targets=targets,
    key=key,
    state=state,
  )
  if options.table.schedule != "gpipe":
    assert head is not None
    out, state = _gradient_loop(layout, stage, head, param_dtypes, args)
  else:
    out, state = gpipe.gpipe(layout, stage, head, param_dtypes, args)
  out = out if head is None else out[None]  # each device's share
  return out, common.combine_state(layout, common.device_chunks(state))


def _sharded(
  local: Callable[..., Any],
  mesh: Any,
  specs: tuple[P, ...],
  out_specs: Any,
  inputs: tuple[Any, ...],
) -> Any:
  """`local(lifted, *inputs)` on every device, under a jitted `shard_map`.

  Run again where the first run asks (`retype.Retrace`), with what the
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
    return sharded(*common.placed(mesh, in_specs, (*inputs, *consts)))

  try:
    return run(None)
  except retype.Retrace as retrace:
    return run(retrace.outside, [c for o in retrace.outside for c in o.consts])


def _gradient_loop(
  layout: common.Layout,
  stage: common.Traced,
  head: common.Traced,
  param_dtypes: Any,
  args: common.Args,
) -> tuple[jax.Array, Any]:
  """A device's 1F1B, ZB-H1 or ZB-V: a custom VJP whose forward rule computes
  the gradients.

  Undifferentiated it is GPipe's forward loop and head. Differentiated, its
  forward rule runs the schedule's loop (`one_f_one_b.loop` or
  `zero_bubble.loop`), which returns this device's share of the gradients
  of the summed loss; the backward rule scales them by the loss's cotangent,
  and `shard_map`'s transpose sums them over the devices. Returns the summed
  loss and the device's state.
  """
  like = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(jnp.shape(a), common.dtype(a)), args
  )
  zero = layout.schedule.schedule in ("zb-h1", "zb-v")
  loop = zero_bubble.loop if zero else one_f_one_b.loop

  @jax.custom_vjp
  def run(args):
    return gpipe.gpipe(layout, stage, head, param_dtypes, args)

  def run_fwd(args):
    loss, state, grads = loop(layout, stage, head, param_dtypes, args)
    return (loss, state), grads

  def run_bwd(grads, cotangents):
    scale = cotangents[0]

    def scaled(grads, like):
      floating = [a for a in jax.tree.leaves(like) if common.is_float(a.dtype)]
      grads = [
        (g * scale.astype(g.dtype)).astype(a.dtype)
        for g, a in zip(grads, floating, strict=True)
      ]
      return common.with_float0(grads, like)

    def zeros(like):
      floats = [jnp.zeros(a.shape, a.dtype) for a in common.floats(like)]
      return common.with_float0(floats, like)

    cotangent = common.Args(
      *(scaled(g, a) for g, a in zip(grads, like[:5], strict=True)),
      key=zeros(like.key),
      state=zeros(like.state),
    )
    return (cotangent,)

  run.defvjp(run_fwd, run_bwd)
  return run(args)


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

"""The public fronts: `accumulate` and `data_parallel`.

Each turns its keywords into `Options` when it is called (`options.make`:
every keyword converted and checked once, the door's rules run), and
returns a function whose every call is planned once per trace and run on
its route (`plan.run`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jaccum._core.microbatch import Split
from jaccum._routes import options as options_lib
from jaccum._routes import plan

FsdpMode = Literal["gather_once", "shard_grads", "shard_all"]


def _wrapped(grad_fn: Callable[..., Any], options: options_lib.Options) -> Any:
  """The accumulated function: `grad_fn`'s signature, and the call-time keywords."""

  # `updated=()`: the wrapper takes grad_fn's name and docstring, not its
  # attributes (an Equinox module's fields would make it look like a module).
  @functools.wraps(grad_fn, updated=())
  def accumulated(*args, num_real_microbatches=None, reduce_state=None, **kwargs):
    call = plan.Call(args, kwargs, num_real_microbatches, reduce_state)
    return plan.run(options, call)

  # No `__wrapped__` (functools.wraps sets it): Equinox follows it from any
  # function it stores and warns "Possibly assigning a JAX-transformed
  # callable" when it reaches a module, such as `eqx.filter_value_and_grad`'s.
  # The signature stays visible to `inspect`.
  del accumulated.__wrapped__
  with contextlib.suppress(TypeError, ValueError):  # a builtin has none to show
    accumulated.__signature__ = inspect.signature(grad_fn)  # pyright: ignore[reportAttributeAccessIssue]
  return accumulated


def accumulate(
  grad_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  batch_argnums: int | Sequence[int] = 1,
  reduce: Any = "mean",
  weight_fn: Callable[..., Any] | None = None,
  accum_dtype: Any = jnp.float32,
  rng_argnum: int | None = None,
  state_argnum: int | None = None,
  axis_name: str | tuple[str, ...] | None = None,
  split: Split | None = None,
  unroll: int | bool = 1,
  grad_leaves: Any = None,
  return_stats: bool = False,
  conv_rewrite: bool = True,
  overlap_reduction: bool = False,
  reduce_dtype: Any = None,
  reduce_fn: Callable[..., Any] | None = None,
  deterministic: bool = False,
) -> Callable[..., Any]:
  """Runs `grad_fn` over `num_microbatches` micro-batches and combines the outputs.

  The returned function takes the same arguments as `grad_fn` and returns the
  same structure. The arguments in `batch_argnums` are split on axis 0 into K
  micro-batches; the others (params, …) and all keyword arguments go whole to
  every micro-step. The loop is one `lax.scan`, so compile time does not grow
  with K; each micro-batch is sliced out of the batch inside the loop, so
  memory holds one micro-batch's work plus one accumulator; `grad_fn` is
  traced once. It computes, for `"mean"` leaves::

    def accumulated(*args):
      for k in range(K):
        micro_args = args with each batch argument cut to micro-batch k
        out_k, w_k = grad_fn(*micro_args), weight_fn(*micro_args)  # w_k = 1 without
      return sum(w_k * out_k) / sum(w_k)                           # 0 if sum(w_k) == 0

  For a loss that is a mean over examples, `"mean"` makes every leaf equal to
  `grad_fn` on the whole batch; for a mean over tokens, `weight_fn` returning
  each micro-batch's token count does the same however unevenly tokens fall.

  Sharded batches. Under `jit`, a batch sharded on axis 0 over *explicit*
  mesh axes is visible at trace time, and the loop runs on every device over
  its own rows with no collective inside it, then one all-reduce combines the
  devices (as `data_parallel` does). For per-example computations the result
  is the unsharded one: micro-batch k is still rows k, k+K, … of the whole
  batch, each device holding its share, so N must be a multiple of devices ×
  K. Keys differ per device too. With `state_argnum`, statistics are then
  per device (a warning says so); with `return_stats`, the small batch is
  each device's share of a micro-batch (devices × K of them), as under
  `data_parallel`. With *auto* axes, or a batch whose sharding
  comes only from `jit(in_shardings=...)`, nothing in the trace says how the
  batch is laid out: the loop runs as on one device and XLA may put an
  all-reduce in every micro-step; use `data_parallel` there.

  Args:
    grad_fn: any function, typically `jax.grad(loss)` or
      `jax.value_and_grad(loss, has_aux=True)`. It may reach its params as an
      argument, a keyword, through `functools.partial` or a closure.
    num_microbatches: the number of micro-batches K, a static positive int
      that divides the batch size N.
    batch_argnums: the positional argument(s) holding the batch; all their
      leaves must share the leading size N. Keyword arguments are never split.
    reduce: how to combine each output leaf: `"mean"`, `"sum"`, `"concat"`
      (per-example outputs, returned in the original row order), `"last"`,
      `"max"` or `"min"` (both also on bools: any / all); a string for all
      leaves or a pytree prefix of the output. `float0` leaves (gradients of
      integer inputs) come back as the whole batch gives them.
    weight_fn: `weight_fn(*micro_args) -> scalar`, called with every
      positional argument cut to one micro-batch; turns every `"mean"` leaf
      into the weighted mean `Σ w_k out_k / Σ w_k`, exactly for any real
      weights, negative ones included. Weights stay in float32 or wider
      (float64 for float64 leaves) whatever the leaves' dtype. A micro-batch
      of weight 0 contributes nothing, even if its output is NaN; a total of
      0 gives zeros.
    accum_dtype: floating `"mean"`/`"sum"` leaves narrower than this are
      accumulated in it and cast back at the end; `None` keeps each leaf's
      dtype. Rounding grows with K (`python benchmarks/accum_precision.py`;
      mean of K gradients of 4,096 entries drawn from N(1, 1), largest and
      root-mean-square error relative to the largest entry)::

        accumulation                  K=16            K=256           K=4096
        float32                       1.7e-7/3.5e-8   6.8e-7/1.9e-7   3.3e-6/8.0e-7
        bf16, float32 accumulator     2.1e-3/9.6e-4   3.3e-3/1.5e-3   3.7e-3/1.7e-3
        bf16, accum_dtype=None        1.1e-2/2.3e-3   4.7e-2/1.2e-2   7.5e-1/7.1e-1

      float32 grows about as √K; bf16 with a float32 accumulator only pays
      the final cast to bf16; bf16 summed in bf16 stalls once the sum
      outgrows its 8-bit mantissa. Keep the float32 default for bf16 models.
    rng_argnum: the positional argument holding a PRNG key; micro-batch k gets
      `jax.random.fold_in(key, k)`; across devices, device d > 0 folds the key
      with d first, so devices draw different numbers and device 0 draws as
      one device would.
    state_argnum: the positional argument holding state that `grad_fn`
      updates (e.g. BatchNorm `batch_stats`): `grad_fn` returns
      `(out, new_state)`, micro-batch k+1 sees the state micro-batch k
      returned, and the result is `(reduced_out, final_state)`. Stateful
      layers therefore advance K times per step (BatchNorm's running averages
      take K updates of momentum, a step counter counts micro-batches).
    axis_name: for use inside your own `shard_map` (or `pmap`, or a `vmap`
      with `axis_name`): the mesh axis (or axes) the batch is split over.
      Each device (or vmapped instance) accumulates its own K
      micro-batches with no communication in the loop (non-batch arguments
      and keyword arguments are cast to device-varying first, so no psum
      enters the backward pass), then one all-reduce combines the devices:
      weighted means with weights summed over devices, sums, maxima. The
      `pmean` of gradients a `pmap` train step usually has becomes redundant;
      drop it. `"concat"` and `"last"` leaves stay per device (`"last"`
      with `deterministic=True`: the global last micro-batch's). Threaded
      floating state is averaged over devices, other state takes device 0's
      value. Inside a `shard_map` that checks types, arrays reached by
      closure are the same on every device and JAX sums their gradients in
      every micro-step; that raises an error asking to pass them as
      arguments (`data_parallel` has no such limit).
    split: `"strided"` (micro-batch k holds rows k, k+K, …: a batch sharded
      over devices stays sharded with no data movement) or `"contiguous"`.
      None (the default) is `"strided"`, or `"contiguous"` with
      `deterministic=True`.
    unroll: passed to `lax.scan`.
    grad_leaves: which output leaves are gradients, as a bool or a pytree
      prefix of bools of the output (used by FSDP and to tell per-example
      outputs apart). By default, the part of the output shaped like the
      first non-batch argument: all of `jax.grad`'s output, the second
      element of `value_and_grad`'s, the first of `grad(has_aux=True)`'s.
    return_stats: also return a `jaccum.AccumulationStats` with the gradient
      noise scale (McCandlish et al. 2018) estimated from the micro-batch
      gradients and their mean: one scalar per micro-step, no extra
      gradient-sized buffer. Batch sizes count examples, or with `weight_fn`
      its weight units. Needs two batch sizes: K >= 2, or several devices.
    conv_rewrite: on CPU, rewrite the micro-step's convolutions into
      XLA:CPU's fast layout where that was measured faster (XLA lays out
      convolutions in a loop body as traced, which is many times slower for
      most of them; see the performance guide). `False` leaves the traced
      program untouched. Other backends never rewrite; values are the same
      either way.
    overlap_reduction: with `axis_name` (and under `data_parallel`): run the
      last micro-batch after the loop, and reduce each gradient leaf on its
      own as soon as that micro-batch's backward pass has made it, so that a
      scheduler that overlaps communication with compute (XLA's
      latency-hiding scheduler on GPU and TPU) can hide the reduction of the
      late layers behind the backward pass of the early ones. One more copy
      of the micro-step in the program (compile time still flat in K).
      False by default: on CPU there is nothing to hide behind, and the gain
      on an accelerator is unmeasured (see the data-parallel guide).
      Not with `num_real_microbatches` (which micro-batch runs last is then
      known only at run time): that call raises a ValueError.
    reduce_dtype: the dtype the one reduction after the loop sends (e.g.
      `jnp.bfloat16`: half the bytes of float32): each device's accumulator
      is cast for it and summed back into its own dtype, so only the reduced
      mean is rounded, never the running sum. None sends the accumulator's
      dtype. See the data-parallel guide for the measured error. XLA:CPU
      sums bf16 in float32: on a mesh with axes besides the data axes the
      program handed to it sends float32 of the rounded shares (the bf16 form
      aborts its compiler there); GPUs and TPUs get the bf16 wire.
    reduce_fn: replaces the reduction of the gradient leaves:
      `reduce_fn(grads, axes, state) -> (reduced, new_state)`, called once per
      step with each device's share of the gradients (shares that sum over
      `axes` to the exact result) and returning their sum (or an estimate of
      it: compression). `state` is the call's `reduce_state=` keyword, each
      leaf with a leading axis of one row per device (`reduce_fn` sees this
      device's row, without that axis); the function then returns
      `(result, new_reduce_state)`. `jaccum.PowerSGD` is one, with error
      feedback.
    deterministic: the same bits whatever K and the number of devices, for
      the same global batch: micro-batch m is rows m·R .. (m+1)·R - 1 (R
      rows each; device d holds micro-batches d·K .. (d+1)·K - 1), its key
      is `fold_in(key, m)`, and `"mean"` and `"sum"` leaves are summed
      exactly, in binned int32 integers whose scale follows each leaf's
      largest magnitude (a maximum: the same however the terms are divided),
      across devices by an integer psum, and read back as floats once. The
      error against the exact sum of the float terms is below n·2^-32 times
      the leaf's largest term plus 1.5 ulp (float32; the guide
      "Reproducible and elastic accumulation" has the measured accuracy and
      cost: 3 int32 per element in the carry and on the wire), over
      float32's whole normal range (weights too); a term of zeros (a padding
      micro-batch) changes no bit. A non-finite term makes its whole leaf
      NaN. It differentiates as a sum (`jax.grad` of a gradient penalty).
      `"last"` leaves are those of the global order's last micro-batch (the
      last that ran, with a count), the same on every device. Not with
      `split="strided"`, a
      `state_argnum` state holding arrays, `reduce_fn`, `reduce_dtype`,
      FSDP's in-loop modes, or more than 2¹⁵ - 1 micro-batches over all
      devices (a ValueError names both options).

  Returns:
    A function with `grad_fn`'s signature, usable with or without `jit`;
    with `return_stats`, it returns `(result, stats)`. It also takes the
    keyword `num_real_microbatches=n` (as optax's `microbatch` does): K is
    then the batch's capacity, and only micro-batches 0..n-1 in split order
    run (the first n·N/K rows with `split="contiguous"`, for a batch padded
    at its end; rows k, k + K, … for k < n with `split="strided"`: name the
    split, a count without one is a ValueError unless `deterministic=True`
    splits contiguously), in a while loop
    that skips the rest rather than masking them; one compilation serves
    every n. Means divide by what ran (or by its weights), `"sum"`, `"max"`,
    `"min"` and threaded state see only the real micro-batches, `"last"` is
    micro-batch n-1's, and `"concat"` rows of skipped micro-batches are zeros;
    n = 0 gives zeros. A concrete count outside [0, K] (called without
    `jit`) is an error; a traced count (any count under `jit`), a Python int
    too, is clamped to [0, K] in its own integer type: -1 gives zeros, an
    int64 count above 2³¹ runs all K. On many devices (`data_parallel`)
    each device may run its own count: pass one per device, shape
    `[devices]`.
    Put it inside your jitted train step: called eagerly, it traces and
    compiles its loop again on every call.

  Raises:
    TypeError, ValueError: on bad arguments, when `accumulate` is called or
      when the returned function is traced; the message names the argument or
      the leaf path.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> def loss(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> w = jnp.ones(3)
    >>> batch = {"x": jnp.arange(24.0).reshape(8, 3), "y": jnp.arange(8.0)}
    >>> grads = jax.jit(jaccum.accumulate(jax.grad(loss), 4))(w, batch)
    >>> bool(jnp.allclose(grads, jax.grad(loss)(w, batch)))
    True
  """
  options = options_lib.make(
    grad_fn,
    num_microbatches,
    batch_argnums=batch_argnums,
    reduce=reduce,
    weight_fn=weight_fn,
    accum_dtype=accum_dtype,
    rng_argnum=rng_argnum,
    state_argnum=state_argnum,
    axis_name=axis_name,
    split=split,
    unroll=unroll,
    grad_leaves=grad_leaves,
    return_stats=return_stats,
    conv_rewrite=conv_rewrite,
    overlap_reduction=overlap_reduction,
    reduce_dtype=reduce_dtype,
    reduce_fn=reduce_fn,
    deterministic=deterministic,
  )
  return _wrapped(grad_fn, options)


def data_parallel(
  grad_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  axis: str | tuple[str, ...] = "data",
  param_specs: Any = None,
  fsdp_mode: FsdpMode = "gather_once",
  **accumulate_kwargs: Any,
) -> Callable[..., Any]:
  """Accumulates over K micro-batches on every device, then reduces once.

  Call the returned function under `jit` with global arrays whose batch is
  sharded over `axis` (or will be: it is laid out per device here). Each
  device runs K micro-batches of its own rows, as `accumulate` does: the
  effective batch is devices × K × micro-batch, nothing communicates inside
  the loop, and one all-reduce combines the devices after it. This holds for
  meshes with auto and explicit axis types and for multi-axis meshes (only
  `axis` is split over; other axes, e.g. `"model"`, keep their sharding).
  `grad_fn` may reach its params any way (argument, keyword, closure,
  `functools.partial`): it runs on each device's rows exactly as it would on
  one device (under `shard_map` without type checks, as under `pmap`), so
  any model that runs on one device runs here, and a closed-over array gets
  its gradient, not the gradient summed over devices. On an explicit mesh,
  where JAX cannot pass arrays placed on the mesh into `shard_map` by
  closure, `grad_fn` is traced outside it and its program runs per device
  with those arrays as inputs (so too where it names `axis` in an
  `out_sharding`: each device holds its rows). What cannot run per device
  either runs as the whole-batch step would, on the sharded batch, with the
  same micro-batches and a warning that says what differs (XLA may
  communicate inside the loop; `deterministic`, `return_stats`,
  `state_argnum`, `reduce_fn` and a count are refused there). Code that
  names `axis` runs per micro-batch across devices: `lax.pmean(x, axis)`
  gives synchronised BatchNorm statistics (one all-reduce per micro-batch).

  With `param_specs` (FSDP / ZeRO style), the first argument (the params)
  arrives sharded as those specs say, and its gradients leave sharded like
  them; on an explicit mesh the params' own sharding says this without
  `param_specs`. `fsdp_mode` chooses what stays sharded inside the loop, for
  P bytes of params on D devices, K micro-batches (per device; measured
  figures in the data-parallel guide, `python -m benchmarks --parts fsdp`):

  ===============  ===================  =============  =====================
  mode             params in the loop   accumulator    on the wire per step
  ===============  ===================  =============  =====================
  `"gather_once"`  all, gathered once   all, float32   gather P, scatter 1×
  `"shard_grads"`  all, gathered once   1/D (ZeRO-2)   gather P, scatter K×
  `"shard_all"`    1/D, each use        1/D (ZeRO-3)   gather 2K×, scatter K×
  ===============  ===================  =============  =====================

  `"gather_once"`, the default, sends the fewest bytes and leaves each
  micro-step as it is; it needs the whole params and a whole accumulator
  on every device. `"shard_grads"` reduce-scatters each micro-batch's
  gradients into an accumulator sharded like the params: about P × D−1/D
  less memory (float32 accumulator) for K reduce-scatters instead of one.
  `"shard_all"` keeps the params sharded too: each is all-gathered right
  before each use, in the forward pass and again in the backward pass, and
  never held whole; params a `lax.scan` slices (stacked layers with a leading
  layer axis) are gathered one layer per iteration, and their gradients
  scattered one layer per iteration. Nothing in the model changes. Pick the
  first mode whose step fits (`fit_microbatches` and `fit_plan` tell, before
  running). With `axis=("replica", "fsdp")` and `param_specs` naming only
  `"fsdp"` (HSDP), the sharded modes reduce-scatter over `"fsdp"` inside the
  loop and sum over `"replica"` once after it. The accumulator follows
  `accum_dtype` (float32 by default) in every mode; a weighted mean then sums
  `w·grad`, weighted on each device before the devices are summed.

  Cross-example computations (BatchNorm statistics threaded with
  `state_argnum`) see each device's rows, as in any data-parallel step;
  threaded floating state is averaged over devices at the end, other state
  (counters, keys) takes device 0's value. Keys differ per device and per
  micro-batch: device d > 0 folds a key (`rng_argnum`, or one threaded as
  state) with d first, and device 0 draws exactly as one device would, so a
  key threaded as state comes back as the unsharded call leaves it.

  Args:
    grad_fn: as for `accumulate`.
    num_microbatches: micro-batches per device, K.
    mesh: the device mesh; defaults to the mesh set with `jax.set_mesh`, else
      the mesh of the batch's sharding.
    axis: the mesh axis (or axes) the batch is split over; defaults to
      `"data"`: pass it when your mesh names its batch axis otherwise (e.g.
      `axis="batch"`).
    param_specs: a `PartitionSpec` per leaf of the first argument (or a pytree
      prefix of it), naming only `axis`, for FSDP; `None` replicates it (or,
      on an explicit mesh, reads its sharding).
    fsdp_mode: `"gather_once"`, `"shard_grads"` or `"shard_all"`: what stays
      sharded inside the loop (above).
    **accumulate_kwargs: any other option of `accumulate` (`batch_argnums`,
      `reduce`, `weight_fn`, `rng_argnum`, `state_argnum`, …);
      `deterministic=True` gives the same bits on any number of devices
      (with counts per device, over a padded batch too).

  Returns:
    A function with `grad_fn`'s signature, and `accumulate`'s keyword
    `num_real_microbatches` (one count, or one per device: shape
    `[devices]`; a device that runs fewer micro-batches skips them, and
    nothing waits for it until the reduction, except with the sharded FSDP
    modes, whose collectives inside the loop need every device: there the
    devices run in step, as many micro-batches as the busiest, the others
    joining with a weight of 0). `"mean"`, `"sum"`, `"max"` and
    `"min"` leaves come back replicated (`"last"` too with `deterministic`),
    gradients of FSDP-sharded params sharded like them, `"concat"` and
    `"last"` leaves (one row per example) sharded over `axis`, in row order.

  Raises:
    TypeError, ValueError: as `accumulate` does, and if `axis` is not a mesh
      axis, the batch does not split into devices × K micro-batches, or
      `param_specs` does not fit the params.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> x = jnp.arange(32.0 * len(jax.devices())).reshape(-1, 2) / 100
    >>> step = jax.jit(jaccum.data_parallel(jax.grad(loss), 2, mesh=mesh))
    >>> bool(jnp.allclose(step(jnp.ones(2), x), jax.grad(loss)(jnp.ones(2), x)))
    True
  """
  on_mesh = options_lib.on_mesh(mesh, axis, param_specs, fsdp_mode, accumulate_kwargs)
  options = options_lib.make(
    grad_fn, num_microbatches, on_mesh=on_mesh, **accumulate_kwargs
  )

  def parallel(*args, num_real_microbatches=None, reduce_state=None, **kwargs):
    call = plan.Call(args, kwargs, num_real_microbatches, reduce_state)
    return plan.run(options, call)

  return parallel

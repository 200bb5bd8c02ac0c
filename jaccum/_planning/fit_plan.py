"""`fit_plan`: K, rematerialisation and FSDP mode chosen together from a budget.

A step's memory and cost are known once XLA has compiled it, before it runs.
`fit_microbatches` uses that to pick K. Here K is one lever of three: a
rematerialisation policy trades activations for recompute, and an FSDP mode
trades memory for bytes on the wire. The fastest plan that fits is often a
light policy at a larger K, not full remat at the smallest.

The search is a branch and bound over the grid of (mode, policy, K). Each
point's compute is known cheaply, from XLA's cost analysis of the micro-step
lowered at that point's K (no compilation); it bounds the point's time from
below. Memory needs a compilation, and it is monotone: it falls as K grows,
as the policy gets heavier and as the mode shards more. So one point over
budget rules out every point lighter in all three, and one that fits rules
out every point whose bound is slower (the bound adds the bytes on the wire
that its mode was seen to send at a smaller K: a mode never sends fewer as
K grows). The search compiles the point with the fastest bound, then the
median of what is left in order of the bound, until nothing is left: it
finds the grid's best point under the cost model, with a few of its
compilations where the monotony holds.

The cost model is blind to what a backend's kernels do with the size of a
micro-batch (caches, kernel choice, per-kernel overhead). With `measure=`,
the step is then timed on the device: the model's choice first (the search
compiled it), then points spread over the grid among those the model ranks
near its choice, then the neighbours of the fastest measured, in interleaved
rounds within a time bound (`timing`), and the plan is the fastest
measured.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from jaccum._planning import points as _points
from jaccum._planning import search as _search
from jaccum._planning import timing as _timing
from jaccum._planning.cost import (
  CostModel,
)

if TYPE_CHECKING:
  pass


def _check_measure(measure: Any, args: Sequence[Any]) -> float | None:
  """The time bound in seconds, or None; the arguments must then be arrays."""
  if measure is None:
    return None
  if isinstance(measure, bool) or not isinstance(measure, numbers.Real):
    raise TypeError(
      "measure must be None (predict only) or a time bound in seconds (a "
      f"number), got {measure!r}."
    )
  if not float(measure) >= 0:  # Also catches NaN.
    raise ValueError(f"measure must be a time bound in seconds >= 0, got {measure!r}.")
  for path, leaf in jax.tree_util.tree_leaves_with_path(list(args)):
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise TypeError(
        "measure= times the step on the device, so the arguments must be "
        f"arrays; args{jax.tree_util.keystr(path)} is {leaf}. Pass arrays, or "
        "leave measure out to choose by the cost model alone."
      )
  if jax.process_count() > 1:
    raise ValueError(
      f"measure= times the step in this process, and with {jax.process_count()} "
      "processes each could choose another plan (their steps would then not "
      "match): leave measure out, or measure in a one-process run and pass "
      "its K and policy."
    )
  return float(measure)


def _plan_of(
  search: _search.Search,
  best: _points.Point,
  model_choice: _points.Point,
  timer: _timing.Timer[_points.Point] | None,
) -> _points.Plan:
  """The plan of `best`, with every point compiled and any timings."""
  points = dict(search.points)
  if timer is not None:
    for point, times in timer.rounds.items():
      if times:
        points[point] = points[point]._replace(
          measured_seconds=timer.median(point), round_seconds=tuple(times)
        )
  chosen = points[best]
  plan_options = dict(search.options)
  if chosen.fsdp_mode:
    plan_options["fsdp_mode"] = chosen.fsdp_mode
  return _points.Plan(
    num_microbatches=chosen.num_microbatches,
    remat=chosen.remat,
    fsdp_mode=chosen.fsdp_mode,
    peak_bytes=chosen.peak_bytes,
    predicted_seconds=chosen.predicted_seconds,
    tried={search.key(q): p for q, p in points.items()},
    memory_budget=search.budget,
    grid_size=len(search.grid),
    cost_model=search.cost_model,
    policy=search.remats[best[1]],
    options=plan_options,
    measured_seconds=chosen.measured_seconds,
    measure_seconds=None if timer is None else timer.seconds,
    measure_spent_seconds=None if timer is None else timer.elapsed(),
    model_choice=search.key(model_choice),
  )


def fit_plan(
  make_grad_fn: Callable[[_points.Remat], Callable[..., Any]],
  *args: Any,
  memory_budget: int | float,
  candidates: Iterable[int] | None = None,
  policies: Sequence[Any] = _points.DEFAULT_POLICIES,
  fsdp_modes: Sequence[str] | None = None,
  cost_model: CostModel | None = None,
  calibrate: bool = False,
  measure: float | None = None,
  **accumulate_kwargs: Any,
) -> _points.Plan:
  """The fastest K, remat policy and FSDP mode whose compiled step fits a budget.

  `fit_microbatches` over more levers. Each configuration is the step
  `jax.jit(accumulate(make_grad_fn(remat), K, **accumulate_kwargs))` (or
  `data_parallel`'s, with the mode as `fsdp_mode`); it is compiled for the
  arguments. Of those that fit, the plan is the one `cost_model` predicts
  fastest (see `CostModel`): compute from XLA's cost analysis of the
  micro-step lowered at each K (a cost that is not affine in the rows, such
  as a loss over all pairs of rows, is seen at every K), which counts the
  recompute of each policy, and the wire from the collectives' bytes in the
  compiled program. With `measure=`, the plan is instead the fastest of the
  steps it times on the device.

  Few configurations are compiled (the module's docstring says how): memory
  is taken to fall as K grows, along `policies` (give them lightest first)
  and along `fsdp_modes` (`gather_once`, `shard_grads`, `shard_all`), and the
  search compiles until no configuration left can fit and be faster.

  Args:
    make_grad_fn: `make_grad_fn(remat) -> grad_fn`, called once per policy
      with a `_points.Remat` that the model applies to its layers, e.g.
      `jax.lax.scan(remat(layer), h, stacked_params)` or
      `nnx.remat(block, policy=remat.policy) if remat else block`.
    *args: `grad_fn`'s positional arguments, as arrays or
      `jax.ShapeDtypeStruct` objects (with a sharding, for a sharded batch).
    memory_budget: bytes per device (an int), or a fraction in (0, 1] of the
      device's memory where the backend reports it.
    candidates: the K to choose from; defaults to every divisor of the batch
      size (per device with `data_parallel`).
    policies: the remat policies, lightest first: None (no remat), names of
      `jax.checkpoint_policies` attributes, policy functions or
      `(name, policy)` pairs. Defaults to no remat,
      `"dots_with_no_batch_dims_saveable"` and `"nothing_saveable"`.
    fsdp_modes: the FSDP modes to choose from with `param_specs`; defaults
      to all three there (and to the one given as `fsdp_mode`, if any), and
      to `"gather_once"` alone with `deterministic=True`, which refuses the
      other two.
    cost_model: the constants of the prediction; defaults to
      `CostModel.calibrate()` with `calibrate=True`, else to
      `CostModel.default()`.
    calibrate: measure the cost model's constants on this backend first
      (small programs of its own, never the step).
    measure: a time bound in seconds to time steps on the device and choose
      by the clock, or None (the default) to choose by the cost model
      alone. It times the model's choice first (compiled by the search, it
      costs only its runs), then points spread over the grid (K, policy,
      mode) among those the model predicts within 2x of its choice (at most
      6, each next the farthest from those picked), then the neighbours of
      the fastest measured (the next K either way, the other policies and
      modes at its K) while that changes, in interleaved rounds (3 per
      group, then 6 more for those within 10% of the fastest, the median of
      all counts), compiling those the search had not; it starts nothing
      (a batch of compilations, a first call, a round) that the time left
      does not cover, judged by the longest of its kind so far as it ran
      (see `_points.Plan` for what it spent), and chooses the least median timed.
      Where the bound is too short to time even the model's choice, it
      warns, naming the bound that would, and the plan is the model's
      choice with `measured_seconds` None. The default runs
      nothing, because choosing by the clock costs what the model's choice
      does not: it needs the arguments as arrays on the device (not
      `jax.ShapeDtypeStruct` objects, nor a plan made before the model is
      allocated), it takes seconds of compiling and running, and its
      choice varies with the machine's load from run to run, where the
      model's is the same on every run and every process (a multi-process
      job must choose the same step everywhere, so it is refused there).
      Where the model is known to rank well (a GPU running large
      micro-batches) it is enough; on a CPU, whose caches and per-kernel
      costs it does not see, measure.
    **accumulate_kwargs: options of `accumulate` (`batch_argnums`, `reduce`,
      …) or of `data_parallel` (`mesh`, `axis`, `param_specs`).

  Returns:
    A `_points.Plan`; `print` it for a table of every configuration compiled (with
    `measure=`, what was timed, the predicted and measured times), and
    `plan.step(make_grad_fn)` for its accumulated function.

  Raises:
    TypeError, ValueError: on bad arguments, as `fit_microbatches` raises
      them, and on a bad `measure` or `jax.ShapeDtypeStruct` arguments with
      it; and when no configuration fits, after compiling every one the
      search skipped, with what dominates the smallest peak (the params
      and what scales with them, the batch, the activations and the
      largest of them), the lever that would move it, and the table of
      what was compiled.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> def make_grad_fn(remat):
    ...   def loss(ws, x):
    ...     layer = remat(lambda h, w: (jnp.tanh(h @ w), None))
    ...     return jnp.mean(jax.lax.scan(layer, x, ws)[0] ** 2)
    ...   return jax.grad(loss)
    >>> ws = jax.ShapeDtypeStruct((8, 128, 128), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((1024, 128), jnp.float32)
    >>> plan = jaccum.fit_plan(make_grad_fn, ws, x, memory_budget=3 << 20)
    >>> plan.peak_bytes <= 3 << 20, len(plan.tried) < plan.grid_size
    (True, True)
    >>> step = jax.jit(plan.step(make_grad_fn))  # K, policy and mode applied
    >>> print(plan)  # One row per configuration compiled.
    memory budget 3.00 MiB per device: K=..., remat=..., peak ... configurations
     K  remat  order  peak  GFLOPs  bytes  wire  predicted
    ...

    Timed on the device, within 10 seconds, the plan is the fastest step
    measured:

    >>> ws, x = jnp.ones((8, 128, 128)) / 128, jnp.ones((1024, 128))
    >>> timed = jaccum.fit_plan(make_grad_fn, ws, x, memory_budget=3 << 20,
    ...                         candidates=[8, 16, 32], measure=10.0)
    >>> fastest = min((p for p in timed.tried.values() if p.measured_seconds),
    ...               key=lambda p: p.measured_seconds)
    >>> timed.measured_seconds == fastest.measured_seconds
    True
    >>> print(timed)
    memory budget 3.00 MiB per device: ..., measured ... ms per step; ... bound...
     K  remat  order  peak  GFLOPs  bytes  wire  predicted  measured
    ...
  """
  seconds = _check_measure(measure, args)
  search = _search.search_for(
    make_grad_fn,
    args,
    memory_budget,
    candidates,
    policies,
    fsdp_modes,
    cost_model,
    calibrate,
    accumulate_kwargs,
  )
  best = search.run()
  if best is None:
    raise _search.nothing_fits(search)
  timer = None if seconds is None else _search.measured(search, best, seconds)
  fastest = timer.fastest() if timer else None
  if timer is not None and fastest is None:
    warnings.warn(_search.timed_nothing(search, best, timer), stacklevel=2)
  return _plan_of(search, fastest or best, best, timer)

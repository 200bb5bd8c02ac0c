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
rounds within a time bound (`_timing`), and the plan is the fastest
measured.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from jaccum._planning import peak as _peak
from jaccum._planning import timing as _timing
from jaccum._planning.cost import (
  CostModel,
  batch_argnum_set,
  cost,
  micro_args,
  step_compute,
)
from jaccum._planning.fit import (
  _PARALLEL_OPTIONS,
  _batch_size,
  _budget_bytes,
  _format_bytes,
  _prepare,
)
from jaccum._planning.fit import (
  _peak as _peak_bytes,
)
from jaccum._routes import rules
from jaccum._routes.accumulate import accumulate, data_parallel
from jaccum._routes.options import FSDP_MODES

if TYPE_CHECKING:
  from jaccum.inspect import MemoryStats

__all__ = ["CostModel", "Plan", "PlanPoint", "Remat", "fit_plan"]

# Lightest first: at a fixed K, memory falls and FLOPs rise along this list.
DEFAULT_POLICIES = (None, "dots_with_no_batch_dims_saveable", "nothing_saveable")
# Predicted times within this share of the fastest count as equal.
TIE = 0.02
# With measure=: the points timed first are those the model puts within this
# factor of its choice (it is off by more than its tie where kernels speed up
# or slow down with the micro-batch), at most MEASURE_SPREAD of them, spread
# over the grid; each group of steps is timed for MEASURE_ROUNDS interleaved
# rounds.
MEASURE_WITHIN = 2.0
MEASURE_SPREAD = 6
MEASURE_ROUNDS = 3
# Then those measured within this share of the fastest race again, for twice
# as many rounds.
MEASURE_CLOSE = 0.1

# A point of the grid: indices of its FSDP mode, policy and K.
Point = tuple[int, int, int]
# A point by its values: (K, policy name, FSDP mode).
Key = tuple[int, str | None, str | None]


@dataclasses.dataclass(frozen=True)
class Remat:
  """A rematerialisation policy, for the layers of a model to apply.

  `fit_plan` calls `make_grad_fn(remat)` with one of these per policy it
  tries; the model applies it where recompute pays, to each layer (remat of
  the whole loss saves nothing: the backward pass recomputes every
  activation and keeps them all). `remat(fn)` is `fn` itself for no remat,
  else `jax.checkpoint(fn, policy=remat.policy)`; `bool(remat)` is False for
  no remat, for models that take a policy instead (`nnx.remat`, `nn.remat`).

  Attributes:
    name: the policy's name (a `jax.checkpoint_policies` attribute, or the
      name you gave it), or None for no rematerialisation.
    policy: the policy function for `jax.checkpoint`, or None.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> remat = jaccum.Remat("nothing_saveable",
    ...                      jax.checkpoint_policies.nothing_saveable)
    >>> layer = remat(lambda h, w: (jnp.tanh(h @ w), None))
    >>> h, _ = jax.lax.scan(layer, jnp.ones((4, 8)), jnp.ones((3, 8, 8)))
    >>> bool(remat), bool(jaccum.Remat(None, None)), h.shape
    (True, False, (4, 8))
  """

  name: str | None
  policy: Callable[..., Any] | None

  def __call__(self, fn: Callable[..., Any], **checkpoint_kwargs: Any) -> Any:
    """`fn` rematerialised under this policy (`fn` itself for no remat)."""
    if self.name is None:
      return fn
    return jax.checkpoint(fn, policy=self.policy, **checkpoint_kwargs)

  def __bool__(self) -> bool:
    return self.name is not None


def _remat(entry: Any) -> Remat:
  """A `Remat` from None, a `jax.checkpoint_policies` name, a policy or a pair."""
  if entry is None or isinstance(entry, Remat):
    return entry or Remat(None, None)
  if isinstance(entry, str):
    policy = getattr(jax.checkpoint_policies, entry, None)
    if policy is None or entry.startswith("_"):
      raise ValueError(
        f"policies: {entry!r} is not a jax.checkpoint_policies name; pass one "
        "(e.g. 'nothing_saveable'), a policy function, or a (name, policy) pair."
      )
    return Remat(entry, policy)
  if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
    if not callable(entry[1]):
      raise TypeError(f"policies: the policy of {entry[0]!r} must be callable.")
    return Remat(*entry)
  if callable(entry):
    return Remat(getattr(entry, "__name__", repr(entry)), entry)
  raise TypeError(
    "policies entries must be None (no remat), a jax.checkpoint_policies name, "
    f"a policy function or a (name, policy) pair; got {entry!r}."
  )


class PlanPoint(NamedTuple):
  """One configuration `fit_plan` compiled, with its figures.

  Attributes:
    num_microbatches: K (per device with `data_parallel`).
    remat: the policy's name, or None.
    fsdp_mode: the FSDP mode, or None off a mesh with `param_specs`.
    peak_bytes: the compiled step's peak per device, as in `MicrobatchFit`.
    flops: the step's FLOPs per device: K micro-steps, recompute included.
    bytes_accessed: the step's memory traffic per device, XLA's estimate.
    wire_bytes: bytes the step's collectives move per device (all-reduces
      twice), from the compiled program; None where a loop's trip count is
      unknown (then counted as 0).
    predicted_seconds: the cost model's time for the step.
    fits: whether `peak_bytes` is within the budget.
    order: 1 for the first configuration compiled, and so on.
    stats: XLA's memory figures behind `peak_bytes`.
    measured_seconds: with `measure=`, the median of its timed rounds on
      the device; None where it was not timed.
    round_seconds: the seconds of each of its timed rounds.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> make_grad_fn = lambda remat: jax.grad(lambda w, x: jnp.mean(x @ w))
    >>> plan = jaccum.fit_plan(make_grad_fn, jnp.ones(8), jnp.ones((32, 8)),
    ...                        memory_budget=1 << 30, candidates=[1, 4])
    >>> point = next(iter(plan.tried.values()))
    >>> point.num_microbatches, point.order, point.fits, point.wire_bytes
    (1, 1, True, 0)
    >>> point.measured_seconds is None  # Not timed: no measure=.
    True
  """

  num_microbatches: int
  remat: str | None
  fsdp_mode: str | None
  peak_bytes: int
  flops: float
  bytes_accessed: float
  wire_bytes: int | None
  predicted_seconds: float
  fits: bool
  order: int
  stats: MemoryStats
  measured_seconds: float | None = None
  round_seconds: tuple[float, ...] = ()


class Plan(NamedTuple):
  """The fastest configuration that fits a memory budget, and what was tried.

  `print` it for a table of every configuration compiled; `plan.step(...)`
  builds the accumulated function it chose.

  Attributes:
    num_microbatches: K (per device with `data_parallel`).
    remat: the chosen policy's name, or None for no rematerialisation.
    fsdp_mode: the chosen FSDP mode, or None off a mesh with `param_specs`.
    peak_bytes: the chosen step's compiled peak per device.
    predicted_seconds: its predicted time per step.
    tried: `{(K, remat, fsdp_mode): PlanPoint}` for every configuration
      compiled, in the order compiled.
    memory_budget: the budget in bytes per device.
    grid_size: how many configurations the search chose among.
    cost_model: the `CostModel` behind the predictions.
    policy: the chosen `Remat`.
    options: the options of `accumulate` or `data_parallel` the step gets
      (`fsdp_mode` included where one was chosen).
    measured_seconds: with `measure=`, the chosen step's median measured
      time (None without, or where nothing could be timed in the bound:
      `fit_plan` then warns).
    measure_seconds: the time bound given as `measure=`, or None.
    measure_spent_seconds: the time measuring took (compiling the points it
      timed that the search had not compiled, and running them): within
      `measure_seconds` but for the last thing it started (a batch of
      compilations or a round) taking longer than any of its kind before.
    model_choice: `(K, remat, fsdp_mode)` that the cost model chose, before
      any measurement.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> def make_grad_fn(remat):
    ...   layer = remat(lambda h, w: (jnp.tanh(h @ w), None))
    ...   return jax.grad(lambda ws, x: jnp.mean(jax.lax.scan(layer, x, ws)[0]))
    >>> ws, x = jnp.ones((4, 16, 16)) / 16, jnp.ones((64, 16))
    >>> plan = jaccum.fit_plan(make_grad_fn, ws, x, memory_budget=1 << 30)
    >>> plan.num_microbatches, plan.remat, plan.fsdp_mode  # all fits at once
    (1, None, None)
    >>> point = plan.tried[(1, None, None)]
    >>> point.fits, point.peak_bytes == plan.peak_bytes
    (True, True)
    >>> grads = jax.jit(plan.step(make_grad_fn))(ws, x)
  """

  num_microbatches: int
  remat: str | None
  fsdp_mode: str | None
  peak_bytes: int
  predicted_seconds: float
  tried: dict[Key, PlanPoint]
  memory_budget: int
  grid_size: int
  cost_model: CostModel
  policy: Remat
  options: dict[str, Any]
  measured_seconds: float | None = None
  measure_seconds: float | None = None
  measure_spent_seconds: float | None = None
  model_choice: Key | None = None

  def step(self, make_grad_fn: Callable[[Remat], Callable[..., Any]]) -> Any:
    """The accumulated function of this plan: K, policy and mode applied.

    Args:
      make_grad_fn: as for `fit_plan`; it gets the chosen `Remat`.

    Returns:
      `accumulate(make_grad_fn(remat), K, **options)`, or `data_parallel`'s
      with the chosen `fsdp_mode` on a mesh: jit it as you would either.
    """
    parallel = any(name in self.options for name in _PARALLEL_OPTIONS)
    transform = data_parallel if parallel else accumulate
    return transform(make_grad_fn(self.policy), self.num_microbatches, **self.options)

  def __str__(self) -> str:
    share = self.peak_bytes / self.memory_budget
    chosen = (self.num_microbatches, self.remat, self.fsdp_mode)
    measured = (
      ""
      if self.measured_seconds is None
      else f", measured {_ms(self.measured_seconds)}"
    )
    head = (
      f"memory budget {_format_bytes(self.memory_budget)} per device: "
      f"{_describe(chosen)}, peak {_format_bytes(self.peak_bytes)} "
      f"({share:.1%} of the budget), predicted {_ms(self.predicted_seconds)}"
      f"{measured} per step; compiled {len(self.tried)} of {self.grid_size} "
      "configurations"
    )
    return head + self._measure_line() + "\n" + _table(self.tried, chosen)

  def _measure_line(self) -> str:
    if self.measure_seconds is None:
      return ""
    timed = [p for p in self.tried.values() if p.measured_seconds is not None]
    line = (
      f"; timed {len(timed)} on the device in interleaved rounds, "
      f"{self.measure_spent_seconds or 0:.3g} s of a {self.measure_seconds:g} s "
      "bound"
    )
    if not timed:
      return line + ": none could be timed in it, so the cost model's choice stands"
    model = self.model_choice
    if model is None or model == (self.num_microbatches, self.remat, self.fsdp_mode):
      return line + "; the cost model chose the same"
    other = self.tried[model].measured_seconds
    return f"{line}; the cost model chose {_describe(model)}" + (
      "" if other is None else f", measured {_ms(other)}"
    )


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3g} ms"


def _describe(key: Key) -> str:
  k, remat, mode = key
  return f"K={k}, remat={remat}" + (f", fsdp_mode={mode}" if mode else "")


def _table(tried: dict[Key, PlanPoint], chosen: Key | None) -> str:
  modes = any(p.fsdp_mode for p in tried.values())
  measured = any(p.measured_seconds is not None for p in tried.values())
  rows: list[tuple[str, ...]] = [
    ("K", "remat", *(("fsdp_mode",) if modes else ()), "order", "peak",
     "GFLOPs", "bytes", "wire", "predicted", *(("measured",) if measured else ()),
     "")
  ]  # fmt: skip
  for key in sorted(tried, key=lambda k: (str(k[2]), _rank(k[1]), k[0])):
    p = tried[key]
    verdict = "chosen" if key == chosen else "fits" if p.fits else "over"
    timed = "–" if p.measured_seconds is None else _ms(p.measured_seconds)
    rows.append(
      (
        str(p.num_microbatches),
        str(p.remat),
        *((str(p.fsdp_mode),) if modes else ()),
        str(p.order),
        _format_bytes(p.peak_bytes),
        f"{p.flops / 1e9:.3g}",
        _format_bytes(int(p.bytes_accessed)),
        "?" if p.wire_bytes is None else _format_bytes(p.wire_bytes),
        _ms(p.predicted_seconds),
        *((timed,) if measured else ()),
        verdict,
      )
    )
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return "\n".join(
    "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
    for row in rows
  )


def _rank(name: str | None) -> tuple[int, str]:
  if name in DEFAULT_POLICIES:
    return (DEFAULT_POLICIES.index(name), "")
  return (len(DEFAULT_POLICIES), str(name))


def _wire_bytes(compiled: Any) -> int | None:
  from jaccum.inspect import _count_collectives  # Loaded on first use.

  counts = _count_collectives(compiled.as_text())
  total = 0
  for kind, count in zip(counts._fields, counts, strict=True):
    inside = count.bytes_inside_loops
    if inside is None:
      return None
    total += (2 if kind == "all_reduce" else 1) * (inside + count.bytes_outside_loops)
  return total


@dataclasses.dataclass
class _Search:
  """The grid of (mode, policy, K), what is known of its points, the search.

  Attributes:
    modes, remats, ks: the levers' values, lightest first (K smallest).
    grad_fns: `{policy name: grad_fn}`.
    compute: `{(policy name, K): (FLOPs, bytes)}` of the step, None where
      the micro-step could not be lowered alone.
    transform: `accumulate` or `data_parallel`; options: its options.
    args: the step's arguments; batch_argnums: theirs; shards: devices the
      batch is split over; rows_per_device: its rows on each.
    budget: bytes per device; cost_model: the predictions' constants.
    points: `{point: PlanPoint}` compiled, in order; executables: theirs.
    compile_seconds: how long each compilation took.
  """

  modes: list[str | None]
  remats: list[Remat]
  ks: list[int]
  grad_fns: dict[str | None, Callable[..., Any]]
  compute: dict[tuple[str | None, int], tuple[float, float] | None]
  transform: Callable[..., Any]
  options: dict[str, Any]
  args: Sequence[Any]
  batch_argnums: Any
  shards: int
  rows_per_device: int
  budget: int
  cost_model: CostModel
  points: dict[Point, PlanPoint] = dataclasses.field(default_factory=dict)
  executables: dict[Point, Any] = dataclasses.field(default_factory=dict)
  compile_seconds: list[float] = dataclasses.field(default_factory=list)

  @property
  def grid(self) -> list[Point]:
    return [(m, j, i) for m in range(len(self.modes))
            for j in range(len(self.remats)) for i in range(len(self.ks))]  # fmt: skip

  def key(self, point: Point) -> Key:
    m, j, i = point
    return (self.ks[i], self.remats[j].name, self.modes[m])

  def bound(self, point: Point) -> float:
    """A lower bound of the point's predicted time, known before compiling."""
    m, j, i = point
    figures = self.compute[(self.remats[j].name, self.ks[i])]
    if figures is None:
      return 0.0  # Unknown until compiled: never ruled out by time.
    k = self.ks[i]
    seconds = self.cost_model.compute_seconds(k, figures[0] / k, figures[1] / k)
    # The wire: a mode's bytes do not fall as K grows (gather_once sends the
    # same at every K, the others more), whatever the policy.
    wire = [
      p.wire_bytes or 0 for (pm, _, pi), p in self.points.items() if pm == m and pi <= i
    ]
    return seconds + max(wire, default=0) / self.cost_model.wire_bytes_per_second

  def build(self, point: Point) -> tuple[Any, float]:
    """The point's step compiled (never run), and the seconds it took."""
    start = _timing.CLOCK()
    m, j, i = point
    mode, remat, k = self.modes[m], self.remats[j], self.ks[i]
    step_options = dict(self.options, **({"fsdp_mode": mode} if mode else {}))
    step = jax.jit(self.transform(self.grad_fns[remat.name], k, **step_options))
    return step.lower(*self.args).compile(), _timing.CLOCK() - start

  def record(self, point: Point, compiled: Any, seconds: float) -> PlanPoint:
    """Records the figures of the point's compiled step."""
    from jaccum import inspect  # Loaded on first use, as `jaccum.inspect` is.

    m, j, i = point
    mode, remat, k = self.modes[m], self.remats[j], self.ks[i]
    stats = inspect._memory_of(compiled)
    peak = _peak_bytes(stats)
    figures = self.compute[(remat.name, k)]
    if figures is None:  # The compiled step's figures: its loop body once.
      whole = cost(compiled)
      figures = k * whole["flops"], k * whole["bytes accessed"]
    flops, accessed = figures
    wire = _wire_bytes(compiled)
    self.points[point] = PlanPoint(
      num_microbatches=k,
      remat=remat.name,
      fsdp_mode=mode,
      peak_bytes=peak,
      flops=flops,
      bytes_accessed=accessed,
      wire_bytes=wire,
      predicted_seconds=self.cost_model.seconds(k, flops / k, accessed / k, wire or 0),
      fits=peak <= self.budget,
      order=len(self.points) + 1,
      stats=stats,
    )
    self.executables[point] = compiled
    self.compile_seconds.append(seconds)
    return self.points[point]

  def compile(self, point: Point) -> PlanPoint:
    """Compiles the point's step (never runs it) and records its figures."""
    return self.record(point, *self.build(point))

  def over_implied(self, point: Point) -> bool:
    """Over budget, known or implied: a point at least as light is over."""
    return any(
      not p.fits and all(a <= b for a, b in zip(point, q, strict=True))
      for q, p in self.points.items()
    )

  def fastest(self) -> Point | None:
    """The fastest fitting point compiled, by the model, ties to the lightest.

    Predictions within TIE of the fastest are equal: the model is not finer
    than that. Of those, the lightest: no remat before remat, the smaller K,
    the mode that sends fewer bytes.
    """
    fitting = [q for q, p in self.points.items() if p.fits]
    if not fitting:
      return None
    least = min(self.points[q].predicted_seconds for q in fitting)
    near = [q for q in fitting if self.points[q].predicted_seconds <= least * (1 + TIE)]
    return min(near, key=_lightness)

  def may_win(self, point: Point, best: Point | None) -> bool:
    """Whether the point could be faster than `best`, or tie and be lighter."""
    if best is None:
      return True
    best_time = self.points[best].predicted_seconds
    lighter = _lightness(point) < _lightness(best)
    bound = self.bound(point)
    return bound < best_time or (lighter and bound <= best_time * (1 + TIE))

  def run(self) -> Point | None:
    """The branch and bound: the grid's fastest fitting point, or None."""
    while True:
      best = self.fastest()
      left = [
        p
        for p in self.grid
        if p not in self.points and self.may_win(p, best) and not self.over_implied(p)
      ]
      if not left:
        break
      left.sort(key=lambda p: (self.bound(p), p))
      # The fastest bound first (a generous budget ends there), then the median.
      self.compile(left[len(left) // 2 if self.points else 0])
    if best is None:
      # Memory need not be monotone: before saying that nothing fits, compile
      # the row with the least memory (the most sharded mode, the heaviest
      # policy) at every K the search skipped.
      for i in range(len(self.ks)):
        if (point := (len(self.modes) - 1, len(self.remats) - 1, i)) not in self.points:
          self.compile(point)
      best = self.fastest()
    return best


def _lightness(point: Point) -> tuple[int, int, int]:
  """Lighter first: the policy, then K, then the mode."""
  m, j, i = point
  return (j, i, m)


def _check_policies(policies: Sequence[Any]) -> list[Remat]:
  if isinstance(policies, str) or not isinstance(policies, Sequence) or not policies:
    raise TypeError(
      "policies must be a non-empty sequence (lightest first) of None, "
      f"jax.checkpoint_policies names, policies or (name, policy) pairs; got "
      f"{policies!r}."
    )
  remats = [_remat(p) for p in policies]
  names = [r.name for r in remats]
  if len(set(names)) != len(names):
    raise ValueError(f"policies must have distinct names, got {names}.")
  return remats


def _grad_fns(
  make_grad_fn: Callable[[Remat], Callable[..., Any]], remats: list[Remat]
) -> dict[str | None, Callable[..., Any]]:
  if not callable(make_grad_fn):
    raise TypeError(
      f"make_grad_fn must be callable, make_grad_fn(remat) -> grad_fn; got "
      f"{make_grad_fn!r}."
    )
  grad_fns = {}
  for remat in remats:
    grad_fn = make_grad_fn(remat)
    if not callable(grad_fn):
      raise TypeError(
        f"make_grad_fn(remat) must return a grad_fn, e.g. jax.grad(loss); for "
        f"{remat!r} it returned {grad_fn!r}."
      )
    grad_fns[remat.name] = grad_fn
  return grad_fns


def _fsdp_modes(
  fsdp_modes: Sequence[str] | None,
  given_mode: str | None,
  on_mesh: bool,
  deterministic: bool = False,
) -> list[str | None]:
  """The modes to choose from: those given, the one given, or all on a mesh.

  With `deterministic=True` only `"gather_once"` is exact: the default grid
  keeps it alone, and sharded modes asked for by name are refused.
  """
  if fsdp_modes is None:
    if given_mode is not None:
      return [given_mode]
    if not on_mesh:
      return [None]
    return ["gather_once"] if deterministic else list(FSDP_MODES)
  if isinstance(fsdp_modes, str) or not fsdp_modes:
    raise TypeError(
      f"fsdp_modes must be a non-empty sequence of {FSDP_MODES}, got {fsdp_modes!r}."
    )
  if bad := [m for m in fsdp_modes if m not in FSDP_MODES]:
    raise ValueError(f"fsdp_modes must be among {FSDP_MODES}, got {bad}.")
  if not on_mesh:
    raise ValueError(
      "fsdp_modes choose among FSDP modes, which need data_parallel's "
      "param_specs=... (or fsdp_mode=...); pass them, or leave fsdp_modes out."
    )
  if deterministic:
    rules.check("fit_plan", fsdp_modes)
  return sorted(set(fsdp_modes), key=FSDP_MODES.index)


def _check_cost_model(cost_model: Any, calibrate: bool) -> CostModel:
  if cost_model is None:
    return CostModel.calibrate() if calibrate else CostModel.default()
  if not isinstance(cost_model, CostModel):
    raise TypeError(f"cost_model must be a jaccum.CostModel, got {cost_model!r}.")
  return cost_model


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


def _search_for(
  make_grad_fn: Callable[[Remat], Callable[..., Any]],
  args: Sequence[Any],
  memory_budget: int | float,
  candidates: Iterable[int] | None,
  policies: Sequence[Any],
  fsdp_modes: Sequence[str] | None,
  cost_model: CostModel | None,
  calibrate: bool,
  accumulate_kwargs: dict[str, Any],
) -> _Search:
  """Checks `fit_plan`'s arguments; the search over their grid, not yet run."""
  budget = _budget_bytes(memory_budget)
  remats = _check_policies(policies)
  grad_fns = _grad_fns(make_grad_fn, remats)
  options = dict(accumulate_kwargs)
  given_mode = options.pop("fsdp_mode", None)
  on_mesh = "param_specs" in options or given_mode is not None
  deterministic = bool(options.get("deterministic", False))
  modes = _fsdp_modes(fsdp_modes, given_mode, on_mesh, deterministic)
  first = grad_fns[remats[0].name]
  check = dict(options, **({"fsdp_mode": modes[0]} if modes[0] else {}))
  transform, ks, shards = _prepare(first, args, candidates, check)
  model = _check_cost_model(cost_model, calibrate)
  batch_argnums = options.get("batch_argnums", 1)
  rows_per_device = _batch_size(args, batch_argnums) // shards
  no_remat = grad_fns.get(None) or make_grad_fn(Remat(None, None))
  compute = step_compute(grad_fns, no_remat, args, batch_argnums, rows_per_device, ks)
  return _Search(
    modes=modes,
    remats=remats,
    ks=ks,
    grad_fns=grad_fns,
    compute=compute,
    transform=transform,
    options=options,
    args=args,
    batch_argnums=batch_argnums,
    shards=shards,
    rows_per_device=rows_per_device,
    budget=budget,
    cost_model=model,
  )


def _nothing_fits(search: _Search) -> ValueError:
  """The error when no configuration fits: what dominates, and the lever."""
  point = min(search.points, key=lambda q: (search.points[q].peak_bytes, q))
  smallest = search.points[point]
  k = smallest.num_microbatches
  micro = micro_args(search.args, search.batch_argnums, search.rows_per_device // k)
  largest = _peak.largest_activation(search.grad_fns[smallest.remat], micro)
  split = _peak.parts(
    smallest.stats,
    search.args,
    batch_argnum_set(search.args, search.batch_argnums),
    search.shards,
    largest,
  )
  advice = _peak.advice(
    split,
    fsdp_mode=smallest.fsdp_mode,
    num_microbatches=k,
    rows_per_device=search.rows_per_device,
    largest_candidate=search.ks[-1],
    policies=[r.name for r in search.remats],
  )
  tried = {search.key(q): p for q, p in search.points.items()}
  return ValueError(
    f"no configuration fits memory_budget={search.budget} "
    f"({_format_bytes(search.budget)}) per device; the smallest peak is "
    f"{_format_bytes(smallest.peak_bytes)} at {_describe(search.key(point))}: "
    f"{_peak.describe(split)}. {advice}\n" + _table(tried, None)
  )


def _estimate(search: _Search, point: Point) -> float:
  """The point's predicted time if compiled, else its bound."""
  known = search.points.get(point)
  return known.predicted_seconds if known else search.bound(point)


def _compile_within(
  search: _Search, timer: _timing.Timer[Point], points: Iterable[Point]
) -> bool:
  """Compiles those of `points` not compiled yet, side by side, in the time left.

  Returns whether every one of them was compiled.
  """
  todo = [p for p in dict.fromkeys(points) if p not in search.points]
  builds = [lambda p=p: search.build(p) for p in todo]
  done = timer.compile(builds, workers=os.cpu_count() or 1)
  for point, (compiled, seconds) in zip(todo, done, strict=False):
    search.record(point, compiled, seconds)
  return len(done) == len(todo)


def _first_points(
  search: _Search, timer: _timing.Timer[Point], best: Point
) -> list[Point]:
  """The points of `_spread`, compiled and fitting.

  One that turns out over the budget is replaced by the next spread, until
  all fit, none is left, or the time is out.
  """
  while True:
    wanted = _spread(search, best)
    if all(p in search.points for p in wanted):
      return wanted
    if not _compile_within(search, timer, wanted):
      return [p for p in wanted if p in search.points and search.points[p].fits]


def _spread(search: _Search, best: Point) -> list[Point]:
  """The points to time first, the model's choice first.

  Of those that may fit and that the model puts within MEASURE_WITHIN of its
  choice, at most MEASURE_SPREAD, each next the farthest from those already
  picked over the grid's levers (K, policy, mode, each scaled to one), the
  faster of equals first: they span the grid, since where the model is
  wrong (caches, per-kernel costs, recompute XLA drops) it is wrong along
  a lever, not at a point.
  """
  limit = search.points[best].predicted_seconds * MEASURE_WITHIN
  near = [
    p
    for p in search.grid
    if not search.over_implied(p) and _estimate(search, p) <= limit
  ]
  sizes = (len(search.modes), len(search.remats), len(search.ks))

  def distance(a: Point, b: Point) -> float:
    return sum(abs(x - y) / max(n - 1, 1) for x, y, n in zip(a, b, sizes, strict=True))

  picked = [best]
  while len(picked) < MEASURE_SPREAD and (rest := [p for p in near if p not in picked]):
    picked.append(
      max(
        rest,
        key=lambda p: (min(distance(p, q) for q in picked), -_estimate(search, p)),
      )
    )
  return picked


def _neighbours(search: _Search, point: Point) -> list[Point]:
  """The next K either way, and the other policies and modes at its K."""
  m, j, i = point
  near = [
    (m, j, i - 1),
    (m, j, i + 1),
    *((m, other, i) for other in range(len(search.remats)) if other != j),
    *((other, j, i) for other in range(len(search.modes)) if other != m),
  ]
  return [p for p in near if 0 <= p[2] < len(search.ks) and not search.over_implied(p)]


def _measured(search: _Search, best: Point, seconds: float) -> _timing.Timer[Point]:
  """Times the model's choice, points near it, then the fastest's neighbours.

  First the model's choice alone, then the points of `_spread`, then, while
  time is left and the fastest measured changes, its neighbours beside it;
  each group for MEASURE_ROUNDS interleaved rounds. A point not yet compiled is
  compiled first (within the bound); one over the budget is never run.
  """
  timer: _timing.Timer[Point] = _timing.Timer(
    seconds, max(search.compile_seconds, default=0.0)
  )
  # NumPy arrays on the device once, not copied there in every timed call.
  args = jax.tree.map(
    lambda leaf: jax.device_put(leaf) if isinstance(leaf, np.ndarray) else leaf,
    list(search.args),
  )

  def enter(points: list[Point]) -> list[Point]:
    _compile_within(search, timer, points)
    entered = []
    for point in points:
      if point in search.points and search.points[point].fits:
        run = functools.partial(search.executables[point], *args)
        if timer.add(point, run, search.points[point].predicted_seconds):
          entered.append(point)
    return entered

  # The model's choice first: the search compiled it, so timing it costs
  # only its runs, and a bound too short to compile more still times it.
  timer.race(enter([best]), MEASURE_ROUNDS)
  tried = set(first := _first_points(search, timer, best))
  if len(first) > 1:
    timer.race(enter(first), MEASURE_ROUNDS)
  while not timer.cut_short and (incumbent := timer.fastest()) is not None:
    new = [p for p in _neighbours(search, incumbent) if p not in tried]
    if not new:
      break
    tried.update(new)
    if entered := enter(new):
      timer.race([incumbent, *entered], MEASURE_ROUNDS)
  _final_race(timer)
  return timer


def _timed_nothing(search: _Search, best: Point, timer: _timing.Timer[Point]) -> str:
  """The warning when `measure=` timed no step: what timing the choice needs."""
  predicted = search.points[best].predicted_seconds
  first = timer.first.get(best, timer.first_call_estimate(predicted))
  need = first * (1 + MEASURE_ROUNDS)
  return (
    f"fit_plan(measure={timer.seconds:g}) timed no step in {timer.elapsed():.3g} "
    f"s: timing the cost model's choice ({_describe(search.key(best))}, "
    f"predicted {_ms(predicted)}) needs about {need:.3g} s, a first call of "
    f"{first:.3g} s{'' if best in timer.first else ' as judged'} and "
    f"{MEASURE_ROUNDS} rounds. The plan is the cost model's choice, unmeasured "
    f"(plan.measured_seconds is None): pass measure={need:.3g} or more to time "
    "it, or leave measure out."
  )


def _final_race(timer: _timing.Timer[Point]) -> None:
  """More rounds, side by side, for those within MEASURE_CLOSE of the fastest.

  A choice between near-equals should not rest on a few rounds each, timed
  in groups under whatever load each group met.
  """
  medians = {p: m for p in timer.rounds if (m := timer.median(p)) is not None}
  if not medians:
    return
  limit = min(medians.values()) * (1 + MEASURE_CLOSE)
  close = [p for p, median in medians.items() if median <= limit]
  if len(close) > 1:
    timer.race(close, 2 * MEASURE_ROUNDS)


def _plan_of(
  search: _Search,
  best: Point,
  model_choice: Point,
  timer: _timing.Timer[Point] | None,
) -> Plan:
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
  return Plan(
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
  make_grad_fn: Callable[[Remat], Callable[..., Any]],
  *args: Any,
  memory_budget: int | float,
  candidates: Iterable[int] | None = None,
  policies: Sequence[Any] = DEFAULT_POLICIES,
  fsdp_modes: Sequence[str] | None = None,
  cost_model: CostModel | None = None,
  calibrate: bool = False,
  measure: float | None = None,
  **accumulate_kwargs: Any,
) -> Plan:
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
      with a `Remat` that the model applies to its layers, e.g.
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
      (see `Plan` for what it spent), and chooses the least median timed.
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
    A `Plan`; `print` it for a table of every configuration compiled (with
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
  search = _search_for(
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
    raise _nothing_fits(search)
  timer = None if seconds is None else _measured(search, best, seconds)
  fastest = timer.fastest() if timer else None
  if timer is not None and fastest is None:
    warnings.warn(_timed_nothing(search, best, timer), stacklevel=2)
  return _plan_of(search, fastest or best, best, timer)

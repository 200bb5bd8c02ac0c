"""`fit_plan`'s search: a branch and bound over the grid, then timing where asked.

`Search` compiles the points whose bound is fastest until none is left
that could beat the best that fits (see `fit_plan`'s module); with
`measure=`, `measured` times the model's choice first, then points spread
over the grid near it, then the neighbours of the fastest, in interleaved
rounds within the bound (`timing`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaccum._planning import peak as _peak
from jaccum._planning import points as _points
from jaccum._planning import timing as _timing
from jaccum._planning.cost import (
  CostModel,
  batch_argnum_set,
  cost,
  micro_args,
  step_compute,
)
from jaccum._planning.fit import (
  _batch_size,
  _budget_bytes,
  _format_bytes,
  _prepare,
)
from jaccum._planning.fit import (
  _peak as _peak_bytes,
)
from jaccum._routes import rules
from jaccum._routes.options import FSDP_MODES

if TYPE_CHECKING:
  pass


@dataclasses.dataclass
class Search:
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
    points: `{point: _points.PlanPoint}` compiled, in order; executables: theirs.
    compile_seconds: how long each compilation took.
  """

  modes: list[str | None]
  remats: list[_points.Remat]
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
  points: dict[_points.Point, _points.PlanPoint] = dataclasses.field(
    default_factory=dict
  )
  executables: dict[_points.Point, Any] = dataclasses.field(default_factory=dict)
  compile_seconds: list[float] = dataclasses.field(default_factory=list)

  @property
  def grid(self) -> list[_points.Point]:
    return [(m, j, i) for m in range(len(self.modes))
            for j in range(len(self.remats)) for i in range(len(self.ks))]  # fmt: skip

  def key(self, point: _points.Point) -> _points.Key:
    m, j, i = point
    return (self.ks[i], self.remats[j].name, self.modes[m])

  def bound(self, point: _points.Point) -> float:
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

  def build(self, point: _points.Point) -> tuple[Any, float]:
    """The point's step compiled (never run), and the seconds it took."""
    start = _timing.CLOCK()
    m, j, i = point
    mode, remat, k = self.modes[m], self.remats[j], self.ks[i]
    step_options = dict(self.options, **({"fsdp_mode": mode} if mode else {}))
    step = jax.jit(self.transform(self.grad_fns[remat.name], k, **step_options))
    return step.lower(*self.args).compile(), _timing.CLOCK() - start

  def record(
    self, point: _points.Point, compiled: Any, seconds: float
  ) -> _points.PlanPoint:
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
    wire = _points.wire_bytes(compiled)
    self.points[point] = _points.PlanPoint(
      num_microbatches=k,
      remat=remat.name,
      fsdp_mode=mode,
      peak_bytes=peak,
      flops=flops,
      bytes_accessed=accessed,
      wire_bytes=wire,
      predicted_seconds=self.cost_model.seconds(
        k, flops / k, accessed / k, wire or 0, stats.temp_bytes
      ),
      fits=peak <= self.budget,
      order=len(self.points) + 1,
      stats=stats,
    )
    self.executables[point] = compiled
    self.compile_seconds.append(seconds)
    return self.points[point]

  def compile(self, point: _points.Point) -> _points.PlanPoint:
    """Compiles the point's step (never runs it) and records its figures."""
    return self.record(point, *self.build(point))

  def over_implied(self, point: _points.Point) -> bool:
    """Over budget, known or implied: a point at least as light is over."""
    return any(
      not p.fits and all(a <= b for a, b in zip(point, q, strict=True))
      for q, p in self.points.items()
    )

  def fastest(self) -> _points.Point | None:
    """The fastest fitting point compiled, by the model, ties to the lightest.

    Predictions within _points.TIE of the fastest are equal: the model is not finer
    than that. Of those, the lightest: no remat before remat, the smaller K,
    the mode that sends fewer bytes.
    """
    fitting = [q for q, p in self.points.items() if p.fits]
    if not fitting:
      return None
    least = min(self.points[q].predicted_seconds for q in fitting)
    near = [
      q
      for q in fitting
      if self.points[q].predicted_seconds <= least * (1 + _points.TIE)
    ]
    return min(near, key=_lightness)

  def may_win(self, point: _points.Point, best: _points.Point | None) -> bool:
    """Whether the point could be faster than `best`, or tie and be lighter."""
    if best is None:
      return True
    best_time = self.points[best].predicted_seconds
    lighter = _lightness(point) < _lightness(best)
    bound = self.bound(point)
    return bound < best_time or (lighter and bound <= best_time * (1 + _points.TIE))

  def run(self) -> _points.Point | None:
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


def _lightness(point: _points.Point) -> tuple[int, int, int]:
  """Lighter first: the policy, then K, then the mode."""
  m, j, i = point
  return (j, i, m)


def _check_policies(policies: Sequence[Any]) -> list[_points.Remat]:
  if isinstance(policies, str) or not isinstance(policies, Sequence) or not policies:
    raise TypeError(
      "policies must be a non-empty sequence (lightest first) of None, "
      f"jax.checkpoint_policies names, policies or (name, policy) pairs; got "
      f"{policies!r}."
    )
  remats = [_points.remat(p) for p in policies]
  names = [r.name for r in remats]
  if len(set(names)) != len(names):
    raise ValueError(f"policies must have distinct names, got {names}.")
  return remats


def _grad_fns(
  make_grad_fn: Callable[[_points.Remat], Callable[..., Any]],
  remats: list[_points.Remat],
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


def search_for(
  make_grad_fn: Callable[[_points.Remat], Callable[..., Any]],
  args: Sequence[Any],
  memory_budget: int | float,
  candidates: Iterable[int] | None,
  policies: Sequence[Any],
  fsdp_modes: Sequence[str] | None,
  cost_model: CostModel | None,
  calibrate: bool,
  accumulate_kwargs: dict[str, Any],
) -> Search:
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
  no_remat = grad_fns.get(None) or make_grad_fn(_points.Remat(None, None))
  compute = step_compute(grad_fns, no_remat, args, batch_argnums, rows_per_device, ks)
  return Search(
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


def nothing_fits(search: Search) -> ValueError:
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
    f"{_format_bytes(smallest.peak_bytes)} at {_points.describe(search.key(point))}: "
    f"{_peak.describe(split)}. {advice}\n" + _points.table(tried, None)
  )


def _estimate(search: Search, point: _points.Point) -> float:
  """The point's predicted time if compiled, else its bound."""
  known = search.points.get(point)
  return known.predicted_seconds if known else search.bound(point)


def _compile_within(
  search: Search, timer: _timing.Timer[_points.Point], points: Iterable[_points.Point]
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
  search: Search, timer: _timing.Timer[_points.Point], best: _points.Point
) -> list[_points.Point]:
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


def _spread(search: Search, best: _points.Point) -> list[_points.Point]:
  """The points to time first, the model's choice first.

  Of those that may fit and that the model puts within _points.MEASURE_WITHIN of its
  choice, at most _points.MEASURE_SPREAD, each next the farthest from those already
  picked over the grid's levers (K, policy, mode, each scaled to one), the
  faster of equals first: they span the grid, since where the model is
  wrong (caches, per-kernel costs, recompute XLA drops) it is wrong along
  a lever, not at a point.
  """
  limit = search.points[best].predicted_seconds * _points.MEASURE_WITHIN
  near = [
    p
    for p in search.grid
    if not search.over_implied(p) and _estimate(search, p) <= limit
  ]
  sizes = (len(search.modes), len(search.remats), len(search.ks))

  def distance(a: _points.Point, b: _points.Point) -> float:
    return sum(abs(x - y) / max(n - 1, 1) for x, y, n in zip(a, b, sizes, strict=True))

  picked = [best]
  while len(picked) < _points.MEASURE_SPREAD and (
    rest := [p for p in near if p not in picked]
  ):
    picked.append(
      max(
        rest,
        key=lambda p: (min(distance(p, q) for q in picked), -_estimate(search, p)),
      )
    )
  return picked


def _neighbours(search: Search, point: _points.Point) -> list[_points.Point]:
  """The next K either way, and the other policies and modes at its K."""
  m, j, i = point
  near = [
    (m, j, i - 1),
    (m, j, i + 1),
    *((m, other, i) for other in range(len(search.remats)) if other != j),
    *((other, j, i) for other in range(len(search.modes)) if other != m),
  ]
  return [p for p in near if 0 <= p[2] < len(search.ks) and not search.over_implied(p)]


def measured(
  search: Search, best: _points.Point, seconds: float
) -> _timing.Timer[_points.Point]:
  """Times the model's choice, points near it, then the fastest's neighbours.

  First the model's choice alone, then the points of `_spread`, then, while
  time is left and the fastest measured changes, its neighbours beside it;
  each group for _points.MEASURE_ROUNDS interleaved rounds. A point not yet compiled is
  compiled first (within the bound); one over the budget is never run.
  """
  timer: _timing.Timer[_points.Point] = _timing.Timer(
    seconds, max(search.compile_seconds, default=0.0)
  )
  # NumPy arrays on the device once, not copied there in every timed call.
  args = jax.tree.map(
    lambda leaf: jax.device_put(leaf) if isinstance(leaf, np.ndarray) else leaf,
    list(search.args),
  )

  def enter(points: list[_points.Point]) -> list[_points.Point]:
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
  timer.race(enter([best]), _points.MEASURE_ROUNDS)
  tried = set(first := _first_points(search, timer, best))
  if len(first) > 1:
    timer.race(enter(first), _points.MEASURE_ROUNDS)
  while not timer.cut_short and (incumbent := timer.fastest()) is not None:
    new = [p for p in _neighbours(search, incumbent) if p not in tried]
    if not new:
      break
    tried.update(new)
    if entered := enter(new):
      timer.race([incumbent, *entered], _points.MEASURE_ROUNDS)
  _final_race(timer)
  return timer


def timed_nothing(
  search: Search, best: _points.Point, timer: _timing.Timer[_points.Point]
) -> str:
  """The warning when `measure=` timed no step: what timing the choice needs."""
  predicted = search.points[best].predicted_seconds
  first = timer.first.get(best, timer.first_call_estimate(predicted))
  need = first * (1 + _points.MEASURE_ROUNDS)
  return (
    f"fit_plan(measure={timer.seconds:g}) timed no step in {timer.elapsed():.3g} "
    f"s: timing the cost model's choice ({_points.describe(search.key(best))}, "
    f"predicted {_points.ms(predicted)}) needs about {need:.3g} s, a first call of "
    f"{first:.3g} s{'' if best in timer.first else ' as judged'} and "
    f"{_points.MEASURE_ROUNDS} rounds. The plan is the cost model's choice, unmeasured "
    f"(plan.measured_seconds is None): pass measure={need:.3g} or more to time "
    "it, or leave measure out."
  )


def _final_race(timer: _timing.Timer[_points.Point]) -> None:
  """More rounds, side by side, for those within _points.MEASURE_CLOSE of the fastest.

  A choice between near-equals should not rest on a few rounds each, timed
  in groups under whatever load each group met.
  """
  medians = {p: m for p in timer.rounds if (m := timer.median(p)) is not None}
  if not medians:
    return
  limit = min(medians.values()) * (1 + _points.MEASURE_CLOSE)
  close = [p for p, median in medians.items() if median <= limit]
  if len(close) > 1:
    timer.race(close, 2 * _points.MEASURE_ROUNDS)

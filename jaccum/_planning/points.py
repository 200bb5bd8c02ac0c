"""What `fit_plan` returns, and the grid it searches: policies, points, plans.

`Remat` names a rematerialisation policy, `PlanPoint` one point of the grid
(K, policy, FSDP mode) as compiled, costed and maybe timed, `Plan` the
chosen point with the table of what was tried.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from jaccum._planning.cost import (
  CostModel,
)
from jaccum._planning.fit import (
  _PARALLEL_OPTIONS,
  _format_bytes,
)
from jaccum._routes.accumulate import accumulate, data_parallel

if TYPE_CHECKING:
  from jaccum.inspect import MemoryStats


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


def remat(entry: Any) -> Remat:
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
      "" if self.measured_seconds is None else f", measured {ms(self.measured_seconds)}"
    )
    head = (
      f"memory budget {_format_bytes(self.memory_budget)} per device: "
      f"{describe(chosen)}, peak {_format_bytes(self.peak_bytes)} "
      f"({share:.1%} of the budget), predicted {ms(self.predicted_seconds)}"
      f"{measured} per step; compiled {len(self.tried)} of {self.grid_size} "
      "configurations"
    )
    return head + self._measure_line() + "\n" + table(self.tried, chosen)

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
    return f"{line}; the cost model chose {describe(model)}" + (
      "" if other is None else f", measured {ms(other)}"
    )


def ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3g} ms"


def describe(key: Key) -> str:
  k, remat, mode = key
  return f"K={k}, remat={remat}" + (f", fsdp_mode={mode}" if mode else "")


def table(tried: dict[Key, PlanPoint], chosen: Key | None) -> str:
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
    timed = "–" if p.measured_seconds is None else ms(p.measured_seconds)
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
        ms(p.predicted_seconds),
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


def wire_bytes(compiled: Any) -> int | None:
  from jaccum.inspect import _count_collectives  # Loaded on first use.

  counts = _count_collectives(compiled.as_text())
  total = 0
  for kind, count in zip(counts._fields, counts, strict=True):
    inside = count.bytes_inside_loops
    if inside is None:
      return None
    total += (2 if kind == "all_reduce" else 1) * (inside + count.bytes_outside_loops)
  return total

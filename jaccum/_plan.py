"""`fit_plan`: K, rematerialisation and FSDP mode chosen together from a budget.

A step's memory and cost are known once XLA has compiled it, before it runs.
`fit_microbatches` uses that to pick K. Here K is one lever of three: a
rematerialisation policy trades activations for recompute, and an FSDP mode
trades memory for bytes on the wire. The fastest plan that fits is often a
light policy at a larger K, not full remat at the smallest.

The search is a branch and bound over the grid of (mode, policy, K). Each
point's compute is known cheaply, from XLA's cost analysis of the lowered
micro-step (no compilation); it bounds the point's time from below. Memory
needs a compilation, and it is monotone: it falls as K grows, as the policy
gets heavier and as the mode shards more. So one point over budget rules out
every point lighter in all three, and one that fits rules out every point
whose bound is slower (the bound adds the bytes on the wire that its mode
was seen to send at a smaller K: a mode never sends fewer as K grows). The
search compiles the point with the fastest bound, then the median of what is
left in order of the bound, until nothing is left: it finds the grid's best
point under the cost model, with a few of its compilations where the
monotony holds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jaccum._accumulate import accumulate
from jaccum._fit import (
  _PARALLEL_OPTIONS,
  _batch_size,
  _budget_bytes,
  _format_bytes,
  _is_int,
  _peak,
  _prepare,
)
from jaccum._parallel import FSDP_MODES, data_parallel

if TYPE_CHECKING:
  from jaccum.inspect import MemoryStats

__all__ = ["CostModel", "Plan", "PlanPoint", "Remat", "fit_plan"]

# Lightest first: at a fixed K, memory falls and FLOPs rise along this list.
DEFAULT_POLICIES = (None, "dots_with_no_batch_dims_saveable", "nothing_saveable")
# Predicted times within this share of the fastest count as equal.
TIE = 0.02


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


class CostModel(NamedTuple):
  """The time a step is predicted to take, from XLA's cost figures.

  A step of K micro-steps, each of `flops` and `bytes_accessed` (XLA's cost
  analysis of the lowered micro-step, its scans unrolled so that every layer
  counts: the FLOPs with the policy's recompute, the bytes without remat,
  which changes what is recomputed, not what is read), moving
  `wire_bytes` between devices, is predicted to take

      K · (flops / flops_per_second + bytes_accessed / bytes_per_second
           + seconds_per_microbatch) + wire_bytes / wire_bytes_per_second

  Compute and memory traffic add rather than overlap, which overstates both
  a little and ranks plans the same; the wire is not overlapped either.
  `CostModel.calibrate()` measures the four constants on this backend with
  small programs of its own (a matmul, an elementwise pass, jaccum's loop
  over micro-steps of no work, and a `psum`), in a second or two;
  `CostModel.default()` gives rough figures per platform, enough to rank
  plans that differ by much.

  Attributes:
    flops_per_second: compute throughput.
    bytes_per_second: memory throughput, in XLA's `bytes accessed`.
    wire_bytes_per_second: bytes a collective moves per second per device
      (an all-reduce is counted twice: reduce-scatter and all-gather).
    seconds_per_microbatch: the loop's overhead per micro-step.

  Examples:
    >>> import jaccum
    >>> model = jaccum.CostModel(1e9, 1e9, 1e8, 1e-5)
    >>> model.seconds(num_microbatches=4, flops=1e6, bytes_accessed=1e6,
    ...               wire_bytes=1e6)  # 4 · (1 + 1 + 0.01) ms + 10 ms
    0.01804
    >>> model.compute_seconds(4, flops=1e6, bytes_accessed=1e6)  # no wire
    0.00804
    >>> jaccum.CostModel.default("cpu").flops_per_second > 0
    True
    >>> measured = jaccum.CostModel.calibrate()  # this backend's constants
    >>> all(value > 0 for value in measured)
    True
  """

  flops_per_second: float
  bytes_per_second: float
  wire_bytes_per_second: float
  seconds_per_microbatch: float

  def compute_seconds(
    self, num_microbatches: int, flops: float, bytes_accessed: float
  ) -> float:
    """The K micro-steps' time, without the wire: a lower bound of `seconds`."""
    per_step = (
      flops / self.flops_per_second
      + bytes_accessed / self.bytes_per_second
      + self.seconds_per_microbatch
    )
    return num_microbatches * per_step

  def seconds(
    self,
    num_microbatches: int,
    flops: float,
    bytes_accessed: float,
    wire_bytes: float,
  ) -> float:
    """The predicted time of a step (see the class)."""
    compute = self.compute_seconds(num_microbatches, flops, bytes_accessed)
    return round(compute + wire_bytes / self.wire_bytes_per_second, 12)

  @classmethod
  def default(cls, platform: str | None = None) -> CostModel:
    """Rough constants for a platform ("cpu", "gpu", "tpu"), the default one's."""
    platform = platform or jax.default_backend()
    return {
      "cpu": cls(5e10, 2e10, 5e9, 5e-6),
      "gpu": cls(5e13, 2e12, 1e11, 1e-5),
      "tpu": cls(1e14, 1e12, 5e10, 1e-5),
    }.get(platform, cls(5e10, 2e10, 5e9, 5e-6))

  @classmethod
  def calibrate(cls) -> CostModel:
    """The four constants measured on the default backend (a second or two)."""
    x = jnp.ones((1024, 1024), jnp.float32)
    flops_ps = _throughput(lambda a: a @ a, x, "flops")
    y = jnp.ones((1 << 26,), jnp.float32)  # 256 MiB: more than any cache
    bytes_ps = _throughput(lambda a: a * 2.0 + 1.0, y, "bytes accessed")

    # jaccum's own loop over a micro-step of next to no work: 4096 micro-steps
    # against one, the difference is the loop's cost per micro-step. (A real
    # micro-step's kernels each cost more: at least a microsecond is taken.)
    from jaccum._accumulate import accumulate

    def tiny(w: jax.Array, x: jax.Array) -> jax.Array:
      return jnp.tanh(x @ w).sum(0)

    w, rows = jnp.ones((8, 8), jnp.float32), jnp.ones((4096, 8), jnp.float32)
    many = _seconds(jax.jit(accumulate(tiny, 4096)), w, rows)
    one = _seconds(jax.jit(accumulate(tiny, 1)), w, rows)
    per_iteration = max(many - one, 1e-6 * 4095) / 4095
    wire_ps = cls.default().wire_bytes_per_second
    if jax.device_count() > 1:
      mesh = jax.make_mesh(
        (jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Explicit,)
      )
      psum = jax.jit(
        jax.shard_map(
          lambda a: jax.lax.psum(a, "d"),
          mesh=mesh,
          in_specs=jax.P("d"),
          out_specs=jax.P("d"),
        )
      )
      z = jax.device_put(
        jnp.ones((jax.device_count() << 20,), jnp.float32),
        jax.NamedSharding(mesh, jax.P("d")),
      )
      wire_ps = 2 * 4 * (1 << 20) / _seconds(psum, z)
    return cls(flops_ps, bytes_ps, wire_ps, per_iteration)


def _seconds(fn: Callable[..., Any], *args: Any) -> float:
  """The median of a few timed runs after a warm-up one."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _throughput(fn: Callable[..., Any], x: jax.Array, figure: str) -> float:
  jitted = jax.jit(fn)
  amount = _cost(jitted.lower(x))[figure]
  return amount / _seconds(jitted, x)


# Scans longer than this stay rolled in the cost analysis (counted once).
MAX_UNROLL = 256


def _unrolled(closed: Any) -> Any:
  """`closed` with its scans unrolled, so that XLA's cost analysis, which
  counts a loop's body once, counts every iteration (stacked layers)."""
  from jaccum._jaxpr import rewrite_eqns

  def unroll(eqn: Any) -> list[Any] | None:
    if eqn.primitive.name != "scan" or not 1 < eqn.params["length"] <= MAX_UNROLL:
      return None
    body = rewrite_eqns(eqn.params["jaxpr"], unroll)
    params = {**eqn.params, "jaxpr": body, "unroll": eqn.params["length"]}
    return [eqn.replace(params=params)]

  return rewrite_eqns(closed, unroll)


def _step_cost(grad_fn: Callable[..., Any], args: Sequence[Any]) -> dict[str, float]:
  """XLA's cost analysis of `grad_fn` lowered for `args`, its scans unrolled."""
  closed = _unrolled(jax.make_jaxpr(grad_fn)(*args))

  def run(*flat: Any) -> list[Any]:
    return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)

  return _cost(jax.jit(run).lower(*jax.tree.leaves(args)))


def _cost(lowered: Any) -> dict[str, float]:
  """XLA's cost analysis of a lowered program: flops and bytes accessed."""
  analysis = lowered.cost_analysis() or {}
  if isinstance(analysis, list | tuple):  # Older JAX: one dict per device.
    analysis = analysis[0] if analysis else {}
  return {
    "flops": float(analysis.get("flops", 0.0)),
    "bytes accessed": float(analysis.get("bytes accessed", 0.0)),
  }


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

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> make_grad_fn = lambda remat: jax.grad(lambda w, x: jnp.mean(x @ w))
    >>> plan = jaccum.fit_plan(make_grad_fn, jnp.ones(8), jnp.ones((32, 8)),
    ...                        memory_budget=1 << 30, candidates=[1, 4])
    >>> point = next(iter(plan.tried.values()))
    >>> point.num_microbatches, point.order, point.fits, point.wire_bytes
    (1, 1, True, 0)
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
  tried: dict[tuple[int, str | None, str | None], PlanPoint]
  memory_budget: int
  grid_size: int
  cost_model: CostModel
  policy: Remat
  options: dict[str, Any]

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
    mode = f", fsdp_mode={self.fsdp_mode}" if self.fsdp_mode else ""
    head = (
      f"memory budget {_format_bytes(self.memory_budget)} per device: "
      f"K={self.num_microbatches}, remat={self.remat}{mode}, peak "
      f"{_format_bytes(self.peak_bytes)} ({share:.1%} of the budget), predicted "
      f"{self.predicted_seconds * 1e3:.3g} ms per step; compiled "
      f"{len(self.tried)} of {self.grid_size} configurations"
    )
    return head + "\n" + _table(self)


def _table(plan: Plan) -> str:
  modes = any(p.fsdp_mode for p in plan.tried.values())
  rows: list[tuple[str, ...]] = [
    ("K", "remat", *(("fsdp_mode",) if modes else ()), "order", "peak",
     "GFLOPs", "bytes", "wire", "predicted", "")
  ]  # fmt: skip
  chosen = (plan.num_microbatches, plan.remat, plan.fsdp_mode)
  for key in sorted(plan.tried, key=lambda k: (str(k[2]), _rank(k[1]), k[0])):
    p = plan.tried[key]
    verdict = "chosen" if key == chosen else "fits" if p.fits else "over"
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
        f"{p.predicted_seconds * 1e3:.3g} ms",
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


def _micro_args(
  args: Sequence[Any], batch_argnums: Any, rows: int
) -> list[jax.ShapeDtypeStruct | Any]:
  """Shapes of one device's micro-step: the batch cut to `rows`, all unsharded."""
  argnums = {batch_argnums} if _is_int(batch_argnums) else set(batch_argnums)
  argnums = {a % len(args) for a in argnums}

  def shape(leaf: Any, batch: bool) -> Any:
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      return leaf
    dims = tuple(leaf.shape)
    if batch and dims:
      dims = (rows, *dims[1:])
    return jax.ShapeDtypeStruct(dims, leaf.dtype)

  return [
    jax.tree.map(lambda leaf, b=(i in argnums): shape(leaf, b), arg)
    for i, arg in enumerate(args)
  ]


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


def fit_plan(
  make_grad_fn: Callable[[Remat], Callable[..., Any]],
  *args: Any,
  memory_budget: int | float,
  candidates: Iterable[int] | None = None,
  policies: Sequence[Any] = DEFAULT_POLICIES,
  fsdp_modes: Sequence[str] | None = None,
  cost_model: CostModel | None = None,
  calibrate: bool = False,
  **accumulate_kwargs: Any,
) -> Plan:
  """The fastest K, remat policy and FSDP mode whose compiled step fits a budget.

  `fit_microbatches` over more levers. Each configuration is the step
  `jax.jit(accumulate(make_grad_fn(remat), K, **accumulate_kwargs))` (or
  `data_parallel`'s, with the mode as `fsdp_mode`); it is compiled for the
  arguments and never run, so they may be `jax.ShapeDtypeStruct` objects. Of
  those that fit, the plan is the one `cost_model` predicts fastest (see
  `CostModel`): compute from XLA's cost analysis of the micro-step, which
  counts the recompute of each policy, and the wire from the collectives'
  bytes in the compiled program.

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
      to all three there (and to the one given as `fsdp_mode`, if any).
    cost_model: the constants of the prediction; defaults to
      `CostModel.calibrate()` with `calibrate=True`, else to
      `CostModel.default()`.
    calibrate: measure the cost model's constants on this backend first
      (small programs of its own, never the step).
    **accumulate_kwargs: options of `accumulate` (`batch_argnums`, `reduce`,
      …) or of `data_parallel` (`mesh`, `axis`, `param_specs`).

  Returns:
    A `Plan`; `print` it for a table of every configuration compiled, and
    `plan.step(make_grad_fn)` for its accumulated function.

  Raises:
    TypeError, ValueError: on bad arguments, as `fit_microbatches` raises
      them; and when no configuration fits, after compiling every one the
      search skipped, with the table of what was compiled.

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
  """
  if not callable(make_grad_fn):
    raise TypeError(
      f"make_grad_fn must be callable, make_grad_fn(remat) -> grad_fn; got "
      f"{make_grad_fn!r}."
    )
  budget = _budget_bytes(memory_budget)
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

  grad_fns: dict[str | None, Callable[..., Any]] = {}
  for remat in remats:
    grad_fn = make_grad_fn(remat)
    if not callable(grad_fn):
      raise TypeError(
        f"make_grad_fn(remat) must return a grad_fn, e.g. jax.grad(loss); for "
        f"{remat!r} it returned {grad_fn!r}."
      )
    grad_fns[remat.name] = grad_fn

  options = dict(accumulate_kwargs)
  given_mode = options.pop("fsdp_mode", None)
  on_mesh = "param_specs" in options or given_mode is not None
  modes: list[str | None]
  if fsdp_modes is not None:
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
    modes = sorted(set(fsdp_modes), key=FSDP_MODES.index)
  elif given_mode is not None:
    modes = [given_mode]
  else:
    modes = list(FSDP_MODES) if on_mesh else [None]

  first = grad_fns[remats[0].name]
  check = dict(options, **({"fsdp_mode": modes[0]} if modes[0] else {}))
  transform, ks, shards = _prepare(first, args, candidates, check)
  if cost_model is None:
    cost_model = CostModel.calibrate() if calibrate else CostModel.default()
  elif not isinstance(cost_model, CostModel):
    raise TypeError(f"cost_model must be a jaccum.CostModel, got {cost_model!r}.")

  batch_argnums = options.get("batch_argnums", 1)
  rows_per_device = _batch_size(args, batch_argnums) // shards

  # Each point's compute: K micro-steps of the lowered micro-step's cost. It
  # is the same in every mode (the gathers are wire, counted when compiled).
  # XLA's figures are affine in the rows (α·rows + β per micro-step), so the
  # step's are αB + βK: lowering the smallest and largest K gives every K.
  # A policy changes what is recomputed, not what the step must read: the
  # bytes are the micro-step's without remat, the FLOPs the policy's own.
  # (Before fusion, a rematerialised program's bytes came out below those
  # without remat, which ranked remat faster than it runs.)
  no_remat = grad_fns.get(None) or make_grad_fn(Remat(None, None))
  costs: dict[tuple[Any, int], dict[str, float] | None] = {}

  def cost_of(grad_fn: Callable[..., Any], key: Any, k: int) -> dict[str, float] | None:
    if (key, k) not in costs:
      micro = _micro_args(args, batch_argnums, rows_per_device // k)
      try:
        costs[(key, k)] = _step_cost(grad_fn, micro)
      except Exception:  # E.g. code that names a mesh axis: known when compiled.
        costs[(key, k)] = None
    return costs[(key, k)]

  def lowered(name: str | None, k: int) -> tuple[float, float] | None:
    flops = cost_of(grad_fns[name], name, k)
    accessed = cost_of(no_remat, None, k)
    if flops is None or accessed is None:
      return None
    return k * flops["flops"], k * accessed["bytes accessed"]

  compute: dict[tuple[str | None, int], tuple[float, float] | None] = {}
  for remat in remats:
    ends = [lowered(remat.name, k) for k in (ks[0], ks[-1])]
    for k in ks:
      if None in ends:
        compute[(remat.name, k)] = None
        continue
      share = (k - ks[0]) / (ks[-1] - ks[0]) if len(ks) > 1 else 0.0
      compute[(remat.name, k)] = tuple(  # type: ignore[assignment]
        a + share * (b - a) for a, b in zip(*ends, strict=True)
      )

  def bound(point: tuple[int, int, int]) -> float:
    m, j, i = point
    figures = compute[(remats[j].name, ks[i])]
    if figures is None:
      return 0.0  # Unknown until compiled: never ruled out by time.
    seconds = cost_model.compute_seconds(ks[i], figures[0] / ks[i], figures[1] / ks[i])
    # The wire: a mode's bytes do not fall as K grows (gather_once sends the
    # same at every K, the others more), whatever the policy.
    wire = [
      q.wire_bytes or 0 for (qm, _, qi), q in points.items() if qm == m and qi <= i
    ]
    return seconds + max(wire, default=0) / cost_model.wire_bytes_per_second

  grid = [(m, j, i) for m in range(len(modes)) for j in range(len(remats))
          for i in range(len(ks))]  # fmt: skip
  points: dict[tuple[int, int, int], PlanPoint] = {}

  from jaccum import inspect  # Loaded on first use, as `jaccum.inspect` is.

  def compile_point(point: tuple[int, int, int]) -> PlanPoint:
    m, j, i = point
    mode, remat, k = modes[m], remats[j], ks[i]
    step_options = dict(options, **({"fsdp_mode": mode} if mode else {}))
    step = jax.jit(transform(grad_fns[remat.name], k, **step_options))
    compiled = step.lower(*args).compile()
    stats = inspect._memory_of(compiled)
    peak = _peak(stats)
    exact = lowered(remat.name, k)
    if exact is None:  # The compiled step's figures: its loop body once.
      figures = _cost(compiled)
      exact = k * figures["flops"], k * figures["bytes accessed"]
    flops, accessed = exact
    wire = _wire_bytes(compiled)
    points[point] = PlanPoint(
      num_microbatches=k,
      remat=remat.name,
      fsdp_mode=mode,
      peak_bytes=peak,
      flops=flops,
      bytes_accessed=accessed,
      wire_bytes=wire,
      predicted_seconds=cost_model.seconds(k, flops / k, accessed / k, wire or 0),
      fits=peak <= budget,
      order=len(points) + 1,
      stats=stats,
    )
    return points[point]

  def over_implied(point: tuple[int, int, int]) -> bool:
    # Over budget if a point at least as light in every lever is over.
    return any(
      not p.fits and all(a <= b for a, b in zip(point, q, strict=True))
      for q, p in points.items()
    )

  def fastest() -> tuple[int, int, int] | None:
    # Predictions within TIE of the fastest are equal: the model is not
    # finer than that. Of those, the lightest: no remat before remat, the
    # smaller K, the mode that sends fewer bytes.
    fitting = [q for q, p in points.items() if p.fits]
    if not fitting:
      return None
    least = min(points[q].predicted_seconds for q in fitting)
    near = [q for q in fitting if points[q].predicted_seconds <= least * (1 + TIE)]
    return min(near, key=lambda q: (q[1], q[2], q[0]))

  def may_win(point: tuple[int, int, int], best: tuple[int, int, int] | None) -> bool:
    if best is None:
      return True
    # Faster than the best, or within its tie and lighter.
    best_time = points[best].predicted_seconds
    lighter = (point[1], point[2], point[0]) < (best[1], best[2], best[0])
    return bound(point) < best_time or (
      lighter and bound(point) <= best_time * (1 + TIE)
    )

  while True:
    best = fastest()
    left = [
      p for p in grid if p not in points and may_win(p, best) and not over_implied(p)
    ]
    if not left:
      break
    left.sort(key=lambda p: (bound(p), p))
    # The fastest bound first (a generous budget ends there), then the median.
    compile_point(left[len(left) // 2 if points else 0])
  if best is None:
    # Memory need not be monotone: before saying that nothing fits, compile
    # the row with the least memory (the most sharded mode, the heaviest
    # policy) at every K the search skipped.
    for i in range(len(ks)):
      if (point := (len(modes) - 1, len(remats) - 1, i)) not in points:
        compile_point(point)
    best = fastest()
  tried = {(p.num_microbatches, p.remat, p.fsdp_mode): p for p in points.values()}
  if best is None:
    smallest = min(points.values(), key=lambda p: p.peak_bytes)
    raise ValueError(
      f"no configuration fits memory_budget={budget} ({_format_bytes(budget)}) "
      f"per device; the smallest peak is {_format_bytes(smallest.peak_bytes)} at "
      f"K={smallest.num_microbatches}, remat={smallest.remat}"
      + (f", fsdp_mode={smallest.fsdp_mode}" if smallest.fsdp_mode else "")
      + ". Shard the params over more devices (param_specs), allow a larger K, "
      "rematerialise more of the model, or use a smaller batch.\n"
      + _table(
        Plan(
          0,
          None,
          None,
          0,
          0.0,
          tried,
          budget,
          len(grid),
          cost_model,
          Remat(None, None),
          options,
        )
      )
    )
  chosen = points[best]
  plan_options = dict(options)
  if chosen.fsdp_mode:
    plan_options["fsdp_mode"] = chosen.fsdp_mode
  return Plan(
    num_microbatches=chosen.num_microbatches,
    remat=chosen.remat,
    fsdp_mode=chosen.fsdp_mode,
    peak_bytes=chosen.peak_bytes,
    predicted_seconds=chosen.predicted_seconds,
    tried=tried,
    memory_budget=budget,
    grid_size=len(grid),
    cost_model=cost_model,
    policy=remats[best[1]],
    options=plan_options,
  )

"""What a step costs before it runs: XLA's cost analysis, and a model of time.

XLA's cost analysis of a lowered program (no compilation) gives its FLOPs and
the bytes it reads and writes. `CostModel` turns those, with the bytes a
compiled step sends between devices, into a predicted step time, from four
constants of the backend that `CostModel.calibrate()` measures. `fit_plan`
ranks its grid with it.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

__all__ = ["CostModel"]


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

  With a cache (`cache_bytes` and `cache_bytes_per_second` both set, as
  `calibrate()` and `default()` set them on a CPU), a step whose temporaries are
  `temp_bytes` reads the share `min(1, temp_bytes / cache_bytes)` of its
  bytes at `bytes_per_second` and the rest at `cache_bytes_per_second`: a
  small micro-batch's working set stays in the cache, where XLA's bytes
  accessed (which count the params again in every micro-step) cost less
  than a pass over memory. Without it (0, the default), every byte costs
  `bytes_per_second`.

  `CostModel.calibrate()` measures the constants on this backend with
  small programs of its own (a matmul, an elementwise pass over memory and
  one within the cache, jaccum's loop over micro-steps of no work, and a
  `psum`), in a second or two; `CostModel.default()` gives rough figures
  per platform (on a CPU, with its cache at 4× the memory's rate), enough
  to rank plans that differ by much.

  Attributes:
    flops_per_second: compute throughput.
    bytes_per_second: memory throughput, in XLA's `bytes accessed`.
    wire_bytes_per_second: bytes a collective moves per second per device
      (an all-reduce is counted twice: reduce-scatter and all-gather).
    seconds_per_microbatch: the loop's overhead per micro-step.
    cache_bytes: the last-level cache's size (0: no cache modelled).
    cache_bytes_per_second: throughput of a pass within that cache.

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
    >>> cached = jaccum.CostModel(1e9, 1e9, 1e8, 1e-5, cache_bytes=4e6,
    ...                           cache_bytes_per_second=4e9)
    >>> cached.compute_seconds(4, flops=1e6, bytes_accessed=1e6,
    ...                        temp_bytes=1e6)  # 4 · (1 + (1/4 + 3/16) + 0.01) ms
    0.00579
    >>> measured = jaccum.CostModel.calibrate()  # this backend's constants
    >>> all(value >= 0 for value in measured) and measured.bytes_per_second > 0
    True
  """

  flops_per_second: float
  bytes_per_second: float
  wire_bytes_per_second: float
  seconds_per_microbatch: float
  cache_bytes: float = 0.0
  cache_bytes_per_second: float = 0.0

  def compute_seconds(
    self,
    num_microbatches: int,
    flops: float,
    bytes_accessed: float,
    temp_bytes: float | None = None,
  ) -> float:
    """The K micro-steps' time, without the wire: a lower bound of `seconds`.

    `temp_bytes` are the step's temporaries, which set the share of the
    bytes read from the cache (see the class); None where they are not
    known yet: every byte at the faster rate, a lower bound of the time.
    """
    seconds_per_byte = 1 / self.bytes_per_second
    if self.cache_bytes > 0 and self.cache_bytes_per_second > 0:
      in_cache = 1 / self.cache_bytes_per_second
      if temp_bytes is None:
        seconds_per_byte = min(seconds_per_byte, in_cache)
      else:
        share = min(1.0, temp_bytes / self.cache_bytes)  # read from memory
        seconds_per_byte = share * seconds_per_byte + (1 - share) * in_cache
    per_step = (
      flops / self.flops_per_second
      + bytes_accessed * seconds_per_byte
      + self.seconds_per_microbatch
    )
    return num_microbatches * per_step

  def seconds(
    self,
    num_microbatches: int,
    flops: float,
    bytes_accessed: float,
    wire_bytes: float,
    temp_bytes: float | None = None,
  ) -> float:
    """The predicted time of a step (see the class)."""
    compute = self.compute_seconds(num_microbatches, flops, bytes_accessed, temp_bytes)
    return round(compute + wire_bytes / self.wire_bytes_per_second, 12)

  @classmethod
  def default(cls, platform: str | None = None) -> CostModel:
    """Rough constants for a platform ("cpu", "gpu", "tpu"), the default one's.

    On a CPU with a last-level cache that Linux reports, the cache is
    modelled at 4× the memory's rate: a micro-batch whose working set stays
    in it runs its params' bytes faster, which ranks small micro-batches
    right (measured 4–9× on a loaded 2-core EPYC; `calibrate()` measures it).
    """
    platform = platform or jax.default_backend()
    if platform == "gpu":
      return cls(5e13, 2e12, 1e11, 1e-5)
    if platform == "tpu":
      return cls(1e14, 1e12, 5e10, 1e-5)
    cache = _last_level_cache_bytes() if platform == "cpu" else 0
    return cls(5e10, 2e10, 5e9, 5e-6, float(cache), 8e10 if cache else 0.0)

  @classmethod
  def calibrate(cls) -> CostModel:
    """The four constants measured on the default backend (a second or two)."""
    x = jnp.ones((1024, 1024), jnp.float32)
    flops_ps = _throughput(lambda a: a @ a, x, "flops")
    y = jnp.ones((1 << 26,), jnp.float32)  # 256 MiB: more than any cache
    bytes_ps = _throughput(lambda a: a * 2.0 + 1.0, y, "bytes accessed")
    cache_bytes = _last_level_cache_bytes()
    # Never slower than memory: a noisy measure must not rank large
    # micro-batches first.
    cache_ps = max(_cache_throughput(cache_bytes), bytes_ps) if cache_bytes else 0.0

    # jaccum's own loop over a micro-step of next to no work: 4096 micro-steps
    # against one, the difference is the loop's cost per micro-step. (A real
    # micro-step's kernels each cost more: at least a microsecond is taken.)
    from jaccum._routes.accumulate import accumulate

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
    return cls(flops_ps, bytes_ps, wire_ps, per_iteration, float(cache_bytes), cache_ps)


def _last_level_cache_bytes() -> int:
  """The CPU's largest cache, as Linux reports it (0 elsewhere, and on other
  backends: an accelerator's cache is not what its memory traffic meets)."""
  if jax.default_backend() != "cpu":
    return 0
  sizes = []
  for path in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
    text = path.read_text().strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text.rstrip("KMG")
    if digits.isdigit():
      sizes.append(int(digits) * scale)
  return max(sizes, default=0)


def _cache_throughput(cache_bytes: int) -> float:
  """Bytes per second of elementwise passes over an array a quarter of the
  cache's size (its input and output half of it), 16 passes in one
  program: the rate of a working set that stays in the cache (36-130 GB/s
  on a loaded 2-core EPYC with 32 MiB of L3, against 8-14 GB/s over 256
  MiB)."""
  size = max(cache_bytes // 4 // 4, 1024)
  passes = 16

  def run(a: jax.Array) -> jax.Array:
    return jax.lax.fori_loop(0, passes, lambda i, a: a * 0.5 + 1.0, a)

  x = jnp.ones((size,), jnp.float32)
  return passes * 2 * 4 * size / _seconds(jax.jit(run), x)


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
  amount = cost(jitted.lower(x))[figure]
  return amount / _seconds(jitted, x)


# Scans longer than this stay rolled in the cost analysis (counted once).
MAX_UNROLL = 256


def _unrolled(closed: Any) -> Any:
  """`closed` with its scans unrolled, so that XLA's cost analysis, which
  counts a loop's body once, counts every iteration (stacked layers)."""
  from jaccum._core.rewrites import rewrite_eqns

  def unroll(eqn: Any) -> list[Any] | None:
    if eqn.primitive.name != "scan" or not 1 < eqn.params["length"] <= MAX_UNROLL:
      return None
    body = rewrite_eqns(eqn.params["jaxpr"], unroll)
    params = {**eqn.params, "jaxpr": body, "unroll": eqn.params["length"]}
    return [eqn.replace(params=params)]

  return rewrite_eqns(closed, unroll)


# XLA's cost figures of each micro-step program lowered, by its text: a plan
# for another budget, or the same model built again, lowers nothing twice.
# (The text names the program's every operation and shape; the values of
# the arrays it closes over, which do not change the cost, are left out.)
_COSTS: dict[tuple[str, str], dict[str, float]] = {}
_COSTS_KEPT = 4096


def step_cost(grad_fn: Callable[..., Any], args: Sequence[Any]) -> dict[str, float]:
  """XLA's cost analysis of `grad_fn` lowered for `args`, its scans unrolled."""
  traced = jax.make_jaxpr(grad_fn)(*args)
  key = (jax.default_backend(), str(traced))
  if key not in _COSTS:
    closed = _unrolled(traced)

    def run(*flat: Any) -> list[Any]:
      return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)

    if len(_COSTS) >= _COSTS_KEPT:
      del _COSTS[next(iter(_COSTS))]
    _COSTS[key] = cost(jax.jit(run).lower(*jax.tree.leaves(args)))
  return dict(_COSTS[key])


def cost(lowered: Any) -> dict[str, float]:
  """XLA's cost analysis of a lowered program: flops and bytes accessed."""
  analysis = lowered.cost_analysis() or {}
  if isinstance(analysis, list | tuple):  # Older JAX: one dict per device.
    analysis = analysis[0] if analysis else {}
  return {
    "flops": float(analysis.get("flops", 0.0)),
    "bytes accessed": float(analysis.get("bytes accessed", 0.0)),
  }


def batch_argnum_set(args: Sequence[Any], batch_argnums: Any) -> set[int]:
  """`batch_argnums` (an int or a sequence) as a set of indices into `args`."""
  single = isinstance(batch_argnums, int | np.integer)
  numbers = (batch_argnums,) if single else batch_argnums
  return {int(a) % len(args) for a in numbers}


def micro_args(
  args: Sequence[Any], batch_argnums: Any, rows: int
) -> list[jax.ShapeDtypeStruct | Any]:
  """Shapes of one device's micro-step: the batch cut to `rows`, all unsharded."""
  argnums = batch_argnum_set(args, batch_argnums)

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


def step_compute(
  grad_fns: dict[str | None, Callable[..., Any]],
  no_remat: Callable[..., Any],
  args: Sequence[Any],
  batch_argnums: Any,
  rows_per_device: int,
  ks: Sequence[int],
) -> dict[tuple[str | None, int], tuple[float, float] | None]:
  """Each (policy, K)'s step: K × the FLOPs and bytes of its micro-step.

  Every K is lowered at its own micro-batch size: a cost that is not affine
  in the rows (a loss over all pairs of a micro-batch's rows, a kernel that
  pads to a tile) is seen as it is at that K. The FLOPs are the policy's,
  recompute included; the bytes are those without remat, since a policy
  changes what is recomputed, not what the step must read (before fusion, a
  rematerialised program's bytes came out below those without remat, which
  ranked remat faster than it runs). A micro-step that cannot be lowered
  alone (one that names a mesh axis) has None: its figures come from the
  compiled step.
  """
  costs: dict[tuple[str | None, int], dict[str, float] | None] = {}

  def cost_of(name: str | None, grad_fn: Callable[..., Any], k: int) -> Any:
    if (name, k) not in costs:
      micro = micro_args(args, batch_argnums, rows_per_device // k)
      try:
        costs[(name, k)] = step_cost(grad_fn, micro)
      except Exception:  # E.g. code that names a mesh axis: known when compiled.
        costs[(name, k)] = None
    return costs[(name, k)]

  compute: dict[tuple[str | None, int], tuple[float, float] | None] = {}
  for name, grad_fn in grad_fns.items():
    for k in ks:
      flops = cost_of(name, grad_fn, k)
      # Keyed by the policy's name: None's bytes are those without remat.
      accessed = cost_of(None, no_remat, k) if name is not None else flops
      compute[(name, k)] = (
        None
        if flops is None or accessed is None
        else (k * flops["flops"], k * accessed["bytes accessed"])
      )
  return compute

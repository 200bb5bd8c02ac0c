"""`fit_microbatches`: the smallest K whose compiled step fits a memory budget.

XLA knows a step's memory once it has compiled it, before it runs. These
functions compile the step for a few K and read that figure, instead of
running, running out of memory and halving the micro-batch.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from jaccum._core.rewrites import spec_axes
from jaccum._routes.accumulate import accumulate, data_parallel
from jaccum._routes.mesh import check_mesh_axes

if TYPE_CHECKING:
  from jaccum.inspect import MemoryStats

# Options only `data_parallel` takes: passing any of them fits its step.
_PARALLEL_OPTIONS = ("mesh", "axis", "param_specs", "fsdp_mode")


class MicrobatchFit(NamedTuple):
  """The number of micro-batches that fits a memory budget, and what was tried.

  `print` it for a table of every K compiled.

  Attributes:
    num_microbatches: the smallest candidate K whose compiled step fits.
    peak_bytes: that step's peak per device: arguments + outputs +
      temporaries − aliased bytes, or the backend's own peak figure where it
      reports a larger one.
    tried: `{K: peak bytes}` for every K compiled, in the order compiled.
    memory_budget: the budget in bytes per device.
    stats: `{K: jaccum.inspect.MemoryStats}`, the figures behind each peak.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
    >>> w = jax.ShapeDtypeStruct((64, 512), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((1024, 64), jnp.float32)
    >>> fit = jaccum.fit_microbatches(
    ...   jax.grad(loss), w, x, memory_budget=2**20, candidates=[2, 8, 32])
    >>> fit.num_microbatches, list(fit.tried)  # compiled 2, then 32, then 8
    (8, [2, 32, 8])
    >>> fit.peak_bytes == fit.tried[8] <= fit.memory_budget < fit.tried[2]
    True
    >>> fit.stats[8].argument_bytes  # w and x, float32
    393216
    >>> print(fit)
    memory budget 1.00 MiB per device: K=8, peak ... (...% of the budget)
     K  order   arguments     outputs  temporaries  aliased        peak
     2      1  384.00 KiB  128.00 KiB  ...   over
     8      3  384.00 KiB  128.00 KiB  ... chosen
    32      2  384.00 KiB  128.00 KiB  ...   fits
  """

  num_microbatches: int
  peak_bytes: int
  tried: dict[int, int]
  memory_budget: int
  stats: dict[int, MemoryStats]

  def __str__(self) -> str:
    share = self.peak_bytes / self.memory_budget
    return (
      f"memory budget {_format_bytes(self.memory_budget)} per device: "
      f"K={self.num_microbatches}, peak {_format_bytes(self.peak_bytes)} "
      f"({share:.1%} of the budget)\n"
      + _table(self.stats, self.memory_budget, self.num_microbatches)
    )


def _peak(stats: MemoryStats) -> int:
  """The peak of a compiled step from XLA's figures (see `MicrobatchFit`)."""
  total = stats.argument_bytes + stats.output_bytes + stats.temp_bytes
  return max(total - stats.alias_bytes, stats.peak_bytes or 0)


def _format_bytes(size: int) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if size >= scale:
      return f"{size / scale:.2f} {unit}"
  return f"{size} B"


def _table(stats: dict[int, MemoryStats], budget: int, chosen: int | None) -> str:
  rows: list[tuple[str, ...]] = [
    ("K", "order", "arguments", "outputs", "temporaries", "aliased", "peak", "")
  ]
  order = {k: i for i, k in enumerate(stats, start=1)}
  for k in sorted(stats):
    s, peak = stats[k], _peak(stats[k])
    verdict = "chosen" if k == chosen else "fits" if peak <= budget else "over"
    sizes = (s.argument_bytes, s.output_bytes, s.temp_bytes, s.alias_bytes, peak)
    rows.append((str(k), str(order[k]), *map(_format_bytes, sizes), verdict))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return "\n".join(
    "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
    for row in rows
  )


def _budget_bytes(memory_budget: Any) -> int:
  """The budget in bytes: an int as is, a float as a share of device memory."""
  if isinstance(memory_budget, bool) or not isinstance(
    memory_budget, int | float | np.integer | np.floating
  ):
    raise TypeError(
      "memory_budget must be bytes (an int) or a fraction of the device's "
      f"memory (a float in (0, 1]), got {memory_budget!r}."
    )
  if not memory_budget > 0:  # Also catches NaN.
    raise ValueError(f"memory_budget must be positive, got {memory_budget!r}.")
  if isinstance(memory_budget, int | np.integer):
    return int(memory_budget)
  if memory_budget > 1:
    raise ValueError(
      f"memory_budget={memory_budget!r} is a float, which means a fraction of "
      "the device's memory, so it must be in (0, 1]; pass bytes as an int, "
      f"e.g. memory_budget={int(memory_budget)}."
    )
  device = jax.local_devices()[0]
  limit = (device.memory_stats() or {}).get("bytes_limit")
  if not limit:
    raise ValueError(
      f"memory_budget={memory_budget!r} is a fraction of the device's memory, "
      f"but the {device.platform} backend does not report its memory "
      "(device.memory_stats() has no 'bytes_limit'); pass the budget in bytes, "
      "as an int."
    )
  return int(memory_budget * limit)


def _divisors(n: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted({*small, *(n // d for d in small)})


def _check_candidates(
  candidates: Iterable[int] | None, batch_size: int | None, what: str
) -> list[int]:
  """Candidates as sorted distinct ints; they default to the batch's divisors.

  `what` names the batch size in errors, e.g. "the batch size 64".
  """
  if candidates is None:
    assert batch_size is not None
    return _divisors(batch_size)
  if isinstance(candidates, str) or not isinstance(candidates, Iterable):
    raise TypeError(
      f"candidates must be a sequence of positive ints, got {candidates!r}."
    )
  values = list(candidates)
  if not values:
    raise ValueError("candidates is empty; give at least one K, or None.")
  not_ints = [c for c in values if isinstance(c, bool) or not _is_int(c)]
  if not_ints:
    raise TypeError(f"candidates must be ints, got {not_ints} in {values}.")
  values = [operator.index(c) for c in values]
  if not_positive := [c for c in values if c < 1]:
    raise ValueError(f"candidates must be positive, got {not_positive} in {values}.")
  if batch_size is not None and (not_divisors := [c for c in values if batch_size % c]):
    raise ValueError(
      f"candidates {not_divisors} do not divide {what}; each K must, so pick "
      f"among its divisors {_divisors(batch_size)}."
    )
  return sorted(set(values))


def _is_int(value: Any) -> bool:
  return isinstance(value, int | np.integer)


def _batch_size(args: Sequence[Any], batch_argnums: Any) -> int:
  """The leading size of the first batch argument's first array."""
  argnum = batch_argnums if _is_int(batch_argnums) else batch_argnums[0]
  if not -len(args) <= argnum < len(args):
    raise ValueError(
      f"batch_argnums={batch_argnums!r} points past the {len(args)} argument(s) "
      "given; pass the step's arguments after grad_fn, as you would call it."
    )
  for leaf in jax.tree.leaves(args[argnum]):
    if np.ndim(leaf) >= 1:
      return np.shape(leaf)[0]
  raise ValueError(f"args[{argnum}], the batch, holds no array with a batch axis.")


def _explicit_shards(batch: Any) -> int:
  """Devices an explicitly sharded batch (arrays or ShapeDtypeStructs) spans."""
  for leaf in jax.tree.leaves(batch):
    sharding = getattr(leaf, "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is not None and not mesh.empty and mesh.are_all_axes_explicit and spec:
      return math.prod(mesh.shape[a] for a in spec_axes(spec[0]))
  return 1


def _num_shards(options: dict[str, Any], args: Sequence[Any], argnum: int) -> int:
  """How many devices `data_parallel` splits the batch over."""
  axis = options.get("axis", "data")
  axes = (axis,) if isinstance(axis, str) else tuple(axis)
  mesh = options.get("mesh")
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    meshes = [
      getattr(getattr(leaf, "sharding", None), "mesh", None)
      for leaf in jax.tree.leaves(args[argnum])
    ]
    mesh = next((m for m in meshes if m is not None and not m.empty), None)
  if mesh is None:
    raise ValueError(
      "fit_microbatches with data_parallel options needs a mesh: pass mesh=..., "
      "call it under jax.set_mesh(mesh), or pass a batch sharded over the mesh."
    )
  check_mesh_axes(axes, mesh)
  return math.prod(mesh.shape[a] for a in axes)


def _memory(step: Callable[..., Any], args: Sequence[Any]) -> MemoryStats:
  """Lowers and compiles `step` for `args`, never runs it: XLA's memory figures."""
  from jaccum import inspect  # Loaded on first use, as `jaccum.inspect` is.

  return inspect.memory(step, *args)


def _search(
  make_step: Callable[[int], Callable[..., Any]],
  args: Sequence[Any],
  candidates: list[int],
  budget: int,
  advice: str = "",
) -> MicrobatchFit:
  """The smallest candidate whose step fits, by bisection while memory falls.

  `advice` ends the message that says no candidate fits.
  """
  stats: dict[int, MemoryStats] = {}  # In the order compiled.

  def peak(k: int) -> int:
    if k not in stats:
      step = make_step(k)
      if not callable(step):
        raise TypeError(f"make_step({k}) must return a step function, got {step!r}.")
      stats[k] = _memory(step, args)
    return _peak(stats[k])

  def falling() -> bool:
    peaks = [_peak(stats[k]) for k in sorted(stats)]
    return all(a >= b for a, b in itertools.pairwise(peaks))

  # While memory falls as K grows, bisect between candidates[low], over the
  # budget, and candidates[high], within it: O(log n) compilations.
  low, high = 0, len(candidates) - 1
  if peak(candidates[low]) > budget and high > low and peak(candidates[high]) <= budget:
    while high - low > 1 and falling():
      middle = (low + high) // 2
      if peak(candidates[middle]) <= budget:
        high = middle
      else:
        low = middle
  if not falling():
    # Memory rose with K somewhere, so bisection can skip a K that fits: compile
    # the rest in increasing order, up to the first that fits.
    for k in candidates:
      if peak(k) <= budget:
        break

  fitting = [k for k in candidates if k in stats and peak(k) <= budget]
  if not fitting:
    # Before saying none fits, check the ones the search skipped: memory need
    # not fall with K (a middle K may fit where both ends are over budget).
    fitting = [k for k in candidates if peak(k) <= budget][:1]
  if not fitting:
    raise ValueError(_no_fit_message(stats, budget, advice))
  chosen = fitting[0]
  return MicrobatchFit(
    num_microbatches=chosen,
    peak_bytes=peak(chosen),
    tried={k: _peak(s) for k, s in stats.items()},
    memory_budget=budget,
    stats=stats,
  )


def _no_fit_message(stats: dict[int, MemoryStats], budget: int, more: str = "") -> str:
  best = min(stats, key=lambda k: (_peak(stats[k]), k))
  s = stats[best]
  # Only the temporaries shrink as K grows; arguments and outputs stay.
  if s.argument_bytes + s.output_bytes - s.alias_bytes >= s.temp_bytes:
    advice = (
      "The arguments and outputs (params, batch, gradients, optimizer state) "
      "dominate, and more micro-batches do not shrink them: shard them over "
      "devices (data_parallel, param_specs), donate buffers, or use a smaller "
      "batch."
    )
  else:
    advice = (
      "The temporaries (activations) dominate: allow a larger K if the batch "
      "has one, rematerialise with jax.checkpoint, or use a smaller batch."
    )
  return (
    f"no candidate K fits memory_budget={budget} ({_format_bytes(budget)}) per "
    f"device; the smallest peak is {_format_bytes(_peak(s))} at K={best}: "
    f"arguments {_format_bytes(s.argument_bytes)}, outputs "
    f"{_format_bytes(s.output_bytes)}, temporaries {_format_bytes(s.temp_bytes)}, "
    f"aliased {_format_bytes(s.alias_bytes)}. {advice}{more}\n"
    + _table(stats, budget, None)
  )


def _prepare(
  grad_fn: Callable[..., Any],
  args: Sequence[Any],
  candidates: Iterable[int] | None,
  accumulate_kwargs: dict[str, Any],
) -> tuple[Callable[..., Any], list[int], int]:
  """The transform to fit, the checked candidates, and the devices per batch.

  The transform is `data_parallel` where any of its options is given, else
  `accumulate`; candidates default to the divisors of the rows per device.
  """
  parallel = any(name in accumulate_kwargs for name in _PARALLEL_OPTIONS)
  transform = data_parallel if parallel else accumulate
  transform(grad_fn, 1, **accumulate_kwargs)  # Checks the options, compiles nothing.
  batch_argnums = accumulate_kwargs.get("batch_argnums", 1)
  batch_size = _batch_size(args, batch_argnums)
  if batch_size == 0:
    raise ValueError(
      f"the batch (args[{batch_argnums}]) has 0 rows: there is nothing to split "
      "into micro-batches; pass a batch with at least one row."
    )
  what = f"the batch size {batch_size}"
  argnum = batch_argnums if _is_int(batch_argnums) else batch_argnums[0]
  # A batch sharded over explicit mesh axes makes plain accumulate loop on
  # every device over its rows too: K then divides the rows per device.
  shards = (
    _num_shards(accumulate_kwargs, args, argnum)
    if parallel
    else _explicit_shards(args[argnum])
  )
  if shards > 1:
    if batch_size % shards:
      raise ValueError(
        f"the batch size {batch_size} must be divisible by the {shards} devices "
        "it is split over."
      )
    what = f"the per-device batch size {batch_size // shards} ({batch_size} rows"
    what += f" over {shards} devices)"
    batch_size //= shards
  candidates = _check_candidates(candidates, batch_size, what)
  if accumulate_kwargs.get("return_stats") and shards == 1 and 1 in candidates:
    # The noise scale needs two batch sizes: K = 1 on one device has one.
    if candidates == [1]:
      raise ValueError(
        "return_stats=True needs K >= 2 on one device (two batch sizes), and the "
        f"only candidate is K=1: {what} has no other divisor."
      )
    candidates = [k for k in candidates if k != 1]
  return transform, candidates, shards


def fit_microbatches(
  grad_fn: Callable[..., Any],
  *args: Any,
  memory_budget: int | float,
  candidates: Iterable[int] | None = None,
  **accumulate_kwargs: Any,
) -> MicrobatchFit:
  """The smallest K whose compiled accumulated step fits a memory budget.

  Compiles `jax.jit(accumulate(grad_fn, K, **accumulate_kwargs))` for the
  arguments and reads XLA's memory figures; it never runs the step, so the
  arguments may be `jax.ShapeDtypeStruct` objects. Where memory falls as K grows it
  compiles O(log n) of the n candidates (at most ⌈log2 n⌉ + 2); where the
  figures it compiled show memory rising with K, it compiles the remaining
  candidates in increasing order up to the first that fits. Before it says
  that none fits, it compiles every candidate it skipped.

  With any of `data_parallel`'s options (`mesh`, `axis`, `param_specs`,
  `fsdp_mode`) it fits `jax.jit(data_parallel(grad_fn, K, ...))` instead: K
  is then the number of micro-batches per device, and the budget is per
  device.

  Args:
    grad_fn: as for `accumulate`.
    *args: `grad_fn`'s positional arguments, as arrays or
      `jax.ShapeDtypeStruct` objects (with a sharding, for a sharded batch).
    memory_budget: bytes per device (an int), or a fraction in (0, 1] of the
      device's memory where the backend reports it
      (`device.memory_stats()["bytes_limit"]`, e.g. on GPU and TPU).
    candidates: the K to choose from; defaults to every divisor of the batch
      size (of the per-device batch size with `data_parallel`).
    **accumulate_kwargs: options of `accumulate` (`batch_argnums`,
      `reduce`, …) or of `data_parallel` (`mesh`, `axis`, `param_specs`,
      `fsdp_mode`).

  Returns:
    A `MicrobatchFit`; `print` it for a table of every K compiled.

  Raises:
    TypeError, ValueError: on a bad budget or bad candidates (not positive,
      not divisors of the batch size); when the backend reports no device
      memory for a fractional budget; and when no candidate fits, naming the
      smallest peak found, its K and what dominates it.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> def loss(w, x):
    ...   return jnp.mean(jnp.tanh(x @ w) ** 2)
    >>> w = jax.ShapeDtypeStruct((64, 512), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((1024, 64), jnp.float32)
    >>> fit = jaccum.fit_microbatches(jax.grad(loss), w, x, memory_budget=2**20)
    >>> fit.num_microbatches, fit.peak_bytes <= 2**20
    (8, True)
  """
  budget = _budget_bytes(memory_budget)
  transform, candidates, _ = _prepare(grad_fn, args, candidates, accumulate_kwargs)
  advice = ""
  if accumulate_kwargs.get("fsdp_mode", "gather_once") != "shard_all" and (
    "param_specs" in accumulate_kwargs
  ):
    # gather_once holds the whole params and accumulator on every device.
    advice = (
      " With param_specs, fsdp_mode='shard_grads' keeps the accumulator "
      "sharded in the loop and 'shard_all' the params too; jaccum.fit_plan "
      "chooses the mode with K."
    )
  return _search(
    lambda k: jax.jit(transform(grad_fn, k, **accumulate_kwargs)),
    args,
    candidates,
    budget,
    advice,
  )


def fit_train_step(
  make_step: Callable[[int], Callable[..., Any]],
  *args: Any,
  memory_budget: int | float,
  batch_size: int | None = None,
  candidates: Iterable[int] | None = None,
) -> MicrobatchFit:
  """The smallest K whose whole compiled train step fits a memory budget.

  `fit_microbatches` for a whole train step: params, optimizer state, the
  update and donated buffers all count. `make_step(K)` returns the step with
  K micro-batches, jitted (with your `donate_argnums`, shardings, …) or not
  (then it is jitted plainly); it is compiled for `args` and never run.

  Args:
    make_step: `make_step(K) -> step`, with `step(*args)` the train step.
    *args: the step's positional arguments, as arrays or
      `jax.ShapeDtypeStruct` objects (e.g. `jax.eval_shape(optimizer.init, params)`).
    memory_budget: as for `fit_microbatches`: bytes per device, or a fraction
      of the device's memory.
    batch_size: the rows the step splits into K micro-batches (per device,
      with `data_parallel`); candidates default to its divisors.
    candidates: the K to choose from; pass this or `batch_size`, or both.

  Returns:
    A `MicrobatchFit`; `print` it for a table of every K compiled.

  Raises:
    TypeError, ValueError: as `fit_microbatches` does, and if neither
      `batch_size` nor `candidates` is given.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaccum
    >>> def loss(w, x):
    ...   return jnp.mean(jnp.tanh(x @ w) ** 2)
    >>> optimizer = optax.adam(1e-3)
    >>> def make_step(num_microbatches):
    ...   grad_fn = jaccum.accumulate(jax.grad(loss), num_microbatches)
    ...   def step(w, opt_state, x):
    ...     updates, opt_state = optimizer.update(grad_fn(w, x), opt_state)
    ...     return optax.apply_updates(w, updates), opt_state
    ...   return jax.jit(step, donate_argnums=(0, 1))
    >>> w = jax.ShapeDtypeStruct((64, 512), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((1024, 64), jnp.float32)
    >>> fit = jaccum.fit_train_step(
    ...   make_step, w, jax.eval_shape(optimizer.init, w), x,
    ...   memory_budget=1_300_000, batch_size=1024)
    >>> fit.num_microbatches, fit.peak_bytes <= 1_300_000
    (8, True)
  """
  if not callable(make_step):
    raise TypeError(
      f"make_step must be callable, make_step(K) -> step; got {make_step!r}."
    )
  budget = _budget_bytes(memory_budget)
  if batch_size is None and candidates is None:
    raise TypeError(
      "fit_train_step needs batch_size= (the candidates are then its divisors) "
      "or candidates=, the K to choose from."
    )
  if batch_size is not None:
    if isinstance(batch_size, bool) or not _is_int(batch_size):
      raise TypeError(f"batch_size must be a positive int, got {batch_size!r}.")
    if batch_size < 1:
      raise ValueError(f"batch_size must be a positive int, got {batch_size}.")
  candidates = _check_candidates(candidates, batch_size, f"batch_size={batch_size}")
  return _search(make_step, args, candidates, budget)

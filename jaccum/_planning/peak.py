"""What a compiled step's peak is made of, and the lever that would move it.

When no configuration fits, `fit_plan` says why: of the step with the least
peak, what takes the memory (the params and what scales with them, the
batch, the activations and the largest of them) and which lever shrinks
that part. K and remat shrink activations only: advising them where the
params dominate, or where K is already one row per micro-batch, misleads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from jaccum._planning.fit import _format_bytes

if TYPE_CHECKING:
  from jaccum.inspect import MemoryStats

# The policy that keeps the least (each layer's input only).
HEAVIEST_POLICY = "nothing_saveable"


class Activation(NamedTuple):
  """The largest value a micro-step makes: its size, type and where."""

  nbytes: int
  type: str
  where: str

  def __str__(self) -> str:
    return f"{self.type} ({_format_bytes(self.nbytes)}) {self.where}"


class PeakParts(NamedTuple):
  """A compiled step's peak per device, split by what holds it.

  Attributes:
    params: arguments other than the batch (params, any other state).
    batch: the batch's share on this device.
    outputs: the step's outputs: the gradients (which the loop accumulates
      into, in place or in a temporary of their size), the loss, any aux.
    temporaries: the rest: a micro-step's activations, and the accumulator
      where XLA keeps it apart from the outputs.
    largest: the largest value the micro-step makes, if it was traced.
  """

  params: int
  batch: int
  outputs: int
  temporaries: int
  largest: Activation | None


def _nbytes(tree: Any) -> int:
  return sum(
    math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    for leaf in jax.tree.leaves(tree)
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
  )


def largest_activation(
  grad_fn: Callable[..., Any], micro_args: Sequence[Any]
) -> Activation | None:
  """The largest value the micro-step makes, nested programs included."""
  try:
    closed = jax.make_jaxpr(grad_fn)(*micro_args)
  except Exception:  # E.g. a micro-step that names a mesh axis.
    return None
  best: tuple[int, Any, Any] | None = None
  stack = [closed.jaxpr]
  while stack:
    jaxpr = stack.pop()
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        aval = var.aval
        if not hasattr(aval, "shape"):
          continue
        size = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
        if best is None or size > best[0]:
          best = (size, aval, eqn)
      for param in eqn.params.values():
        for sub in param if isinstance(param, tuple | list) else (param,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            stack.append(inner)
  if best is None:
    return None
  size, aval, eqn = best
  return Activation(size, aval.str_short(), f"from {eqn.primitive.name}{_where(eqn)}")


def _where(eqn: Any) -> str:
  """' at file:line (function)' of the user's code that made `eqn`, if known."""
  try:
    from jax._src import source_info_util  # No public API gives the user's line.

    return f" at {source_info_util.summarize(eqn.source_info)}"
  except Exception:
    return ""


def parts(
  stats: MemoryStats,
  args: Sequence[Any],
  batch_argnums: set[int],
  shards: int,
  largest: Activation | None,
) -> PeakParts:
  """Splits `stats` (per device) into the parts of `PeakParts`."""
  batch = _nbytes([args[i] for i in sorted(batch_argnums)]) // max(shards, 1)
  batch = min(batch, stats.argument_bytes)
  return PeakParts(
    params=stats.argument_bytes - batch,
    batch=batch,
    outputs=stats.output_bytes,
    temporaries=stats.temp_bytes,
    largest=largest,
  )


def describe(split: PeakParts) -> str:
  """The parts, in bytes, as a list in words."""
  return (
    f"params {_format_bytes(split.params)}, batch {_format_bytes(split.batch)}, "
    f"gradients and their accumulator (the outputs) {_format_bytes(split.outputs)}, "
    f"temporaries {_format_bytes(split.temporaries)}"
  )


def advice(
  split: PeakParts,
  *,
  fsdp_mode: str | None,
  num_microbatches: int,
  rows_per_device: int,
  largest_candidate: int,
  policies: Sequence[str | None],
) -> str:
  """What dominates the peak, and the lever that would move it."""
  with_params = split.params + split.outputs
  total = with_params + split.batch + split.temporaries
  share = lambda part: f"{_format_bytes(part)} of {_format_bytes(total)}"
  if with_params >= max(split.batch, split.temporaries):
    if fsdp_mode is None:
      lever = (
        "shard them over devices: data_parallel's param_specs with "
        "fsdp_mode='shard_all' keeps params, gradients and accumulator sharded"
      )
    elif fsdp_mode != "shard_all":
      lever = "fsdp_mode='shard_all' shards the params too; add it to fsdp_modes"
    else:
      lever = "shard them over more devices"
    return (
      f"The params and what scales with them dominate ({share(with_params)}: "
      f"params {_format_bytes(split.params)}, gradients and their accumulator "
      f"{_format_bytes(split.outputs)}); neither K nor remat shrinks them: "
      f"{lever}, or keep them in a narrower dtype."
    )
  if split.batch >= split.temporaries:
    return (
      f"The batch dominates ({share(split.batch)} on each device): it is an "
      "argument of the step, whole at every K; shard it over more devices "
      "(data_parallel) or pass fewer rows per step."
    )
  largest = f"; the largest is {split.largest}" if split.largest else ""
  head = f"The activations dominate ({share(split.temporaries)}{largest})."
  if num_microbatches < rows_per_device:
    return (
      f"{head} A larger K shrinks them: allow K up to {rows_per_device} "
      f"(the largest candidate was {largest_candidate})."
    )
  if HEAVIEST_POLICY not in policies:
    return f"{head} Rematerialise more: add {HEAVIEST_POLICY!r} to policies."
  return (
    f"{head} K is at one row per micro-batch and the heaviest policy is "
    "tried: one row needs them. Shard that activation over devices (tensor "
    "parallelism) or make it smaller (chunk the operation, a narrower dtype)."
  )

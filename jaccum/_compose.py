"""Where two options meet: every pair that cannot be exact, refused by name.

Each option is exact on its own; a pair of them is exact, or it is refused
here, at trace time, with a message that names both and the way out. The
rules live together so that a new option's crossings are read in one place:

=========================================  =====================================
pair                                       rule
=========================================  =====================================
`reduce_fn` × `reduce_dtype`               refused: `reduce_fn` sets its wire
`reduce_fn` × FSDP (`param_specs`)         refused: scattered, not reduced whole
`reduce_fn` × one device                   refused: nothing to reduce over
`overlap_reduction` × a count              refused: the last micro-batch is
                                           known only at run time
a count per device × `grad_fn`'s own       refused: an idle device would join
collectives over the data axes             them with rows that are not real
a count per device × FSDP's sharded modes  exact: idle devices join each
                                           reduce-scatter with zeros
a count × the split left out              refused: strided micro-batches
                                           spread through the batch, so a
                                           batch padded at its end loses real
                                           rows; the message names both
                                           splits (`deterministic=True`
                                           splits contiguously: taken)
a count × `split="contiguous"` on a        refused: the first micro-batches
batch sharded by `accumulate`              live on the first devices
`reduce="last"` × `split="contiguous"` on  refused: the last micro-batch
a batch sharded by `accumulate`            lives on the last devices
`return_stats` × gradients not averaged    refused: the noise scale measures
                                           means
`deterministic` × `split="strided"`        refused: a strided micro-batch's
                                           rows depend on K and the devices
`deterministic` × `state_argnum`, a state  refused: state threads through
with array leaves                          each device's micro-batches in
                                           turn, a chain that K and the
                                           devices cut differently (a state
                                           with no arrays, as `jaccum.nnx`
                                           passes for a model of params
                                           alone, is exact)
`deterministic` × jaccum.nnx variables     refused, naming the variables
outside `wrt`, or jaccum.linen's           (the same chain, in the wrapper's
`batch_stats`, holding arrays              words)
`deterministic` × `reduce_fn`              refused: its sum is the user's,
                                           not exact
`deterministic` × `reduce_dtype`           refused: a narrowed wire rounds
                                           each device's share
`deterministic` × FSDP's sharded modes     refused: their reduce-scatters in
                                           the loop sum floats per micro-batch
                                           (`"gather_once"` is exact: its one
                                           scatter after the loop is of
                                           integers)
`deterministic` × `fit_plan`'s sharded     refused when named (the default
`fsdp_modes`                               grid keeps `"gather_once"` alone)
`deterministic` × more than 512            refused: the bins hold that many
micro-batches per device, or 2¹⁵ - 1 over  terms
all devices
`deterministic` × a count, on a batch      exact: device d runs the global
sharded by `accumulate`                    micro-batches d·K .. that are real
`deterministic` × `reduce="last"`          exact: the global order's last
                                           micro-batch (the last that ran),
                                           the same on every device
`deterministic` × everything else          exact, and the same bits whatever
                                           K and the devices
=========================================  =====================================

Pairs not listed are exact together; `tests/test_pairs.py` crosses every
option with every other against the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # _config checks the options with these rules
  from jaccum._config import Config


def check_options(config: Config, split: str | None = None) -> None:
  """The pairs that the options alone decide, checked when they are given.

  `split` is the one given (None: the default).
  """
  if config.deterministic:
    _deterministic_and(config, split)
  if config.reduce_fn is not None and config.reduce_dtype is not None:
    raise ValueError(
      f"reduce_fn and reduce_dtype={config.reduce_dtype} do not combine: "
      "reduce_fn replaces jaccum's reduction of the gradients, so it decides "
      "what crosses the wire (jaccum.PowerSGD sends low-rank factors). Cast "
      "inside reduce_fn to narrow its wire, or drop reduce_fn to send the "
      "gradients in reduce_dtype."
    )


def reduce_fn_needs_devices(config: Config) -> None:
  if config.reduce_fn is not None:
    raise ValueError(
      "reduce_fn replaces the reduction over devices: it needs axis_name (inside "
      "shard_map or pmap) or jaccum.data_parallel."
    )


def reduce_fn_and_fsdp(config: Config, scattered: Sequence[Any]) -> None:
  if config.reduce_fn is not None and any(h is not None for h in scattered):
    raise ValueError(
      "reduce_fn and FSDP (param_specs) do not combine: reduce_fn reduces whole "
      "gradients, and FSDP reduce-scatters them so that each device keeps the "
      "shard its params live on. Use one or the other."
    )


def count_and_overlap(config: Config, num_real: Any) -> None:
  if num_real is not None and config.overlap_reduction:
    raise ValueError(
      "overlap_reduction=True and num_real_microbatches do not combine: "
      "overlap_reduction runs the last of the K micro-batches after the loop, "
      "while with num_real_microbatches which one runs last depends on the "
      "count, known only when the step runs. Pass overlap_reduction=False to "
      "keep the count, or call without num_real_microbatches (all K "
      "micro-batches run) to keep the overlap."
    )


def count_per_device_and_collectives(axes: Sequence[str], used: set[str]) -> None:
  """Refuses per-device counts when `grad_fn` itself communicates over `axes`."""
  if used & set(axes):
    raise ValueError(
      f"num_real_microbatches with a count that differs between devices, and a "
      f"grad_fn that communicates over the data axes {sorted(used & set(axes))} "
      f"(e.g. lax.pmean for synchronised BatchNorm), do not combine: a device "
      f"with fewer micro-batches would have to join those collectives with "
      f"rows that are not real, which changes what the others compute. Give "
      f"every device the same count (a scalar), or drop the collective from "
      f"grad_fn."
    )


def count_and_contiguous(axes: Sequence[str]) -> None:
  raise ValueError(
    f'num_real_microbatches with split="contiguous" and a batch sharded '
    f"over {tuple(axes)}: the first contiguous micro-batches live on the first "
    "devices only, so the loop that runs on every device's rows cannot run "
    'just them. Use split="strided" (micro-batch k spans every device), or '
    "jaccum.data_parallel for a count per device."
  )


def count_needs_split(
  config: Config, axes: Sequence[str] | None, sharded: bool
) -> None:
  """A count with the split left to its default: refused, naming both splits.

  `axes`: the devices each running its own rows (`data_parallel`,
  `axis_name`), or with `sharded` the axes over which `accumulate` splits a
  batch as one; None on one device.
  """
  if config.split_named or config.deterministic:
    return
  whose = "each device's rows" if axes and not sharded else "the whole batch"
  ran = (
    f"num_real_microbatches with the split left out (strided, the default) "
    f"runs micro-batches 0..n-1 of K={config.num_microbatches}, micro-batch k "
    f"holding rows k, k + K, k + 2K, … of {whose}: the rows whose index modulo "
    f"K is below n. A batch padded at its end (as "
    f"variable-size and Poisson-sampled batches are) would lose real rows and "
    f"sum padding rows. Name the split: "
  )
  strided = (
    'split="strided" keeps the strided order (put the padding at the rows '
    "whose index modulo K is n or more)."
  )
  if sharded:
    fix = (
      f'split="contiguous" cannot take a count on a batch accumulate splits over '
      f"the explicit mesh axes {tuple(axes or ())} (the first micro-batches live "
      f"on the first devices): for a batch padded at its end use "
      f'jaccum.data_parallel with split="contiguous" and a count per device '
      f"(each device's real rows first); or {strided}"
    )
  elif axes:
    fix = (
      f'split="contiguous" runs the first n·R/K of each device\'s R rows (for a '
      f"batch padded at its end: each device's rows padded at their end, a count "
      f"per device with data_parallel); {strided}"
    )
  else:
    fix = (
      f'split="contiguous" runs the first n·N/K of the batch\'s N rows (for a '
      f"batch padded at its end); {strided}"
    )
  raise ValueError(ran + fix)


def stats_need_means(modes: Sequence[str]) -> None:
  """`return_stats` × gradient leaves reduced other than by `"mean"`."""
  summed = sorted({m for m in modes if m not in ("mean", "float0")})
  if summed:
    raise ValueError(
      f"return_stats=True measures gradients that are means over each "
      f"micro-batch's examples (or weight units): the gradient leaves must be "
      f'reduced with "mean", got {summed}. For a loss summed '
      f"over examples, divide it by the micro-batch's size (or, with "
      f'weight_fn, its total weight) and keep reduce="mean".'
    )


def _deterministic_and(config: Config, split: str | None) -> None:
  """`deterministic=True` × the options whose result depends on K and the devices."""
  why = {
    "split": (
      split == "strided",
      'split="strided"',
      "a strided micro-batch (rows k, k+K, …) holds different rows for each K "
      "and number of devices. Leave split out (deterministic=True splits "
      "contiguously: micro-batch m is rows m·R .. (m+1)·R - 1)",
    ),
    "reduce_fn": (
      config.reduce_fn is not None,
      "reduce_fn",
      "reduce_fn's sum over devices is its own, not exact. Drop one of them",
    ),
    "reduce_dtype": (
      config.reduce_dtype is not None,
      f"reduce_dtype={config.reduce_dtype}",
      "deterministic=True sends exact integer sums; a narrower wire would "
      "round each device's share. Drop reduce_dtype",
    ),
  }
  for refused, named, reason in why.values():
    if refused:
      raise ValueError(f"deterministic=True and {named} do not combine: {reason}.")


def deterministic_and_state(state_argnum: int | None) -> None:
  raise ValueError(
    f"deterministic=True and state_argnum={state_argnum} do not combine: the "
    "state is threaded through each device's micro-batches in turn, a chain "
    "that K and the devices cut differently (BatchNorm statistics, or the "
    "counts of an nnx.Rngs, would differ). Keep the state out of grad_fn's "
    "arguments, or drop deterministic=True."
  )


def deterministic_and_model_state(variables: Sequence[str]) -> None:
  """`deterministic=True` × jaccum.nnx variables outside `wrt` that hold arrays."""
  shown = ", ".join(variables[:4])
  if len(variables) > 4:
    shown += f" and {len(variables) - 4} more"
  raise ValueError(
    f"deterministic=True and a model (or graph-node argument) whose "
    f"non-parameter variables hold arrays ({shown}) do not combine: jaccum.nnx "
    "threads them through each device's micro-batches in turn, a chain that K "
    "and the devices cut differently (BatchNorm statistics, nnx.Rngs counts). "
    "For dropout, build nnx.Dropout without rngs and pass a key instead: "
    "loss_fn(model, x, y, key) calling model(x, rngs=nnx.Rngs(dropout=key)), "
    "with rng_argnum=3, draws from fold_in(key, m) for micro-batch m. Otherwise "
    "drop deterministic=True."
  )


def deterministic_and_batch_stats() -> None:
  """`deterministic=True` × jaccum.linen's `batch_stats` holding arrays."""
  raise ValueError(
    "deterministic=True and batch_stats holding arrays do not combine: "
    "jaccum.linen threads the statistics through each device's micro-batches "
    "in turn, a chain that K and the devices cut differently. A model that "
    "only reads them (use_running_average=True) can pass batch_stats={} and "
    "close over the statistics in loss_fn; otherwise drop deterministic=True."
  )


def deterministic_and_sharded_loop(fsdp_mode: str) -> None:
  raise ValueError(
    f"deterministic=True and fsdp_mode={fsdp_mode!r} do not combine: that mode "
    "reduce-scatters floating gradients inside the loop, one sum over devices "
    "per micro-batch, whose rounding depends on K and the devices. Use "
    "fsdp_mode='gather_once' (its one reduce-scatter after the loop sums "
    "integers, exactly)."
  )


def deterministic_and_fsdp_modes(fsdp_modes: Sequence[str]) -> None:
  """`fit_plan`'s `fsdp_modes` × `deterministic=True`: only gather_once is exact."""
  sharded = [m for m in fsdp_modes if m != "gather_once"]
  if sharded:
    raise ValueError(
      f"deterministic=True and fsdp_modes={list(fsdp_modes)!r} do not combine: "
      f"{sharded} reduce-scatter floating gradients inside the loop, whose "
      "rounding depends on K and the devices. Pass fsdp_modes=['gather_once'], "
      "or leave fsdp_modes out (with deterministic=True fit_plan then tries "
      "gather_once alone)."
    )


def deterministic_and_terms(
  num_microbatches: int, num_devices: int, per_device: int, most: int
) -> None:
  if num_microbatches > per_device or num_microbatches * num_devices > most:
    raise ValueError(
      f"deterministic=True sums at most {per_device} micro-batches per device "
      f"and {most} over all devices exactly (what its bins hold), got "
      f"num_microbatches={num_microbatches} on {num_devices} device(s). Use "
      "fewer, larger micro-batches."
    )

"""Where two options meet: every pair that cannot be exact, as one table of rules.

Each option is exact on its own; a pair of them is exact together, or a
`Rule` here refuses it with a message that names both and the way out. A
rule is data: the options it joins, when it fires, and what it says. Rules
of the `"door"` stage need the options alone (`Options`, checked when a front
is called); `"plan"` rules need the call too (`Facts`, checked by the plan
once per trace); the wrappers, `fit_plan` and `DiLoCo` (its own options
record) check their own stages.
`tests/test_pairs.py` meets every rule of `RULES` and crosses every option
with every other against the whole batch, so a rule that exists is tested.

Pairs not in the table are exact together, among them: a count per device ×
FSDP's sharded modes (idle devices join each reduce-scatter with zeros),
`deterministic` × a count on a batch sharded by `accumulate` (device d runs
the global micro-batches d·K .. that are real), `deterministic` ×
`reduce="last"` (the global order's last micro-batch that ran, the same on
every device), and `deterministic` × every other option (the same bits
whatever K and the devices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

Stage = Literal["door", "plan", "nnx", "linen", "fit_plan", "diloco"]

# What `deterministic=True`'s bins hold (`exact.MAX_PER_DEVICE`, `MAX_TERMS`).
_MOST_PER_DEVICE, _MOST_TERMS = 512, 2**15 - 1


class Facts(NamedTuple):
  """What the plan knows of one call, for the rules of the `"plan"` stage.

  Each fact is None until the plan has it (some need the traced step).

  Attributes:
    options: the call's `Options`.
    devices: the devices the batch is split over (1 on one device).
    on_devices: the loop runs per device (`axis_name`, `data_parallel`, a
      batch sharded over explicit axes), so there is a reduction over them.
    sharded_by_accumulate: plain `accumulate` on a batch sharded over
      explicit axes: the result must be the unsharded call's.
    axes: the data axes.
    count: a count of real micro-batches was given.
    count_varies: the count may differ between devices.
    collectives: the mesh axes `grad_fn`'s own collectives run over.
    state_arrays: the threaded state holds arrays.
    sharded_mode: the FSDP mode that shards inside the loop, if any.
    grad_modes: the `reduce` modes of the gradient leaves.
    last_path: where the first `"last"` leaf sits in the output (`[0][1]`).
    scattered: any gradient leaf comes back scattered (FSDP).
    whole_batch: on the whole batch's route, `(failures, cause_and_fix)`:
      how the function failed on each device's rows, and the usual cause and
      fix; None elsewhere.
  """

  options: Any
  devices: int = 1
  on_devices: bool = False
  sharded_by_accumulate: bool = False
  axes: tuple[str, ...] = ()
  count: bool = False
  count_varies: bool = False
  collectives: frozenset[str] | None = None
  state_arrays: bool | None = None
  sharded_mode: str | None = None
  grad_modes: tuple[str, ...] | None = None
  last_path: str | None = None
  scattered: bool | None = None
  whole_batch: tuple[str, str] | None = None


class Rule(NamedTuple):
  """One refused pair.

  Attributes:
    name: the pair, as the documentation and the tests name it.
    why: the reason, in a few words.
    stage: when it can be decided (see the module docstring).
    fires: whether it refuses, given the stage's facts.
    message: the error's text, given the same facts.
  """

  name: str
  why: str
  stage: Stage
  fires: Callable[[Any], bool]
  message: Callable[[Any], str]


def _deterministic_and_split(o: Any) -> str:
  return (
    'deterministic=True and split="strided" do not combine: a strided '
    "micro-batch (rows k, k+K, …) holds different rows for each K and number of "
    "devices. Leave split out (deterministic=True splits contiguously: "
    "micro-batch m is rows m·R .. (m+1)·R - 1)."
  )


def _reduce_fn_and_reduce_dtype(o: Any) -> str:
  return (
    f"reduce_fn and reduce_dtype={o.reduce_dtype} do not combine: "
    "reduce_fn replaces jaccum's reduction of the gradients, so it decides "
    "what crosses the wire (jaccum.PowerSGD sends low-rank factors). Cast "
    "inside reduce_fn to narrow its wire, or drop reduce_fn to send the "
    "gradients in reduce_dtype."
  )


def _count_and_overlap(f: Facts) -> str:
  return (
    "overlap_reduction=True and num_real_microbatches do not combine: "
    "overlap_reduction runs the last of the K micro-batches after the loop, "
    "while with num_real_microbatches which one runs last depends on the "
    "count, known only when the step runs. Pass overlap_reduction=False to "
    "keep the count, or call without num_real_microbatches (all K "
    "micro-batches run) to keep the overlap."
  )


def _count_varies_and_collectives(f: Facts) -> str:
  used = sorted((f.collectives or set()) & set(f.axes))
  return (
    f"num_real_microbatches with a count that differs between devices, and a "
    f"grad_fn that communicates over the data axes {used} "
    f"(e.g. lax.pmean for synchronised BatchNorm), do not combine: a device "
    f"with fewer micro-batches would have to join those collectives with "
    f"rows that are not real, which changes what the others compute. Give "
    f"every device the same count (a scalar), or drop the collective from "
    f"grad_fn."
  )


def _count_needs_split(f: Facts) -> str:
  """A count with the split left to its default: the message names both."""
  axes, sharded = f.axes, f.sharded_by_accumulate
  whose = "each device's rows" if axes and not sharded else "the whole batch"
  ran = (
    f"num_real_microbatches with the split left out (strided, the default) "
    f"runs micro-batches 0..n-1 of K={f.options.num_microbatches}, micro-batch k "
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
      f"the explicit mesh axes {tuple(axes)} (the first micro-batches live "
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
  return ran + fix


def _count_and_contiguous(f: Facts) -> str:
  return (
    f'num_real_microbatches with split="contiguous" and a batch sharded '
    f"over {tuple(f.axes)}: the first contiguous micro-batches live on the first "
    "devices only, so the loop that runs on every device's rows cannot run "
    'just them. Use split="strided" (micro-batch k spans every device), or '
    "jaccum.data_parallel for a count per device."
  )


def _last_and_contiguous(f: Facts) -> str:
  return (
    f'reduce="last" at output{f.last_path} with split="contiguous" '
    f"and a batch sharded over {tuple(f.axes)}: the last contiguous micro-batch "
    f"lives on the last devices only, so the loop that runs on every device's "
    f'rows cannot return it. Use split="strided" (its last micro-batch spans all '
    f"devices), or jaccum.data_parallel for each device's own last micro-batch."
  )


def _stats_of_summed(f: Facts) -> str:
  summed = sorted({m for m in f.grad_modes or () if m not in ("mean", "float0")})
  return (
    f"return_stats=True measures gradients that are means over each "
    f"micro-batch's examples (or weight units): the gradient leaves must be "
    f'reduced with "mean", got {summed}. For a loss summed '
    f"over examples, divide it by the micro-batch's size (or, with "
    f'weight_fn, its total weight) and keep reduce="mean".'
  )


def _stats_of_one_size(f: Facts) -> str:
  return (
    "return_stats=True estimates the gradient noise from two batch sizes, the "
    "micro-batch and the whole batch; with num_microbatches=1 on one device "
    "there is only one. Use K >= 2, or several devices."
  )


def _deterministic_and_state(f: Facts) -> str:
  return (
    f"deterministic=True and state_argnum={f.options.state_argnum} do not "
    "combine: the state is threaded through each device's micro-batches in "
    "turn, a chain that K and the devices cut differently (BatchNorm "
    "statistics, or the counts of an nnx.Rngs, would differ). Keep the state "
    "out of grad_fn's arguments, or drop deterministic=True."
  )


def _deterministic_and_sharded(f: Facts) -> str:
  return (
    f"deterministic=True and fsdp_mode={f.sharded_mode!r} do not combine: that "
    "mode reduce-scatters floating gradients inside the loop, one sum over "
    "devices per micro-batch, whose rounding depends on K and the devices. Use "
    "fsdp_mode='gather_once' (its one reduce-scatter after the loop sums "
    "integers, exactly)."
  )


def _too_many_terms(f: Facts) -> bool:
  k = f.options.num_microbatches
  return k > _MOST_PER_DEVICE or k * f.devices > _MOST_TERMS


def _deterministic_and_terms(f: Facts) -> str:
  return (
    f"deterministic=True sums at most {_MOST_PER_DEVICE} micro-batches per "
    f"device and {_MOST_TERMS} over all devices exactly (what its bins hold), "
    f"got num_microbatches={f.options.num_microbatches} on {f.devices} "
    "device(s). Use fewer, larger micro-batches."
  )


def _model_state(variables: Sequence[str]) -> str:
  shown = ", ".join(variables[:4])
  if len(variables) > 4:
    shown += f" and {len(variables) - 4} more"
  return (
    f"deterministic=True and a model (or graph-node argument) whose "
    f"non-parameter variables hold arrays ({shown}) do not combine: jaccum.nnx "
    "threads them through each device's micro-batches in turn, a chain that K "
    "and the devices cut differently (BatchNorm statistics, nnx.Rngs counts). "
    "For dropout, build nnx.Dropout without rngs and pass a key instead: "
    "loss_fn(model, x, y, key) calling model(x, rngs=nnx.Rngs(dropout=key)), "
    "with rng_argnum=3, draws from fold_in(key, m) for micro-batch m. Otherwise "
    "drop deterministic=True."
  )


def _batch_stats(_: Any) -> str:
  return (
    "deterministic=True and batch_stats holding arrays do not combine: "
    "jaccum.linen threads the statistics through each device's micro-batches "
    "in turn, a chain that K and the devices cut differently. A model that "
    "only reads them (use_running_average=True) can pass batch_stats={} and "
    "close over the statistics in loss_fn; otherwise drop deterministic=True."
  )


def _fsdp_modes(fsdp_modes: Sequence[str]) -> str:
  sharded = [m for m in fsdp_modes if m != "gather_once"]
  return (
    f"deterministic=True and fsdp_modes={list(fsdp_modes)!r} do not combine: "
    f"{sharded} reduce-scatter floating gradients inside the loop, whose "
    "rounding depends on K and the devices. Pass fsdp_modes=['gather_once'], "
    "or leave fsdp_modes out (with deterministic=True fit_plan then tries "
    "gather_once alone)."
  )


# option -> why the whole batch's step cannot give what the per-device loop does
_PER_DEVICE = {
  "deterministic=True": (
    "its bits are those of devices × K micro-batches of each device's rows, "
    "and the whole batch's step sums K micro-batches of all devices' rows"
  ),
  "return_stats=True": (
    "the noise scale's small batch is a micro-batch of one device's rows, and "
    "the whole batch's step has micro-batches of all devices' rows"
  ),
  "state_argnum": (
    "each device threads its state through its own rows, and the whole "
    "batch's step threads one state through all devices' rows"
  ),
  "num_real_microbatches": "it counts micro-batches per device",
  "reduce_fn": "it reduces each device's accumulator",
}


def _per_device_only(f: Facts) -> list[str]:
  o = f.options
  given = {
    "deterministic=True": o.deterministic,
    "return_stats=True": o.return_stats,
    "state_argnum": o.state_argnum is not None,
    "num_real_microbatches": f.count,
    "reduce_fn": o.reduce_fn is not None,
  }
  return [name for name, on in given.items() if on]


def _whole_batch(f: Facts) -> str:
  assert f.whole_batch is not None
  failures, cause_and_fix = f.whole_batch
  named = _per_device_only(f)
  return (
    f"{' and '.join(named)} need{'s' if len(named) == 1 else ''} the per-device "
    f"loop, which cannot run grad_fn here ({failures}): "
    + "; ".join(f"{name}: {_PER_DEVICE[name]}" for name in named)
    + f". Without {'them' if len(named) > 1 else 'it'} the step would run as the "
    f"whole batch's does. {cause_and_fix}"
  )


def _reduce_fn_on_one_device(f: Facts) -> str:
  return (
    "reduce_fn replaces the reduction over devices: it needs axis_name (inside "
    "shard_map or pmap) or jaccum.data_parallel."
  )


def _reduce_fn_and_fsdp(f: Facts) -> str:
  return (
    "reduce_fn and FSDP (param_specs) do not combine: reduce_fn reduces whole "
    "gradients, and FSDP reduce-scatters them so that each device keeps the "
    "shard its params live on. Use one or the other."
  )


RULES: tuple[Rule, ...] = (
  # The door: the options alone.
  Rule(
    '`deterministic` × `split="strided"`',
    "a strided micro-batch's rows depend on K and the devices",
    "door",
    lambda o: o.deterministic and o.split_named and o.split == "strided",
    _deterministic_and_split,
  ),
  Rule(
    "`deterministic` × `reduce_fn`",
    "its sum is the user's, not exact",
    "door",
    lambda o: o.deterministic and o.reduce_fn is not None,
    lambda o: (
      "deterministic=True and reduce_fn do not combine: reduce_fn's sum over "
      "devices is its own, not exact. Drop one of them."
    ),
  ),
  Rule(
    "`deterministic` × `reduce_dtype`",
    "a narrowed wire rounds each device's share",
    "door",
    lambda o: o.deterministic and o.reduce_dtype is not None,
    lambda o: (
      f"deterministic=True and reduce_dtype={o.reduce_dtype} do not combine: "
      "deterministic=True sends exact integer sums; a narrower wire would round "
      "each device's share. Drop reduce_dtype."
    ),
  ),
  Rule(
    "`reduce_fn` × `reduce_dtype`",
    "`reduce_fn` sets its wire",
    "door",
    lambda o: o.reduce_fn is not None and o.reduce_dtype is not None,
    _reduce_fn_and_reduce_dtype,
  ),
  # The plan: the options and the call.
  Rule(
    "`deterministic`, `return_stats`, `state_argnum`, a count or `reduce_fn` × "
    "the whole batch's route",
    "their result is that of each device's own micro-batches, which the whole "
    "batch's step does not cut",
    "plan",
    lambda f: f.whole_batch is not None and bool(_per_device_only(f)),
    _whole_batch,
  ),
  Rule(
    "`reduce_fn` × one device",
    "nothing to reduce over",
    "plan",
    lambda f: f.options.reduce_fn is not None and not f.on_devices,
    _reduce_fn_on_one_device,
  ),
  Rule(
    "`overlap_reduction` × a count",
    "the last micro-batch is known only at run time",
    "plan",
    lambda f: f.count and f.options.overlap_reduction,
    _count_and_overlap,
  ),
  Rule(
    "a count × the split left out",
    "strided micro-batches spread through the batch, so a batch padded at its "
    "end loses real rows; the message names both splits (`deterministic=True` "
    "splits contiguously: taken)",
    "plan",
    lambda f: f.count and not f.options.split_named and not f.options.deterministic,
    _count_needs_split,
  ),
  Rule(
    'a count × `split="contiguous"` on a batch sharded by `accumulate`',
    "the first micro-batches live on the first devices",
    "plan",
    lambda f: (
      f.count
      and f.sharded_by_accumulate
      and f.options.split == "contiguous"
      and not f.options.deterministic
    ),
    _count_and_contiguous,
  ),
  Rule(
    "`return_stats` × one batch size",
    "the noise scale needs two batch sizes",
    "plan",
    lambda f: f.options.return_stats and f.options.num_microbatches * f.devices == 1,
    _stats_of_one_size,
  ),
  Rule(
    "`deterministic` × `state_argnum`, a state with array leaves",
    "state threads through each device's micro-batches in turn, a chain that K "
    "and the devices cut differently (a state with no arrays, as `jaccum.nnx` "
    "passes for a model of params alone, is exact)",
    "plan",
    lambda f: bool(f.options.deterministic and f.state_arrays),
    _deterministic_and_state,
  ),
  Rule(
    "`deterministic` × FSDP's sharded modes",
    "their reduce-scatters in the loop sum floats per micro-batch "
    '(`"gather_once"` is exact: its one scatter after the loop is of integers)',
    "plan",
    lambda f: f.options.deterministic and f.sharded_mode is not None,
    _deterministic_and_sharded,
  ),
  Rule(
    "`deterministic` × more than 512 micro-batches per device, or 2¹⁵ - 1 over "
    "all devices",
    "the bins hold that many terms",
    "plan",
    lambda f: f.options.deterministic and _too_many_terms(f),
    _deterministic_and_terms,
  ),
  Rule(
    "a count per device × `grad_fn`'s own collectives over the data axes",
    "an idle device would join them with rows that are not real",
    "plan",
    lambda f: f.count_varies and bool((f.collectives or set()) & set(f.axes)),
    _count_varies_and_collectives,
  ),
  Rule(
    "`return_stats` × gradients not averaged",
    "the noise scale measures means",
    "plan",
    lambda f: (
      f.options.return_stats
      and any(m not in ("mean", "float0") for m in f.grad_modes or ())
    ),
    _stats_of_summed,
  ),
  Rule(
    '`reduce="last"` × `split="contiguous"` on a batch sharded by `accumulate`',
    "the last micro-batch lives on the last devices",
    "plan",
    lambda f: (
      f.last_path is not None
      and f.sharded_by_accumulate
      and f.options.split == "contiguous"
    ),
    _last_and_contiguous,
  ),
  Rule(
    "`reduce_fn` × FSDP (`param_specs`)",
    "scattered, not reduced whole",
    "plan",
    lambda f: f.options.reduce_fn is not None and bool(f.scattered),
    _reduce_fn_and_fsdp,
  ),
  # The wrappers' and fit_plan's own.
  Rule(
    "`deterministic` × jaccum.nnx variables outside `wrt`, or jaccum.linen's "
    "`batch_stats`, holding arrays",
    "the same chain, in the wrapper's words",
    "nnx",
    bool,
    _model_state,
  ),
  Rule(  # the same pair, met by jaccum.linen
    "`deterministic` × jaccum.nnx variables outside `wrt`, or jaccum.linen's "
    "`batch_stats`, holding arrays",
    "the same chain, in the wrapper's words",
    "linen",
    bool,
    _batch_stats,
  ),
  Rule(
    "`DiLoCo`'s `reduce_fn` × `reduce_dtype`",
    "`reduce_fn` sets its wire",
    "diloco",
    lambda o: o.reduce_fn is not None and o.reduce_dtype is not None,
    lambda o: (
      f"DiLoCo's reduce_fn and reduce_dtype={o.reduce_dtype} do not "
      "combine: reduce_fn replaces the reduction of the pseudo-gradients, so it "
      "decides what crosses the slow axis. Cast inside reduce_fn to narrow its "
      "wire, or drop reduce_fn to send the pseudo-gradients in reduce_dtype."
    ),
  ),
  Rule(
    "`deterministic` × `fit_plan`'s sharded `fsdp_modes`",
    'refused when named (the default grid keeps `"gather_once"` alone)',
    "fit_plan",
    lambda modes: any(m != "gather_once" for m in modes),
    _fsdp_modes,
  ),
)


def check(stage: Stage, facts: Any) -> None:
  """Raises the first rule of `stage` that fires on `facts`."""
  for rule in RULES:
    if rule.stage == stage and rule.fires(facts):
      raise ValueError(rule.message(facts))


def check_door(options: Any) -> None:
  check("door", options)

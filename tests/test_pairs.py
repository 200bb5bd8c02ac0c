"""Every option crossed with every other, on every route where both apply.

DESIGN.md, invariant 11: any two options that each apply on a route give,
together, the exact result, or a trace-time refusal whose message names
both. This grid checks it pairwise: for each route, every level of every
option meets every level of every other option in at least one case (all
pairs, not all products), and `test_every_pair_of_levels_is_covered` checks
that the covering set does cover them.

Options and levels (`OPTIONS`): `num_real_microbatches` (None, 0 < n < K, 0,
K, and one count per device where devices run: `data_parallel`'s `[devices]`
count, or in the user's `shard_map` each device's own), `weight_fn` (None,
positive weights, weights that include negative ones), `return_stats`,
`reduce` (all `"mean"`, or a tree giving the aux outputs `"sum"`, `"max"`,
`"min"`, `"last"` and `"concat"`), `rng_argnum`, `state_argnum` (an EMA of
the batch mean and an int counter), `split`, the dtype (float64 params; bf16
params with the float32 accumulator; bf16 params with `accum_dtype=None`),
`overlap_reduction`, `reduce_dtype`, `reduce_fn` (an exact psum, and
`jaccum.PowerSGD` with a `min_compression` too large to compress anything),
`fsdp_mode` with `param_specs`, the mesh (one data axis, or HSDP's
`("replica", "fsdp")` on 2 x 4), `jaccum.MultiSteps` over two calls,
explicit `grad_leaves`, `unroll=2`, `conv_rewrite=False` (the model holds
a 1-D convolution) and `deterministic`.

Routes (`ROUTES`): one device (`accumulate`), `data_parallel` on an auto and
on an explicit mesh, and `accumulate(axis_name=...)` inside the user's own
`jax.shard_map`. An option that does not apply on a route is not one of its
factors.

The covering set is built by `all_pairs`, a small deterministic greedy
generator: while some pair of levels is uncovered, it starts a case from the
first uncovered pair and gives every other option the level that covers the
most uncovered pairs with the levels chosen so far (the best of a few seeded
orders of the options). Pairs that jaccum
refuses (the rules of `jaccum/_routes/rules.py`) never enter a case; each
rule is met on its own below, for an error whose message names both options.

The reference (`reference`) does not call jaccum: a Python loop over
devices d and micro-batches k, in float64, takes `jax.value_and_grad` of the
loss on exactly the rows of micro-batch k of device d (device d holds rows
d·N/D …; micro-batch k of them is rows k, k+K, … or the k-th block), with
the key `fold_in(key_d, k)` (`key_d = fold_in(key, d)` for d > 0) and the
state threaded through that device's micro-batches, and combines the
results in NumPy as `accumulate`'s and `data_parallel`'s docstrings say.
With `deterministic=True` the micro-batches are cut in its global order:
micro-batch m is rows m·R .. (m+1)·R - 1, device d runs the global
micro-batches from the number the devices before it run (d·K without a
count), micro-batch m's key is `fold_in(key, m)`, and `"last"` is the last
that ran of them all, the same on every device.
jaccum runs in float64 too, so most comparisons are to 1e-12 of each leaf's
largest magnitude; options that round by design are compared at their
rounding (`Tolerance`).
"""

import contextlib
import functools
import itertools
import random
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaccum
from jaccum._routes import rules

DEVICES, K, ROWS = 8, 4, 2  # devices, micro-batches per device, rows of each
BATCH = DEVICES * K * ROWS
LENGTH = 8  # of each example's 1-D signal
PER_DEVICE_COUNTS = (3, 1, 4, 0, 2, 4, 4, 1)  # every n in [0, K], some twice
SOME = 2  # a scalar count 0 < n < K

# Tolerances, relative to each leaf's magnitude (`weighted_mean`: a bound on
# every term of its sum, so cancelling terms do not hide a rounding).
# float64: rounding in sums of at most a few hundred terms stays far below.
EXACT = 1e-12
# bf16 keeps 8 significant bits: a rounding moves a value by at most u.
U_BF16 = 2**-8
# bf16 params: each micro-batch's gradient rounds to bf16, their mean (in the
# float32 accumulator) rounds once more, and the reference is rounded to bf16
# for the dtype check: 3u.
BF16_PARAMS = 4 * U_BF16
# accum_dtype=None: besides those, each of the K weighted updates of the bf16
# carry rounds up to three times (scale, add, cast), and the 8 devices' bf16
# carries are summed in a tree of three levels: 3 + 3K + 3 = 18u at most,
# about a third of it seen.
BF16_SUMMED = 18 * U_BF16
# reduce_dtype=bf16: each device's share rounds once, and a bf16 sum over 8
# devices rounds at most three more times: 4u.
BF16_WIRE = 4 * U_BF16
# AccumulationStats are float32 scalars by contract: each figure is a float32
# sum of a few dozen squared norms (relative error ~ 1e-6).
STATS_F32 = 1e-5


# --- The model: a 1-D convolution of two channels and a dense head (40 params).


def conv1d(x, kernel):
  return jax.lax.conv_general_dilated(
    x, kernel, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
  )


def loss_fn(params, batch, state, key):
  """A per-example-mean loss, its aux outputs and the state it updates."""
  x = batch["x"]
  # bf16 params compute in the data's float64: only their gradients round.
  p = jax.tree.map(lambda a: a.astype(x.dtype), params)
  inputs = x
  if key is not None:  # noise, as dropout draws it: a new key per micro-batch
    inputs = inputs + 0.1 * jax.random.normal(key, x.shape, jnp.float32).astype(x.dtype)
  if state is not None:  # centred by the threaded state: gradients depend on it
    inputs = inputs - state["ema"]
  h = jnp.tanh(conv1d(inputs, p["conv"]))
  pred = h.reshape(x.shape[0], -1) @ p["dense"] + p["bias"]
  per_row = 0.5 * jnp.sum((pred - batch["y"]) ** 2, axis=1)
  aux = {
    "sum": jnp.sum(per_row),
    "max": jnp.max(pred),
    "min": jnp.min(per_row),
    "last": pred[:, 0],
    "concat": per_row,
  }
  new_state = None
  if state is not None:
    new_state = {
      "ema": 0.9 * state["ema"] + 0.1 * jnp.mean(x),
      "count": state["count"] + 1,
    }
  return jnp.mean(per_row), (aux, new_state)


AUX_MODES = {
  "sum": "sum",
  "max": "max",
  "min": "min",
  "last": "last",
  "concat": "concat",
}
MIXED_REDUCE = (("mean", AUX_MODES), "mean")  # ((value, aux), grads)


def make_grad_fn(stateful, keyed):
  """`value_and_grad(loss_fn, has_aux=True)` as `f(params, batch, [state], [key])`."""
  value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

  def grad_fn(params, batch, *rest):
    state = rest[0] if stateful else None
    key = rest[-1] if keyed else None
    (value, (aux, new_state)), grads = value_and_grad(params, batch, state, key)
    out = ((value, aux), grads)
    return (out, new_state) if stateful else out

  return grad_fn


# The reference's micro-step, compiled once per shape.
REFERENCE_STEP = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


def make_params(dtype):
  rng = np.random.default_rng(0)
  params = {
    "conv": rng.normal(size=(3, 1, 2)) / 2,
    "dense": rng.normal(size=(2 * LENGTH, 2)) / 4,
    "bias": np.array([0.1, -0.2]),
  }
  return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


# Per-row token counts, positive and signed. With the signed ones, micro-batch
# 1 weighs less than 0 on one device and, on 8 devices, on six of them under
# either split; on the other two (rows 16..31 flip sign) micro-batches 0, 2
# and 3 do. On one device, the contiguous split and n = 2 weigh 0 in total
# (zeros, not NaN). Every call's total is >= 0, as MultiSteps needs
# (`multisteps_weight` checks).
TOKENS = np.tile([1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0, 2.0], BATCH // 8)
SIGNED = np.tile([5.0, -1.0, -2.0, -1.0, 3.0, -2.0, 4.0, 2.0], BATCH // 8)
SIGNED[16:32] *= -1


def make_batch(call):
  rng = np.random.default_rng(10 + call)
  return {  # host arrays: the reference slices them in NumPy
    "x": rng.normal(0.5, 1.0, size=(BATCH, LENGTH, 1)),
    "y": rng.normal(size=(BATCH, 2)),
    "tokens": TOKENS,
    "signed": SIGNED,
  }


STATE0 = {"ema": 0.2, "count": 0}


def make_state():
  return {"ema": jnp.float64(STATE0["ema"]), "count": jnp.int32(STATE0["count"])}


WEIGHT_COLUMNS = {"positive": "tokens", "signed": "signed"}


def make_weight_fn(level):
  if level is None:
    return None
  column = WEIGHT_COLUMNS[level]
  return lambda params, batch, *rest: jnp.sum(batch[column])


def exact_psum(grads, axes, state):
  return jax.lax.psum(grads, axes), state


def make_reduce_fn(level):
  """The two exact `reduce_fn`s, and the `reduce_state` each starts from."""
  if level is None:
    return None, None
  if level == "psum":
    return exact_psum, None
  # Compresses a matrix only if its factors are 1e9 times smaller: never.
  powersgd = jaccum.PowerSGD(rank=1, min_compression=1e9)
  return powersgd, powersgd.init(make_params(jnp.float64), DEVICES)


# --- Options, their levels, and the routes they apply on.

OPTIONS = {
  "count": (None, "some", "zero", "all", "per_device"),
  "fsdp": (None, "gather_once", "shard_grads", "shard_all"),
  "weight": (None, "positive", "signed"),
  "dtype": ("float64", "bfloat16", "bfloat16_accum_none"),
  "reduce_fn": (None, "psum", "powersgd"),
  "stats": (False, True),
  "reduce": ("mean", "mixed"),
  "rng": (False, True),
  "state": (False, True),
  "split": ("strided", "contiguous"),
  "overlap": (False, True),
  "reduce_dtype": (None, "bfloat16"),
  "mesh": ("data", "hsdp"),
  "multisteps": (False, True),
  "grad_leaves": (False, True),
  "unroll": (1, 2),
  "conv_rewrite": (True, False),
  "deterministic": (False, True),
}

DEVICE_ONLY = ("reduce_dtype", "reduce_fn", "mesh")


class Route(NamedTuple):
  options: dict[str, tuple[Any, ...]]  # the factors that apply here, and their levels
  kind: Any  # the mesh's axis type, or None on one device


def _route_options(drop=(), devices=True):
  options = {}
  for name, levels in OPTIONS.items():
    if name in drop or (not devices and name in DEVICE_ONLY):
      continue
    if name == "count" and not devices:
      levels = tuple(level for level in levels if level != "per_device")
    options[name] = levels
  return options


ROUTES = {
  "one_device": Route(_route_options(drop=("fsdp",), devices=False), None),
  "data_parallel-auto": Route(_route_options(), AxisType.Auto),
  "data_parallel-explicit": Route(_route_options(), AxisType.Explicit),
  "shard_map": Route(_route_options(drop=("fsdp",)), AxisType.Explicit),
}


# With `deterministic=True`, the options whose result depends on K and the
# devices, at the levels that do (jaccum/_compose.py's table).
DETERMINISTIC_REFUSES = {
  "split": ("strided",),
  "state": (True,),
  "reduce_fn": ("psum", "powersgd"),
  "reduce_dtype": ("bfloat16",),
  "fsdp": ("shard_grads", "shard_all"),
}


def refused(a, b):
  """Whether two (option, level) pairs are refused (a rule of jaccum's table)."""
  levels = dict((a, b))
  if len(levels) < 2:
    return False
  if levels.get("deterministic"):
    (name, level), *_ = [(n, v) for n, v in levels.items() if n != "deterministic"]
    return level in DETERMINISTIC_REFUSES.get(name, ())
  non_default = {name for name, level in levels.items() if level not in (None, False)}
  return non_default in (
    {"reduce_fn", "reduce_dtype"},
    {"reduce_fn", "fsdp"},
    {"overlap", "count"},
  )


def valid_pairs(options):
  names = list(options)
  return {
    ((f, a), (g, b))
    for i, f in enumerate(names)
    for g in names[i + 1 :]
    for a in options[f]
    for b in options[g]
    if not refused((f, a), (g, b))
  }


def pairs_of(case, names):
  return {
    ((f, case[f]), (g, case[g])) for i, f in enumerate(names) for g in names[i + 1 :]
  }


def all_pairs(options, tries=30):
  """A deterministic covering set: every valid pair of levels in some case.

  Greedy: each case starts from the first uncovered pair (the options with
  the most levels come first) and fills the other options, in `tries` orders
  (the given one, then shuffled by a seeded generator), each with the level
  that covers the most uncovered pairs with those chosen so far (ties: the
  first, default, level); the order that covers the most is kept.
  """
  names = list(options)
  rank = {name: i for i, name in enumerate(names)}
  ordered = lambda x, y: (x, y) if rank[x[0]] < rank[y[0]] else (y, x)
  uncovered = valid_pairs(options)
  shuffled = random.Random(0)
  cases = []
  while uncovered:
    first = min(uncovered, key=lambda p: [(rank[n], options[n].index(v)) for n, v in p])
    best_gain, best = -1, {}
    for attempt in range(tries):
      order = list(names)
      if attempt:
        shuffled.shuffle(order)
      case = dict(first)
      for name in order:
        if name in case:
          continue
        chosen = list(case.items())

        def gain(level, name=name, chosen=chosen, left=uncovered):
          if any(refused((name, level), other) for other in chosen):
            return -1
          return sum(ordered((name, level), other) in left for other in chosen)

        case[name] = max(options[name], key=gain)
      covered = len(pairs_of(case, names) & uncovered)
      if covered > best_gain:
        best_gain, best = covered, {name: case[name] for name in names}
    cases.append(best)
    uncovered -= pairs_of(best, names)
  return cases


# Routes with the same options share one covering set (computed once).
_covering = functools.cache(lambda items: all_pairs(dict(items)))
CASES = [
  (route_name, index, case)
  for route_name, route in ROUTES.items()
  for index, case in enumerate(_covering(tuple(route.options.items())))
]


def case_id(route_name, index, case):
  changed = [
    f"{name}={level}" for name, level in case.items() if level != OPTIONS[name][0]
  ]
  return f"{route_name}-{index:02d}[{','.join(changed)}]"


# --- What each case runs.


class Setup(NamedTuple):
  """A case made concrete: the mesh, the axes, the devices, and the options."""

  case: dict[str, Any]
  mesh: Any
  axes: tuple[str, ...]
  devices: int  # over which the batch is split: 1 on one device
  counts: tuple[int, ...] | None  # per device, None for all K
  params: Any
  options: dict[str, Any]


def count_levels(level, devices):
  """The call's `num_real_microbatches` and what each device runs."""
  if level is None:
    return None, None
  if level == "per_device":
    return jnp.asarray(PER_DEVICE_COUNTS, jnp.int32), PER_DEVICE_COUNTS
  n = {"some": SOME, "zero": 0, "all": K}[level]
  return jnp.int32(n), (n,) * devices


def fsdp_specs(axis):
  return {"conv": P(), "dense": P(axis), "bias": P()}


def make_setup(route_name, case):
  route = ROUTES[route_name]
  mesh, axes, devices = None, (), 1
  if route.kind is not None:
    devices = DEVICES
    if case.get("mesh") == "hsdp":
      axes = ("replica", "fsdp")
      mesh = jax.make_mesh((2, 4), axes, axis_types=(route.kind,) * 2)
    else:
      axes = ("data",)
      mesh = jax.make_mesh((DEVICES,), axes, axis_types=(route.kind,))
  param_dtype = jnp.float64 if case["dtype"] == "float64" else jnp.bfloat16
  params = make_params(param_dtype)
  options = {
    "reduce": MIXED_REDUCE if case["reduce"] == "mixed" else "mean",
    "weight_fn": make_weight_fn(case["weight"]),
    "return_stats": case["stats"],
    "split": case["split"],
    "unroll": case["unroll"],
    "conv_rewrite": case["conv_rewrite"],
    "overlap_reduction": case["overlap"],
    "deterministic": case["deterministic"],
  }
  if case["dtype"] == "bfloat16_accum_none":
    options["accum_dtype"] = None
  extra = 2
  if case["state"]:
    options["state_argnum"], extra = extra, extra + 1
  if case["rng"]:
    options["rng_argnum"] = extra
  if case["grad_leaves"]:
    options["grad_leaves"] = (False, True)  # ((value, aux), grads)
  if case.get("reduce_dtype"):
    options["reduce_dtype"] = jnp.bfloat16
  _, counts = count_levels(case["count"], devices)
  return Setup(case, mesh, axes, devices, counts, params, options)


def placed(setup, tree, spec):
  if setup.mesh is None:
    return tree
  return jax.device_put(tree, NamedSharding(setup.mesh, spec))


def placed_params(setup):
  fsdp = setup.case.get("fsdp")
  if setup.mesh is None:
    return setup.params
  specs = (
    fsdp_specs(setup.axes[-1]) if fsdp else jax.tree.map(lambda _: P(), setup.params)
  )
  return jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(setup.mesh, s)), setup.params, specs
  )


def out_specs(setup):
  """The user's shard_map out_specs: per-device leaves over the axes."""
  case, per_device = setup.case, P(setup.axes)
  aux = {name: P() for name in AUX_MODES}
  if case["reduce"] == "mixed":
    # deterministic=True: the global last micro-batch's, the same everywhere.
    aux.update(last=P() if case["deterministic"] else per_device, concat=per_device)
  spec = ((P(), aux), P())
  if case["state"]:
    spec = (spec, P())
  if case["stats"]:
    spec = (spec, P())
  if case["reduce_fn"]:
    spec = (spec, per_device)
  return spec


def make_step(route_name, setup):
  """The jitted step: `step(params, batch, extras, count, reduce_state)`."""
  case = setup.case
  grad_fn = make_grad_fn(case["state"], case["rng"])
  reduce_fn, _ = make_reduce_fn(case.get("reduce_fn"))
  options = dict(setup.options)
  if reduce_fn is not None:
    options["reduce_fn"] = reduce_fn
  if route_name == "one_device":
    accumulated = jaccum.accumulate(grad_fn, K, **options)
  elif route_name.startswith("data_parallel"):
    fsdp = case["fsdp"]
    accumulated = jaccum.data_parallel(
      grad_fn,
      K,
      mesh=setup.mesh,
      axis=setup.axes,
      param_specs=fsdp_specs(setup.axes[-1]) if fsdp else None,
      fsdp_mode=fsdp or "gather_once",
      **options,
    )
  else:
    accumulated = jaccum.accumulate(grad_fn, K, axis_name=setup.axes, **options)

  def call(params, batch, extras, count, reduce_state):
    keywords = {}
    if count is not None:
      keywords["num_real_microbatches"] = count
    if reduce_fn is not None:
      keywords["reduce_state"] = reduce_state
    return accumulated(params, batch, *extras, **keywords)

  if route_name != "shard_map":
    return jax.jit(call)
  per_device_count = case["count"] == "per_device"

  def in_user_shard_map(params, batch, extras, count, reduce_state):
    if per_device_count:
      count = count.reshape(())  # this device's own count
    return call(params, batch, extras, count, reduce_state)

  axes = P(setup.axes)
  return jax.jit(
    jax.shard_map(
      in_user_shard_map,
      mesh=setup.mesh,
      in_specs=(P(), axes, P(), axes if per_device_count else P(), axes),
      out_specs=out_specs(setup),
    )
  )


# --- The reference: per micro-batch, in float64, combined in NumPy.


class Reference(NamedTuple):
  out: Any  # ((value, aux), grads), float64
  magnitude: Any  # like `out`, a float per leaf that bounds each term's size
  state: Any
  stats: dict[str, float] | None
  total_weight: float  # of the micro-batches that ran


def micro_rows(device, k, devices, split):
  """Rows of micro-batch k of device d, by the documented split."""
  per_device = BATCH // devices
  local = np.arange(device * per_device, (device + 1) * per_device)
  if split == "strided":
    return local[k::K]
  rows = per_device // K
  return local[k * rows : (k + 1) * rows]


def weighted_mean(outs, weights):
  """`Σ w·out / Σ w` per leaf (zeros for a total of 0), and its magnitude.

  The magnitude of a leaf is the largest entry of `Σ |w|·|out| / |Σ w|`: no
  term of the sum is larger, so a rounding of each term (bf16 gradients, a
  bf16 wire) moves the result by at most its relative size times this, even
  where the terms cancel (negative weights, gradients of mixed sign).
  """
  total = float(np.sum(weights))
  if total == 0:
    zeros = jax.tree.map(lambda x: np.zeros(np.shape(x)), outs[0])
    return zeros, jax.tree.map(lambda x: 0.0, outs[0])
  combine = lambda f: jax.tree.map(
    lambda *xs: (
      sum(f(w) * f(np.asarray(x, np.float64)) for w, x in zip(weights, xs, strict=True))
      / f(total)
    ),
    *outs,
  )
  return combine(lambda x: x), jax.tree.map(np.max, combine(np.abs))


def closed_form_stats(weights, micro_grads, grads):
  """AccumulationStats' figures from the micro-batch gradients (`_stats`' docstring)."""
  sq = lambda tree: sum(
    float(np.sum(np.asarray(x, np.float64) ** 2)) for x in jax.tree.leaves(tree)
  )
  total = float(np.sum(weights))
  num_weighted = sum(w != 0 for w in weights)
  with np.errstate(divide="ignore", invalid="ignore"):
    small = (
      np.float64(sum(w * sq(g) for w, g in zip(weights, micro_grads, strict=True)))
      / total
    )
    big = sq(grads)
    b_small, b_big = np.float64(total) / num_weighted, total
    nan = np.float64(np.nan)
    defined = num_weighted >= 2 and total != 0
    true = (b_big * big - b_small * small) / (b_big - b_small) if defined else nan
    trace = (small - big) / (1 / b_small - 1 / b_big) if defined else nan
    return {
      "micro_grad_sq_norm": small,
      "grad_sq_norm": big,
      "true_grad_sq_norm": true,
      "trace_covariance": trace,
      "noise_scale": trace / true if defined else nan,
      "total_weight": np.float64(total),
      "microbatch_weight": b_small,
    }


def reference(setup, params, batch, state, key):
  """What the docstrings say the accumulated step returns, without jaccum."""
  case, devices = setup.case, setup.devices
  params64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
  counts = setup.counts or (K,) * devices
  column = WEIGHT_COLUMNS.get(case["weight"])
  rows_per_micro = BATCH // devices // K
  weights, outs, micro_grads, lasts, finals = [], [], [], [], []
  concat = np.zeros(BATCH)
  first = 0  # deterministic=True: the global index of device d's first micro-batch
  global_last = np.zeros(rows_per_micro)
  for device in range(devices):
    device_key = None
    if case["rng"]:
      device_key = key if device == 0 else jax.random.fold_in(key, device)
    device_state = state if case["state"] else None
    last = np.zeros(rows_per_micro)
    for k in range(counts[device]):
      rows = micro_rows(device, k, devices, case["split"])
      micro = jax.tree.map(lambda x, rows=rows: jnp.asarray(x[rows]), batch)
      micro_key = None if device_key is None else jax.random.fold_in(device_key, k)
      if case["deterministic"] and case["rng"]:
        micro_key = jax.random.fold_in(key, first + k)
      (value, (aux, new_state)), grads = REFERENCE_STEP(
        params64, micro, device_state, micro_key
      )
      weights.append(float(np.sum(batch[column][rows])) if column else float(len(rows)))
      outs.append((value, aux))
      micro_grads.append(grads)
      last = global_last = np.asarray(aux["last"])
      concat[rows] = np.asarray(aux["concat"])
      device_state = new_state
    lasts.append(last)
    finals.append(device_state)
    first += counts[device]
  ran = [aux for _, aux in outs]
  if not outs:  # nothing ran: one term of weight 0, shaped like a micro-step's
    aux = {name: np.float64(0) for name in AUX_MODES}
    aux.update(last=np.zeros(rows_per_micro), concat=np.zeros(rows_per_micro))
    outs, weights = [(np.float64(0), aux)], [0.0]
    micro_grads = [jax.tree.map(lambda x: np.zeros(x.shape), params64)]
  (value, aux), (value_magnitude, aux_magnitude) = weighted_mean(outs, weights)
  grads, grads_magnitude = weighted_mean(micro_grads, weights)
  if case["reduce"] == "mixed":
    pick = lambda name, reduce: np.float64(
      reduce([float(a[name]) for a in ran]) if ran else 0
    )
    aux = {
      "sum": pick("sum", sum),
      # "n = 0 gives zeros" (accumulate's docstring): max and min of nothing too.
      "max": pick("max", max),
      "min": pick("min", min),
      # Each device's own last micro-batch, devices in order (zeros if none
      # ran); deterministic=True: the last of the global order that ran.
      "last": global_last if case["deterministic"] else np.concatenate(lasts),
      "concat": concat,
    }
    aux_magnitude = {name: float(np.max(np.abs(x))) for name, x in aux.items()}
    aux_magnitude["sum"] = float(pick("sum", lambda xs: sum(map(abs, xs))))
  new_state = None
  if case["state"]:
    # Floating state averaged over devices, other state device 0's.
    new_state = {
      "ema": np.mean([float(s["ema"]) for s in finals]),
      "count": np.int32(finals[0]["count"]),
    }
  stats = closed_form_stats(weights, micro_grads, grads) if case["stats"] else None
  return Reference(
    out=((value, aux), grads),
    magnitude=((value_magnitude, aux_magnitude), grads_magnitude),
    state=new_state,
    stats=stats,
    total_weight=float(np.sum(weights)),
  )


# --- Comparing.


class Tolerance(NamedTuple):
  """Per part of the output, the error allowed relative to its magnitude."""

  grads: float
  summed: float  # "mean" and "sum" outputs other than the gradients
  stats: float

  @classmethod
  def of(cls, case):
    params = {"float64": 0, "bfloat16": BF16_PARAMS, "bfloat16_accum_none": BF16_SUMMED}
    wire = BF16_WIRE if case.get("reduce_dtype") else 0
    grads = params[case["dtype"]] + wire
    # A squared norm doubles its gradients' relative rounding.
    stats = 2 * grads if grads else STATS_F32
    return cls(grads or EXACT, wire or EXACT, stats)


@contextlib.contextmanager
def every_check():
  """Runs every check in the block, then fails with all that failed, not the first."""
  failures = []

  def check(assertion, *args, **kwargs):
    try:
      assertion(*args, **kwargs)
    except AssertionError as failure:
      failures.append(str(failure))

  yield check
  if failures:
    pytest.fail("\n".join(failures))


def assert_leaves_close(actual, expected, tolerances, magnitudes, check):
  """Each leaf within its tolerance times its magnitude (the reference's bound)."""
  flat = jax.tree_util.tree_flatten_with_path(actual)[0]
  for (path, got), want, tolerance, magnitude in zip(
    flat,
    jax.tree.leaves(expected),
    jax.tree.leaves(tolerances),
    jax.tree.leaves(magnitudes),
    strict=True,
  ):
    where = jax.tree_util.keystr(path)
    check(
      assert_trees_close,
      {where: got},
      {where: want},
      rtol=0.0,
      atol=tolerance * magnitude,
    )


def compare_stats(actual, expected, tolerance, check):
  """Each field within float32 rounding of its closed form; NaN where undefined."""
  small, big = expected["micro_grad_sq_norm"], expected["grad_sq_norm"]
  b_small, b_big = expected["microbatch_weight"], expected["total_weight"]
  # The estimates subtract two nearly equal figures: their error scales with
  # the terms subtracted, not with the difference.
  terms = {
    "true_grad_sq_norm": lambda: (
      (abs(b_big * big) + abs(b_small * small)) / abs(b_big - b_small)
    ),
    "trace_covariance": lambda: (abs(small) + abs(big)) / abs(1 / b_small - 1 / b_big),
  }
  terms["noise_scale"] = lambda: (
    abs(expected["noise_scale"])
    * sum(
      terms[name]() / abs(expected[name])
      for name in ("true_grad_sq_norm", "trace_covariance")
    )
  )
  for name, want in expected.items():
    got = np.float64(getattr(actual, name))
    if not np.isfinite(want):  # NaN where undefined; inf for a total weight of 0
      check(np.testing.assert_equal, {name: got}, {name: want})
    else:
      scale = terms.get(name, lambda want=want: abs(want))()
      check(
        assert_trees_close, {name: got}, {name: want}, rtol=0.0, atol=tolerance * scale
      )


def compare(setup, got, ref, tolerance, check, reduce_state):
  """Every part of the accumulated step's output against the reference."""
  case = setup.case
  if case.get("reduce_fn"):
    # Nothing to compress: the state comes back as it went in (one row per device).
    got, new_reduce_state = got
    check(assert_trees_close, new_reduce_state, reduce_state, rtol=EXACT)
  if case["stats"]:
    got, stats = got
    compare_stats(stats, ref.stats, tolerance.stats, check)
  if case["state"]:
    got, state = got
    check(assert_trees_close, state, as_dtypes(ref.state, make_state()), rtol=EXACT)
  (value, aux), grads = ref.out
  # Gradients in their params' dtypes, everything else in the data's float64.
  expected = ((np.float64(value), aux), as_dtypes(grads, setup.params))
  modes = AUX_MODES if case["reduce"] == "mixed" else dict.fromkeys(AUX_MODES, "mean")
  tolerances = (
    (
      tolerance.summed,
      {
        n: tolerance.summed if m in ("mean", "sum") else EXACT for n, m in modes.items()
      },
    ),
    jax.tree.map(lambda _: tolerance.grads, grads),
  )
  assert_leaves_close(got, expected, tolerances, ref.magnitude, check)


def as_dtypes(tree, like):
  return jax.tree.map(lambda x, y: jnp.asarray(x, jnp.asarray(y).dtype), tree, like)


def multisteps_weight(case, ref):
  """The weight MultiSteps gets for one call: its total weight, where weighted."""
  if case["weight"] is None and case["count"] is None:
    return None  # every call weighs the same
  assert ref.total_weight >= 0  # the test's tokens are made so; MultiSteps needs it
  return jnp.float32(ref.total_weight)


# One for every case, so that its jitted update compiles once per signature.
MULTISTEPS = jaccum.MultiSteps(optax.sgd(1.0), every_k_schedule=2)


@pytest.mark.slow
@pytest.mark.parametrize(
  ("route_name", "index", "case"), CASES, ids=[case_id(*c) for c in CASES]
)
def test_every_pair_of_options_is_exact(route_name, index, case):
  with jax.enable_x64(True), every_check() as check:
    setup = make_setup(route_name, case)
    step = make_step(route_name, setup)
    tolerance = Tolerance.of(case)
    count, _ = count_levels(case["count"], setup.devices)
    if route_name == "shard_map" and case["count"] == "per_device":
      count = placed(setup, count, P(setup.axes))  # the user's shard_map splits it
    _, reduce_state = make_reduce_fn(case.get("reduce_fn"))
    params = placed_params(setup)
    state = ref_state = make_state()
    opt_state = MULTISTEPS.init(params)
    window = []  # per call: (weight, reference gradients, their magnitude)
    for call in range(2 if case["multisteps"] else 1):
      host_batch = make_batch(call)
      batch = placed(setup, host_batch, P(setup.axes))
      key = jax.random.key(call)
      extras = [placed(setup, state, P())] if case["state"] else []
      extras += [key] if case["rng"] else []
      got = step(params, batch, extras, count, reduce_state)
      ref = reference(setup, setup.params, host_batch, ref_state, key)
      compare(setup, got, ref, tolerance, check, reduce_state)
      if case.get("reduce_fn"):
        got, reduce_state = got  # the next call starts from it
      if case["stats"]:
        got, _ = got
      if case["state"]:
        (got, state), ref_state = got, jax.tree.map(jnp.asarray, ref.state)
      if case["multisteps"]:
        weight = multisteps_weight(case, ref)
        updates, opt_state = MULTISTEPS.update(got[1], opt_state, params, weight=weight)
        window.append((1.0 if weight is None else ref.total_weight, ref))
    if case["multisteps"]:
      # sgd(1.0): the window's update is minus the weighted mean over both calls,
      # each call's gradients rounded as that call's were.
      weights = [w for w, _ in window]
      expected, _ = weighted_mean([r.out[1] for _, r in window], weights)
      magnitude, _ = weighted_mean([r.magnitude[1] for _, r in window], weights)
      # In float64: the updates' dtype is MultiSteps' business, not this grid's.
      assert_leaves_close(
        jax.tree.map(lambda u: np.asarray(u, np.float64), updates),
        jax.tree.map(lambda g: -g, expected),
        jax.tree.map(lambda _: tolerance.grads, expected),
        magnitude,
        check,
      )


def test_every_pair_of_levels_is_covered():
  """The covering set holds every valid pair of levels, and no refused one."""
  for route_name, route in ROUTES.items():
    cases = [case for name, _, case in CASES if name == route_name]
    names = list(route.options)
    covered = set().union(*(pairs_of(case, names) for case in cases))
    assert valid_pairs(route.options) <= covered, route_name
    for case in cases:
      assert set(case) == set(names)
      for pair in itertools.combinations(case.items(), 2):
        assert not refused(*pair), (route_name, pair)


# --- The refused pairs, one by one: an error that names both options.


def refusal_setup(mesh_kind=AxisType.Auto):
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(mesh_kind,))
  batch = jax.device_put(make_batch(0), NamedSharding(mesh, P("data")))
  return mesh, make_params(jnp.float32), batch


def refuse_reduce_fn_and_reduce_dtype():
  jaccum.data_parallel(
    make_grad_fn(False, False), K, reduce_fn=exact_psum, reduce_dtype=jnp.bfloat16
  )


def refuse_fsdp_and(mode, option, **call):
  mesh, params, batch = refusal_setup()
  step = jaccum.data_parallel(
    make_grad_fn(False, False),
    K,
    mesh=mesh,
    param_specs=fsdp_specs("data"),
    fsdp_mode=mode,
    **option,
  )
  jax.jit(step)(params, batch, **call)


def refuse_reduce_fn_and_fsdp(mode):
  refuse_fsdp_and(mode, {"reduce_fn": exact_psum}, reduce_state=None)


def refuse_reduce_fn_on_one_device():
  step = jaccum.accumulate(make_grad_fn(False, False), K, reduce_fn=exact_psum)
  jax.jit(step)(make_params(jnp.float32), make_batch(0), reduce_state=None)


def refuse_overlap_and_a_count(route_name):
  grad_fn, params = make_grad_fn(False, False), make_params(jnp.float32)
  count = jnp.int32(SOME)
  if route_name == "one_device":
    step = jaccum.accumulate(grad_fn, K, overlap_reduction=True, split="strided")
    return jax.jit(step)(params, make_batch(0), num_real_microbatches=count)
  mesh, _, batch = refusal_setup()
  if route_name == "data_parallel":
    step = jaccum.data_parallel(
      grad_fn, K, mesh=mesh, overlap_reduction=True, split="strided"
    )
    counts = jnp.asarray(PER_DEVICE_COUNTS, jnp.int32)
    return jax.jit(step)(params, batch, num_real_microbatches=counts)
  step = jaccum.accumulate(
    grad_fn, K, axis_name="data", overlap_reduction=True, split="strided"
  )
  in_shard_map = jax.shard_map(
    lambda p, b, n: step(p, b, num_real_microbatches=n),
    mesh=mesh,
    in_specs=(P(), P("data"), P()),
    out_specs=P(),
  )
  return jax.jit(in_shard_map)(params, batch, count)


def refuse_a_count_per_device_and_collectives():
  def synced(params, batch, state, key):
    # Synchronised centring: grad_fn's own collective over the data axis.
    centred = {**batch, "x": batch["x"] - jax.lax.pmean(jnp.mean(batch["x"]), "data")}
    return loss_fn(params, centred, state, key)

  grad_fn = lambda params, batch: jax.value_and_grad(synced, has_aux=True)(
    params, batch, None, None
  )
  mesh, params, batch = refusal_setup()
  step = jaccum.data_parallel(grad_fn, K, mesh=mesh, split="strided")
  counts = jnp.asarray(PER_DEVICE_COUNTS, jnp.int32)
  jax.jit(step)(params, batch, num_real_microbatches=counts)


def refuse_a_count_with_the_split_left_out(route_name):
  grad_fn, params = make_grad_fn(False, False), make_params(jnp.float32)
  count = jnp.int32(SOME)
  if route_name == "one_device":
    step = jaccum.accumulate(grad_fn, K)
    return jax.jit(step)(params, make_batch(0), num_real_microbatches=count)
  mesh, _, batch = refusal_setup()
  if route_name == "data_parallel":
    step = jaccum.data_parallel(grad_fn, K, mesh=mesh)
    counts = jnp.asarray(PER_DEVICE_COUNTS, jnp.int32)
    return jax.jit(step)(params, batch, num_real_microbatches=counts)
  _, _, batch = refusal_setup(AxisType.Explicit)  # accumulate splits it as one
  return jax.jit(jaccum.accumulate(grad_fn, K))(
    params, batch, num_real_microbatches=count
  )


def refuse_a_count_and_contiguous_on_a_sharded_batch():
  _, params, batch = refusal_setup(AxisType.Explicit)
  step = jaccum.accumulate(make_grad_fn(False, False), K, split="contiguous")
  jax.jit(step)(params, batch, num_real_microbatches=jnp.int32(SOME))


def refuse_last_and_contiguous_on_a_sharded_batch():
  _, params, batch = refusal_setup(AxisType.Explicit)
  reduce = (("mean", {**dict.fromkeys(AUX_MODES, "mean"), "last": "last"}), "mean")
  step = jaccum.accumulate(
    make_grad_fn(False, False), K, split="contiguous", reduce=reduce
  )
  jax.jit(step)(params, batch)


def refuse_deterministic_and(option):
  jaccum.accumulate(make_grad_fn(False, False), K, deterministic=True, **option)


def refuse_deterministic_and_state():
  step = jaccum.accumulate(
    make_grad_fn(True, False), K, state_argnum=2, deterministic=True, split=None
  )
  jax.jit(step)(make_params(jnp.float32), make_batch(0), make_state())


def refuse_deterministic_and_nnx_rngs():
  from flax import nnx

  import jaccum.nnx

  rngs = nnx.Rngs(0)
  model = nnx.Sequential(nnx.Linear(1, 2, rngs=rngs), nnx.Dropout(0.5, rngs=rngs))
  loss = lambda model, x: jnp.mean(model(x))
  jaccum.nnx.grad(loss, K, deterministic=True)(model, np.ones((8, 1), np.float32))


def refuse_deterministic_and_linen_batch_stats():
  import jaccum.linen

  def loss(params, batch_stats, x):
    return jnp.mean(x * params["w"]), {"batch_stats": {"mean": batch_stats["mean"]}}

  step = jaccum.linen.value_and_grad(loss, K, has_aux=True, deterministic=True)
  step({"w": jnp.ones(())}, {"mean": jnp.zeros(())}, np.ones((8, 1), np.float32))


def refuse_deterministic_and_fit_plans_sharded_modes():
  mesh = jax.make_mesh((8,), ("data",))
  jaccum.fit_plan(
    lambda remat: jax.grad(lambda w, x: jnp.mean(x @ w)),
    jax.ShapeDtypeStruct((8, 2), jnp.float32),
    jax.ShapeDtypeStruct((64, 8), jnp.float32),
    memory_budget=1 << 30,
    mesh=mesh,
    param_specs=P("data"),
    deterministic=True,
    fsdp_modes=["gather_once", "shard_all"],
  )


def refuse_deterministic_and_fsdp(mode):
  refuse_fsdp_and(mode, {"deterministic": True})


def refuse_deterministic_and_too_many_microbatches():
  step = jaccum.accumulate(lambda w, x: w * jnp.mean(x), 513, deterministic=True)
  step(1.0, np.zeros((513, 1), np.float32))


def refuse_deterministic_on_the_whole_batchs_route():
  """A reshard of the activation over "data" on fewer rows per device than
  devices: only the whole batch's step runs it, which deterministic refuses."""
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Explicit,))

  def grad_fn(params, batch):
    def loss(params):
      hidden = jnp.tanh(batch["x"][:, :, 0] @ params["dense"][:LENGTH])
      hidden = jax.sharding.reshard(hidden, NamedSharding(mesh, P("data")))
      return jnp.mean((hidden - batch["y"]) ** 2)

    return jax.grad(loss)(params)

  params = jax.device_put(make_params(jnp.float32), NamedSharding(mesh, P()))
  batch = {k: v for k, v in make_batch(0).items() if k in ("x", "y")}
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  step = jaccum.data_parallel(grad_fn, K, mesh=mesh, deterministic=True)
  jax.jit(step)(params, batch)


def refuse_stats_of_one_batch_size():
  step = jaccum.accumulate(make_grad_fn(False, False), 1, return_stats=True)
  jax.jit(step)(make_params(jnp.float32), make_batch(0))


def refuse_stats_of_summed_gradients():
  step = jaccum.accumulate(
    make_grad_fn(False, False), K, return_stats=True, reduce=(("mean", "mean"), "sum")
  )
  jax.jit(step)(make_params(jnp.float32), make_batch(0))


def refuse_diloco_reduce_fn_and_reduce_dtype():
  jaccum.DiLoCo(
    optax.sgd(0.1),
    4,
    axis_name="replica",
    reduce_fn=exact_psum,
    reduce_dtype=jnp.bfloat16,
  )


# Each rule of jaccum's table (`rules.RULES`), by its name: how to meet that
# pair, and what the message must name.
REFUSALS = {
  "`DiLoCo`'s `reduce_fn` × `reduce_dtype`": (
    [refuse_diloco_reduce_fn_and_reduce_dtype],
    r"DiLoCo's reduce_fn and reduce_dtype=bfloat16 do not combine",
  ),
  "`reduce_fn` × `reduce_dtype`": (
    [refuse_reduce_fn_and_reduce_dtype],
    r"reduce_fn and reduce_dtype=bfloat16 do not combine",
  ),
  "`reduce_fn` × FSDP (`param_specs`)": (
    [
      functools.partial(refuse_reduce_fn_and_fsdp, mode) for mode in OPTIONS["fsdp"][1:]
    ],
    r"reduce_fn and FSDP \(param_specs\) do not combine",
  ),
  "`reduce_fn` × one device": (
    [refuse_reduce_fn_on_one_device],
    r"reduce_fn replaces the reduction over devices: it needs axis_name",
  ),
  "`overlap_reduction` × a count": (
    [
      functools.partial(refuse_overlap_and_a_count, route)
      for route in ("one_device", "data_parallel", "shard_map")
    ],
    r"overlap_reduction=True and num_real_microbatches do not combine",
  ),
  "a count per device × `grad_fn`'s own collectives over the data axes": (
    [refuse_a_count_per_device_and_collectives],
    r"num_real_microbatches with a count that differs between devices, and a "
    r"grad_fn that communicates over the data axes \['data'\]",
  ),
  "a count × the split left out": (
    [
      functools.partial(refuse_a_count_with_the_split_left_out, route)
      for route in ("one_device", "data_parallel", "sharded")
    ],
    r"num_real_microbatches with the split left out \(strided, the default\) "
    r"runs micro-batches 0..n-1 of K=4, micro-batch k holding rows k, k \+ K",
  ),
  'a count × `split="contiguous"` on a batch sharded by `accumulate`': (
    [refuse_a_count_and_contiguous_on_a_sharded_batch],
    r'num_real_microbatches with split="contiguous" and a batch sharded',
  ),
  '`reduce="last"` × `split="contiguous"` on a batch sharded by `accumulate`': (
    [refuse_last_and_contiguous_on_a_sharded_batch],
    r'reduce="last" at output\[0\]\[1\]\[\'last\'\] with split="contiguous" and a '
    r"batch sharded",
  ),
  "`deterministic`, `return_stats`, `state_argnum`, a count or `reduce_fn` × "
  "the whole batch's route": (
    [refuse_deterministic_on_the_whole_batchs_route],
    r"deterministic=True needs the per-device loop, which cannot run grad_fn here",
  ),
  "`return_stats` × one batch size": (
    [refuse_stats_of_one_batch_size],
    r"return_stats=True estimates the gradient noise from two batch sizes",
  ),
  "`return_stats` × gradients not averaged": (
    [refuse_stats_of_summed_gradients],
    r"return_stats=True measures gradients .* reduced with \"mean\", got \['sum'\]",
  ),
  '`deterministic` × `split="strided"`': (
    [functools.partial(refuse_deterministic_and, {"split": "strided"})],
    r'deterministic=True and split="strided" do not combine',
  ),
  "`deterministic` × `state_argnum`, a state with array leaves": (
    [refuse_deterministic_and_state],
    r"deterministic=True and state_argnum=2 do not combine",
  ),
  "`deterministic` × `reduce_fn`": (
    [functools.partial(refuse_deterministic_and, {"reduce_fn": exact_psum})],
    r"deterministic=True and reduce_fn do not combine",
  ),
  "`deterministic` × `reduce_dtype`": (
    [functools.partial(refuse_deterministic_and, {"reduce_dtype": jnp.bfloat16})],
    r"deterministic=True and reduce_dtype=bfloat16 do not combine",
  ),
  "`deterministic` × FSDP's sharded modes": (
    [
      functools.partial(refuse_deterministic_and_fsdp, mode)
      for mode in ("shard_grads", "shard_all")
    ],
    r"deterministic=True and fsdp_mode='shard_(grads|all)' do not combine",
  ),
  "`deterministic` × jaccum.nnx variables outside `wrt`, or jaccum.linen's "
  "`batch_stats`, holding arrays": (
    [refuse_deterministic_and_nnx_rngs, refuse_deterministic_and_linen_batch_stats],
    r"deterministic=True and (a model .*rngs/count \(RngCount\)|batch_stats holding)",
  ),
  "`deterministic` × `fit_plan`'s sharded `fsdp_modes`": (
    [refuse_deterministic_and_fit_plans_sharded_modes],
    r"deterministic=True and fsdp_modes=\['gather_once', 'shard_all'\] do not",
  ),
  "`deterministic` × more than 512 micro-batches per device, or 2¹⁵ - 1 over "
  "all devices": (
    [refuse_deterministic_and_too_many_microbatches],
    r"deterministic=True sums at most 512 micro-batches per device",
  ),
}


def test_the_refusals_tested_are_the_tables():
  """Every rule is met here, and nothing here names a rule that does not exist."""
  assert set(REFUSALS) == {rule.name for rule in rules.RULES}


REFUSAL_CASES = [
  (pair, attempt) for pair, (attempts, _) in REFUSALS.items() for attempt in attempts
]


@pytest.mark.parametrize(
  ("pair", "attempt"),
  REFUSAL_CASES,
  ids=[f"{pair.replace('×', 'x')}-{i}" for i, (pair, _) in enumerate(REFUSAL_CASES)],
)
def test_a_refused_pair_is_refused_by_name(pair, attempt):
  with pytest.raises((ValueError, TypeError), match=REFUSALS[pair][1]):
    attempt()


# --- accumulate_coupled × its options.
#
# The same idea for `jaccum.accumulate_coupled` (issue 36): its options, the
# route (one device; `axis_name` in the user's `shard_map`; `mesh=` on an auto
# mesh; a batch sharded over an explicit mesh) among them, crossed pairwise
# by `all_pairs`. The model is a CLIP loss with a learnable temperature over
# two towers, one of them the 1-D convolution above. The reference is the
# whole batch's `jax.value_and_grad(has_aux=True)` in float64 on the same
# rows, each row's noise drawn with its micro-batch's documented key; it
# does not call jaccum. Gradients of bf16 params are held to their rounding
# times the sum of the magnitudes of the terms that make them (the loss's
# direct gradient and each micro-batch's pull-back), computed apart.

COUPLED_OPTIONS = {
  "route": ("one_device", "shard_map", "mesh", "explicit"),
  "dtype": ("float64", "bfloat16", "bfloat16_accum_none"),
  "batch_argnums": ("one", "two"),  # {"x", "y"} as argument 1, or x, y as 1 and 2
  "num_microbatches": (K, 1),
  "rng": (False, True),
  "state": (False, True),  # read-only: a shift and an int counter
  "split": ("strided", "contiguous"),
  "has_aux": (False, True),
  "unroll": (1, 2),
  "conv_rewrite": (True, False),
}
COUPLED_CASES = all_pairs(COUPLED_OPTIONS)


def coupled_case_id(index, case):
  changed = [
    f"{name}={level}"
    for name, level in case.items()
    if level != COUPLED_OPTIONS[name][0]
  ]
  return f"coupled-{index:02d}[{','.join(changed)}]"


def coupled_towers(params, x, y, state, key):
  """Per row on its own: `(reps, row_aux)`."""
  p = jax.tree.map(lambda a: a.astype(x.dtype), params)  # bf16 params: float64 math
  if key is not None:
    x = x + 0.1 * jax.random.normal(key, x.shape, jnp.float32).astype(x.dtype)
  if state is not None:
    x = x - state["shift"] * (state["count"] + 1)
  image = jnp.tanh(conv1d(x, p["conv"])).reshape(x.shape[0], -1) @ p["dense"]
  text = jnp.tanh(y @ p["text"])
  norm = lambda z: jnp.linalg.norm(z, axis=-1, keepdims=True)
  reps = {"image": image / norm(image), "text": text / norm(text)}
  row_aux = {"norm": norm(image)[:, 0], "arg": jnp.argmax(image, -1), "up": y[:, 0] > 0}
  return reps, row_aux


def coupled_loss(params, reps):
  """CLIP with a learnable temperature, and measurements of its logits."""
  t = jnp.exp(params["log_temp"].astype(reps["image"].dtype))
  logits = t * reps["image"] @ reps["text"].T
  labels = jnp.arange(logits.shape[0])
  ce = optax.softmax_cross_entropy_with_integer_labels
  loss = (ce(logits, labels).mean() + ce(logits.T, labels).mean()) / 2
  aux = {"t": t, "ncorrect": jnp.sum(jnp.argmax(logits, 1) == labels), "logits": logits}
  return loss, aux


def coupled_params(dtype):
  rng = np.random.default_rng(1)
  params = {
    "conv": rng.normal(size=(3, 1, 2)) / 2,
    "dense": rng.normal(size=(2 * LENGTH, 3)) / 4,
    "text": rng.normal(size=(2, 3)),
    "log_temp": np.array(1.0),
  }
  return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


COUPLED_STATE = {"shift": 0.3, "count": 2}


def coupled_functions(case):
  """`(encode_fn, loss_fn)` with the case's argument layout and outputs."""
  two = case["batch_argnums"] == "two"

  def encode_fn(params, *args):
    rest = list(args[2:] if two else args[1:])
    x, y = args[:2] if two else (args[0]["x"], args[0]["y"])
    state = rest.pop(0) if case["state"] else None
    key = rest.pop(0) if case["rng"] else None
    reps, row_aux = coupled_towers(params, x, y, state, key)
    out = (reps, row_aux) if case["has_aux"] else reps
    return (out, state) if case["state"] else out

  loss_fn = coupled_loss if case["has_aux"] else lambda p, r: coupled_loss(p, r)[0]
  return encode_fn, loss_fn


def coupled_mesh(route):
  kind = AxisType.Auto if route == "mesh" else AxisType.Explicit
  return jax.make_mesh((DEVICES,), ("data",), axis_types=(kind,))


def coupled_step(case):
  """The jitted step, and the call's arguments made from `(params, x, y, extras)`."""
  encode_fn, loss_fn = coupled_functions(case)
  route, two = case["route"], case["batch_argnums"] == "two"
  num_batch = 2 if two else 1
  options = {
    "batch_argnums": (1, 2) if two else 1,
    "split": case["split"],
    "unroll": case["unroll"],
    "conv_rewrite": case["conv_rewrite"],
    "has_aux": case["has_aux"],
  }
  extra = 1 + num_batch
  if case["state"]:
    options["state_argnum"], extra = extra, extra + 1
  if case["rng"]:
    options["rng_argnum"] = extra
  if case["dtype"] == "bfloat16_accum_none":
    options["accum_dtype"] = None
  mesh = None if route == "one_device" else coupled_mesh(route)
  if route == "mesh":
    options["mesh"] = mesh
  if route == "shard_map":
    options["axis_name"] = "data"
  coupled = jaccum.accumulate_coupled(
    encode_fn, loss_fn, case["num_microbatches"], **options
  )

  def arguments(params, x, y, extras):
    batch = [x, y] if two else [{"x": x, "y": y}]
    if route in ("shard_map", "explicit"):
      batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    return (params, *batch, *extras)

  if route != "shard_map":
    return jax.jit(coupled), arguments
  out = ((P(), (P(), P("data"))), P()) if case["has_aux"] else P()
  step = jax.shard_map(
    coupled,
    mesh=mesh,
    in_specs=(P(),) + (P("data"),) * num_batch + (P(),) * (case["state"] + case["rng"]),
    out_specs=(out, P()) if case["state"] else out,
  )
  return jax.jit(step), arguments


def coupled_micro_rows(case):
  """Per micro-batch `(device, k, rows)`, by the documented split."""
  devices = 1 if case["route"] == "one_device" else DEVICES
  num_microbatches = case["num_microbatches"]
  per_device = BATCH // devices
  out = []
  for device in range(devices):
    local = np.arange(device * per_device, (device + 1) * per_device)
    rows = per_device // num_microbatches
    for k in range(num_microbatches):
      if case["split"] == "strided":
        out.append((device, k, local[k::num_microbatches]))
      else:
        out.append((device, k, local[k * rows : (k + 1) * rows]))
  return out


def coupled_key(key, device, k):
  """Micro-batch k's key on device d: `fold_in(key_d, k)`, key_d = key on d = 0."""
  device_key = key if device == 0 else jax.random.fold_in(key, device)
  return jax.random.fold_in(device_key, k)


def coupled_reference(case, params, x, y, state, key):
  """`((loss, (aux, row_aux)), grads)` of the whole batch in float64, and a
  magnitude per gradient leaf that bounds the terms it is summed from."""
  params64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
  micro = coupled_micro_rows(case)

  def encode(p, rows=None, device=0, k=0):
    rows = np.arange(BATCH) if rows is None else rows
    micro_key = None if key is None else coupled_key(key, device, k)
    return coupled_towers(p, x[rows], y[rows], state, micro_key)

  def encode_all(p):
    if key is None:  # rows are independent: the whole batch at once
      return encode(p)
    parts = [encode(p, rows, device, k) for device, k, rows in micro]
    order = np.argsort(np.concatenate([rows for _, _, rows in micro]))
    return jax.tree.map(lambda *xs: jnp.concatenate(xs)[order], *parts)

  def whole(p):
    reps, row_aux = encode_all(p)
    loss, aux = coupled_loss(p, reps)
    return loss, (aux, row_aux)

  out = jax.value_and_grad(whole, has_aux=True)(params64)
  magnitude = jax.tree.map(lambda g: np.max(np.abs(g)), out[1])
  if case["dtype"] != "float64":
    reps, _ = encode_all(params64)
    direct, cotangent = jax.grad(lambda p, r: coupled_loss(p, r)[0], (0, 1))(
      params64, reps
    )
    total = jax.tree.map(np.abs, direct)
    for device, k, rows in micro:
      _, pull = jax.vjp(
        lambda p, rows=rows, d=device, k=k: encode(p, rows, d, k)[0], params64
      )
      (term,) = pull(jax.tree.map(lambda c, rows=rows: c[rows], cotangent))
      total = jax.tree.map(lambda t, g: t + np.abs(g), total, term)
    magnitude = jax.tree.map(np.max, total)
  return out, magnitude


@pytest.mark.slow
@pytest.mark.parametrize(
  ("index", "case"),
  list(enumerate(COUPLED_CASES)),
  ids=[coupled_case_id(i, c) for i, c in enumerate(COUPLED_CASES)],
)
def test_coupled_every_pair_of_options_is_exact(index, case):
  with jax.enable_x64(True), every_check() as check:
    param_dtype = jnp.float64 if case["dtype"] == "float64" else jnp.bfloat16
    params = coupled_params(param_dtype)
    host = make_batch(0)
    x, y = jnp.asarray(host["x"]), jnp.asarray(host["y"])
    state = {
      "shift": jnp.float64(COUPLED_STATE["shift"]),
      "count": jnp.int32(COUPLED_STATE["count"]),
    }
    key = jax.random.key(7)
    extras = ([state] if case["state"] else []) + ([key] if case["rng"] else [])
    step, arguments = coupled_step(case)
    got = step(*arguments(params, x, y, extras))
    ref, magnitude = coupled_reference(
      case, params, x, y, state if case["state"] else None, key if case["rng"] else None
    )
    (loss, (aux, row_aux)), grads = ref
    if case["state"]:
      got, new_state = got
      check(assert_trees_close, new_state, state, rtol=0)  # read, never changed
    value = (loss, (aux, row_aux)) if case["has_aux"] else loss
    expected = (value, as_dtypes(grads, params))
    tolerance = {"float64": EXACT, "bfloat16": BF16_PARAMS}.get(
      case["dtype"], BF16_SUMMED
    )
    # The loss and the auxes are float64 math on the same values: exact.
    value_magnitude = jax.tree.map(lambda v: np.max(np.abs(v), initial=0.0), value)
    assert_leaves_close(
      got,
      expected,
      (jax.tree.map(lambda _: EXACT, value), jax.tree.map(lambda _: tolerance, grads)),
      (value_magnitude, magnitude),
      check,
    )


def test_coupled_every_pair_of_levels_is_covered():
  names = list(COUPLED_OPTIONS)
  covered = set().union(*(pairs_of(case, names) for case in COUPLED_CASES))
  assert valid_pairs(COUPLED_OPTIONS) <= covered
  assert all(set(case) == set(names) for case in COUPLED_CASES)

"""Four overheads measured side by side (issue 39, items 2, 4, 5 and 6).

* **deterministic**: `deterministic=True` ÷ the plain step on the digits MLP
  (64 → 256 → 256 → 10) at K = 8, for several rows per micro-batch R (the
  issue's point: R = 64, 512 rows); both timed in interleaved rounds, the
  median of per-round ratios, of wall time and of this process's CPU time
  (on a shared machine the second is the steadier). And the profile of an
  exact add, per micro-step and 2^16 elements of a gradient leaf, against a
  float add: its maximum alone, and the whole add (the maximum, three slot
  kernels and their scalars).
* **lm**: `jaccum.accumulate` ÷ `optax.microbatch` on the suite's transformer
  LM (`models.py`), K = 4 and 8, interleaved; and whether their compiled
  loop bodies are the same program (instructions counted by opcode and
  shape, tuple indices aside).
* **fit_plan**: the plan part's LM (`plan.py`): every grid point timed
  (`plan.measure_grid`), with the minor page faults one step takes, and
  `fit_plan`'s choice by the cost model alone at the generous budget (every
  point fits): its time ÷ the grid's best.
* **fsdp** (its own process: 8 simulated CPU devices): temporaries per device
  of `fsdp_mode="gather_once"`, `"shard_all"` and a hand-written ZeRO-3 loop
  (each layer all-gathered in its scan step, its gradient reduce-scattered
  by JAX's transpose of the gather), 8 layers of 1024² float32 in a
  `lax.scan`, K = 4, 64 rows per micro-batch per device, without and with
  remat.

The suite runs it as the `overheads` part; on its own:

    python -m benchmarks --parts overheads [--quick]
    python -m benchmarks.overheads --out fsdp.json [--quick]  # the fsdp half
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import resource
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NUM_DEVICES = 8
K = 8
GOALS = {"deterministic": 1.10, "lm": 1.0, "fit_plan": 1.25, "fsdp": 0.2}


def _interleaved(calls: dict[str, Any], rounds: int) -> dict[str, dict[str, list]]:
  """Wall and CPU seconds of each call per round, in rotated order."""
  for call in calls.values():
    jax.block_until_ready(call())
  wall = {n: [] for n in calls}
  cpu = {n: [] for n in calls}
  names = list(calls)
  for round_ in range(rounds):
    shift = round_ % len(names)
    for name in names[shift:] + names[:shift]:
      start, start_cpu = time.perf_counter(), time.process_time()
      jax.block_until_ready(calls[name]())
      cpu[name].append(time.process_time() - start_cpu)
      wall[name].append(time.perf_counter() - start)
  return {"wall": wall, "cpu": cpu}


def _ratio(times: dict[str, dict[str, list]], a: str, b: str, clock: str) -> float:
  return float(np.median(np.divide(times[clock][a], times[clock][b])))


def deterministic(quick: bool, rounds: int) -> dict[str, Any]:
  """`deterministic=True` ÷ plain at K = 8 for several rows per micro-batch."""
  import jaccum
  from benchmarks import models

  model = models.build("mlp", True)
  grad = jax.grad(model.loss)
  plain = jax.jit(jaccum.accumulate(grad, K))
  exact = jax.jit(jaccum.accumulate(grad, K, deterministic=True))
  rows = []
  for rows_per_micro in (64,) if quick else (16, 32, 64, 128, 256):
    batch = jax.tree.map(jnp.asarray, models.MODELS["mlp"].batch(K * rows_per_micro))
    times = _interleaved(
      {
        "plain": lambda b=batch: plain(model.params, b),
        "deterministic": lambda b=batch: exact(model.params, b),
      },
      rounds,
    )
    row = {
      "rows_per_microbatch": rows_per_micro,
      "plain_ms": float(np.median(times["wall"]["plain"]) * 1e3),
      "deterministic_ms": float(np.median(times["wall"]["deterministic"]) * 1e3),
      "ratio": _ratio(times, "deterministic", "plain", "wall"),
      "cpu_ratio": _ratio(times, "deterministic", "plain", "cpu"),
      # Each at its least interfered with: on a loaded machine the steadiest.
      "least_ratio": float(
        np.min(times["wall"]["deterministic"]) / np.min(times["wall"]["plain"])
      ),
    }
    rows.append(row)
    print(
      f"deterministic R={rows_per_micro}: {row['ratio']:.3f}x wall, "
      f"{row['cpu_ratio']:.3f}x CPU, {row['least_ratio']:.3f}x least "
      f"({row['plain_ms']:.2f} ms plain)",
      flush=True,
    )
  return {"rows": rows, "profile": exact_add_profile(rounds)}


def exact_add_profile(rounds: int) -> dict[str, float]:
  """µs per micro-step of an add into a 256 × 256 leaf (2^16 elements)."""
  from jaccum._core import exact

  steps = 32
  leaf = jnp.asarray(np.random.default_rng(0).standard_normal((256, 256)), jnp.float32)
  scales = jnp.asarray(np.linspace(1, 1.001, steps), jnp.float32)

  def loop(update, init):
    def run(g, scales):
      return jax.lax.scan(lambda c, s: (update(c, g * s), None), init(g), scales)[0]

    return jax.jit(run)

  calls = {
    "float add": loop(lambda c, x: c + x, jnp.zeros_like),
    "maximum": loop(
      lambda c, x: jnp.maximum(c, exact._largest(x)), lambda g: jnp.float32(0)
    ),
    "exact add": loop(exact.add, lambda g: exact.zeros(g.shape, g.dtype)),
  }
  calls = {name: lambda f=f: f(leaf, scales) for name, f in calls.items()}
  times = _interleaved(calls, rounds)
  # The least of the rounds: the add's own cost, with the least interference.
  return {n: float(np.min(t)) / steps * 1e6 for n, t in times["wall"].items()}


def _loop_body(compiled_text: str) -> collections.Counter:
  """The largest while body's instructions as (opcode, shape): a program's
  fingerprint that ignores names and the order of tuple elements."""
  bodies = re.split(r"\n(?=\S)", compiled_text)
  counted = []
  for body in bodies:
    found = collections.Counter()
    for line in body.splitlines()[1:]:
      match = re.match(r"\s*(?:ROOT )?%\S+ = (\S+) ([\w-]+)\(", line)
      if match and match.group(2) not in ("get-tuple-element", "tuple", "parameter"):
        found[(match.group(2), match.group(1))] += 1
    counted.append(found)
  return max(counted, key=lambda c: sum(c.values()))


def lm(quick: bool, rounds: int) -> list[dict[str, Any]]:
  """jaccum.accumulate ÷ optax.microbatch on the suite's LM, K = 4 and 8."""
  from optax import microbatching

  import jaccum
  from benchmarks import models

  model = models.build("lm", quick)
  value_and_grad = jax.value_and_grad(model.loss)
  size = jax.tree.leaves(model.batch)[0].shape[0]
  rows = []
  for num_microbatches in (4,) if quick else (4, 8):
    optax_step = lambda k=num_microbatches: jax.jit(
      microbatching.microbatch(
        value_and_grad,
        argnums=1,
        microbatch_size=size // k,
        accumulator=microbatching.AccumulationType.MEAN,
      )
    )
    steps = {
      "jaccum": jax.jit(jaccum.accumulate(value_and_grad, num_microbatches)),
      "optax.microbatch": optax_step(),
      # The same program compiled again: what the method reads between two
      # equal steps, the floor under the ratio above.
      "optax.microbatch again": optax_step(),
    }
    bodies = {
      name: _loop_body(step.lower(model.params, model.batch).compile().as_text())
      for name, step in steps.items()
    }
    times = _interleaved(
      {n: lambda s=s: s(model.params, model.batch) for n, s in steps.items()}, rounds
    )
    row = {
      "K": num_microbatches,
      "ms": {n: float(np.median(t) * 1e3) for n, t in times["wall"].items()},
      "ratio": _ratio(times, "jaccum", "optax.microbatch", "wall"),
      "cpu_ratio": _ratio(times, "jaccum", "optax.microbatch", "cpu"),
      "floor": _ratio(times, "optax.microbatch again", "optax.microbatch", "wall"),
      "cpu_floor": _ratio(times, "optax.microbatch again", "optax.microbatch", "cpu"),
      "loop_instructions": sum(bodies["jaccum"].values()),
      "same_loop_body": bodies["jaccum"] == bodies["optax.microbatch"],
    }
    rows.append(row)
    print(
      f"lm K={num_microbatches}: jaccum / optax.microbatch {row['ratio']:.3f} wall, "
      f"{row['cpu_ratio']:.3f} CPU (optax ÷ itself {row['floor']:.3f}, "
      f"{row['cpu_floor']:.3f}); same loop body: {row['same_loop_body']}",
      flush=True,
    )
  return rows


def fit_plan(quick: bool, rounds: int) -> dict[str, Any]:
  """fit_plan's choice by the cost model alone on the plan part's LM, every
  point fitting, against the grid timed; and each point's page faults."""
  import jaccum
  from benchmarks import plan

  model = plan.lm(quick)
  cost_model = jaccum.CostModel.calibrate()
  grid = plan.measure_grid(model, cost_model, rounds)
  for row in grid:
    step = jax.jit(
      jaccum.accumulate(
        model.make_grad_fn(plan.remat(row["remat"])), row["num_microbatches"]
      )
    )
    jax.block_until_ready(step(*model.args))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(step(*model.args))
    row["page_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    row.pop("step_s_rounds")
  budget = max(row["peak_bytes"] for row in grid)
  # With the calibrated model, and with nothing said (CostModel.default()).
  chosen, default = (
    jaccum.fit_plan(
      model.make_grad_fn,
      *model.args,
      memory_budget=budget,
      candidates=model.candidates,
      policies=model.policies,
      cost_model=model_,
    )
    for model_ in (cost_model, None)
  )
  at = {(r["num_microbatches"], r["remat"]): r for r in grid}
  best = min(grid, key=lambda r: r["step_s"])
  result = {
    "grid": grid,
    "cost_model": cost_model._asdict(),
    "best": [best["num_microbatches"], best["remat"]],
  }
  for name, plan_ in (("", chosen), ("default_", default)):
    picked = at[(plan_.num_microbatches, plan_.remat)]
    result[f"{name}chosen"] = [plan_.num_microbatches, plan_.remat]
    result[f"{name}ratio"] = picked["step_s"] / best["step_s"]
    print(
      f"fit_plan lm generous ({name or 'calibrated'}): K={plan_.num_microbatches} "
      f"{plan_.remat} {result[f'{name}ratio']:.2f}x the grid's best",
      flush=True,
    )
  result["default_cost_model"] = jaccum.CostModel.default()._asdict()
  return result


def run(quick: bool, rounds: int | None = None) -> dict[str, Any]:
  """The timed items, in this process (one device, like the sweep's)."""
  rounds = rounds or (5 if quick else 40)
  return {
    "K": K,
    "rounds": rounds,
    "goals": GOALS,
    # Its steps take milliseconds: many rounds cost little and steady it.
    "deterministic": deterministic(quick, rounds if quick else 5 * rounds),
    "lm": lm(quick, rounds),
    "fit_plan": fit_plan(quick, 3 if quick else 8),
  }


def fsdp(quick: bool) -> list[dict[str, Any]]:
  """Temporaries per device: gather_once, shard_all, ZeRO-3 by hand."""
  import jaccum
  import jaccum.inspect

  mesh = jax.make_mesh(
    (NUM_DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  width, rows_per_micro, num_microbatches = (256, 16, 4) if quick else (1024, 64, 4)
  specs = {"stack": jax.P(None, None, "data"), "head": jax.P("data")}
  shapes = {"stack": (8, width, width), "head": (width, 8)}
  params = {
    k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=jax.NamedSharding(mesh, specs[k]))
    for k, s in shapes.items()
  }
  x = jax.ShapeDtypeStruct(
    (NUM_DEVICES * num_microbatches * rows_per_micro, width),
    jnp.float32,
    sharding=jax.NamedSharding(mesh, jax.P("data")),
  )

  def layer(h, w):
    return jnp.tanh(h @ w)

  result = []
  for remat in (False, True):

    def loss(params, x, remat=remat):
      block = lambda h, w: (layer(h, w), None)
      block = jax.checkpoint(block) if remat else block
      h, _ = jax.lax.scan(block, x, params["stack"])
      return jnp.mean((h @ params["head"]) ** 2)

    temps = {}
    for mode in ("gather_once", "shard_all"):
      step = jaccum.data_parallel(
        jax.grad(loss), num_microbatches, mesh=mesh, param_specs=specs, fsdp_mode=mode
      )
      temps[mode] = jaccum.inspect.memory(jax.jit(step), params, x).temp_bytes
    hand = _zero3_by_hand(layer, mesh, specs, remat, num_microbatches)
    temps["zero3 by hand"] = jaccum.inspect.memory(hand, params, x).temp_bytes
    row = {
      "width": width,
      "rows_per_microbatch": rows_per_micro,
      "remat": remat,
      "temp_bytes": temps,
      "ratio": temps["shard_all"] / temps["gather_once"],
    }
    result.append(row)
    print(
      f"fsdp remat={remat}: "
      + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in temps.items())
      + f"; shard_all / gather_once {row['ratio']:.3f}",
      flush=True,
    )
  return result


def _zero3_by_hand(layer, mesh, specs, remat, num_microbatches):
  def per_device(params, x):
    def local_loss(params, rows):
      def block(h, shard):
        return layer(h, jax.lax.all_gather(shard, "data", axis=1, tiled=True)), None

      block = jax.checkpoint(block) if remat else block
      h, _ = jax.lax.scan(block, rows, params["stack"])
      head = jax.lax.all_gather(params["head"], "data", axis=0, tiled=True)
      return jnp.mean((h @ head) ** 2) / NUM_DEVICES

    def micro(acc, rows):
      grads = jax.grad(local_loss)(params, rows)
      return jax.tree.map(lambda a, g: a + g / num_microbatches, acc, grads), None

    rows = x.reshape(num_microbatches, -1, x.shape[-1])
    return jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), rows)[0]

  in_specs = (specs, jax.P("data"))
  return jax.jit(
    jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=specs)
  )


def section(record: dict[str, Any]) -> str:
  """The part's tables, from its record."""
  from benchmarks.report import markdown_table

  goals = record["goals"]
  det = record["deterministic"]
  parts = [
    "## Overheads side by side (issue 39)\n",
    f"**deterministic=True ÷ plain**, digits MLP 64-256-256-10, K = {record['K']}, "
    f"median of the interleaved rounds' ratios and the ratio of each's least (goal ≤ "
    f"{goals['deterministic']} at 64 rows per micro-batch):\n",
    markdown_table(
      [
        "rows per micro-batch",
        "plain ms",
        "deterministic ms",
        "÷ (wall)",
        "÷ (CPU)",
        "÷ (least of each)",
      ],
      [
        [
          r["rows_per_microbatch"],
          f"{r['plain_ms']:.2f}",
          f"{r['deterministic_ms']:.2f}",
          f"{r['ratio']:.3f}",
          f"{r['cpu_ratio']:.3f}",
          f"{r['least_ratio']:.3f}",
        ]
        for r in det["rows"]
      ],
    ),
    "\nAn add into a 2^16-element leaf, µs per micro-step (least of the rounds): "
    + ", ".join(f"{k} {v:.1f}" for k, v in det["profile"].items())
    + ".\n",
    "**LM: jaccum ÷ optax.microbatch** (goal ≤ 1.0):\n",
    markdown_table(
      [
        "K",
        "jaccum ms",
        "optax.microbatch ms",
        "÷ (wall)",
        "÷ (CPU)",
        "optax ÷ itself (wall, CPU)",
        "same loop",
      ],
      [
        [
          r["K"],
          f"{r['ms']['jaccum']:.1f}",
          f"{r['ms']['optax.microbatch']:.1f}",
          f"{r['ratio']:.3f}",
          f"{r['cpu_ratio']:.3f}",
          f"{r['floor']:.3f}, {r['cpu_floor']:.3f}",
          f"{'yes' if r['same_loop_body'] else 'no'} ({r['loop_instructions']})",
        ]
        for r in record["lm"]
      ],
    ),
  ]
  plan = record["fit_plan"]
  default = ""
  if "default_chosen" in plan:
    default = (
      f"; with `CostModel.default()` (no `calibrate=True`): "
      f"K={plan['default_chosen'][0]} {plan['default_chosen'][1] or 'no remat'}, "
      f"{plan['default_ratio']:.2f}×"
    )
  parts += [
    f"\n**fit_plan by the cost model alone**, the plan part's LM, every point "
    f"fitting, with `calibrate=True`: K={plan['chosen'][0]} "
    f"{plan['chosen'][1] or 'no remat'}, {plan['ratio']:.2f}× the grid's best "
    f"(K={plan['best'][0]} {plan['best'][1] or 'no remat'}; goal ≤ "
    f"{goals['fit_plan']}){default}. Predictions are the calibrated model's:\n",
    markdown_table(
      ["K", "remat", "temp MiB", "page faults / step", "predicted ms", "measured ms"],
      [
        [
          r["num_microbatches"],
          r["remat"] or "no remat",
          f"{r['temp_bytes'] / 2**20:.1f}",
          r["page_faults"],
          f"{r['predicted_s'] * 1e3:.1f}",
          f"{r['step_s'] * 1e3:.1f}",
        ]
        for r in plan["grid"]
      ],
    ),
  ]
  if "fsdp" in record:
    parts += [
      f"\n**FSDP temporaries per device**, {NUM_DEVICES} simulated devices, "
      f"8 layers of width² float32 in a lax.scan, K = 4 (goal: shard_all ≤ "
      f"{goals['fsdp']} × gather_once):\n",
      markdown_table(
        ["width", "rows", "remat", "gather_once", "shard_all", "ZeRO-3 by hand", "÷"],
        [
          [
            r["width"],
            r["rows_per_microbatch"],
            "yes" if r["remat"] else "no",
            *(
              f"{r['temp_bytes'][k] / 2**20:.2f} MiB"
              for k in ("gather_once", "shard_all", "zero3 by hand")
            ),
            f"{r['ratio']:.3f}",
          ]
          for r in record["fsdp"]
        ],
      ),
    ]
  return "\n".join(parts)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes")
  parser.add_argument("--out", type=pathlib.Path, required=True, help="JSON path")
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(fsdp(args.quick), indent=2) + "\n")


if __name__ == "__main__":
  main()

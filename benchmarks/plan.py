"""Benchmark: `jaccum.fit_plan`'s choice against every point of its grid, timed.

`fit_plan` picks K and a rematerialisation policy from a memory budget
without running anything: it compiles some points of the grid (policy × K)
and predicts each one's time with a `CostModel`. This part checks that choice
against the clock. For two models on one device,

* a stacked-layer MLP: 8 tanh layers of width 256 in a `lax.scan` whose body
  is `remat(layer)`, a head, batch 1,024;
* a digits-sized CNN: (N, 8, 8, 1) inputs like scikit-learn's digits, two
  3×3 convolutions (16 and 32 channels), each `remat(conv)`, a dense head to
  10 classes, cross-entropy, batch 512;

it compiles and times every point of the grid: `fit_plan`'s default policies
× the K candidates, each the step `jax.jit(jaccum.accumulate(make_grad_fn(
remat), K))` on real arrays, checked against the plain gradient, then timed
in interleaved rounds (the median per point). Each point's compiled peak and
predicted time are `fit_plan`'s own figures (`fit_plan` on that one point
with an unbounded budget), all from one `CostModel.calibrate()`.

Then, for three budgets per model chosen from those peaks (a quarter of the
grid fits, half of it, all of it), `fit_plan`'s real search, and:

* the chosen plan's rank by measured time among the points that fit;
* its measured time ÷ the fastest fitting point's (goal: ≤ 1.05);
* its measured time ÷ that of the smallest K that fits with full remat
  (`nothing_saveable`), the usual hand-picked answer (goal: ≤ 0.85, 15%
  faster, wherever a lighter policy fits);
* how many points the search compiled, against the grid's size (goal: at
  most a third).

    python -m benchmarks.plan          # a few minutes on 2 busy CPU cores
    python -m benchmarks.plan --quick  # K = 1 and 8, 3 rounds, for CI

Writes `benchmarks/results/plan.json`, `plan.md` and `plan.png`
(`results/quick/` with `--quick`), or with `--out PATH` only the record, as
JSON. The suite's `plan` part (`python -m benchmarks --parts plan`) calls
`run` in the suite's process: it needs one device, no simulated ones.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaccum

# fit_plan's default policies, lightest first; the last is full remat.
POLICIES = inspect.signature(jaccum.fit_plan).parameters["policies"].default
FULL_REMAT = "nothing_saveable"
# Budgets from the grid's compiled peaks: the share of the grid that fits.
BUDGET_SHARES = {"tight": 0.25, "middle": 0.5, "generous": 1.0}
GOAL_VS_BEST = 1.05
GOAL_VS_FULL_REMAT = 0.85
TOLERANCE = 1e-4  # Every point's gradient against the plain one's, relative.


class Model(NamedTuple):
  """A model as `fit_plan` takes it: `make_grad_fn(remat)` and its arguments."""

  name: str
  description: str
  make_grad_fn: Callable[[Any], Callable[..., Any]]
  args: tuple[Any, ...]
  candidates: tuple[int, ...]


def mlp(quick: bool) -> Model:
  """The stacked-layer MLP: the layers in a `lax.scan` of `remat(layer)`."""
  layers, width, batch = 8, 256, 1024
  rng = np.random.default_rng(0)
  params = {
    "stack": jnp.asarray(
      rng.normal(size=(layers, width, width)) / np.sqrt(width), jnp.float32
    ),
    "head": jnp.asarray(rng.normal(size=(width, 10)) / np.sqrt(width), jnp.float32),
  }
  x = jnp.asarray(rng.normal(size=(batch, width)), jnp.float32)

  def make_grad_fn(remat):
    def layer(h, w):
      return jnp.tanh(h @ w), None

    def loss(params, x):
      # The policy on the scan body: each layer keeps what it allows.
      h, _ = jax.lax.scan(remat(layer), x, params["stack"])
      return jnp.mean((h @ params["head"]) ** 2)

    return jax.value_and_grad(loss)

  return Model(
    "mlp",
    f"MLP, {layers} tanh layers of width {width} in a remat'd lax.scan",
    make_grad_fn,
    (params, x),
    (1, 8) if quick else (1, 2, 4, 8, 16),
  )


def cnn(quick: bool) -> Model:
  """The digits-sized CNN: two convolutions, each `remat(conv)`, a dense head."""
  batch, classes = 512, 10
  rng = np.random.default_rng(0)

  def normal(*shape):
    fan_in = int(np.prod(shape[:-1]))
    return jnp.asarray(rng.normal(size=shape) / np.sqrt(fan_in), jnp.float32)

  params = {
    "conv1": normal(3, 3, 1, 16),
    "bias1": jnp.zeros((16,), jnp.float32),
    "conv2": normal(3, 3, 16, 32),
    "bias2": jnp.zeros((32,), jnp.float32),
    "head": normal(8 * 8 * 32, classes),
  }
  images = jnp.asarray(rng.uniform(0, 16, size=(batch, 8, 8, 1)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, classes, size=(batch,)), jnp.int32)

  def conv(h, kernel, bias):
    out = jax.lax.conv_general_dilated(
      h, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jax.nn.relu(out + bias)

  def make_grad_fn(remat):
    conv1, conv2 = remat(conv), remat(conv)

    def loss(params, batch):
      images, labels = batch
      h = conv1(images / 16.0, params["conv1"], params["bias1"])
      h = conv2(h, params["conv2"], params["bias2"])
      logits = h.reshape(h.shape[0], -1) @ params["head"]
      picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
      return jnp.mean(jax.nn.logsumexp(logits, axis=1) - picked)

    return jax.value_and_grad(loss)

  return Model(
    "cnn",
    "digits-sized CNN, (N, 8, 8, 1), two remat'd 3×3 convolutions (16, 32 "
    "channels), a dense head",
    make_grad_fn,
    (params, (images, labels)),
    (1, 8) if quick else (1, 2, 4, 8, 16),
  )


def remat(policy: str | None) -> jaccum.Remat:
  """The `Remat` fit_plan hands `make_grad_fn` for a policy's name."""
  if policy is None:
    return jaccum.Remat(None, None)
  return jaccum.Remat(policy, getattr(jax.checkpoint_policies, policy))


def _key(policy: str | None, k: int) -> str:
  return f"K={k} {policy or 'no remat'}"


def measure_grid(model: Model, cost_model: Any, rounds: int) -> list[dict[str, Any]]:
  """Every grid point's compiled figures, prediction and measured time."""
  from benchmarks import _measure

  plain = jax.jit(model.make_grad_fn(remat(None)))
  reference = jax.device_get(plain(*model.args))
  grid = [(policy, k) for policy in POLICIES for k in model.candidates]
  steps = {
    point: jax.jit(jaccum.accumulate(model.make_grad_fn(remat(point[0])), point[1]))
    for point in grid
  }
  rows, calls = [], {}
  # The steps to time compile in a second thread (into JAX's cache, for the
  # calls below) while this one runs fit_plan point by point: both cores.
  with futures.ThreadPoolExecutor(1) as pool:
    compiled = [
      pool.submit(lambda s=steps[p]: s.lower(*model.args).compile()) for p in grid
    ]
    for (policy, k), done in zip(grid, compiled, strict=True):
      # fit_plan on this point alone, with a budget nothing exceeds: its
      # figures are those the real search sees when it compiles the point.
      single = jaccum.fit_plan(
        model.make_grad_fn,
        *model.args,
        memory_budget=1 << 50,
        candidates=[k],
        policies=[policy],
        cost_model=cost_model,
      )
      point = single.tried[(k, policy, None)]
      done.result()
      step = steps[(policy, k)]
      error = _measure.relative_difference(jax.device_get(step(*model.args)), reference)
      assert error < TOLERANCE, (model.name, policy, k, error)
      calls[_key(policy, k)] = lambda step=step: step(*model.args)
      rows.append(
        {
          "num_microbatches": k,
          "remat": policy,
          "peak_bytes": point.peak_bytes,
          "temp_bytes": point.stats.temp_bytes,
          "flops": point.flops,
          "bytes_accessed": point.bytes_accessed,
          "predicted_s": point.predicted_seconds,
          "max_rel_error": error,
        }
      )
  # The check above ran each step once: that was its warm-up.
  times = _measure.interleaved(calls, rounds, warmup=0)
  for row in rows:
    seconds = times[_key(row["remat"], row["num_microbatches"])]
    row["step_s"] = float(np.median(seconds))
    row["step_s_rounds"] = seconds.tolist()
    print(
      f"{model.name} {_key(row['remat'], row['num_microbatches']):<40}"
      f" peak {row['peak_bytes'] / 2**20:7.2f} MiB"
      f" predicted {row['predicted_s'] * 1e3:7.2f} ms"
      f" measured {row['step_s'] * 1e3:7.2f} ms",
      flush=True,
    )
  return rows


def budgets(rows: list[dict[str, Any]]) -> dict[str, int]:
  """Budgets at the grid's peaks, each letting a share of the points fit.

  A budget equal to a point's peak lets that point fit (`peak <= budget`),
  so the tight one admits the quarter of the grid with the least memory,
  which is full remat and the larger K, and the generous one every point.
  """
  peaks = sorted(row["peak_bytes"] for row in rows)
  return {
    name: peaks[max(0, round(share * len(peaks)) - 1)]
    for name, share in BUDGET_SHARES.items()
  }


def _paired(a: dict[str, Any], b: dict[str, Any]) -> float:
  """The median over rounds of a's time / b's in the same round."""
  return float(np.median(np.divide(a["step_s_rounds"], b["step_s_rounds"])))


def evaluate(
  model: Model, rows: list[dict[str, Any]], budget: int, cost_model: Any
) -> dict[str, Any]:
  """`fit_plan`'s search at `budget`, and where its choice ranks when timed."""
  start = time.perf_counter()
  plan = jaccum.fit_plan(
    model.make_grad_fn,
    *model.args,
    memory_budget=budget,
    candidates=model.candidates,
    cost_model=cost_model,
  )
  search_s = time.perf_counter() - start
  at = {(r["num_microbatches"], r["remat"]): r for r in rows}
  chosen = at[(plan.num_microbatches, plan.remat)]
  fitting = sorted(
    (r for r in rows if r["peak_bytes"] <= budget), key=lambda r: r["step_s"]
  )
  best = fitting[0]
  # The plan the cost model would pick with every point compiled: the
  # search should find it (or one within the model's tie margin).
  model_best = min(fitting, key=lambda r: r["predicted_s"])
  full = [r for r in fitting if r["remat"] == FULL_REMAT]
  baseline = min(full, key=lambda r: r["num_microbatches"]) if full else None
  point = lambda r: None if r is None else [r["num_microbatches"], r["remat"]]
  return {
    "budget_bytes": budget,
    "num_fitting": len(fitting),
    "chosen": point(chosen),
    "chosen_peak_bytes": plan.peak_bytes,
    "chosen_predicted_s": plan.predicted_seconds,
    "chosen_step_s": chosen["step_s"],
    "rank": fitting.index(chosen) + 1,
    "best": point(best),
    "vs_best": chosen["step_s"] / best["step_s"],
    "vs_best_paired": _paired(chosen, best),
    "model_best": point(model_best),
    # Within the model's tie margin of the best it predicts for the grid.
    "model_best_found": chosen["predicted_s"]
    <= model_best["predicted_s"] * (1 + jaccum._plan.TIE),
    # The search's compile of the chosen point agrees with the grid's.
    "peak_agrees": plan.peak_bytes == chosen["peak_bytes"],
    "full_remat_smallest_k": point(baseline),
    "vs_full_remat": None
    if baseline is None
    else chosen["step_s"] / baseline["step_s"],
    "vs_full_remat_paired": None if baseline is None else _paired(chosen, baseline),
    "lighter_policy_fits": any(r["remat"] != FULL_REMAT for r in fitting),
    "compiled": len(plan.tried),
    "compiled_points": [[k, remat] for k, remat, _ in plan.tried],
    "grid_size": plan.grid_size,
    "search_s": search_s,
  }


def _spearman(a: list[float], b: list[float]) -> float:
  """Rank correlation of two lists (ties are broken by position)."""
  ranks = lambda v: np.argsort(np.argsort(v))
  return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def run(quick: bool, rounds: int | None = None) -> dict[str, Any]:
  """Measures both models' grids and evaluates the search at three budgets each."""
  rounds = rounds or (3 if quick else 30)
  start = time.perf_counter()
  cost_model = jaccum.CostModel.calibrate()
  print(f"calibrated in {time.perf_counter() - start:.1f} s: {cost_model}", flush=True)
  models = []
  for model in (mlp(quick), cnn(quick)):
    grid_start = time.perf_counter()
    rows = measure_grid(model, cost_model, rounds)
    grid_s = time.perf_counter() - grid_start
    searches, by_budget = {}, {}
    for name, budget in budgets(rows).items():
      # Equal budgets (equal peaks: remat that saves nothing) search once.
      if budget not in by_budget:
        by_budget[budget] = evaluate(model, rows, budget, cost_model)
      searches[name] = result = by_budget[budget]
      vs_full = result["vs_full_remat"]
      print(
        f"{model.name} {name} budget {budget / 2**20:.2f} MiB:"
        f" chosen K={result['chosen'][0]} {result['chosen'][1]},"
        f" rank {result['rank']} of {result['num_fitting']},"
        f" {result['vs_best']:.2f}× best,"
        f" {'–' if vs_full is None else f'{vs_full:.2f}'}× full remat,"
        f" compiled {result['compiled']} of {result['grid_size']}",
        flush=True,
      )
    models.append(
      {
        "name": model.name,
        "description": model.description,
        "batch_size": jax.tree.leaves(model.args[1])[0].shape[0],
        "candidates": list(model.candidates),
        "policies": list(POLICIES),
        "rows": rows,
        "budgets": searches,
        "grid_s": grid_s,
        "spearman": _spearman(
          [r["predicted_s"] for r in rows], [r["step_s"] for r in rows]
        ),
      }
    )
  return {
    "rounds": rounds,
    "cost_model": cost_model._asdict(),
    "tie": jaccum._plan.TIE,
    "goals": {"vs_best": GOAL_VS_BEST, "vs_full_remat": GOAL_VS_FULL_REMAT},
    "models": models,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="K = 1 and 8, 3 rounds")
  parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
  parser.add_argument("--out", type=pathlib.Path, help="write the record here only")
  args = parser.parse_args()
  load_before = os.getloadavg()[0]
  record = run(args.quick, args.rounds)
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return
  from benchmarks import _record, plots, report

  path, saved, table = _record.save_with_table(
    "plan", args.quick, load_before, record, report.plan_section
  )
  suite = {**saved, "parts": {"plan": saved}}
  written = plots.plot_plan(suite, path.parent)
  print(f"\n{table}\nsaved {path.with_suffix('.md')}, {', '.join(map(str, written))}")


if __name__ == "__main__":
  main()

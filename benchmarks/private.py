"""Benchmark: `jaccum.dp_value_and_grad` against plain accumulation and the vmap path.

On the suite's MLP and transformer LM (`benchmarks/models.py`), for K
micro-batches on one device, three steps over the same batch:

* plain: `jaccum.accumulate(jax.value_and_grad(mean loss), K)`, no privacy;
* private: `jaccum.dp_value_and_grad(per-example loss, K, ...)` with
  `norms="auto"` (ghost norms where the program allows);
* vmap: the same with `norms="vmap"`: every example's gradient formed, as
  jax_privacy's `clipped_grad` does.

For each: XLA's temporaries from the compiled step (`jaccum.inspect.memory`),
its floating-point operations (`cost_analysis`) and the step time, in
interleaved rounds, as paired ratios (private ÷ plain, private ÷ vmap).
The private and vmap steps are checked against each other first; the
record also says which params leaves took the ghost path.

Targets (issue 38): at K = 8, private ÷ plain ≤ 1.3× in time and
temporaries, private ÷ vmap ≤ 0.6× in time.

    python -m benchmarks.private          # K = 1, 4, 8, 16; minutes on 2 cores
    python -m benchmarks.private --quick  # the quick models, K = 8, for CI

Writes `benchmarks/results/private.json` and `private.md` (`results/quick/`
with `--quick`), or with `--out PATH` only the record, as JSON. The suite's
`private` part (`python -m benchmarks --parts private`) calls `run` in its
own process (one device).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import jaccum
import jaccum.inspect
from jaccum._core import clipping, ghost

GOAL_TIME = 1.3  # private ÷ plain
GOAL_VMAP = 0.6  # private ÷ vmap
GOAL_TEMP = 1.3  # private ÷ plain
TARGET_K = 8
TOLERANCE = 1e-4  # private against vmap, relative
MIB = 2**20


def per_example_loss(name: str, graphdef: Any):
  """The suite model's loss, one per example (the LM's: its tokens' mean)."""

  def loss(params, batch):
    model = nnx.merge(graphdef, params)
    if name == "lm":
      tokens = batch["tokens"]
      logits = model(tokens[:, :-1])
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
      return ce.mean(-1)
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

  return loss


def paths(loss: Any, params: Any, batch: Any) -> dict[str, str]:
  """Which params leaves take the ghost path, and which form per-example gradients."""
  names = [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  one = clipping.one_example(loss, clipping.Layout((1,), None), [params, batch], {})
  return ghost.trace(one, params, (batch,), None)[1].describe(names)


def steps(model: Any, k: int) -> dict[str, Any]:
  loss = per_example_loss(model.name, model.graphdef)
  private = dict(l2_clip_norm=1.0, noise_multiplier=1.0)
  return {
    f"plain K={k}": jax.jit(jaccum.accumulate(jax.value_and_grad(model.loss), k)),
    f"private K={k}": jax.jit(jaccum.dp_value_and_grad(loss, k, **private)),
    f"vmap K={k}": jax.jit(jaccum.dp_value_and_grad(loss, k, norms="vmap", **private)),
  }


def measure_model(name: str, quick: bool, ks: tuple[int, ...], rounds: int):
  from benchmarks import _measure, models

  model = models.build(name, quick)
  key = jax.random.key(0)
  jitted: dict[str, Any] = {}
  for k in ks:
    jitted |= steps(model, k)
  args = (model.params, model.batch)
  kwargs = lambda n: {} if n.startswith("plain") else {"noise_key": key}
  calls = {n: (lambda n=n, s=s: s(*args, **kwargs(n))) for n, s in jitted.items()}
  rows: dict[str, dict[str, Any]] = {}
  for k in ks:
    ours = jax.device_get(calls[f"private K={k}"]())
    theirs = jax.device_get(calls[f"vmap K={k}"]())
    error = _measure.relative_difference(ours, theirs)
    assert error < TOLERANCE, (name, k, error)
    for n in (f"plain K={k}", f"private K={k}", f"vmap K={k}"):
      temp = jaccum.inspect.memory(jitted[n], *args, **kwargs(n)).temp_bytes
      compiled = jitted[n].lower(*args, **kwargs(n)).compile()
      rows[n] = {"temp_bytes": temp, "flops": float(compiled.cost_analysis()["flops"])}
    rows[f"private K={k}"]["max_rel_error_vs_vmap"] = error
    print(f"{name} K={k}: compiled, private against vmap {error:.1e}", flush=True)
  times = _measure.interleaved(calls, rounds)
  for k in ks:
    plain, ours, theirs = (f"{m} K={k}" for m in ("plain", "private", "vmap"))
    for n in (plain, ours, theirs):
      rows[n]["step_s"] = float(np.median(times[n]))
      rows[n]["step_s_rounds"] = times[n].tolist()
    rows[ours]["time_vs_plain"] = _measure.paired_ratio(times, ours, plain)
    rows[ours]["time_vs_vmap"] = _measure.paired_ratio(times, ours, theirs)
    rows[theirs]["time_vs_plain"] = _measure.paired_ratio(times, theirs, plain)
    for n in (ours, theirs):
      rows[n]["temp_vs_plain"] = rows[n]["temp_bytes"] / rows[plain]["temp_bytes"]
      rows[n]["flops_vs_plain"] = rows[n]["flops"] / rows[plain]["flops"]
    print(
      f"{name} K={k}: private {rows[ours]['step_s'] * 1e3:.1f} ms "
      f"({rows[ours]['time_vs_plain']:.2f}× plain, {rows[ours]['time_vs_vmap']:.2f}× "
      f"vmap), temporaries {rows[ours]['temp_vs_plain']:.2f}× plain",
      flush=True,
    )
  return {
    "description": models.MODELS[name].description,
    "batch_size": int(jax.tree.leaves(model.batch)[0].shape[0]),
    "paths": paths(per_example_loss(name, model.graphdef), model.params, model.batch),
    "rows": rows,
  }


def run(quick: bool, rounds: int | None = None) -> dict[str, Any]:
  ks = (TARGET_K,) if quick else (1, 4, TARGET_K, 16)
  rounds = rounds or (2 if quick else 10)
  return {
    "ks": list(ks),
    "rounds": rounds,
    "goals": {
      "time_vs_plain": GOAL_TIME,
      "time_vs_vmap": GOAL_VMAP,
      "temp_vs_plain": GOAL_TEMP,
      "k": TARGET_K,
    },
    "models": {name: measure_model(name, quick, ks, rounds) for name in ("mlp", "lm")},
  }


def section(record: dict[str, Any]) -> str:
  """The report's section: one table per model, the goals at K = 8, the paths."""
  from benchmarks.report import markdown_table

  goals, parts = record["goals"], []
  for result in record["models"].values():
    rows = result["rows"]

    def cell(n: str, what: str, rows=rows) -> str:
      if what == "flops_vs_plain":  # from the counts (records before it kept one)
        plain = rows[f"plain K={n.split('K=')[1]}"]
        return f"{rows[n]['flops'] / plain['flops']:.2f}×"
      return f"{rows[n][what]:.2f}×"

    table = markdown_table(
      [
        "K",
        "plain step, ms",
        "private step, ms",
        "vmap step, ms",
        "private ÷ plain",
        "private ÷ vmap",
        "temporaries: private ÷ plain",
        "vmap ÷ plain",
        "XLA flops: private ÷ plain",
        "vmap ÷ plain",
      ],
      [
        [
          k,
          f"{rows[f'plain K={k}']['step_s'] * 1e3:.1f}",
          f"{rows[f'private K={k}']['step_s'] * 1e3:.1f}",
          f"{rows[f'vmap K={k}']['step_s'] * 1e3:.1f}",
          cell(f"private K={k}", "time_vs_plain"),
          cell(f"private K={k}", "time_vs_vmap"),
          cell(f"private K={k}", "temp_vs_plain"),
          cell(f"vmap K={k}", "temp_vs_plain"),
          cell(f"private K={k}", "flops_vs_plain"),
          cell(f"vmap K={k}", "flops_vs_plain"),
        ]
        for k in record["ks"]
      ],
    )
    ghosts = sorted(p for p, how in result["paths"].items() if how.startswith("ghost"))
    others = sorted(
      p for p, how in result["paths"].items() if not how.startswith("ghost")
    )
    how = result["paths"]
    ghost_list = ", ".join(f"{p} ({how[p]})" for p in ghosts)
    parts += [
      f"**{result['description']}**, batch {result['batch_size']}:\n",
      table,
      "",
      f"Ghost path: {ghost_list}. "
      f"Per-example gradients: {', '.join(others) or 'none'}.\n",
    ]
  verdicts = []
  k = goals["k"]
  for name, result in record["models"].items():
    row = result["rows"].get(f"private K={k}")
    if row is None:
      continue
    said = {
      what: f"{row[what]:.2f}× {over} (goal ≤ {goals[what]:g}: "
      f"{'met' if row[what] <= goals[what] else 'not met'})"
      for what, over in (
        ("time_vs_plain", "plain"),
        ("time_vs_vmap", "vmap"),
        ("temp_vs_plain", "plain"),
      )
    }
    verdicts.append(
      f"{name} at K = {k}: step {said['time_vs_plain']}, {said['time_vs_vmap']}; "
      f"temporaries {said['temp_vs_plain']}."
    )
  return "\n".join(
    [
      "## Differential privacy: `dp_value_and_grad`\n",
      'Plain accumulation of the mean loss, the private step (`norms="auto"`, '
      'σ = 1, C = 1) and the per-example vmap path (`norms="vmap"`), at each '
      "K on one device: step time (median of "
      f"{record['rounds']} interleaved rounds; ratios are medians of per-round "
      "ratios), XLA's temporaries and its count of floating-point operations "
      "(`cost_analysis`). The private and vmap results were checked against "
      "each other first.\n",
      *parts,
      " ".join(verdicts),
    ]
  )


def main() -> None:
  from benchmarks import _record

  _record.standalone("private", __doc__, run, lambda: section, "quick models, K = 8")


if __name__ == "__main__":
  main()

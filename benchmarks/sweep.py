"""The sweep over K: every method of `methods` on every model of `models`.

For each model and number of micro-batches K (same effective batch N), each
method (those flat in K too, so that their first steps meet the same load as
the others') is built afresh and measured for

* time to first step: the wall time of its first step, from a fresh function
  (tracing, lowering, compiling every program it runs, the first run);
* compile time: XLA's backend compile time within that first step, summed
  over its programs (and eager ops compiled on first use);
* agreement: Adam's first moment after that step, (1 - b1) × the gradient it
  applied, against the whole batch's; it must agree to 1e-4 (relative to the
  largest entry) before any timing means anything;
* memory: "temp" is XLA's temporaries (`temp_size_in_bytes`, the largest
  over the method's programs); "working" adds what the step needs beyond its
  live inputs: outputs not written into donated inputs, and the buffers it
  holds between programs (a host loop's accumulator, a micro-batch sliced out
  of the batch, a MultiSteps accumulator);
* step time: the median over rounds in which every method takes one step, in
  rotated order; ratios are medians of per-round ratios.
"""

from __future__ import annotations

import time
from concurrent import futures as concurrent_futures
from typing import Any

import jax
import numpy as np
import optax

from benchmarks import _measure, methods, models

TOLERANCE = 1e-4


def first_step(method: methods.Method, batch: Any) -> tuple[Any, dict[str, float]]:
  """Builds a state and takes the first step, timing it and its compiles."""
  state = method.init()
  jax.block_until_ready(state)
  with _measure.compile_events() as events:
    start = time.perf_counter()
    state = jax.block_until_ready(method.step(state, batch))
    seconds = time.perf_counter() - start
  return state, {
    "first_step_s": seconds,
    "compile_s": events[_measure.BACKEND_COMPILE],
    "lower_s": events[_measure.LOWER],
  }


def memory(method: methods.Method, state: Any, batch: Any) -> dict[str, Any]:
  programs = [
    _measure.memory(jitted, *args) for jitted, args in method.programs(state, batch)
  ]
  held = method.held(state, batch)
  if any(p["temp"] is None for p in programs):
    return {"temp_bytes": None, "working_bytes": None, "held_bytes": held}
  working = max(p["temp"] + p["output"] - p["alias"] for p in programs) + held
  return {
    "temp_bytes": max(p["temp"] for p in programs),
    "working_bytes": working,
    "held_bytes": held,
    "programs": programs,
  }


def first_steps(
  built: dict[str, methods.Method], batch: Any, concurrent: bool
) -> dict[str, tuple[Any, dict[str, float]]]:
  """Every method's first step: one after another, or two at a time.

  Two at a time (`--quick`, where only the suite's running matters) keeps
  both cores busy compiling, so the times to first step of methods that ran
  side by side are not comparable.
  """
  if not concurrent:
    return {name: first_step(method, batch) for name, method in built.items()}
  with concurrent_futures.ThreadPoolExecutor(2) as pool:
    futures = {
      name: pool.submit(first_step, method, batch) for name, method in built.items()
    }
    return {name: future.result() for name, future in futures.items()}


def run_model(
  name: str,
  quick: bool,
  rounds: int,
  ks: tuple[int, ...] | None = None,
  method_names: tuple[str, ...] | None = None,
) -> dict[str, Any]:
  """Rows for one model, one per (K, method).

  `ks` and `method_names` default to the model's own (`models.Spec`).
  """
  spec = models.MODELS[name]
  model = models.build(name, quick)
  tx = optax.adam(1e-3)
  batch_size = jax.tree.leaves(model.batch)[0].shape[0]

  rows = []
  for num_microbatches in ks or (spec.quick_ks if quick else spec.ks):
    # Every method is built afresh at every K, those that do not depend on K
    # too: their first steps then meet the same load as the others'.
    wanted = method_names or (quick and spec.quick_methods) or tuple(methods.METHODS)
    built = {
      method_name: method
      for method_name, make in methods.METHODS.items()
      if method_name in wanted
      and (method := make(model, num_microbatches, tx)) is not None
    }
    firsts = first_steps(built, model.batch, quick)
    states = {method_name: state for method_name, (state, _) in firsts.items()}
    # A copy on the host: the whole batch's state is donated at its next step.
    reference = jax.tree.map(np.asarray, methods.adam_mu(states["whole"][1]))
    differences, memories = {}, {}
    for method_name, method in built.items():
      difference = _measure.relative_difference(
        methods.adam_mu(states[method_name][1]), reference
      )
      assert difference < TOLERANCE, (
        f"{name} K={num_microbatches}: {method_name}'s gradient differs from the "
        f"whole batch's by {difference:.2g} (relative)"
      )
      differences[method_name] = difference
      memories[method_name] = memory(method, states[method_name], model.batch)

    def call(method_name, built=built, states=states):
      def take_step():
        states[method_name] = built[method_name].step(states[method_name], model.batch)
        return states[method_name]

      return take_step

    # No warm-up: every method has taken its first step already.
    times = _measure.interleaved(
      {method_name: call(method_name) for method_name in built}, rounds, warmup=0
    )
    for method_name in built:
      row = {
        "model": name,
        "num_microbatches": num_microbatches,
        "batch_size": batch_size,
        "method": method_name,
        "step_s": float(np.median(times[method_name])),
        "step_s_min": float(np.min(times[method_name])),
        "step_s_rounds": times[method_name].tolist(),
        "step_vs_whole": _measure.paired_ratio(times, method_name, "whole"),
        "gradient_difference": differences[method_name],
        **firsts[method_name][1],
        **{k: v for k, v in memories[method_name].items() if k != "programs"},
      }
      rows.append(row)
    print(_line(rows[-len(built) :]), flush=True)
  return {
    "model": name,
    "description": spec.description,
    "batch_size": batch_size,
    "param_bytes": _measure.nbytes(model.params),
    "batch_bytes": _measure.nbytes(model.batch),
    "rows": rows,
  }


def _line(rows: list[dict[str, Any]]) -> str:
  head = f"{rows[0]['model']} K={rows[0]['num_microbatches']}:"
  return head + "".join(
    f"  {r['method']} {r['step_s'] * 1e3:.1f} ms ({r['step_vs_whole']:.2f}×)"
    for r in rows
  )


def run(quick: bool, rounds: int, model_names: list[str]) -> dict[str, Any]:
  return {
    "optimizer": "adam(1e-3), params and state donated",
    "rounds": rounds,
    "tolerance": TOLERANCE,
    "concurrent_first_steps": quick,
    "models": [run_model(name, quick, rounds) for name in model_names],
  }

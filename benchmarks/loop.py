"""Small micro-batches: what the accumulation loop costs per micro-batch, and why.

The quickstart's step (the digits MLP 64-256-256-10, a batch of 512 as 16
micro-batches of 32 rows, `value_and_grad` with the accuracy as aux) takes
longer accumulated than on the whole batch. This part splits that gap:

* **whole**: the whole batch in one program;
* **jaccum**: `jaccum.accumulate(grad_fn, K)`;
* **bare scan**: the simplest loop that does the same work, a `lax.scan` over
  the batch reshaped to `[K, N/K, ...]` whose carry is the summed output;
* **unrolled**: that scan with `unroll=True`, K copies of the micro-step in
  one program and no loop;
* **K × micro-step**: one micro-step jitted on its own, timed and multiplied
  by K (each call pays a dispatch, timed alone as **dispatch**);
* the fixed cost of one iteration, from jaccum and the bare scan over N
  micro-batches of one row (whose arithmetic is negligible), and from an
  **empty scan** of N iterations that only adds 1 to a carry shaped like the
  gradients;
* the loop bodies' HLO: the instructions of the while body by opcode. Each
  fusion, dot or copy there is one kernel launched per iteration;
* the quickstart's own comparison: its train step (gradients, then an Adam
  update; nothing donated) on the whole batch and accumulated.

Costs per micro-batch are medians over rounds of per-round differences,
divided by K. All variants agree with the whole batch before they are timed.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaccum
from benchmarks import _measure, models

BATCH_SIZE = 512
NUM_MICROBATCHES = 16


def loss_with_accuracy(model: models.Model):
  """The quickstart's loss: mean cross-entropy, with the accuracy as aux."""

  def loss(params, batch):
    from flax import nnx

    logits = nnx.merge(model.graphdef, params)(batch["x"])
    labels = batch["y"]
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return cross_entropy.mean(), {"accuracy": (logits.argmax(-1) == labels).mean()}

  return loss


def bare_scan(grad_fn, num_microbatches: int, unroll: int | bool = 1):
  """The simplest accumulation loop: contiguous micro-batches, a summed carry."""

  def accumulated(params, batch):
    micro = jax.tree.map(lambda x: x.reshape(num_microbatches, -1, *x.shape[1:]), batch)
    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, first))

    def body(total, microbatch):
      return jax.tree.map(jnp.add, total, grad_fn(params, microbatch)), None

    total, _ = jax.lax.scan(body, zeros, micro, unroll=unroll)
    return jax.tree.map(lambda x: x / num_microbatches, total)

  return accumulated


def empty_scan(num_iterations: int):
  """A loop that only adds 1 to a carry shaped like `params`: the loop alone."""

  def loop(params, batch):
    def body(carry, _):
      return jax.tree.map(lambda x: x + 1, carry), None

    carry, _ = jax.lax.scan(
      body, jax.tree.map(jnp.zeros_like, params), length=num_iterations
    )
    return carry

  return loop


def _computations(hlo: str) -> dict[str, list[str]]:
  computations, name = {}, None
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY\s+)?%?([^\s({]+).*\{\s*$", line)
    if header and not line.startswith("HloModule"):
      name = header.group(1)
      computations[name] = []
    elif line.startswith("}"):
      name = None
    elif name and re.match(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s*=", line):
      computations[name].append(line)
  return computations


# Instructions that move no data and launch nothing.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}


def loop_body_ops(jitted, *args) -> dict[str, int]:
  """Opcode counts of the (largest) while body in the optimised HLO."""
  computations = _computations(jitted.lower(*args).compile().as_text())
  bodies = [
    match.group(1)
    for lines in computations.values()
    for line in lines
    if (match := re.search(r" while\(.*body=%?([\w.\-]+)", line))
  ]
  if not bodies:
    return {}
  body = max(bodies, key=lambda name: len(computations[name]))
  counts = collections.Counter(
    re.search(r"\s([a-z][a-z0-9\-]*)\(", " " + line.split("=", 1)[1]).group(1)
    for line in computations[body]
  )
  counts = dict(sorted(counts.items()))
  counts["kernels"] = sum(n for op, n in counts.items() if op not in _FREE)
  return counts


def run(quick: bool, rounds: int) -> dict[str, Any]:
  model = models.build("mlp", quick=True)  # the quickstart's shapes, 512 rows
  params, batch = model.params, model.batch
  assert jax.tree.leaves(batch)[0].shape[0] == BATCH_SIZE
  grad_fn = jax.value_and_grad(loss_with_accuracy(model), has_aux=True)
  k, rows = NUM_MICROBATCHES, BATCH_SIZE // NUM_MICROBATCHES
  micro = jax.tree.map(lambda x: x[:rows], batch)

  steps = {
    "whole": jax.jit(grad_fn),
    "jaccum": jax.jit(jaccum.accumulate(grad_fn, k)),
    "bare scan": jax.jit(bare_scan(grad_fn, k)),
    "unrolled": jax.jit(bare_scan(grad_fn, k, unroll=True)),
    f"jaccum K={BATCH_SIZE}": jax.jit(jaccum.accumulate(grad_fn, BATCH_SIZE)),
    f"bare scan K={BATCH_SIZE}": jax.jit(bare_scan(grad_fn, BATCH_SIZE)),
    f"empty scan K={BATCH_SIZE}": jax.jit(empty_scan(BATCH_SIZE)),
  }
  micro_step = jax.jit(grad_fn)
  dispatch = jax.jit(lambda params, batch: params["layers"][0]["bias"])
  tx = optax.adam(1e-3)
  opt_state = tx.init(params)

  def train_step(grad_fn):
    @jax.jit
    def step(params, opt_state, batch):
      (loss, aux), grads = grad_fn(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss, aux

    return step

  train_steps = {
    "train step, whole": train_step(grad_fn),
    "train step, jaccum": train_step(jaccum.accumulate(grad_fn, k)),
  }

  if quick:
    _measure.precompile(
      [(step, (params, batch)) for step in steps.values()]
      + [(step, (params, opt_state, batch)) for step in train_steps.values()]
      + [(micro_step, (params, micro)), (dispatch, (params, micro))]
    )
  expected = steps["whole"](params, batch)
  for name, step in steps.items():
    if not name.startswith("empty"):
      difference = _measure.relative_difference(step(params, batch), expected)
      assert difference < 1e-4, f"{name} differs from the whole batch by {difference}"

  calls = {
    name: (lambda step=step: step(params, batch)) for name, step in steps.items()
  }
  for name, step in train_steps.items():
    calls[name] = lambda step=step: step(params, opt_state, batch)
  calls["micro-step"] = lambda: micro_step(params, micro)
  calls["dispatch"] = lambda: dispatch(params, micro)
  times = _measure.interleaved(calls, rounds, warmup=2)

  def per_microbatch_us(a, b, count):
    return float(np.median(times[a] - times[b])) / count * 1e6

  big = BATCH_SIZE
  findings = {
    "train_step_jaccum_vs_whole_ratio": _measure.paired_ratio(
      times, "train step, jaccum", "train step, whole"
    ),
    "jaccum_vs_whole_ratio": _measure.paired_ratio(times, "jaccum", "whole"),
    "bare_scan_vs_whole_ratio": _measure.paired_ratio(times, "bare scan", "whole"),
    "unrolled_vs_whole_ratio": _measure.paired_ratio(times, "unrolled", "whole"),
    "k_micro_steps_vs_whole_ratio": float(
      np.median(k * times["micro-step"] / times["whole"])
    ),
    # Per micro-batch, against the whole batch: the whole cost of accumulating.
    "jaccum_minus_whole_us": per_microbatch_us("jaccum", "whole", k),
    # What jaccum adds to the simplest loop doing the same work.
    "jaccum_minus_bare_scan_us": per_microbatch_us("jaccum", "bare scan", k),
    # What the loop costs over the same micro-steps in straight-line code.
    "bare_scan_minus_unrolled_us": per_microbatch_us("bare scan", "unrolled", k),
    # A micro-step of 32 rows run on its own, less one dispatch.
    "micro_step_alone_us": float(np.median(times["micro-step"] - times["dispatch"]))
    * 1e6,
    # Fixed cost of one iteration (1-row micro-batches: no arithmetic to speak of).
    "jaccum_per_iteration_us": float(np.median(times[f"jaccum K={big}"])) / big * 1e6,
    "bare_scan_per_iteration_us": float(np.median(times[f"bare scan K={big}"]))
    / big
    * 1e6,
    "empty_scan_per_iteration_us": float(np.median(times[f"empty scan K={big}"]))
    / big
    * 1e6,
  }
  hlo = {
    name: loop_body_ops(steps[name], params, batch) for name in ("jaccum", "bare scan")
  }
  hlo["jaccum return_stats"] = loop_body_ops(
    jax.jit(jaccum.accumulate(grad_fn, k, return_stats=True)), params, batch
  )
  return {
    "config": f"digits MLP 64-256-256-10, batch {BATCH_SIZE}, K={k} of {rows} rows",
    "rounds": rounds,
    "seconds": {name: float(np.median(t)) for name, t in times.items()},
    "seconds_min": {name: float(np.min(t)) for name, t in times.items()},
    "findings": findings,
    "loop_body_ops": hlo,
  }


def table(record: dict[str, Any]) -> str:
  lines = [f"{record['config']}; median of {record['rounds']} rounds"]
  for name, seconds in record["seconds"].items():
    lines.append(
      f"  {name:22} {seconds * 1e3:8.2f} ms"
      f"  (min {record['seconds_min'][name] * 1e3:.2f})"
    )
  for name, value in record["findings"].items():
    lines.append(f"  {name:34} {value:8.2f}")
  for name, ops in record["loop_body_ops"].items():
    lines.append(f"  loop body, {name}: {ops}")
  return "\n".join(lines)

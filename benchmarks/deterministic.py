"""`deterministic=True` against the plain step: time, accuracy and bytes on the wire.

For the suite's three models (`benchmarks/models.py`: the MLP, the CNN and
the LM), with K micro-batches:

* time: the plain accumulated step and the deterministic one on one device,
  side by side in interleaved rounds (`_measure.interleaved`), and the median
  of their per-round ratio;
* accuracy: the largest error of each against the whole batch's gradient in
  float64, relative to each leaf's largest entry (the same micro-batches:
  `split="contiguous"` for the plain step too);
* bytes on the wire: `data_parallel` on 8 simulated devices with 2
  micro-batches each, read by `jaccum.inspect.collectives` (per device, per
  step), and the collectives inside the loop (0 for both).

The time and the accuracy are measured in the suite's process, on its one
device (`run`); the bytes in a process of their own that holds 8 simulated
CPU devices (`main`, which the suite starts):

    python -m benchmarks.deterministic --out wire.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import numpy as np

NUM_DEVICES = 8


def _relative_error(actual, expected) -> float:
  """The largest |a - e| / max |e| over the leaves (each leaf its own scale)."""
  return max(
    float(np.max(np.abs(np.asarray(a, np.float64) - e)) / np.max(np.abs(e)))
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
  )


def _float64_gradient(model) -> dict:
  with jax.enable_x64(True):
    wide = lambda t: jax.tree.map(
      lambda x: np.asarray(x, np.float64) if x.dtype == np.float32 else x, t
    )
    grads = jax.jit(jax.grad(model.loss))(wide(model.params), wide(model.batch))
    return jax.tree.map(np.asarray, grads)


def _names(quick: bool) -> tuple[str, ...]:
  return ("mlp",) if quick else ("mlp", "cnn", "lm")


def model_row(name: str, quick: bool, rounds: int) -> dict:
  import jaccum
  from benchmarks import _measure, models

  model = models.build(name, quick)
  num_microbatches = 4 if quick else 8
  grad = jax.grad(model.loss)
  plain = jax.jit(jaccum.accumulate(grad, num_microbatches))
  exact = jax.jit(jaccum.accumulate(grad, num_microbatches, deterministic=True))
  same_order = jax.jit(jaccum.accumulate(grad, num_microbatches, split="contiguous"))
  expected = _float64_gradient(model)
  errors = {
    "plain": _relative_error(same_order(model.params, model.batch), expected),
    "deterministic": _relative_error(exact(model.params, model.batch), expected),
  }
  times = _measure.interleaved(
    {
      "plain": lambda: plain(model.params, model.batch),
      "deterministic": lambda: exact(model.params, model.batch),
    },
    rounds,
  )
  row = {
    "model": name,
    "K": num_microbatches,
    "params": int(sum(np.size(p) for p in jax.tree.leaves(model.params))),
    "ms": {k: float(np.median(v) * 1e3) for k, v in times.items()},
    "ratio": _measure.paired_ratio(times, "deterministic", "plain"),
    "error": errors,
  }
  print(
    f"{name}: {row['ms']['plain']:.1f} ms plain, {row['ms']['deterministic']:.1f} "
    f"ms deterministic ({row['ratio']:.3f}x); error {errors['plain']:.2e} plain, "
    f"{errors['deterministic']:.2e} deterministic",
    flush=True,
  )
  return row


def wire_row(name: str, quick: bool) -> dict:
  """Bytes per step per device, and collectives in the loop, on 8 devices."""
  import jaccum
  import jaccum.inspect
  from benchmarks import models

  model = models.build(name, quick)
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",), devices=jax.devices()[:NUM_DEVICES])
  wire = {}
  for variant, options in (("plain", {}), ("deterministic", {"deterministic": True})):
    step = jaccum.data_parallel(jax.grad(model.loss), 2, mesh=mesh, **options)
    counts = jaccum.inspect.collectives(jax.jit(step), model.params, model.batch)
    wire[variant] = {"bytes": counts.bytes_per_step, "in_loop": counts.inside_loops}
  print(
    f"{name}: {wire['plain']['bytes']:,} B plain, "
    f"{wire['deterministic']['bytes']:,} B deterministic on the wire",
    flush=True,
  )
  return wire


def run(quick: bool, rounds: int | None = None) -> dict:
  """Time and accuracy on this process's device (one, for the suite)."""
  rounds = rounds or (3 if quick else 30)
  return {
    "devices": NUM_DEVICES,
    "rounds": rounds,
    "rows": [model_row(name, quick, rounds) for name in _names(quick)],
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
  parser.add_argument("--out", type=pathlib.Path, required=True, help="JSON path")
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
  record = {name: wire_row(name, args.quick) for name in _names(args.quick)}
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
  main()

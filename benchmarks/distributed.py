"""Collectives and step time on 8 simulated CPU devices: naive jit + scan vs jaccum.

For K micro-batches per device it reports the compiled step's all-reduces
(inside the accumulation loop and outside it, from `jaccum.inspect.collectives`)
and the median step time of

* **naive jit+scan**: what users write first, a `lax.scan` over micro-batches
  under plain `jit` with the batch sharded over an auto `"data"` mesh axis;
  XLA places an all-reduce in the loop body, run once per micro-batch;
* **jaccum.data_parallel**: `shard_map` around the loop, one all-reduce after it;
* **jaccum.accumulate (explicit mesh)**: plain `accumulate` under `jit`, the
  batch sharded over an *explicit* `"data"` axis: it sees the sharding at trace
  time and takes the same per-device route.

The devices are simulated: `jax_num_cpu_devices=8` must be set before JAX
starts, so this part runs in its own process (`python -m benchmarks.distributed`,
which the suite starts as a subprocess and waits for, before the single-device
parts run), and the suite's other parts never see more than the default
devices. It uses the CPU backend's devices explicitly, so it runs the same on a
machine whose default backend is a GPU. Simulated devices share the machine's
cores: the times show the cost of the extra collectives' synchronisation, not
of a network; the counts are what a real cluster would pay.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax

ROWS_PER_MICROBATCH = 32  # per device
WIDTH = 256
NUM_DEVICES = 8


def loss(params, x):
  import jax.numpy as jnp

  for w in params[:-1]:
    x = jnp.tanh(x @ w)
  return jnp.mean((x @ params[-1]) ** 2)


def naive(num_microbatches):
  import jax.numpy as jnp

  def step(params, x):
    micro = jnp.swapaxes(x.reshape(-1, num_microbatches, WIDTH), 0, 1)

    def body(total, xs):
      return jax.tree.map(jnp.add, total, jax.grad(loss)(params, xs)), None

    total, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
    return jax.tree.map(lambda g: g / num_microbatches, total)

  return jax.jit(step)


def interleaved_ms(steps, args, rounds):
  """Median ms of each step, run in rotated order so load hits all alike."""
  for step, step_args in zip(steps.values(), args.values(), strict=True):
    jax.block_until_ready(step(*step_args))
  times = {name: [] for name in steps}
  names = list(steps)
  for round_ in range(rounds):
    shift = round_ % len(names)
    for name in names[shift:] + names[:shift]:
      start = time.perf_counter()
      jax.block_until_ready(steps[name](*args[name]))
      times[name].append(1e3 * (time.perf_counter() - start))
  return {name: statistics.median(t) for name, t in times.items()}


def run(quick: bool) -> dict:
  """Measures every K; needs `jax_num_cpu_devices` set to 8 before JAX started."""
  import numpy as np
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaccum
  import jaccum.inspect

  try:
    devices = jax.devices("cpu")[:NUM_DEVICES]
  except RuntimeError as e:  # JAX_PLATFORMS names no cpu
    print(f"skipped: no CPU backend ({e})")
    return {"skipped": f"no CPU backend: {e}"}
  assert len(devices) == NUM_DEVICES, (
    f"found {len(devices)} CPU devices: set jax_num_cpu_devices={NUM_DEVICES} "
    "before JAX starts (python -m benchmarks.distributed does)"
  )
  auto = jax.make_mesh(
    (NUM_DEVICES,), ("data",), axis_types=(AxisType.Auto,), devices=devices
  )
  explicit = jax.make_mesh(
    (NUM_DEVICES,), ("data",), axis_types=(AxisType.Explicit,), devices=devices
  )
  keys = jax.random.split(jax.random.key(0), 4)
  params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys[:3]]
  rows = []
  for num_microbatches in (2, 8) if quick else (2, 8, 32):
    batch = NUM_DEVICES * num_microbatches * ROWS_PER_MICROBATCH
    x = jax.random.normal(keys[3], (batch, WIDTH))
    on = lambda mesh, spec, tree: jax.device_put(tree, NamedSharding(mesh, spec))
    args = {
      "naive jit+scan": (on(auto, P(), params), on(auto, P("data"), x)),
      "jaccum.data_parallel": (on(auto, P(), params), on(auto, P("data"), x)),
      "jaccum.accumulate (explicit mesh)": (
        on(explicit, P(), params),
        on(explicit, P("data"), x),
      ),
    }
    steps = {
      "naive jit+scan": naive(num_microbatches),
      "jaccum.data_parallel": jax.jit(
        jaccum.data_parallel(jax.grad(loss), num_microbatches, mesh=auto)
      ),
      "jaccum.accumulate (explicit mesh)": jax.jit(
        jaccum.accumulate(jax.grad(loss), num_microbatches)
      ),
    }
    # The explicit-mesh step is traced, compiled and run under its mesh.
    mesh_of = {name: auto for name in steps}
    mesh_of["jaccum.accumulate (explicit mesh)"] = explicit
    with jax.set_mesh(auto):
      reference = jax.device_get(jax.grad(loss)(*args["naive jit+scan"]))
    counts, errors, calls = {}, {}, {}
    for name, step in steps.items():
      with jax.set_mesh(mesh_of[name]):
        error = max(
          float(np.abs(a - b).max())
          for a, b in zip(jax.device_get(step(*args[name])), reference, strict=True)
        )
        assert error < 1e-5, (name, error)
        errors[name] = error
        counts[name] = jaccum.inspect.collectives(step, *args[name])

      def call(*step_args, step=step, mesh=mesh_of[name]):
        with jax.set_mesh(mesh):
          return step(*step_args)

      calls[name] = call
    step_ms = interleaved_ms(calls, args, 6 if quick else 30)
    for name in steps:
      rows.append(
        {
          "K": num_microbatches,
          "approach": name,
          "all_reduce_in_loop": counts[name].all_reduce.inside_loops,
          "all_reduce_outside": counts[name].all_reduce.outside_loops,
          "collectives_in_loop": counts[name].inside_loops,
          "collectives_outside": counts[name].outside_loops,
          "step_ms": step_ms[name],
          "max_abs_error": errors[name],
        }
      )
      print(
        f"{num_microbatches:>3}  {name:<36}{rows[-1]['all_reduce_in_loop']:>8}"
        f"{rows[-1]['all_reduce_outside']:>9}{rows[-1]['step_ms']:>9.1f}",
        flush=True,
      )
  return {
    "devices": [str(d) for d in devices],
    "rows_per_microbatch_per_device": ROWS_PER_MICROBATCH,
    "model": f"MLP 3×{WIDTH}, tanh, mean squared output",
    "rows": rows,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="K ∈ {2, 8}, fewer rounds")
  parser.add_argument("--out", type=pathlib.Path, required=True, help="JSON path")
  args = parser.parse_args()
  # Before any JAX computation in this process, and only in this process.
  jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
  print(f"{'K':>3}  {'approach':<36}{'in loop':>8}{'outside':>9}{'step ms':>9}")
  record = run(args.quick)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
  main()

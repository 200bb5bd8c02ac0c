"""FSDP modes on 8 simulated CPU devices: memory per device, bytes on the wire, time.

For a stacked-layer MLP (L layers of width² float32 run by a remat'd
`lax.scan`, and a head), each `data_parallel(..., fsdp_mode=...)`:

* **gather_once**: params gathered once, a whole float32 accumulator, one
  reduce-scatter after the loop;
* **shard_grads** (ZeRO-2): a reduce-scatter per micro-batch into a sharded
  accumulator;
* **shard_all** (ZeRO-3): params stay sharded, each layer gathered where it
  is used, in the forward pass and again in the backward.

It reports, per device and from the compiled program (nothing estimated):
XLA's temporaries (`jaccum.inspect.memory`), the bytes its collectives move
per step (`jaccum.inspect.collectives`, loops counted by their trip counts),
and the median step time. Every mode is first checked against the
whole-batch gradient. The devices are simulated CPU devices sharing this
machine's cores, so the times show the cost of the extra collectives'
work, not of a network: label them CPU. Like `benchmarks.distributed`, it
runs in its own process (the suite starts it).

    python -m benchmarks.fsdp --out results.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax

NUM_DEVICES = 8
LAYERS = 8
ROWS_PER_MICROBATCH = 16  # per device
MODES = ("gather_once", "shard_grads", "shard_all")


def model(width: int, seed: int = 0):
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P

  rng = np.random.default_rng(seed)
  params = {
    "stack": jnp.asarray(
      rng.normal(size=(LAYERS, width, width)) / np.sqrt(width), jnp.float32
    ),
    "head": jnp.asarray(rng.normal(size=(width, 8)) / np.sqrt(width), jnp.float32),
  }

  def loss(params, x):
    def block(h, w):
      return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(jax.checkpoint(block), x, params["stack"])
    return jnp.mean((h @ params["head"]) ** 2)

  return params, loss, {"stack": P(None, None, "data"), "head": P("data")}


def interleaved_ms(calls, rounds):
  """Median ms of each call, run in rotated order so load hits all alike."""
  for call in calls.values():
    jax.block_until_ready(call())
  times = {name: [] for name in calls}
  names = list(calls)
  for round_ in range(rounds):
    shift = round_ % len(names)
    for name in names[shift:] + names[:shift]:
      start = time.perf_counter()
      jax.block_until_ready(calls[name]())
      times[name].append(1e3 * (time.perf_counter() - start))
  return {name: statistics.median(t) for name, t in times.items()}


def run(quick: bool) -> dict:
  """Measures every width and K; needs 8 CPU devices set before JAX started."""
  import numpy as np
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaccum
  import jaccum.inspect

  devices = jax.devices("cpu")[:NUM_DEVICES]
  assert len(devices) == NUM_DEVICES, (
    f"found {len(devices)} CPU devices: python -m benchmarks.fsdp sets "
    f"jax_num_cpu_devices={NUM_DEVICES} before JAX starts"
  )
  mesh = jax.make_mesh(
    (NUM_DEVICES,), ("data",), axis_types=(AxisType.Auto,), devices=devices
  )
  rows = []
  for width in (128, 256) if quick else (256, 512, 768):
    params, loss, specs = model(width)
    params_bytes = sum(v.nbytes for v in params.values())
    placed = {
      k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()
    }
    for num_microbatches in (2,) if quick else (2, 8):
      batch = NUM_DEVICES * num_microbatches * ROWS_PER_MICROBATCH
      x = np.random.default_rng(1).normal(size=(batch, width)).astype(np.float32)
      x_sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
      reference = jax.device_get(jax.jit(jax.grad(loss))(params, x))
      calls = {}
      for mode in MODES:
        step = jax.jit(
          jaccum.data_parallel(
            jax.grad(loss),
            num_microbatches,
            mesh=mesh,
            param_specs=specs,
            fsdp_mode=mode,
          )
        )
        grads = jax.device_get(step(placed, x_sharded))
        error = max(
          float(np.abs(grads[k] - reference[k]).max() / np.abs(reference[k]).max())
          for k in grads
        )
        assert error < 1e-4, (mode, width, num_microbatches, error)
        memory = jaccum.inspect.memory(step, placed, x_sharded)
        counts = jaccum.inspect.collectives(step, placed, x_sharded)
        rows.append(
          {
            "width": width,
            "params_bytes": params_bytes,
            "K": num_microbatches,
            "mode": mode,
            "temp_bytes": memory.temp_bytes,
            "bytes_per_step": counts.bytes_per_step,
            "collectives_in_loop": counts.inside_loops,
            "max_rel_error": error,
          }
        )
        calls[mode] = lambda step=step, p=placed, x=x_sharded: step(p, x)
      step_ms = interleaved_ms(calls, 3 if quick else 12)
      for row in rows[-len(MODES) :]:
        row["step_ms_cpu"] = step_ms[row["mode"]]
        print(
          f"width {width:>4} K {num_microbatches:>2} {row['mode']:<12}"
          f" params {params_bytes / 2**20:6.2f} MiB"
          f" temp {row['temp_bytes'] / 2**20:7.2f} MiB"
          f" wire {row['bytes_per_step'] / 2**20:7.2f} MiB/step"
          f" {row['step_ms_cpu']:7.1f} ms (CPU)",
          flush=True,
        )
  return {
    "devices": [str(d) for d in devices],
    "model": f"{LAYERS} layers of width² float32 in a remat'd lax.scan, a head",
    "rows_per_microbatch_per_device": ROWS_PER_MICROBATCH,
    "rows": rows,
    "mesh_3d": run_3d(quick),
  }


def run_3d(quick: bool) -> list[dict]:
  """Each mode on a data × fsdp × tensor mesh (2 × 2 × 2): FSDP over "fsdp",
  replicas over "data", each layer's output dimension over "tensor"."""
  import numpy as np
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaccum
  import jaccum.inspect

  mesh = jax.make_mesh(
    (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3
  )
  width, num_microbatches = (128, 2) if quick else (512, 4)
  params, loss, _ = model(width)
  specs = {"stack": P(None, "fsdp", "tensor"), "head": P("fsdp", None)}
  placed = {
    k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()
  }
  batch = NUM_DEVICES * num_microbatches * ROWS_PER_MICROBATCH
  x = np.random.default_rng(2).normal(size=(batch, width)).astype(np.float32)
  x_sharded = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
  reference = jax.device_get(jax.jit(jax.grad(loss))(params, x))
  rows = []
  for mode in MODES:
    step = jax.jit(
      jaccum.data_parallel(
        jax.grad(loss),
        num_microbatches,
        mesh=mesh,
        axis=("data", "fsdp"),
        param_specs=specs,
        fsdp_mode=mode,
      )
    )
    grads = jax.device_get(step(placed, x_sharded))
    error = max(
      float(np.abs(grads[k] - reference[k]).max() / np.abs(reference[k]).max())
      for k in grads
    )
    assert error < 1e-4, (mode, error)
    counts = jaccum.inspect.collectives(step, placed, x_sharded)
    by_axis = {
      "+".join(key) if isinstance(key, tuple) else str(key): (
        (count.bytes_inside_loops or 0) + count.bytes_outside_loops
      )
      for key, count in counts.by_axis.items()
    }
    row = {
      "mode": mode,
      "width": width,
      "K": num_microbatches,
      "params_bytes": sum(v.nbytes for v in params.values()),
      "temp_bytes": jaccum.inspect.memory(step, placed, x_sharded).temp_bytes,
      "bytes_per_step_by_axis": by_axis,
    }
    rows.append(row)
    print(
      f"data×fsdp×tensor {mode:<12} temp {row['temp_bytes'] / 2**20:7.2f} MiB "
      + " ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in by_axis.items()),
      flush=True,
    )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small widths, K=2")
  parser.add_argument("--out", type=pathlib.Path, required=True, help="JSON path")
  args = parser.parse_args()
  # Before any JAX computation in this process, and only in this process.
  jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
  record = run(args.quick)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
  main()

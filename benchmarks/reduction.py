"""The one reduction after the loop, per option, on 8 simulated CPU devices.

For `data_parallel` on an MLP of four 512x512 layers: the bytes the
reduction sends per step per device (from the program: XLA:CPU widens bf16
collectives to float32 when it compiles, so the bf16 row is read from the
program jaccum hands it, as a GPU or TPU would run it) and the median CPU step
time, for the exact float32 all-reduce, `overlap_reduction=True`,
`reduce_dtype=bfloat16` and `reduce_fn=jaccum.PowerSGD(rank)`. Then the
error `reduce_dtype=bfloat16` adds against float32, by K and devices: the
largest error relative to the largest entry of the mean of K x devices
gradients of 4,096 entries drawn from N(1, 1).

Simulated devices share the machine's cores: the times are CPU times, and
there is no network for an overlap to hide. It runs in its own process (the
suite starts it).

    python -m benchmarks.reduction --out results.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax

NUM_DEVICES = 8
WIDTH, LAYERS, K = 512, 4, 4


def _time(calls, rounds):
  for call in calls.values():
    jax.block_until_ready(call())
  times = {name: [] for name in calls}
  names = list(calls)
  for round_ in range(rounds):
    for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
      start = time.perf_counter()
      jax.block_until_ready(calls[name]())
      times[name].append(1e3 * (time.perf_counter() - start))
  return {name: statistics.median(t) for name, t in times.items()}


def options_table(quick: bool) -> list[dict]:
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaccum
  import jaccum.inspect

  mesh = jax.make_mesh(
    (NUM_DEVICES,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")
  )
  rng = np.random.default_rng(0)
  params = {
    f"w{i}": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32)
    for i in range(LAYERS)
  }
  x = rng.normal(size=(NUM_DEVICES * K * 8, WIDTH)).astype(np.float32)
  x = jax.device_put(x, NamedSharding(mesh, P("data")))

  def loss(p, x):
    for i in range(LAYERS):
      x = jnp.tanh(x @ p[f"w{i}"])
    return jnp.mean(x**2)

  exact = jax.grad(loss)(params, np.asarray(x))
  variants = {
    "float32 all-reduce": {},
    "overlap_reduction": {"overlap_reduction": True},
    "reduce_dtype=bfloat16": {"reduce_dtype": jnp.bfloat16},
    "PowerSGD rank 4": {"reduce_fn": jaccum.PowerSGD(rank=4)},
    "PowerSGD rank 16": {"reduce_fn": jaccum.PowerSGD(rank=16)},
  }
  rows, calls = [], {}
  for name, options in variants.items():
    step = jax.jit(jaccum.data_parallel(jax.grad(loss), K, mesh=mesh, **options))
    hook = options.get("reduce_fn")
    kwargs = {} if hook is None else {"reduce_state": hook.init(params, NUM_DEVICES)}
    lowered = step.lower(params, x, **kwargs)
    sent = jaccum.inspect._count_collectives(lowered.as_text(dialect="hlo"))
    out = step(params, x, **kwargs)
    grads = out if hook is None else out[0]
    error = max(
      float(np.max(np.abs(grads[k] - exact[k])) / np.max(np.abs(exact[k])))
      for k in exact
    )
    rows.append(
      {"option": name, "bytes_per_step": sent.bytes_per_step, "max_rel_error": error}
    )
    calls[name] = lambda step=step, kwargs=kwargs: step(params, x, **kwargs)
  times = _time(calls, 4 if quick else 20)
  for row in rows:
    row["step_ms_cpu"] = times[row["option"]]
    print(
      f"{row['option']:<24}{row['bytes_per_step']:>12,} B/step"
      f"{row['step_ms_cpu']:>9.1f} ms (CPU)  error {row['max_rel_error']:.1e}",
      flush=True,
    )
  return rows


def bf16_error_table(quick: bool) -> list[dict]:
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaccum

  rows = []
  size = 4096
  for devices in (2, 8) if quick else (2, 4, 8):
    mesh = jax.make_mesh(
      (devices,), ("data",), axis_types=(AxisType.Auto,),
      devices=jax.devices("cpu")[:devices],
    )  # fmt: skip
    for num_microbatches in (4, 64) if quick else (4, 16, 64, 256):
      g = np.random.default_rng(devices * 1000 + num_microbatches).normal(
        1.0, 1.0, size=(devices * num_microbatches, size)
      )
      sharded = jax.device_put(g.astype(np.float32), NamedSharding(mesh, P("data")))
      mean = {}
      for dtype in (None, jnp.bfloat16):
        step = jax.jit(
          jaccum.data_parallel(
            lambda w, g: g[0] + 0 * w,
            num_microbatches,
            mesh=mesh,
            reduce_dtype=dtype,
          )
        )
        mean[dtype] = np.asarray(step(jnp.zeros(size), sharded), np.float64)
      exact = g.mean(axis=0)
      scale = np.max(np.abs(exact))
      rows.append(
        {
          "devices": devices,
          "K": num_microbatches,
          "float32": float(np.max(np.abs(mean[None] - exact)) / scale),
          "bfloat16": float(np.max(np.abs(mean[jnp.bfloat16] - exact)) / scale),
        }
      )
      print(
        f"devices {devices} K {num_microbatches:>3}: float32 "
        f"{rows[-1]['float32']:.1e}, bfloat16 on the wire {rows[-1]['bfloat16']:.1e}",
        flush=True,
      )
  return rows


def run(quick: bool) -> dict:
  assert len(jax.devices("cpu")) >= NUM_DEVICES, "set 8 CPU devices before JAX starts"
  return {
    "devices": NUM_DEVICES,
    "model": f"MLP of {LAYERS} {WIDTH}x{WIDTH} float32 layers, K={K}",
    "options": options_table(quick),
    "bf16_error": bf16_error_table(quick),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer rounds and sizes")
  parser.add_argument("--out", type=pathlib.Path, required=True, help="JSON path")
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
  record = run(args.quick)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
  main()

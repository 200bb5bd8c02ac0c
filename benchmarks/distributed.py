"""Naive jit + scan vs `jaccum.data_parallel` on 8 simulated CPU devices.

For K ∈ {2, 8, 32} micro-batches per device it reports the compiled step's
all-reduces (inside the accumulation loop and outside it, from
`jaccum.inspect.collectives`) and the median step time. The naive step is what
users write first: a `lax.scan` over micro-batches under plain `jit` with the
batch sharded over a `"data"` mesh axis (auto axis types), where XLA places an
all-reduce in the loop body, once per micro-batch. Simulated CPU devices share
two cores, so the times show the cost of the extra collectives' synchronisation,
not of a network; the counts are what a real cluster would pay.

    python benchmarks/distributed.py           # ~2 minutes on 2 cores
    python benchmarks/distributed.py --quick
"""

import argparse
import os
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any JAX computation

import _record  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaccum  # noqa: E402
import jaccum.inspect  # noqa: E402

ROWS_PER_MICROBATCH = 32  # per device
WIDTH = 256


def loss(params, x):
  for w in params[:-1]:
    x = jnp.tanh(x @ w)
  return jnp.mean((x @ params[-1]) ** 2)


def naive(num_microbatches):
  def step(params, x):
    micro = jnp.swapaxes(x.reshape(-1, num_microbatches, WIDTH), 0, 1)

    def body(total, xs):
      return jax.tree.map(jnp.add, total, jax.grad(loss)(params, xs)), None

    total, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
    return jax.tree.map(lambda g: g / num_microbatches, total)

  return jax.jit(step)


def interleaved_ms(steps, args, rounds):
  """Median ms of each step, run in alternating order so load hits all alike."""
  for step in steps.values():
    jax.block_until_ready(step(*args))
  times = {name: [] for name in steps}
  for round_ in range(rounds):
    names = list(steps)[round_ % 2 :] + list(steps)[: round_ % 2]
    for name in names:
      start = time.perf_counter()
      jax.block_until_ready(steps[name](*args))
      times[name].append(1e3 * (time.perf_counter() - start))
  return {name: statistics.median(t) for name, t in times.items()}


def main(quick: bool) -> None:
  load_before = os.getloadavg()[0]
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  keys = jax.random.split(jax.random.key(0), 4)
  params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys[:3]]
  rows = []
  for num_microbatches in (2, 8) if quick else (2, 8, 32):
    batch = 8 * num_microbatches * ROWS_PER_MICROBATCH
    x = jax.random.normal(keys[3], (batch, WIDTH))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    steps = {
      "naive jit+scan": naive(num_microbatches),
      "jaccum.data_parallel": jax.jit(
        jaccum.data_parallel(jax.grad(loss), num_microbatches, mesh=mesh)
      ),
    }
    reference = steps["naive jit+scan"](params, x)
    step_ms = interleaved_ms(steps, (params, x), 6 if quick else 30)
    for name, step in steps.items():
      error = jax.tree.reduce(
        max,
        jax.tree.map(
          lambda a, b: float(jnp.abs(a - b).max()), step(params, x), reference
        ),
      )
      assert error < 1e-5, (name, error)
      counts = jaccum.inspect.collectives(step, params, x)
      rows.append(
        {
          "K": num_microbatches,
          "approach": name,
          "all_reduce_in_loop": counts.all_reduce.inside_loops,
          "all_reduce_outside": counts.all_reduce.outside_loops,
          "collectives_in_loop": counts.inside_loops,
          "collectives_outside": counts.outside_loops,
          "step_ms": step_ms[name],
        }
      )

  print(
    f"8 CPU devices, {ROWS_PER_MICROBATCH} rows per micro-batch per device, "
    f"MLP 3×{WIDTH}"
  )
  print(
    f"{'K':>3}  {'approach':<22}{'all-reduce in loop':>19}{'outside':>9}{'step ms':>9}"
  )
  for row in rows:
    print(
      f"{row['K']:>3}  {row['approach']:<22}{row['all_reduce_in_loop']:>19}"
      f"{row['all_reduce_outside']:>9}{row['step_ms']:>9.1f}"
    )
  name = "distributed-quick" if quick else "distributed"
  _record.save(_record.RESULTS / f"{name}.json", load_before, rows=rows)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="K ∈ {2, 8}, fewer repeats")
  main(parser.parse_args().quick)

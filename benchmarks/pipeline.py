"""Benchmark: the memory of `jaccum.pipeline`'s schedules as K grows.

Four stages, each two residual MLP blocks whose hidden width is 8 × the model
width (so a stage's activations are ~34 × its input), on 4 simulated CPU
devices. For each schedule (GPipe and 1F1B, each with and without `remat`) it
compiles `jax.value_and_grad` of a loss on the pipeline's output, with
gradients for the stage parameters and the input, and reports XLA's temporary
memory per device (`jaccum.inspect.memory`) in two settings:

* fixed micro-batch (16 rows), K growing, so the batch grows with K: what a
  schedule stores per micro-batch shows as the growth per micro-batch, given in
  bytes and in micro-batch inputs (4 KiB). The pipeline's output, its
  cotangent and the input's cotangent are K micro-batches each, so any
  schedule grows by at least ~3 micro-batch inputs per micro-batch, unless
  XLA reuses their buffers.
* fixed batch (256 rows), K growing, so micro-batches shrink.

    python -m benchmarks.pipeline          # about 2 minutes on 2 CPU cores
    python -m benchmarks.pipeline --quick  # fewer K

The tables are printed and saved as `benchmarks/results/pipeline.json`
(`results/quick/` with --quick).
"""

import argparse
import os

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any JAX computation

import jax.numpy as jnp  # noqa: E402

import jaccum  # noqa: E402
import jaccum.inspect  # noqa: E402
from benchmarks import _record  # noqa: E402

NUM_STAGES = 4
WIDTH = 64
HIDDEN = 8 * WIDTH
BLOCKS_PER_STAGE = 2
MICROBATCH_ROWS = 16
BATCH_ROWS = 256
SCHEDULES = {
  "gpipe": {"schedule": "gpipe"},
  "gpipe+remat": {"schedule": "gpipe", "remat": True},
  "1f1b": {"schedule": "1f1b"},
  "1f1b+remat": {"schedule": "1f1b", "remat": True},
}


def stage_fn(params, x):
  for block in range(BLOCKS_PER_STAGE):
    hidden = jax.nn.gelu(x @ params["w_in"][block])
    x = x + hidden @ params["w_out"][block]
  return x


def init(key):
  k_in, k_out = jax.random.split(key)
  shape = (NUM_STAGES, BLOCKS_PER_STAGE)
  return {
    "w_in": jax.random.normal(k_in, (*shape, WIDTH, HIDDEN)) / WIDTH**0.5,
    "w_out": jax.random.normal(k_out, (*shape, HIDDEN, WIDTH)) / HIDDEN**0.5,
  }


def temp_bytes(mesh, options, num_microbatches, batch_rows):
  loss_fn = lambda y, t: jnp.sum(jnp.sin(y))
  pipe = jaccum.pipeline(
    stage_fn, num_microbatches, mesh=mesh, loss_fn=loss_fn, **options
  )
  loss = lambda params, x: pipe(params, x, None)
  step = jax.value_and_grad(loss, argnums=(0, 1))
  params = jax.eval_shape(init, jax.random.key(0))
  x = jax.ShapeDtypeStruct((batch_rows, WIDTH), jnp.float32)
  return jaccum.inspect.memory(step, params, x).temp_bytes


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer K")
  args = parser.parse_args()
  mesh = jax.make_mesh(
    (NUM_STAGES,),
    ("stage",),
    devices=jax.devices()[:NUM_STAGES],
    axis_types=(jax.sharding.AxisType.Auto,),
  )
  load_before = os.getloadavg()[0]
  input_bytes = MICROBATCH_ROWS * WIDTH * 4
  activations = MICROBATCH_ROWS * (WIDTH + 2 * HIDDEN) * 4 * BLOCKS_PER_STAGE
  print(
    f"{NUM_STAGES} stages × {BLOCKS_PER_STAGE} MLP blocks {WIDTH}->{HIDDEN}->{WIDTH}"
    f"; a micro-batch of {MICROBATCH_ROWS} rows: input {input_bytes:,} B, one "
    f"stage's activations ~{activations:,} B"
  )

  ks = (4, 16) if args.quick else (1, 4, 8, 16, 32, 64)
  print(f"\nfixed micro-batch of {MICROBATCH_ROWS} rows; temp bytes per device")
  print(f"{'schedule':<13}{'K':>4}{'temp':>13}{'growth/micro-batch':>20}{'inputs':>8}")
  fixed_microbatch = {}
  for name, options in SCHEDULES.items():
    previous = None
    for k in ks:
      temp = temp_bytes(mesh, options, k, k * MICROBATCH_ROWS)
      fixed_microbatch.setdefault(name, {})[k] = temp
      growth = "" if previous is None else (temp - previous[1]) / (k - previous[0])
      inputs = "" if previous is None else f"{growth / input_bytes:.1f}"
      growth = "" if previous is None else f"{growth:,.0f}"
      print(f"{name:<13}{k:>4}{temp:>13,}{growth:>20}{inputs:>8}")
      previous = (k, temp)

  ks = (4, 16) if args.quick else (1, 2, 4, 8, 16, 32, 64)
  print(f"\nfixed batch of {BATCH_ROWS} rows; temp bytes per device")
  print(f"{'K':>4}" + "".join(f"{name:>14}" for name in SCHEDULES))
  fixed_batch = {name: {} for name in SCHEDULES}
  for k in ks:
    for name, options in SCHEDULES.items():
      fixed_batch[name][k] = temp_bytes(mesh, options, k, BATCH_ROWS)
    print(f"{k:>4}" + "".join(f"{fixed_batch[n][k]:>14,}" for n in SCHEDULES))

  _record.save(
    "pipeline",
    args.quick,
    load_before,
    num_stages=NUM_STAGES,
    width=WIDTH,
    hidden=HIDDEN,
    blocks_per_stage=BLOCKS_PER_STAGE,
    microbatch_rows=MICROBATCH_ROWS,
    batch_rows=BATCH_ROWS,
    temp_bytes_fixed_microbatch=fixed_microbatch,
    temp_bytes_fixed_batch=fixed_batch,
  )


if __name__ == "__main__":
  main()

"""Benchmark: `jaccum.pipeline`'s schedules: memory against K, FLOPs, bubble, head.

On 4 simulated CPU devices (a `"stage"` axis of 4), a model of 8 residual MLP
blocks (64 → 512 → 64, GELU), each stage 2 blocks (1 with 2 virtual stages
per device), micro-batches of 16 rows, the loss `sum(sin(y))` computed in the
last stage (`loss_fn`), `jax.value_and_grad` for the stage parameters and the
input. For each schedule it reports, from the compiled step:

* temporaries per device against K (`jaccum.inspect.memory`), K from 2S up,
  the batch growing with K;
* FLOPs per device (`compiled.cost_analysis()`): XLA counts a loop's body
  once, so this is the work of one tick, in units of F, the forward of what a
  tick runs (a stage, or a virtual stage) on one micro-batch, compiled alone:
  F + B is about 3, 2F + B about 4;
* the bubble: the idle fraction of the forward ticks, and the step time in
  lockstep ticks (each as long as its busiest device, F = 1, B = 2 for a whole
  stage), counted from jaccum's own schedule (`_Ticks`) for V = 1, 2, 4;
* the head: a GPT-2-small-sized output layer (768 → 50,257) and its loss,
  after the pipeline as plain JAX on the output every stage holds, the same
  with the output spread over the stages by a sharding constraint, and as
  `loss_fn` in the last stage. FLOPs per device of the head alone: the
  step's, less those of the same step with a trivial loss.

    python -m benchmarks.pipeline          # about 2 minutes on 2 CPU cores
    python -m benchmarks.pipeline --quick  # K = 2S and 4S, for CI

Writes `benchmarks/results/pipeline.json` and `pipeline.md` (`results/quick/`
with --quick), or with `--out PATH` only the record, as JSON (the suite's
`pipeline` part).
"""

import argparse
import json
import os
import pathlib

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any JAX computation

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaccum  # noqa: E402
import jaccum.inspect  # noqa: E402
from benchmarks import _record, report  # noqa: E402
from jaccum._pipeline import _Ticks  # noqa: E402

NUM_STAGES = 4
NUM_BLOCKS = 8
WIDTH = 64
HIDDEN = 8 * WIDTH
MICROBATCH_ROWS = 16
# name: (pipeline options, loss inside the pipeline, stages per device V)
SCHEDULES = {
  "gpipe, loss after": ({}, False, 1),
  "gpipe": ({}, True, 1),
  "gpipe+remat": ({"remat": True}, True, 1),
  "1f1b": ({"schedule": "1f1b"}, True, 1),
  "1f1b+remat": ({"schedule": "1f1b", "remat": True}, True, 1),
  "gpipe V=2": ({}, True, 2),
  "gpipe+remat V=2": ({"remat": True}, True, 2),
  "1f1b V=2": ({"schedule": "1f1b"}, True, 2),
  "1f1b+remat V=2": ({"schedule": "1f1b", "remat": True}, True, 2),
}
HEAD_WIDTH, VOCAB, HEAD_ROWS = 768, 50257, 8


def stage_fn(params, x):
  for block in range(params["w_in"].shape[0]):
    hidden = jax.nn.gelu(x @ params["w_in"][block])
    x = x + hidden @ params["w_out"][block]
  return x


def stage_params(num_chunks):
  lead = (NUM_STAGES,) if num_chunks == 1 else (num_chunks, NUM_STAGES)
  blocks = NUM_BLOCKS // (NUM_STAGES * num_chunks)
  shape = lambda *s: jax.ShapeDtypeStruct((*lead, blocks, *s), jnp.float32)
  return {"w_in": shape(WIDTH, HIDDEN), "w_out": shape(HIDDEN, WIDTH)}


def step(mesh, schedule, num_microbatches):
  """`value_and_grad` of the loss, and abstract arguments for it."""
  options, inside, num_chunks = SCHEDULES[schedule]
  loss_fn = lambda y, t: jnp.sum(jnp.sin(y))
  pipe = jaccum.pipeline(
    stage_fn,
    num_microbatches,
    mesh=mesh,
    loss_fn=loss_fn if inside else None,
    num_virtual_stages=num_chunks,
    **options,
  )
  if inside:
    loss = lambda params, x: pipe(params, x, None)
  else:
    loss = lambda params, x: loss_fn(pipe(params, x), None)
  x = jax.ShapeDtypeStruct((num_microbatches * MICROBATCH_ROWS, WIDTH), jnp.float32)
  return jax.value_and_grad(loss, argnums=(0, 1)), (stage_params(num_chunks), x)


def tick_forward_flops(num_chunks):
  """F: one tick's forward (a stage or a virtual stage) on one micro-batch."""
  params = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape[1 if num_chunks == 1 else 2 :], a.dtype),
    stage_params(num_chunks),
  )
  x = jax.ShapeDtypeStruct((MICROBATCH_ROWS, WIDTH), jnp.float32)
  return flops(jax.jit(stage_fn).lower(params, x).compile())


def flops(compiled):
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["flops"])


def schedules(mesh, ks):
  """Temporaries for each K, and FLOPs at K = 2S, for every schedule."""
  rows = {}
  forward = {v: tick_forward_flops(v) for v in (1, 2)}
  for name, (_, _, num_chunks) in SCHEDULES.items():
    temp = {}
    for k in ks:
      fn, args = step(mesh, name, k)
      temp[k] = jaccum.inspect.memory(fn, *args).temp_bytes
    fn, args = step(mesh, name, 2 * NUM_STAGES)
    step_flops = flops(jax.jit(fn).lower(*args).compile())
    rows[name] = {
      "num_chunks": num_chunks,
      "temp_bytes": temp,
      "flops": step_flops,
      "flops_in_f": step_flops / forward[num_chunks],
    }
    print(
      f"{name:<18}"
      + "".join(f"{temp[k] / 1e6:>9.2f}" for k in ks)
      + f"{step_flops / 1e6:>10.2f}{step_flops / forward[num_chunks]:>7.2f}",
      flush=True,
    )
  return rows, forward


def bubble(num_stages, num_chunks, num_microbatches):
  """Idle fraction of the forward ticks, and lockstep step times, from `_Ticks`."""
  ticks = _Ticks(num_stages, num_chunks, num_microbatches)
  forward, backward = 1 / num_chunks, 2 / num_chunks
  busy = sum(
    bool(ticks.forward(t, s)[2])
    for t in range(ticks.num_forward_ticks)
    for s in range(num_stages)
  )
  idle = 1 - busy / (num_stages * ticks.num_forward_ticks)
  # GPipe: every device computes in every tick (the bubble's work is thrown
  # away), forwards then backwards. 1F1B: a tick lasts as long as the busiest
  # device's work; idle work is skipped.
  gpipe = ticks.num_forward_ticks * (forward + backward)
  one_f_one_b = 0.0
  for t in range(ticks.num_1f1b_ticks):
    one_f_one_b += max(
      forward * bool(ticks.forward(t, s)[2]) + backward * bool(ticks.backward(t, s)[2])
      for s in range(num_stages)
    )
  return {"idle": idle, "gpipe_time": gpipe, "1f1b_time": one_f_one_b}


def head_flops(mesh):
  """Per-device FLOPs of the head and loss: after the pipeline, spread, in it."""
  num_microbatches = 2 * NUM_STAGES
  rows = num_microbatches * HEAD_ROWS
  stage = lambda w, x: x + jnp.tanh(x * w)
  params = jax.ShapeDtypeStruct((NUM_STAGES, HEAD_WIDTH), jnp.float32)
  head = jax.ShapeDtypeStruct((HEAD_WIDTH, VOCAB), jnp.float32)
  x = jax.ShapeDtypeStruct((rows, HEAD_WIDTH), jnp.float32)
  targets = jax.ShapeDtypeStruct((rows,), jnp.int32)

  def cross_entropy(head, y, t):
    logits = y @ head
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, t))

  def trivial(head, y, t):
    return jnp.sum(y)

  def variant(where, loss):
    def f(params, head, x, t):
      if where == "loss_fn":
        pipe = jaccum.pipeline(
          stage, num_microbatches, mesh=mesh, loss_fn=lambda y, t: loss(head, y, t)
        )
        return pipe(params, x, t)
      y = jaccum.pipeline(stage, num_microbatches, mesh=mesh)(params, x)
      if where == "spread":
        spread = NamedSharding(mesh, P("stage"))
        y = jax.lax.with_sharding_constraint(y, spread)
        t = jax.lax.with_sharding_constraint(t, spread)
      return loss(head, y, t)

    fn = jax.value_and_grad(f, argnums=(0, 1, 2))
    return flops(jax.jit(fn).lower(params, head, x, targets).compile())

  out = {}
  for where in ("after", "spread", "loss_fn"):
    out[where] = variant(where, cross_entropy) - variant(where, trivial)
  out["rows"] = rows
  out["num_microbatches"] = num_microbatches
  return out


def run(quick: bool) -> dict:
  mesh = jax.make_mesh(
    (NUM_STAGES,),
    ("stage",),
    devices=jax.devices()[:NUM_STAGES],
    axis_types=(jax.sharding.AxisType.Auto,),
  )
  S = NUM_STAGES
  ks = (2 * S, 4 * S) if quick else (2 * S, 4 * S, 8 * S, 16 * S, 32 * S)
  print(
    f"{S} stages, {NUM_BLOCKS} MLP blocks {WIDTH}->{HIDDEN}->{WIDTH}, micro-batches"
    f" of {MICROBATCH_ROWS} rows; temporaries per device (MB) for K = {list(ks)};"
    " FLOPs per device at K = 2S (MFLOP, and in F)"
  )
  rows, forward = schedules(mesh, ks)
  bubbles = {
    v: {k: bubble(S, v, k) for k in (S, 2 * S, 4 * S, 8 * S)} for v in (1, 2, 4)
  }
  for v, by_k in bubbles.items():
    print(
      f"V={v} bubble: " + ", ".join(f"K={k} {b['idle']:.1%}" for k, b in by_k.items())
    )
  heads = head_flops(mesh)
  print(
    "head FLOPs per device (MFLOP): "
    + ", ".join(f"{k} {heads[k] / 1e6:.1f}" for k in ("after", "spread", "loss_fn"))
  )
  return {
    "num_stages": S,
    "num_blocks": NUM_BLOCKS,
    "width": WIDTH,
    "hidden": HIDDEN,
    "microbatch_rows": MICROBATCH_ROWS,
    "ks": list(ks),
    "forward_flops": forward,
    "schedules": rows,
    "bubble": bubbles,
    "head": {"width": HEAD_WIDTH, "vocab": VOCAB, **heads},
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="K = 2S and 4S only")
  parser.add_argument("--out", type=pathlib.Path, help="write the record here only")
  args = parser.parse_args()
  # XLA's passes, and so the compiled program's buffers and FLOPs, are the
  # same without LLVM's optimisations, which take most of each compile.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  )
  load_before = os.getloadavg()[0]
  record = run(args.quick)
  if args.out:
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return
  path, _, table = _record.save_with_table(
    "pipeline", args.quick, load_before, record, report.pipeline_section
  )
  print(f"\n{table}\nsaved {path.with_suffix('.md')}")


if __name__ == "__main__":
  main()

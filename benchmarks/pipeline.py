"""Benchmark: `jaccum.pipeline` schedules: idle share, memory, FLOPs against K; head.

On 4 simulated CPU devices (a `"stage"` axis of 4), a model of 8 residual MLP
blocks (64 → 512 → 64, GELU), each stage 2 blocks (1 with 2 virtual stages
per device), micro-batches of 16 rows, the loss `sum(sin(y))` computed in the
last stage (`loss_fn`), `jax.value_and_grad` for the stage parameters and the
input. For each schedule it reports, from the compiled step:

* temporaries per device against K (`jaccum.inspect.memory`), K from 2S up,
  the batch growing with K;
* matmul FLOPs per device and step against K, read from the compiled HLO
  (`jaccum._planning.hlo_cost`): each loop's body times its trip count, each tick's
  conditionals at their costliest branch, as XLA's cost analysis counts a
  conditional: the work of the tick's busiest device, summed over the ticks;
* FLOPs per tick (`compiled.cost_analysis()`, which counts a loop's body
  once), in units of F, the forward of what a tick runs (a stage, or a
  virtual stage) on one micro-batch, compiled alone: F + B is about 3, 2F + B
  about 4, ZB-H1's F, B or W about 1 (ZB-V's, half a stage's, 1 too);
* the idle share of the device-ticks and the step time in lockstep ticks
  (each as long as its busiest device, F = B = W = 1 for a whole stage), from
  the schedule each runs (`jaccum.pipeline_schedule`), for V = 1, 2, 4;
* temporaries per device at a small size (issue 39: residual tanh blocks of
  width 64, 256 rows, K = 8), 1F1B, ZB-H1 and ZB-V, and how many
  micro-batches each device holds from F to W (in whole stages), from the
  schedule: the SPMD program gives every device the same buffers;
* the head: a GPT-2-small-sized output layer (768 → 50,257) and its loss,
  after the pipeline as plain JAX on the output every stage holds, the same
  with the output spread over the stages by a sharding constraint, and as
  `loss_fn` in the last stage. FLOPs per device of the head alone: the
  step's, less those of the same step with a trivial loss.

It also draws the schedules at S = 4, K = 8 (`--schedule-out`, by default
`pipeline_schedule.png` beside the results; the guide's picture is
`docs/_static/pipeline_schedule.png`).

    python -m benchmarks.pipeline          # 79 programs compiled: minutes on 2 cores
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
import numpy as np

jax.config.update("jax_num_cpu_devices", 8)  # before any JAX computation

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaccum  # noqa: E402
import jaccum.inspect  # noqa: E402
from benchmarks import _record, report  # noqa: E402
from jaccum._planning import hlo_cost as _hlo_cost  # noqa: E402

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
  "zb-h1": ({"schedule": "zb-h1"}, True, 1),
  "zb-h1+remat": ({"schedule": "zb-h1", "remat": True}, True, 1),
  "zb-v": ({"schedule": "zb-v"}, True, 2),
  "zb-v+remat": ({"schedule": "zb-v", "remat": True}, True, 2),
}
# The idle share's rows: (schedule, V); GPipe's equals 1F1B's at every V.
IDLE = [
  ("gpipe", 1),
  ("1f1b", 1),
  ("1f1b", 2),
  ("1f1b", 4),
  ("zb-h1", 1),
  ("zb-v", 2),
]
# The small size (issue 39): residual tanh blocks of width 64 (64 → 128 → 64),
# 256 rows, K = 8; (schedule, V, blocks per stage or chunk).
SMALL_WIDTH, SMALL_ROWS = 64, 256
SMALL = [
  ("1f1b", 1, 1),
  ("zb-h1", 1, 1),
  ("1f1b", 1, 2),
  ("zb-h1", 1, 2),
  ("zb-v", 2, 1),
]
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
  """Temporaries and step matmul FLOPs for each K, and XLA's FLOPs per tick at
  K = 2S, for every schedule: one compile per schedule and K."""
  rows = {}
  forward = {v: tick_forward_flops(v) for v in (1, 2)}
  for name, (_, _, num_chunks) in SCHEDULES.items():
    temp, step_flops = {}, {}
    for k in ks:
      fn, args = step(mesh, name, k)
      compiled = jax.jit(fn).lower(*args).compile()
      # What `jaccum.inspect.memory(fn, *args).temp_bytes` reports.
      temp[k] = compiled.memory_analysis().temp_size_in_bytes
      step_flops[k] = _hlo_cost.matmul_flops(compiled.as_text())
      if k == 2 * NUM_STAGES:
        tick_flops = flops(compiled)
    rows[name] = {
      "num_chunks": num_chunks,
      "temp_bytes": temp,
      "step_matmul_flops": step_flops,
      "flops": tick_flops,
      "flops_in_f": tick_flops / forward[num_chunks],
    }
    print(
      f"{name:<18}"
      + "".join(f"{temp[k] / 1e6:>9.2f}" for k in ks)
      + "".join(f"{step_flops[k] / 1e6:>9.1f}" for k in ks)
      + f"{tick_flops / 1e6:>10.2f}{tick_flops / forward[num_chunks]:>7.2f}",
      flush=True,
    )
  return rows, forward


def idle_shares(num_stages, ks):
  """`{schedule: {K: (idle share, lockstep time)}}` from `pipeline_schedule`."""
  out = {}
  for name, v in IDLE:
    label = name if v == 1 else f"{name} V={v}"
    out[label] = {}
    for k in ks:
      schedule = jaccum.pipeline_schedule(
        num_stages, k, schedule=name, num_virtual_stages=v
      )
      out[label][k] = {"idle": schedule.idle, "time": schedule.time}
  return out


def small_temporaries(mesh):
  """Temporaries per device at the small size: `{"schedule V=v, n blocks":
  bytes}`, `value_and_grad` of a loss in the last stage."""
  S, K = NUM_STAGES, 2 * NUM_STAGES

  def blocks(params, x):
    for i in range(params["w_in"].shape[0]):
      hidden = jnp.tanh(x @ params["w_in"][i] + params["b"][i])
      x = x + params["scale"][i] * (hidden @ params["w_out"][i])
    return x

  loss_fn = lambda y, t: jnp.sum(jnp.sin(y) @ jnp.linspace(0, 1, SMALL_WIDTH) * t)
  out = {}
  for name, num_chunks, num_blocks in SMALL:
    lead = ((S,) if num_chunks == 1 else (num_chunks, S)) + (num_blocks,)
    width, hidden = SMALL_WIDTH, 2 * SMALL_WIDTH
    shapes = {"w_in": (width, hidden), "b": (hidden,), "w_out": (hidden, width)}
    params = {
      name: jax.ShapeDtypeStruct((*lead, *shape), jnp.float32)
      for name, shape in {**shapes, "scale": ()}.items()
    }
    pipe = jaccum.pipeline(
      blocks,
      K,
      mesh=mesh,
      schedule=name,
      num_virtual_stages=num_chunks,
      loss_fn=loss_fn,
    )
    x = jax.ShapeDtypeStruct((SMALL_ROWS, width), jnp.float32)
    t = jax.ShapeDtypeStruct((SMALL_ROWS,), jnp.float32)
    fn = jax.value_and_grad(lambda p, x, t, pipe=pipe: pipe(p, x, t), argnums=(0, 1))
    compiled = jax.jit(fn).lower(params, x, t).compile()
    label = f"{name} V={num_chunks}, {num_blocks * S * num_chunks} blocks"
    out[label] = compiled.memory_analysis().temp_size_in_bytes
    print(f"small: {label:<26} {out[label] / 1e3:9.1f} kB", flush=True)
  return out


def held_per_device(num_stages, num_microbatches):
  """`{schedule: [per device, the most micro-batches held from F to the end
  of their backward]}`, in whole stages (a chunk is 1/V): what each device
  of the SPMD program fills of the buffers all of them allocate alike."""
  out = {}
  for name, v in (("1f1b", 1), ("zb-h1", 1), ("1f1b", 2), ("zb-v", 2)):
    schedule = jaccum.pipeline_schedule(
      num_stages, num_microbatches, schedule=name, num_virtual_stages=v
    )
    held = []
    for s in range(num_stages):
      live, most = set(), 0
      for tick in schedule.ticks:
        live |= {(k, c) for kind, k, c in tick[s] if kind == "F"}
        most = max(most, len(live))
        live -= {(k, c) for kind, k, c in tick[s] if kind == "W"}
      held.append(most / v)
    out[name if v == 1 else f"{name} V={v}"] = held
  return out


def plot_schedules(num_stages, num_microbatches, path: pathlib.Path) -> None:
  """Each schedule as a timeline of lockstep ticks, from `pipeline_schedule`:
  a tick lasts as long as its busiest device's work (F, B, W each 1/V of a
  whole stage's forward), and a device runs its work in order within it."""
  colors = {"F": "#4c8bd6", "B": "#f0913a", "W": "#5bb35b"}
  panels = [
    ("gpipe", 1, "GPipe: a forward loop, then autodiff's backward loop"),
    ("1f1b", 1, "1F1B, the loss in the last stage: a forward and a backward per tick"),
    ("1f1b", 2, "1F1B, num_virtual_stages=2 (the second stage per device hatched)"),
    ("zb-h1", 1, "ZB-H1: one of F, B, W per tick, W where the device would idle"),
    ("zb-v", 2, "ZB-V: two chunks per device in a V, one of F, B, W per tick"),
  ]
  fig, axes = plt.subplots(len(panels), 1, figsize=(12, 10.5))
  ends = []
  for ax, (name, num_chunks, title) in zip(axes, panels, strict=True):
    schedule = jaccum.pipeline_schedule(
      num_stages, num_microbatches, schedule=name, num_virtual_stages=num_chunks
    )
    cost = 1 / num_chunks
    time = 0.0
    for tick in schedule.ticks:
      width = max(len(works) for works in tick) * cost
      for s, works in enumerate(tick):
        ax.add_patch(plt.Rectangle((time, s), width, 1, fc="#eeeeee", ec="white"))
        for i, (kind, k, v) in enumerate(works):
          start = time + i * cost
          hatch = "////" if v == 1 else None
          box = plt.Rectangle((start, s), cost, 1, fc=colors[kind], ec="white")
          box.set_hatch(hatch)
          ax.add_patch(box)
          ax.text(start + cost / 2, s + 0.5, k, ha="center", va="center", fontsize=6)
      time += width
    ends.append(time)
    ax.set(ylim=(num_stages, 0), yticks=np.arange(num_stages) + 0.5)
    ax.set_yticklabels([f"device {s}" for s in range(num_stages)])
    ax.set_title(
      f"{title}: time {time:g}, idle {schedule.idle:.1%}", fontsize=9, loc="left"
    )
    for spine in ("top", "right", "left"):
      ax.spines[spine].set_visible(False)
  for ax in axes:
    ax.set_xlim(0, max(ends))
  axes[-1].set_xlabel("time, in forwards of one micro-batch through one stage")
  handles = [plt.Rectangle((0, 0), 1, 1, fc=colors[k]) for k in "FBW"]
  handles.append(plt.Rectangle((0, 0), 1, 1, fc="#eeeeee"))
  labels = ["F: forward", "B: backward to the input", "W: to the weights", "idle"]
  fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
  fig.suptitle(
    f"S={num_stages} devices, K={num_microbatches} micro-batches (numbered), in "
    "lockstep ticks (jaccum.pipeline_schedule)",
    fontsize=10,
  )
  fig.tight_layout(rect=(0, 0.03, 1, 1))
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  print(f"saved {path}")


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
    f" of {MICROBATCH_ROWS} rows; temporaries per device (MB) and matmul MFLOP"
    f" per step for K = {list(ks)}; FLOPs per tick at K = 2S (MFLOP, and in F)"
  )
  rows, forward = schedules(mesh, ks)
  idle = idle_shares(S, (S, 2 * S, 4 * S, 8 * S))
  for label, by_k in idle.items():
    print(
      f"{label} idle: " + ", ".join(f"K={k} {b['idle']:.1%}" for k, b in by_k.items())
    )
  small = small_temporaries(mesh)
  held = held_per_device(S, 2 * S)
  for name, by_device in held.items():
    print(f"{name} held per device at K = {2 * S}: {by_device}")
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
    "idle": idle,
    "small": {"width": SMALL_WIDTH, "rows": SMALL_ROWS, "temp_bytes": small},
    "held": held,
    "head": {"width": HEAD_WIDTH, "vocab": VOCAB, **heads},
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="K = 2S and 4S only")
  parser.add_argument("--out", type=pathlib.Path, help="write the record here only")
  parser.add_argument(
    "--schedule-out",
    type=pathlib.Path,
    help="draw the schedules at S = 4, K = 8 here (default: beside the results)",
  )
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
    if args.schedule_out:
      plot_schedules(NUM_STAGES, 2 * NUM_STAGES, args.schedule_out)
    return
  path, _, table = _record.save_with_table(
    "pipeline", args.quick, load_before, record, report.pipeline_section
  )
  print(f"\n{table}\nsaved {path.with_suffix('.md')}")
  plot_schedules(
    NUM_STAGES,
    2 * NUM_STAGES,
    args.schedule_out or path.with_name("pipeline_schedule.png"),
  )


if __name__ == "__main__":
  main()

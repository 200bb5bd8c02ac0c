"""Pipeline parallelism: a small transformer LM in 4 stages on 2 data × 4 stage devices.

The model is the one of `token_weighted_lm.py` (byte embedding, pre-norm
transformer blocks, tied output weights) with 8 blocks, trained on paragraphs
of Python's own docs (`pydoc_data.topics`). Its blocks are split into 4
stages of 2 blocks; `jaccum.pipeline` runs stage s on the devices at position
s of a `"stage"` mesh axis, with K micro-batches flowing through the stages,
and each of the 2 positions of a `"data"` axis pipelines its own half of the
batch. The embedding, head and loss are ordinary JAX around the pipeline.

The same model, from the same start and on the same batches, is also trained
unpipelined (all blocks applied in order, one device): the loss curves agree
to float32 rounding. The script prints the bubble fraction, each device's
share of the parameters, and saves the loss curves and a picture of the two
schedules (GPipe and 1F1B).

  python examples/pipeline_lm.py [--quick] [--steps N] [--schedule gpipe|1f1b]
      [--out PATH.png] [--schedule-out PATH.png]
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import re
import time
from pydoc_data.topics import topics  # CPython's own help text, ~460 KB.

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any JAX computation

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jaccum  # noqa: E402

DATA, STAGES = 2, 4
BLOCKS_PER_STAGE = 2
NUM_MICROBATCHES = 8  # per data shard
BATCH_SIZE = 32  # sequences per step: 2 data shards × 8 micro-batches × 2
SEQ_LEN = 64  # Tokens (bytes) per padded sequence; 0 is the padding byte.
DIM, NUM_HEADS = 64, 4


def load_paragraphs() -> tuple[np.ndarray, np.ndarray]:
  """Returns `(tokens [P, SEQ_LEN + 1], lengths [P])`, one paragraph per row."""
  text = "\n\n".join(topics[name] for name in sorted(topics))
  paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
  encoded = [p.encode()[: SEQ_LEN + 1] for p in paragraphs if len(p) >= 8]
  tokens = np.zeros((len(encoded), SEQ_LEN + 1), np.int32)
  for row, data in enumerate(encoded):
    tokens[row, : len(data)] = np.frombuffer(data, np.uint8)
  return tokens, np.array([len(data) for data in encoded])


class Block(nnx.Module):
  """The transformer block of `token_weighted_lm.py`."""

  def __init__(self, dim: int, num_heads: int, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.attn_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
    self.attn_out = nnx.Linear(dim, dim, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, dim = x.shape
    qkv = self.qkv(self.attn_norm(x)).reshape(batch, length, 3 * self.num_heads, -1)
    q, k, v = jnp.split(qkv, 3, axis=2)
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + self.attn_out(attn.reshape(batch, length, dim))
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


# The graph of one block; stage s's parameters are its blocks' states, stacked.
BLOCK_GRAPH = nnx.split(Block(DIM, NUM_HEADS, nnx.Rngs(0)))[0]
EMBED_GRAPH = nnx.split(nnx.Embed(256, DIM, rngs=nnx.Rngs(0)))[0]
NORM_GRAPH = nnx.split(nnx.LayerNorm(DIM, rngs=nnx.Rngs(0)))[0]


def init_params(seed: int = 0) -> dict:
  """`{"embed", "position", "norm", "stages"}`; stages leaves are `[S, 2, ...]`."""
  rngs = nnx.Rngs(seed)
  embed = nnx.split(nnx.Embed(256, DIM, rngs=rngs))[1]
  position = 0.02 * jax.random.normal(rngs.params(), (SEQ_LEN, DIM))
  blocks = [
    nnx.split(Block(DIM, NUM_HEADS, rngs))[1] for _ in range(STAGES * BLOCKS_PER_STAGE)
  ]
  stages = jax.tree.map(
    lambda *b: jnp.stack(b).reshape(STAGES, BLOCKS_PER_STAGE, *b[0].shape), *blocks
  )
  norm = nnx.split(nnx.LayerNorm(DIM, rngs=rngs))[1]
  return {"embed": embed, "position": position, "norm": norm, "stages": stages}


def stage_fn(stage_params, x):
  """One stage: its blocks in order, on one micro-batch of activations."""
  # A scan over the blocks compiles one block, not BLOCKS_PER_STAGE copies.
  block = lambda x, params: (nnx.merge(BLOCK_GRAPH, params)(x), None)
  return jax.lax.scan(block, x, stage_params)[0]


def sequential_blocks(stages, x):
  """The unpipelined model: every stage in order on the whole batch."""
  return jax.lax.scan(lambda x, params: (stage_fn(params, x), None), x, stages)[0]


def make_loss(blocks):
  """The loss around `blocks(stages, x)`: embedding, head and loss in plain JAX."""

  def loss(params, inputs, targets, mask):
    embed = nnx.merge(EMBED_GRAPH, params["embed"])
    x = blocks(params["stages"], embed(inputs) + params["position"])
    logits = embed.attend(nnx.merge(NORM_GRAPH, params["norm"])(x))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)

  return loss


def train(blocks, params, batches, desc):
  """Trains from `params`; returns the losses, the final state, seconds a step."""
  loss = make_loss(blocks)
  optimizer = optax.adamw(3e-3)
  # Adam's moments sit with their parameters (a stage's on its stage), the
  # step count with the first parameter.
  home = jax.tree.leaves(params)[0].sharding
  opt_state = optax.tree_map_params(
    optimizer,
    lambda state, param: jax.device_put(state, param.sharding),
    optimizer.init(params),
    params,
    transform_non_params=lambda state: jax.device_put(state, home),
  )
  # The state leaves the step placed as it came in, so the step compiles once.
  placement = jax.tree.map(lambda x: x.sharding, (params, opt_state))

  @functools.partial(jax.jit, out_shardings=(*placement, None))
  def train_step(params, opt_state, inputs, targets, mask):
    value, grads = jax.value_and_grad(loss)(params, inputs, targets, mask)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  losses, start = [], time.perf_counter()
  for step, batch in enumerate(tqdm(batches, desc)):
    params, opt_state, value = train_step(params, opt_state, *batch)
    losses.append(float(value))
    if step == 0:
      start = time.perf_counter()  # time the steps after the first, compiled one
  seconds = (time.perf_counter() - start) / max(1, len(batches) - 1)
  return np.array(losses), params, opt_state, seconds


def bytes_on(device, tree) -> int:
  return sum(
    shard.data.nbytes
    for leaf in jax.tree.leaves(tree)
    for shard in leaf.addressable_shards
    if shard.device == device
  )


def tree_bytes(tree) -> int:
  return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


# --- the schedules: who works on what, tick by tick -----------------------------

# Work in units of one stage's forward on one micro-batch; a backward costs two.
COST = {"F": 1, "R": 1, "B": 2}


def schedule(num_stages: int, num_microbatches: int, name: str) -> list:
  """The loops of a schedule: `loops[i][t][s]` lists stage s's work in tick t.

  Work is `(kind, micro-batch)`: F forward, R forward re-run in the backward
  loop, B backward. The ticks are those of `jaccum._pipeline`: forward tick t
  runs micro-batch t - s on stage s; GPipe's backward loop is the forward
  loop in reverse; 1F1B's backward tick t re-runs micro-batch t - s and runs
  the backward of micro-batch t - (2S - 2 - s).
  """
  S, K = num_stages, num_microbatches
  one = lambda kind, k: [(kind, k)] if 0 <= k < K else []
  forward = [[one("F", t - s) for s in range(S)] for t in range(K + S - 1)]
  if name == "gpipe":
    backward = [
      [one("B", K + S - 2 - t - s) for s in range(S)] for t in range(K + S - 1)
    ]
  else:
    backward = [
      [one("R", t - s) + one("B", t - (2 * S - 2 - s)) for s in range(S)]
      for t in range(K + 2 * S - 2)
    ]
  return [forward, backward]


def modelled(num_stages: int, num_microbatches: int, name: str, remat: bool):
  """`(step time, idle fraction)` in lockstep ticks, each as long as its busiest
  stage. With remat a backward re-runs its forward; 1F1B with remat skips the
  last stage's re-run forward, whose output nobody takes."""
  total, busy = 0, [0] * num_stages
  for loop in schedule(num_stages, num_microbatches, name):
    for tick in loop:
      work = [
        sum(
          COST[kind] + (kind == "B" and remat)
          for kind, _ in cell
          if not (remat and kind == "R" and s == num_stages - 1)
        )
        for s, cell in enumerate(tick)
      ]
      total += max(work)
      busy = [b + w for b, w in zip(busy, work, strict=True)]
  return total, 1 - sum(busy) / (num_stages * total)


def plot_schedules(num_stages: int, num_microbatches: int, path: pathlib.Path) -> None:
  colors = {"F": "#4c8bd6", "R": "#a9c8ee", "B": "#f0913a"}
  titles = {
    "gpipe": "GPipe: a forward loop, then autodiff's backward loop",
    "1f1b": "1F1B: a forward loop (nothing kept), then a loop of re-run forward "
    "(top) + backward (bottom)",
  }
  widths = [
    sum(len(loop) + 1 for loop in schedule(num_stages, num_microbatches, n))
    for n in titles
  ]
  fig, axes = plt.subplots(2, 1, figsize=(11, 4.4))
  for ax, name in zip(axes, titles, strict=True):
    offset = 0
    for loop in schedule(num_stages, num_microbatches, name):
      # One row per stage; split in two where a tick holds two kinds of work.
      kinds = sorted({kind for tick in loop for cell in tick for kind, _ in cell})
      kinds.sort(key="FRB".index)
      height = 1 / len(kinds)
      for t, tick in enumerate(loop):
        for s, cell in enumerate(tick):
          for i, kind in enumerate(kinds):
            k, y = dict(cell).get(kind), s + i * height
            face = "#eeeeee" if k is None else colors[kind]
            ax.add_patch(plt.Rectangle((offset + t, y), 1, height, fc=face, ec="white"))
            if k is not None:
              ax.text(
                offset + t + 0.5,
                y + height / 2,
                k,
                ha="center",
                va="center",
                fontsize=7,
              )
      offset += len(loop) + 1
    ax.set(
      xlim=(0, max(widths) - 1),
      ylim=(num_stages, 0),
      yticks=np.arange(num_stages) + 0.5,
    )
    ax.set_yticklabels([f"stage {s}" for s in range(num_stages)])
    ax.set_xticks([])
    ax.set_title(titles[name], fontsize=9, loc="left")
    for spine in ax.spines.values():
      spine.set_visible(False)
  handles = [plt.Rectangle((0, 0), 1, 1, fc=colors[k]) for k in "FRB"] + [
    plt.Rectangle((0, 0), 1, 1, fc="#eeeeee")
  ]
  fig.legend(
    handles,
    ["forward", "forward re-run", "backward", "idle"],
    loc="lower center",
    ncol=4,
    fontsize=8,
  )
  fig.suptitle(
    f"S={num_stages} stages, K={num_microbatches} micro-batches (numbered); one "
    "column is one tick",
    fontsize=10,
  )
  fig.tight_layout(rect=(0, 0.06, 1, 1))
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  print(f"saved {path}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few steps, for CI")
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
  parser.add_argument("--out", default="examples/out/pipeline_lm.png")
  parser.add_argument("--schedule-out", default="examples/out/pipeline_schedule.png")
  args = parser.parse_args()
  num_steps = args.steps or (3 if args.quick else 200)

  mesh = jax.make_mesh(
    (DATA, STAGES), ("data", "stage"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  tokens, lengths = load_paragraphs()
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(num_steps):
    rows = rng.choice(len(tokens), BATCH_SIZE, replace=False)
    mask = np.arange(SEQ_LEN) < lengths[rows, None] - 1  # Real next-byte targets.
    batches.append((tokens[rows, :-1], tokens[rows, 1:], mask.astype(np.float32)))
  print(
    f"{len(tokens)} paragraphs, {lengths.sum() / 1e3:.0f}k bytes; {num_steps} steps"
  )

  params = init_params()
  # Each stage's blocks on its own devices; the rest (embedding, norm) and the
  # batch as plain JAX would place them: replicated, and sharded over "data".
  stage_sharding = NamedSharding(mesh, P("stage"))
  pipelined_params = {
    **jax.device_put(
      {k: v for k, v in params.items() if k != "stages"}, NamedSharding(mesh, P())
    ),
    "stages": jax.device_put(params["stages"], stage_sharding),
  }
  batch_sharding = NamedSharding(mesh, P("data"))
  sharded_batches = [jax.device_put(b, batch_sharding) for b in batches]
  pipe = jaccum.pipeline(stage_fn, NUM_MICROBATCHES, mesh=mesh, schedule=args.schedule)

  piped, piped_params, piped_state, piped_seconds = train(
    pipe, pipelined_params, sharded_batches, f"pipelined ({args.schedule})"
  )
  unpipelined_params = jax.device_put(params, jax.devices()[0])
  whole, _, _, whole_seconds = train(
    sequential_blocks, unpipelined_params, batches, "unpipelined"
  )

  gap = np.abs(piped - whole)
  print(f"unpipelined loss: first {whole[0]:.4f}, last {whole[-1]:.4f} nats/token")
  print(f"pipelined loss:   first {piped[0]:.4f}, last {piped[-1]:.4f} nats/token")
  print(
    f"max |pipelined - unpipelined| = {gap.max():.2e} (step {gap.argmax()}); "
    f"at step 0 {gap[0]:.2e}"
  )
  bubble = (STAGES - 1) / (NUM_MICROBATCHES + STAGES - 1)
  print(
    f"bubble fraction (S - 1) / (K + S - 1) = {STAGES - 1}/"
    f"{NUM_MICROBATCHES + STAGES - 1} = {bubble:.1%} at K={NUM_MICROBATCHES}"
  )
  print(
    "modelled step (lockstep ticks, backward = 2 forwards; time in forwards of "
    "one micro-batch through one stage) and idle fraction:"
  )
  for k in (NUM_MICROBATCHES, 4 * NUM_MICROBATCHES):
    cells = []
    for name in ("gpipe", "1f1b"):
      for remat in (False, True):
        time_units, idle = modelled(STAGES, k, name, remat)
        cells.append(f"{name}{'+remat' if remat else ''} {time_units} ({idle:.1%})")
    print(f"  K={k}: " + ", ".join(cells))
  device = mesh.devices.flat[0]
  total = tree_bytes(params)
  stage_total = tree_bytes(params["stages"])
  print(
    f"parameters: {total / 1e6:.2f} MB in all, of which blocks {stage_total / 1e6:.2f}"
    f" MB; per device {bytes_on(device, piped_params) / 1e6:.2f} MB "
    f"(blocks {bytes_on(device, piped_params['stages']) / 1e6:.2f} MB = 1/{STAGES});"
    f" with Adam's state {bytes_on(device, (piped_params, piped_state)) / 1e6:.2f} MB"
    f" per device vs {3 * total / 1e6:.2f} MB unpipelined"
  )
  print(
    f"seconds per step on {jax.device_count()} simulated CPU devices (they share "
    f"the host's cores, so this is no speed measurement): pipelined "
    f"{piped_seconds:.3f}, unpipelined {whole_seconds:.3f}"
  )

  steps = np.arange(num_steps)
  fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(11, 4))
  ax_loss.plot(steps, whole, "k-", lw=1.2, label="unpipelined (1 device)")
  ax_loss.plot(steps, piped, "C0--", lw=1.2, label=f"pipelined, {args.schedule}")
  ax_loss.set(xlabel="step", ylabel="per-token loss (nats)", title="training loss")
  ax_loss.legend()
  ax_gap.plot(steps, piped - whole, "C0", lw=1)
  ax_gap.axhline(0, color="k", lw=0.8)
  ax_gap.set(
    xlabel="step", ylabel="pipelined - unpipelined", title="difference (float32)"
  )
  fig.suptitle(
    f"{STAGES * BLOCKS_PER_STAGE}-block LM in {STAGES} stages × {DATA} data shards, "
    f"K={NUM_MICROBATCHES} micro-batches of {BATCH_SIZE // DATA // NUM_MICROBATCHES} "
    "sequences per shard"
  )
  fig.tight_layout()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  print(f"saved {out}")
  plot_schedules(STAGES, NUM_MICROBATCHES, pathlib.Path(args.schedule_out))


if __name__ == "__main__":
  main()

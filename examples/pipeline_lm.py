"""Pipeline parallelism: a small transformer LM in 4 stages on 2 data × 4 stage devices.

The model is the one of `token_weighted_lm.py` (byte embedding, pre-norm
transformer blocks with dropout, tied output weights) with 8 blocks, trained
on paragraphs of Python's own docs (`pydoc_data.topics`). Its blocks are
split into 4 stages (with `--virtual-stages 2`, 8 stages of one block, two
per device); `jaccum.pipeline` runs stage s on the devices at position s of a
`"stage"` mesh axis with K micro-batches flowing through the stages, and
each of the 2 positions of a `"data"` axis pipelines its own half of the
batch. With `--schedule 1f1b` (or `zb-h1`, or `zb-v` with two stages per
device in a V: stage s and 7 − s on device s) the stage that ends the model
also computes the head and the token-weighted loss (`loss_fn`); with GPipe
they are plain JAX after the pipeline, its output spread over the stages by
one sharding constraint.

Each stage draws its dropout masks from the key jaccum folds with the
micro-batch and the stage. The same model is trained unpipelined, on one
device, from the same start, on the same batches and with the same keys (a
plain loop over micro-batches and stages): the loss curves agree to float32
rounding. The script prints each schedule's idle share and step time in
lockstep ticks (`jaccum.pipeline_schedule`), each device's share of the
parameters, and saves the loss curves.

  python examples/pipeline_lm.py [--quick] [--steps N]
      [--schedule gpipe|1f1b|zb-h1|zb-v] [--virtual-stages V] [--dropout P]
      [--out PATH.png]
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
NUM_BLOCKS = 8
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
  """The transformer block of `token_weighted_lm.py`, with dropout."""

  def __init__(self, dim: int, num_heads: int, dropout: float, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.attn_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
    self.attn_out = nnx.Linear(dim, dim, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)
    self.dropout = nnx.Dropout(dropout)  # The key comes with each call.

  def __call__(self, x: jax.Array, rngs: nnx.Rngs) -> jax.Array:
    batch, length, dim = x.shape
    qkv = self.qkv(self.attn_norm(x)).reshape(batch, length, 3 * self.num_heads, -1)
    q, k, v = jnp.split(qkv, 3, axis=2)
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + self.dropout(self.attn_out(attn.reshape(batch, length, dim)), rngs=rngs)
    mlp = self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))
    return x + self.dropout(mlp, rngs=rngs)


EMBED_GRAPH = nnx.split(nnx.Embed(256, DIM, rngs=nnx.Rngs(0)))[0]
NORM_GRAPH = nnx.split(nnx.LayerNorm(DIM, rngs=nnx.Rngs(0)))[0]


def init_params(num_chunks: int, seed: int = 0) -> dict:
  """`{"embed", "position", "norm", "stages"}`.

  `stages` holds the blocks' states stacked `[S, blocks per stage, ...]`,
  or `[V, S, blocks per stage, ...]` with V virtual stages per device (stage
  v·S + s at `[v, s]`).
  """
  rngs = nnx.Rngs(seed)
  embed = nnx.split(nnx.Embed(256, DIM, rngs=rngs))[1]
  position = 0.02 * jax.random.normal(rngs.params(), (SEQ_LEN, DIM))
  blocks = [nnx.split(Block(DIM, NUM_HEADS, 0.0, rngs))[1] for _ in range(NUM_BLOCKS)]
  lead = (STAGES,) if num_chunks == 1 else (num_chunks, STAGES)
  per_stage = NUM_BLOCKS // (STAGES * num_chunks)
  stages = jax.tree.map(
    lambda *b: jnp.stack(b).reshape(*lead, per_stage, *b[0].shape), *blocks
  )
  norm = nnx.split(nnx.LayerNorm(DIM, rngs=rngs))[1]
  return {"embed": embed, "position": position, "norm": norm, "stages": stages}


def make_stage(dropout: float):
  """One stage: its blocks in order on one micro-batch, each with its own key."""
  graph = nnx.split(Block(DIM, NUM_HEADS, dropout, nnx.Rngs(0)))[0]

  def stage_fn(stage_params, x, *, rng):
    # A scan over the blocks compiles one block, not one per block. The
    # `nnx.Rngs` is made inside the scan, from that block's key.
    def block(x, inputs):
      params, key = inputs
      return nnx.merge(graph, params)(x, nnx.Rngs(dropout=key)), None

    num_blocks = jax.tree.leaves(stage_params)[0].shape[0]
    keys = jax.random.split(rng, num_blocks)
    return jax.lax.scan(block, x, (stage_params, keys))[0]

  return stage_fn


def head_loss(params, y, targets, mask):
  """Σ over tokens of the cross-entropy, with the tied embedding as output layer."""
  embed = nnx.merge(EMBED_GRAPH, params["embed"])
  logits = embed.attend(nnx.merge(NORM_GRAPH, params["norm"])(y))
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(losses * mask)


def embed_inputs(params, inputs):
  return nnx.merge(EMBED_GRAPH, params["embed"])(inputs) + params["position"]


def pipelined_loss(mesh, stage_fn, schedule: str, num_chunks: int):
  """The per-token loss, the blocks pipelined; the head inside it with 1F1B
  and ZB-H1."""
  if schedule != "gpipe":

    def loss(params, inputs, targets, mask, key):
      # The head's parameters reach loss_fn by closure: they get gradients.
      head = lambda y, t: head_loss(params, y, *t)
      pipe = jaccum.pipeline(
        stage_fn,
        NUM_MICROBATCHES,
        mesh=mesh,
        data_axes="data",
        schedule=schedule,
        loss_fn=head,
        num_virtual_stages=num_chunks,
      )
      x = embed_inputs(params, inputs)
      total = pipe(params["stages"], x, (targets, mask), rng=key)
      return total / jnp.maximum(jnp.sum(mask), 1.0)

    return loss

  pipe = jaccum.pipeline(
    stage_fn,
    NUM_MICROBATCHES,
    mesh=mesh,
    data_axes="data",
    num_virtual_stages=num_chunks,
  )

  def loss(params, inputs, targets, mask, key):
    y = pipe(params["stages"], embed_inputs(params, inputs), rng=key)
    # The output is replicated over the stages; spread over them, the head
    # runs on 1/S of the rows on each device instead of all of them.
    spread = NamedSharding(mesh, P(("data", "stage")))
    y = jax.lax.with_sharding_constraint(y, spread)
    targets, mask = (
      jax.lax.with_sharding_constraint(a, spread) for a in (targets, mask)
    )
    return head_loss(params, y, targets, mask) / jnp.maximum(jnp.sum(mask), 1.0)

  return loss


def sequential_loss(stage_fn, num_chunks: int):
  """The same model unpipelined: a loop over the D·K micro-batches, each through
  every stage in order, stage l on micro-batch m with fold_in(fold_in(key, m), l)."""
  num_microbatches = DATA * NUM_MICROBATCHES

  def loss(params, inputs, targets, mask, key):
    stages = params["stages"]
    if num_chunks > 1:
      stages = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stages)
    split = lambda a: a.reshape(num_microbatches, -1, *a.shape[1:])
    x = split(embed_inputs(params, inputs))

    def microbatch(total, batch):
      m, h, t, w = batch

      def stage(h, layer):
        index, stage_params = layer
        stage_key = jax.random.fold_in(jax.random.fold_in(key, m), index)
        return stage_fn(stage_params, h, rng=stage_key), None

      num_stages = jax.tree.leaves(stages)[0].shape[0]
      h = jax.lax.scan(stage, h, (jnp.arange(num_stages), stages))[0]
      return total + head_loss(params, h, t, w), None

    batches = (jnp.arange(num_microbatches), x, split(targets), split(mask))
    total = jax.lax.scan(microbatch, jnp.float32(0), batches)[0]
    return total / jnp.maximum(jnp.sum(mask), 1.0)

  return loss


def train(loss, params, batches, seed, desc):
  """Trains from `params`; returns the losses, the final state, seconds a step."""
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
  def train_step(params, opt_state, key, inputs, targets, mask):
    value, grads = jax.value_and_grad(loss)(params, inputs, targets, mask, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  losses, start = [], time.perf_counter()
  for step, batch in enumerate(tqdm(batches, desc)):
    key = jax.random.fold_in(jax.random.key(seed), step)
    params, opt_state, value = train_step(params, opt_state, key, *batch)
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few steps, for CI")
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument(
    "--schedule", choices=("gpipe", "1f1b", "zb-h1", "zb-v"), default="1f1b"
  )
  parser.add_argument("--virtual-stages", type=int, choices=(1, 2), default=1)
  parser.add_argument("--dropout", type=float, default=0.1)
  parser.add_argument("--out", default="examples/out/pipeline_lm.png")
  args = parser.parse_args()
  num_steps = args.steps or (3 if args.quick else 200)
  num_chunks = args.virtual_stages
  if args.schedule == "zb-v" and num_chunks != 2:
    parser.error("--schedule zb-v runs two stages per device: --virtual-stages 2")

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
    f"{len(tokens)} paragraphs, {lengths.sum() / 1e3:.0f}k bytes; {num_steps} steps;"
    f" {args.schedule}, {num_chunks} stage(s) per device, dropout {args.dropout}"
  )

  params = init_params(num_chunks)
  stage_fn = make_stage(args.dropout)
  # Each stage's blocks on its own devices; the rest (embedding, norm) and the
  # batch as plain JAX would place them: replicated, and sharded over "data".
  stage_axis = P("stage") if num_chunks == 1 else P(None, "stage")
  stages = params["stages"]
  if args.schedule == "zb-v":  # chunk 1 runs back up: stage 2S - 1 - s at [1, s]
    stages = jax.tree.map(lambda a: jnp.stack([a[0], a[1][::-1]]), stages)
  pipelined_params = {
    **jax.device_put(
      {k: v for k, v in params.items() if k != "stages"}, NamedSharding(mesh, P())
    ),
    "stages": jax.device_put(stages, NamedSharding(mesh, stage_axis)),
  }
  batch_sharding = NamedSharding(mesh, P("data"))
  sharded_batches = [jax.device_put(b, batch_sharding) for b in batches]

  loss = pipelined_loss(mesh, stage_fn, args.schedule, num_chunks)
  piped, piped_params, piped_state, piped_seconds = train(
    loss, pipelined_params, sharded_batches, 1, f"pipelined ({args.schedule})"
  )
  unpipelined_params = jax.device_put(params, jax.devices()[0])
  whole, _, _, whole_seconds = train(
    sequential_loss(stage_fn, num_chunks), unpipelined_params, batches, 1, "unpipelined"
  )

  gap = np.abs(piped - whole)
  print(f"unpipelined loss: first {whole[0]:.4f}, last {whole[-1]:.4f} nats/token")
  print(f"pipelined loss:   first {piped[0]:.4f}, last {piped[-1]:.4f} nats/token")
  print(
    f"max |pipelined - unpipelined| = {gap.max():.2e} (step {gap.argmax()}); "
    f"at step 0 {gap[0]:.2e}"
  )
  K = NUM_MICROBATCHES
  print(
    "step time in lockstep ticks (each as long as its busiest device; time in "
    "forwards of one micro-batch through one stage, F = B = W = 1) and idle "
    "share, from jaccum.pipeline_schedule:"
  )
  for k in (K, 4 * K):
    cells = []
    for name, v in (("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zb-v", 2)):
      schedule = jaccum.pipeline_schedule(
        STAGES, k, schedule=name, num_virtual_stages=v
      )
      label = name + (f"×{v}" if v > 1 else "")
      cells.append(f"{label} {schedule.time:g} ({schedule.idle:.1%})")
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
  label = f"pipelined, {args.schedule}" + (
    f", V={num_chunks}" if num_chunks > 1 else ""
  )
  ax_loss.plot(steps, piped, "C0--", lw=1.2, label=label)
  ax_loss.set(xlabel="step", ylabel="per-token loss (nats)", title="training loss")
  ax_loss.legend()
  ax_gap.plot(steps, piped - whole, "C0", lw=1)
  ax_gap.axhline(0, color="k", lw=0.8)
  ax_gap.set(
    xlabel="step", ylabel="pipelined - unpipelined", title="difference (float32)"
  )
  fig.suptitle(
    f"{NUM_BLOCKS}-block LM in {STAGES * num_chunks} stages × {DATA} data shards, "
    f"K={NUM_MICROBATCHES} micro-batches of {BATCH_SIZE // DATA // NUM_MICROBATCHES} "
    f"sequences per shard, dropout {args.dropout}"
  )
  fig.tight_layout()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  print(f"saved {out}")


if __name__ == "__main__":
  main()

"""Profile: which ops of a micro-step run slower in a loop body than outside, on CPU.

XLA:CPU optimises the entry computation with passes that loop bodies do not
get (convolutions: `ConvCanonicalization`; see jaccum/_conv_layout.py). This
script looks for other ops that the accumulation loop makes slower, for four
micro-steps (gradients of the suite's MLP on 512 rows and its one-block
transformer LM on 8 sequences, from `models.py`, the Flax tutorial's CNN in
two versions, average and max pooling, and a ResNet block with BatchNorm).

Per model, the time of one micro-step:

* "call": `jit(grad_fn)` on one micro-batch, per call (includes dispatch);
* "loop": per iteration of a `lax.scan` over K micro-batches that evaluates
  the traced micro-step, as jaccum's loop does; "loop+rw" the same with
  `canonicalize_convolutions`;
* "unrolled": the same scan with `unroll=True`: the same work, no loop.

Per op: every distinct `dot_general`, convolution, pooling window
(`reduce_window*`, `select_and_scatter_add`), reduction, transpose, pad,
gather/scatter... of those micro-steps (by primitive, params and operand
types), run K times on fresh operands chained through a scalar carry (so XLA
can neither hoist it out of the loop nor run the copies side by side), in a
rolled scan ("loop") and an unrolled one; "call" is one `jit` call of the op.
"loop/unr" well above 1 marks an op the loop slows down; an op over 1.3x is
timed again with three times the rounds, and that second figure is kept.

Timings alternate between variants within every round; medians over rounds,
ratios are medians of per-round ratios. The machine may be shared: see the
load average saved with the results.

    python -m benchmarks.profile_loop_ops           # ~5 minutes on 2 cores
    python -m benchmarks.profile_loop_ops --quick   # fewer rounds, one op a kind

Results: `benchmarks/results/profile_loop_ops.json` (`results/quick/` with
--quick).
"""

import argparse
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.extend.core import Literal, jaxprs_in_params

from benchmarks import _record
from benchmarks import models as suite_models
from jaccum._core.rewrites import canonicalize_convolutions

NUM_MICROBATCHES = 8
SLOWER = 1.3  # loop/unrolled above this is timed again with 3x the rounds
PROFILED = {
  "dot_general",
  "conv_general_dilated",
  "reduce_window_sum",
  "reduce_window_max",
  "reduce_window",
  "select_and_scatter_add",
  "select_and_gather_add",
  "reduce_sum",
  "reduce_max",
  "argmax",
  "cumsum",
  "transpose",
  "pad",
  "gather",
  "scatter-add",
  "scatter_add",
  "dynamic_slice",
  "dynamic_update_slice",
  "concatenate",
  "rev",
  "sort",
}


# --- models: (params, micro-batch, loss) ---------------------------------------


class TutorialCNN(nnx.Module):
  """The Flax NNX MNIST tutorial's CNN, here on the 8x8 digits."""

  def __init__(self, rngs, pool=nnx.avg_pool):
    self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
    self.linear1 = nnx.Linear(64 * 2 * 2, 256, rngs=rngs)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)
    self.pool = functools.partial(pool, window_shape=(2, 2), strides=(2, 2))

  def __call__(self, x):
    x = self.pool(nnx.relu(self.conv1(x)))
    x = self.pool(nnx.relu(self.conv2(x)))
    x = nnx.relu(self.linear1(x.reshape(x.shape[0], -1)))
    return self.linear2(x)


class ResNetBlock(nnx.Module):
  """A stem, one residual block (conv-BN-relu-conv-BN, skip), a linear head."""

  def __init__(self, rngs, channels=32):
    self.stem = nnx.Conv(3, channels, (3, 3), rngs=rngs)
    self.conv1 = nnx.Conv(channels, channels, (3, 3), use_bias=False, rngs=rngs)
    self.bn1 = nnx.BatchNorm(channels, rngs=rngs)
    self.conv2 = nnx.Conv(channels, channels, (3, 3), use_bias=False, rngs=rngs)
    self.bn2 = nnx.BatchNorm(channels, rngs=rngs)
    self.head = nnx.Linear(channels, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem(x))
    y = nnx.relu(self.bn1(self.conv1(x)))
    x = nnx.relu(x + self.bn2(self.conv2(y)))
    return self.head(x.mean((1, 2)))


def nnx_model(module, x_shape, micro):
  """A functional loss over an NNX module's params; BatchNorm in training mode."""
  graphdef, state = nnx.split(module(nnx.Rngs(0)))

  def loss(state, batch):  # BatchNorm statistics are passed, not closed over
    logits = nnx.merge(graphdef, state)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  rng = np.random.default_rng(1)
  batch = {
    "x": rng.normal(size=(micro, *x_shape)).astype(np.float32),
    "y": np.arange(micro) % 10,
  }
  return state, batch, loss


def suite_model(name, quick, rows):
  """A model of the suite (`models.py`) with a micro-batch of its first `rows`."""
  model = suite_models.build(name, quick)
  micro = jax.tree.map(lambda x: np.asarray(x[:rows]), model.batch)
  return model.params, micro, model.loss


def models():
  """name -> (params, micro-batch, loss)."""
  return {
    "mlp": suite_model("mlp", False, 512),
    "transformer": suite_model("lm", True, 8),  # --quick's size: one block
    "cnn_avgpool": nnx_model(TutorialCNN, (8, 8, 1), 16),
    "cnn_maxpool": nnx_model(
      functools.partial(TutorialCNN, pool=nnx.max_pool), (8, 8, 1), 16
    ),
    "resnet_bn": nnx_model(ResNetBlock, (16, 16, 3), 16),
  }


# --- timing ----------------------------------------------------------------------


def time_interleaved(calls, rounds):
  """Seconds per call of each `(fn, args)`, one entry per round, rotated order."""
  for fn, args in calls.values():
    for _ in range(2):
      jax.block_until_ready(fn(*args))
  times = {name: [] for name in calls}
  names = list(calls)
  for round_index in range(rounds):
    shift = round_index % len(names)
    for name in names[shift:] + names[:shift]:
      fn, args = calls[name]
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {name: np.array(t) for name, t in times.items()}


def profile_model(params, micro, loss, rounds):
  """Per-micro-step seconds: one call, loop, loop+rewrite, unrolled."""
  grad_fn = jax.grad(loss)
  leaves, tree = jax.tree.flatten((params, micro))
  closed = jax.make_jaxpr(lambda *leaves: grad_fn(*jax.tree.unflatten(tree, leaves)))(
    *leaves
  )
  rewritten = canonicalize_convolutions(closed)
  num_params = len(jax.tree.leaves(params))
  # Loop over micro-batches: stack K micro-batches as K copies shifted by k.
  micro_leaves = leaves[num_params:]
  stacked = [
    np.stack([np.roll(x, k, axis=0) for k in range(NUM_MICROBATCHES)])
    for x in micro_leaves
  ]

  def as_loop(closed, unroll):
    def run(params, stacked):
      def body(total, micro):
        out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *params, *micro)
        return total + sum(jnp.sum(o) for o in out), None

      zero = jnp.zeros((), jnp.float32)
      return jax.lax.scan(body, zero, stacked, unroll=unroll)[0]

    return jax.jit(run), (leaves[:num_params], stacked)

  calls = {
    "call": (jax.jit(grad_fn), (params, micro)),
    "loop": as_loop(closed, 1),
    "loop+rw": as_loop(rewritten, 1),
    "unrolled": as_loop(rewritten, True),
  }
  times = time_interleaved(calls, rounds)
  for name in ("loop", "loop+rw", "unrolled"):
    times[name] = times[name] / NUM_MICROBATCHES
  return times, [closed, rewritten]


# --- single ops ------------------------------------------------------------------


def profiled_eqns(jaxprs):
  """Distinct equations of `PROFILED` primitives, nested programs included."""
  found = {}

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      subs = list(jaxprs_in_params(eqn.params))
      for sub in subs:
        visit(sub)
      floating = [
        v
        for v in eqn.invars
        if not isinstance(v, Literal) and jnp.issubdtype(v.aval.dtype, jnp.floating)
      ]
      if subs or eqn.primitive.name not in PROFILED or not floating:
        continue
      key = (
        eqn.primitive.name,
        str(sorted((k, str(v)) for k, v in eqn.params.items())),
        tuple(v.aval.str_short() for v in eqn.invars),
      )
      found.setdefault(key, eqn)

  for closed in jaxprs:
    visit(closed.jaxpr)
  return list(found.values())


def op_calls(eqn):
  """`call`, `loop` and `unrolled` runs of one equation, as `(fn, args)`."""
  rng = np.random.default_rng(0)
  operands = []
  for v in eqn.invars:
    aval = v.aval
    if isinstance(v, Literal):
      operands.append(v.val)
    elif jnp.issubdtype(aval.dtype, jnp.floating):
      operands.append(rng.normal(size=aval.shape).astype(aval.dtype))
    else:
      operands.append(np.zeros(aval.shape, aval.dtype))
  chained = next(
    i
    for i, v in enumerate(eqn.invars)
    if not isinstance(v, Literal) and jnp.issubdtype(v.aval.dtype, jnp.floating)
  )  # `profiled_eqns` keeps only ops with a floating operand
  bind = lambda *ops: eqn.primitive.bind(*ops, **eqn.params)
  stacked = np.stack([np.roll(operands[chained], k) for k in range(NUM_MICROBATCHES)])

  def looped(unroll):
    def run(stacked, operands):
      def body(total, x):
        ops = list(operands)
        ops[chained] = x + total.astype(x.dtype)  # each copy waits for the last
        out = bind(*ops)
        out = out if isinstance(out, list | tuple) else [out]
        return 1e-30 * sum(jnp.sum(o).astype(jnp.float32) for o in out), None

      zero = jnp.zeros((), jnp.float32)
      return jax.lax.scan(body, zero, stacked, unroll=unroll)[0]

    return jax.jit(run), (stacked, operands)

  return {
    "call": (jax.jit(bind), operands),
    "loop": looped(1),
    "unrolled": looped(True),
  }


def profile_op(eqn, rounds):
  times = time_interleaved(op_calls(eqn), rounds)
  for name in ("loop", "unrolled"):
    times[name] = times[name] / NUM_MICROBATCHES
  primitive, detail, shapes = describe(eqn)
  return {
    "primitive": primitive,
    "detail": detail,
    "operands": shapes,
    "seconds": {k: float(np.median(v)) for k, v in times.items()},
    "loop/unrolled": float(np.median(times["loop"] / times["unrolled"])),
  }


def describe(eqn):
  params = eqn.params
  if eqn.primitive.name == "dot_general":
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    detail = f"contract {tuple(lc)}x{tuple(rc)} batch {tuple(lb)}x{tuple(rb)}"
  elif eqn.primitive.name == "conv_general_dilated":
    lhs, rhs, out = params["dimension_numbers"]
    detail = f"{tuple(lhs)} {tuple(rhs)} {tuple(out)} bg={params['batch_group_count']}"
  elif "window_dimensions" in params:
    detail = f"window {params['window_dimensions']}"
  elif "permutation" in params:
    detail = f"perm {params['permutation']}"
  elif "axes" in params:
    detail = f"axes {params['axes']}"
  else:
    detail = ""
  shapes = ",".join(v.aval.str_short() for v in eqn.invars)
  return eqn.primitive.name, detail, shapes


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--quick", action="store_true", help="fewer rounds, one op of each primitive"
  )
  args = parser.parse_args()
  rounds = 5 if args.quick else 11
  start, load_before = time.perf_counter(), os.getloadavg()

  model_rows, traced = [], {}
  print(
    f"{'model':12} {'call':>8} {'loop':>8} {'loop+rw':>8} {'unrolled':>8} µs"
    f"{'loop/unr':>9}{'rw/unr':>7}{'rw/call':>8}"
  )
  for name, (params, micro, loss) in models().items():
    times, traced[name] = profile_model(params, micro, loss, rounds)
    ratio = lambda a, b, t=times: float(np.median(t[a] / t[b]))
    row = {
      "model": name,
      "seconds": {k: float(np.median(v)) for k, v in times.items()},
      "loop/unrolled": ratio("loop", "unrolled"),
      "loop+rw/unrolled": ratio("loop+rw", "unrolled"),
      "loop+rw/call": ratio("loop+rw", "call"),
    }
    model_rows.append(row)
    s = row["seconds"]
    print(
      f"{name:12}"
      + "".join(f" {s[k] * 1e6:>8.0f}" for k in ("call", "loop", "loop+rw", "unrolled"))
      + f"   {row['loop/unrolled']:>9.2f}{row['loop+rw/unrolled']:>7.2f}"
      + f"{row['loop+rw/call']:>8.2f}",
      flush=True,
    )

  eqns = profiled_eqns([c for pair in traced.values() for c in pair])
  if args.quick:  # CI checks that it runs: the first op of each kind, not all
    first_of_kind: dict[str, Any] = {}
    for eqn in eqns:
      first_of_kind.setdefault(eqn.primitive.name, eqn)
    eqns = list(first_of_kind.values())
  print(f"\n{len(eqns)} distinct ops; per op, µs:")
  header = f"{'op':24}{'call':>9}{'loop':>9}{'unrolled':>9}{'loop/unr':>9}"
  print(header + "  detail, operands")
  op_rows = []
  for eqn in eqns:
    row = profile_op(eqn, rounds)
    if row["loop/unrolled"] > SLOWER:  # a second look, longer: most are noise
      row = profile_op(eqn, 3 * rounds) | {"first_look": row["loop/unrolled"]}
    op_rows.append(row)
    s = row["seconds"]
    print(
      f"{row['primitive']:24}"
      + "".join(f"{s[k] * 1e6:>9.1f}" for k in ("call", "loop", "unrolled"))
      + f"{row['loop/unrolled']:>9.2f}  {row['detail']} {row['operands']}",
      flush=True,
    )
  elapsed = time.perf_counter() - start

  slow = sorted(
    (r for r in op_rows if r["loop/unrolled"] > SLOWER),
    key=lambda r: -r["loop/unrolled"],
  )
  print(f"\nops over {SLOWER}x slower in the loop than unrolled ({len(slow)}):")
  for r in slow:
    print(f"  {r['loop/unrolled']:.2f}x {r['primitive']} {r['detail']} {r['operands']}")
  print(
    f"\n{_record.machine()['cpu']}, {os.cpu_count()} cores, jax {jax.__version__}; "
    f"median of {rounds} rounds; {elapsed:.0f} s"
  )
  _record.save(
    "profile_loop_ops",
    args.quick,
    load_before[0],
    rounds=rounds,
    num_microbatches=NUM_MICROBATCHES,
    seconds_total=elapsed,
    models=model_rows,
    ops=op_rows,
  )


if __name__ == "__main__":
  main()

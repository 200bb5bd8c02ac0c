"""DiLoCo's bytes per mesh axis against data parallel, on 8 simulated CPU devices.

A mesh of 4 replicas (the slow `"replica"` axis) × 2 devices (the fast
`"data"` axis) trains an MLP of four square float32 layers (four leaves, so
that 4 fragments are equal). For each method: the bytes one step sends per
device over each axis, averaged over a round of H = 32 steps (each distinct
program compiled once and counted by `jaccum.inspect`, as
`DiLoCo.train_step(...).bytes_per_step` does), the most one call sends over
the slow axis, the state DiLoCo adds per replica (bytes per param), and the
median CPU time of a step over a round.

- data parallel: `jaccum.data_parallel` over both axes, every step;
- DiLoCo: the replicas' pseudo-gradients reduced once a round;
- Streaming DiLoCo, 4 fragments, delay 1: a quarter at a time;
- each with `reduce_dtype=bfloat16` too: read from the program jaccum hands
  XLA (XLA:CPU widens bf16 all-reduces when it compiles; GPUs and TPUs send
  them as written), where the compiled program would show float32.

The fast axis carries each replica's data-parallel gradients every step in
every method. It runs in its own process (the suite starts it).

    python -m benchmarks.diloco [--quick] [--out results.json]

Writes `benchmarks/results/diloco.json` and `diloco.md` (`results/quick/`
with `--quick`), or with `--out PATH` only the record, as JSON (the suite's
way: `python -m benchmarks --parts diloco`).
"""

from __future__ import annotations

import statistics
import time

import jax

NUM_DEVICES, REPLICAS, SYNC_EVERY, FRAGMENTS, DELAY = 8, 4, 32, 4, 1


def _mlp(width: int):
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(0)
  params = {
    f"w{i}": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32)
    for i in range(4)
  }

  def loss(p, x):
    for i in range(4):
      x = jnp.tanh(x @ p[f"w{i}"])
    return jnp.mean(x**2)

  return params, loss


def _by_axis(counts) -> dict[str, float]:
  return {
    "+".join(key) if isinstance(key, tuple) else str(key): float(
      c.bytes_outside_loops + (c.bytes_inside_loops or 0)
    )
    for key, c in counts.by_axis.items()
  }


def _handed_to_xla(step, params, state, x, layout) -> tuple[dict[str, float], float]:
  """Bytes per step by axis, and the most one call sends over the slow axis,
  from the lowered programs of a round (the wire as jaccum writes it)."""
  import jax.numpy as jnp

  import jaccum.inspect

  total: dict[str, float] = {}
  most = 0.0
  seen: dict[str, dict[str, float]] = {}
  for count in range(SYNC_EVERY, 2 * SYNC_EVERY):
    at = state._replace(count=jnp.full_like(state.count, count))
    text = step.lower(params, at, x).as_text(dialect="hlo")
    sent = seen.setdefault(
      text, _by_axis(jaccum.inspect._count_collectives(text, layout))
    )
    most = max(most, sent.get("replica", 0.0))
    for key, value in sent.items():
      total[key] = total.get(key, 0.0) + value / SYNC_EVERY
  return total, most


def _round_ms(call, params, state, x, rounds: int) -> float:
  """Median ms of a step, timed over whole rounds (every phase in its share).

  Each step is waited for: XLA:CPU's simulated devices can deadlock with
  several programs holding collectives in flight at once.
  """

  def steps(params, state, count):
    for _ in range(count):
      params, state = jax.block_until_ready(call(params, state, x)[:2])
    return params, state

  params, state = steps(params, state, SYNC_EVERY + 1)  # compiles every phase
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    params, state = steps(params, state, SYNC_EVERY)
    times.append(1e3 * (time.perf_counter() - start) / SYNC_EVERY)
  return statistics.median(times)


def run(quick: bool) -> dict:
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaccum
  import jaccum.inspect

  assert len(jax.devices("cpu")) >= NUM_DEVICES, "set 8 CPU devices before JAX starts"
  width = 256 if quick else 512
  mesh = jax.make_mesh(
    (REPLICAS, NUM_DEVICES // REPLICAS), ("replica", "data"), devices=jax.devices("cpu")
  )
  layout = jaccum.inspect._layout(mesh)
  params, loss = _mlp(width)
  num_params = 4 * width * width
  x = np.random.default_rng(1).normal(size=(NUM_DEVICES * 16, width))
  x = jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, P()))
  rows, rounds = [], 2 if quick else 5

  grad_fn = jaccum.data_parallel(jax.grad(loss), 1, mesh=mesh, axis=("replica", "data"))
  sgd = optax.sgd(1e-3)

  @jax.jit
  def dp_step(params, opt_state, x):
    updates, opt_state = sgd.update(grad_fn(params, x), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  sent = _by_axis(jaccum.inspect.collectives(dp_step, params, sgd.init(params), x))
  rows.append(
    {
      "method": "data parallel",
      "bytes_per_step": sent,
      "most_per_call_slow": sent.get("replica+data", 0.0),
      "extra_bytes_per_param": 0.0,
      "step_ms_cpu": _round_ms(dp_step, params, sgd.init(params), x, rounds),
    }
  )
  variants = {
    f"DiLoCo H={SYNC_EVERY}": {},
    f"DiLoCo H={SYNC_EVERY}, bf16 wire": {"reduce_dtype": jnp.bfloat16},
    f"Streaming P={FRAGMENTS}, delay {DELAY}": {
      "num_fragments": FRAGMENTS,
      "delay": DELAY,
    },
    f"Streaming P={FRAGMENTS}, delay {DELAY}, bf16 wire": {
      "num_fragments": FRAGMENTS,
      "delay": DELAY,
      "reduce_dtype": jnp.bfloat16,
    },
  }
  for name, options in variants.items():
    diloco = jaccum.DiLoCo(sgd, SYNC_EVERY, axis_name="replica", **options)
    step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh, axis="data")
    replicas, state = step.init(params)
    sent, most = _handed_to_xla(step, replicas, state, x, layout)
    one = diloco.init(params)
    extra = jax.tree.leaves((one.snapshot, one.outer_state, one.in_flight))
    rows.append(
      {
        "method": name,
        "bytes_per_step": sent,
        "bytes_per_step_compiled": step.bytes_per_step(replicas, state, x),
        "most_per_call_slow": most,
        "extra_bytes_per_param": sum(a.nbytes for a in extra) / num_params,
        "step_ms_cpu": _round_ms(step, replicas, state, x, rounds),
      }
    )
  for row in rows:
    print(
      f"{row['method']:<34}"
      + ", ".join(f"{k}: {v:,.0f} B" for k, v in row["bytes_per_step"].items())
      + f"; at most {row['most_per_call_slow']:,.0f} B a call over the slow axis;"
      f" +{row['extra_bytes_per_param']:.1f} B/param; {row['step_ms_cpu']:.1f} ms",
      flush=True,
    )
  return {
    "devices": NUM_DEVICES,
    "mesh": f"{REPLICAS} replicas x {NUM_DEVICES // REPLICAS} devices",
    "model": f"MLP of 4 {width}x{width} float32 layers ({num_params:,} params, "
    f"{4 * num_params:,} B)",
    "sync_every": SYNC_EVERY,
    "rows": rows,
  }


def main() -> None:
  from benchmarks import _record

  _record.standalone(
    "diloco", __doc__, run, lambda: _record.section("diloco"),
    "a smaller model, 2 rounds", rounds=False, devices=NUM_DEVICES,
  )  # fmt: skip


if __name__ == "__main__":
  main()

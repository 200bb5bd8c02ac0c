"""Benchmark: `jaccum.MultiSteps` vs `optax.MultiSteps`, time per mini-step and memory.

Both wrap the same inner optimizer with K=8 mini-steps per window, in the same
jitted train step (gradients of one micro-batch, `update`, `apply_updates`)
that donates params and optimizer state, as real training loops do. Cases:

* adam on an MLP of 12.6M parameters: optax runs Adam on every mini-step and
  throws 7 of 8 results away; jaccum runs it once per window.
* muon (`optax.contrib.muon`) on an MLP of 2.1M parameters: a compute-heavy
  inner update (Newton-Schulz iterations on every weight matrix).

Two reference rows: "sketch", the first formulation tried, a plain `lax.cond`
around the inner update whose other branch returns fresh zeros and the
unchanged inner state (its conditional makes params-sized buffers that jaccum's
formulation avoids); and "optax-nd", optax.MultiSteps without donation, which
on CPU is faster than with it, so that jaccum is also compared with optax at
its best. `--no-donate` runs every variant without donation.

Reported per case: the median time per mini-step (each round runs one window
of each variant, in rotated order, so background load hits them alike; ratios
are medians of per-round ratios), the median time of the calls that only
accumulate and of the call that ends a window, XLA's temporary memory
(`compiled.memory_analysis().temp_size_in_bytes`) and the params-sized `copy`
ops left in the compiled step. All variants must agree on the params after a
window before their times mean anything.

Run it as part of the suite (`python -m benchmarks --parts multisteps`, with
`--no-donate` for the undonated variant); `--quick` runs the Adam case only,
on a smaller MLP, for 2 windows.
"""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaccum

K = 8
MICROBATCH = 8  # rows per mini-step: small, as when memory forces accumulation


def init_mlp(key, sizes):
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
    for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def loss(params, batch):
  x = batch["x"]
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  logits = x @ params[-1]["w"] + params[-1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def microbatches(key, sizes):
  kx, ky = jax.random.split(key)
  return [
    {
      "x": jax.random.normal(jax.random.fold_in(kx, k), (MICROBATCH, sizes[0])),
      "y": jax.random.randint(jax.random.fold_in(ky, k), (MICROBATCH,), 0, sizes[-1]),
    }
    for k in range(K)
  ]


class Sketch:
  """The first sketch: `lax.cond` around the inner update only."""

  def __init__(self, opt, every_k):
    self.opt, self.every_k = opt, every_k

  def init(self, params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return jnp.zeros([], jnp.int32), self.opt.init(params), zeros

  def update(self, grads, state, params):
    mini_step, inner_state, acc = state
    acc = jax.tree.map(lambda a, g: a + (g - a) / (mini_step + 1), acc, grads)
    emit = mini_step == self.every_k - 1
    updates, inner_state = jax.lax.cond(
      emit,
      self.opt.update,
      lambda acc, inner_state, params: (jax.tree.map(jnp.zeros_like, acc), inner_state),
      acc,
      inner_state,
      params,
    )
    acc = jax.tree.map(lambda a: jnp.where(emit, 0, a), acc)
    return updates, (jnp.where(emit, 0, mini_step + 1), inner_state, acc)


# name: (layer sizes, quick layer sizes, inner optimizer)
CASES = {
  "adam": ([1024, 2048, 2048, 2048, 1024, 10], [256, 512, 512, 256, 10], optax.adam),
  "muon": ([512, 1024, 1024, 512, 10], [128, 256, 256, 128, 10], optax.contrib.muon),
}
# name: (wrapper, donates params and state). "optax-nd" is optax without
# donation, a reference: on CPU, optax.MultiSteps runs faster that way.
VARIANTS = {
  "optax": (optax.MultiSteps, True),
  "optax-nd": (optax.MultiSteps, False),
  "sketch": (Sketch, True),
  "jaccum": (jaccum.MultiSteps, True),
}


def params_sized_copies(compiled, params):
  """`copy` ops outside fusions whose shape is a param's: buffers XLA copied."""
  shapes = {f"f32[{','.join(map(str, p.shape))}]" for p in jax.tree.leaves(params)}
  count, computation = 0, ""
  for line in compiled.as_text().splitlines():
    if line and not line.startswith(" "):
      computation = line.lstrip("%")
    match = re.search(r"= (f32\[[\d,]*\])\S* copy\(", line)
    if match and match.group(1) in shapes and not computation.startswith("fused"):
      count += 1
  return count


def measure(case, quick, rounds, donate):
  full_sizes, quick_sizes, make_inner = CASES[case]
  sizes = quick_sizes if quick else full_sizes
  params = init_mlp(jax.random.key(0), sizes)
  batches = microbatches(jax.random.key(1), sizes)
  num_params = sum(p.size for p in jax.tree.leaves(params))

  variants = {
    name: (wrapper, donates and donate)
    for name, (wrapper, donates) in VARIANTS.items()
    if donate or name != "optax-nd"
  }
  compiled, states, temp, copies = {}, {}, {}, {}
  for name, (wrapper, donates) in variants.items():
    opt = wrapper(make_inner(1e-3), K)

    def train_step(params, opt_state, batch, opt=opt):
      updates, opt_state = opt.update(jax.grad(loss)(params, batch), opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    step = jax.jit(train_step, donate_argnums=(0, 1) if donates else ())
    state = opt.init(params)
    compiled[name] = step.lower(params, state, batches[0]).compile()
    temp[name] = compiled[name].memory_analysis().temp_size_in_bytes
    copies[name] = params_sized_copies(compiled[name], params)
    states[name] = (jax.tree.map(jnp.copy, params), state)

  def run_window(name):
    """One window of K calls; returns the seconds of each call."""
    params, state = states[name]
    seconds = []
    for batch in batches:
      start = time.perf_counter()
      params, state = compiled[name](params, state, batch)
      jax.block_until_ready(params)
      seconds.append(time.perf_counter() - start)
    states[name] = (params, state)
    return seconds

  # One window from the same params: all variants must land on the same params.
  for name in variants:
    run_window(name)
  reference = states["optax"][0]
  for name in variants:
    error = max(
      float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
      for a, b in zip(
        jax.tree.leaves(states[name][0]), jax.tree.leaves(reference), strict=True
      )
    )
    assert error < 1e-5, f"{case}: {name} differs from optax by {error:.2g}"

  times = {name: [] for name in variants}
  names = list(variants)
  for round_index in range(rounds):
    shift = round_index % len(names)
    for name in names[shift:] + names[:shift]:
      times[name].append(run_window(name))
  times = {name: np.array(t) for name, t in times.items()}  # [rounds, K]
  per_step = {name: t.mean(axis=1) for name, t in times.items()}
  ratio = lambda a, b: float(np.median(per_step[a] / per_step[b]))
  return {
    "case": case,
    "num_params": int(num_params),
    "param_bytes": int(num_params * 4),
    "every_k": K,
    "microbatch_rows": MICROBATCH,
    "donated": donate,
    "seconds_per_mini_step": {n: float(np.median(t)) for n, t in per_step.items()},
    "seconds_accumulate_call": {
      n: float(np.median(t[:, :-1])) for n, t in times.items()
    },
    "seconds_emit_call": {n: float(np.median(t[:, -1])) for n, t in times.items()},
    "time_ratios": {
      f"{name}/{base}": ratio(name, base)
      for base in ("optax", "optax-nd")
      if base in names
      for name in names
    },
    "temp_bytes": temp,
    # None where optax's temporaries are a few scalars (without donation XLA
    # writes straight into fresh output buffers): such a ratio means nothing.
    "memory_ratios": {
      f"{name}/optax": temp[name] / temp["optax"] if temp["optax"] > 2**20 else None
      for name in names
    },
    "params_sized_copies": copies,
  }


def table(results):
  mib = 2**20
  header = (
    f"{'inner':6}{'params':>8}{'variant':>9} |{'ms/mini-step':>13}{'accum':>8}"
    f"{'emit':>8}{'×optax':>8}{'×optax-nd':>10} |{'temp MiB':>9}{'×optax':>8}"
    f"{'copies':>7}"
  )
  lines = [header, "-" * len(header)]
  for r in results:
    for name in r["temp_bytes"]:
      ratios = [r["time_ratios"].get(f"{name}/{b}") for b in ("optax", "optax-nd")]
      ratios = ["-" if x is None else f"{x:.2f}" for x in ratios]
      memory = r["memory_ratios"][f"{name}/optax"]
      memory = "-" if memory is None else f"{memory:.2f}"
      lines.append(
        f"{r['case']:6}{r['num_params'] / 1e6:>7.1f}M{name:>9} |"
        f"{r['seconds_per_mini_step'][name] * 1e3:>13.1f}"
        f"{r['seconds_accumulate_call'][name] * 1e3:>8.1f}"
        f"{r['seconds_emit_call'][name] * 1e3:>8.1f}{ratios[0]:>8}{ratios[1]:>10} |"
        f"{r['temp_bytes'][name] / mib:>9.1f}{memory:>8}"
        f"{r['params_sized_copies'][name]:>7}"
      )
  return "\n".join(lines)


def run(quick: bool, rounds: int | None = None, donate: bool = True) -> dict:
  """Every case (the Adam case only with `quick`); a record for the suite."""
  rounds = rounds or (2 if quick else 7)
  start = time.perf_counter()
  results = []
  for case in ("adam",) if quick else tuple(CASES):
    results.append(measure(case, quick, rounds, donate=donate))
    print(table(results[-1:]), flush=True)
  return {
    "every_k": K,
    "microbatch_rows": MICROBATCH,
    "donated": donate,
    "rounds": rounds,
    "seconds_total": time.perf_counter() - start,
    "results": results,
  }

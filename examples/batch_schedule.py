"""Grow the batch with the gradient noise scale: fewer steps for the same loss?

Two tasks, each trained three ways from the same start on the same stream of
examples:

- fixed small: K_small micro-batches per step;
- fixed large: K_large micro-batches, the learning rate scaled by
  sqrt(K_large / K_small) (Adam's square-root rule);
- noise-driven: `jaccum.BatchSizeController` starts at K_small and doubles K
  whenever the smoothed critical batch `B_simple` (`return_stats=True`,
  `jaccum.NoiseScaleEMA`) exceeds the batch, up to K_large, halving it when
  even half the batch would exceed `B_simple`, with the same square-root rule;
  and (not with --quick) the same with `headroom=4`, which keeps the batch
  below B_simple / 4.

The tasks: the CNN of examples/noise_scale.py on scikit-learn's digits (the
loss on the whole training set), and the byte-level transformer of
examples/token_weighted_lm.py on Python's help text (token-weighted, the loss
per token on 256 held-out paragraphs). The target is the loss the fixed small
batch ends at after the budget of examples. Every run gets that budget (the
step that crosses it is cut short, so they see exactly the same examples); the
large and noise-driven runs then go on to `--overrun` times the budget, to say
how many steps and examples they need to reach the target if they do not
within the budget. Printed per run: its loss at the budget, and the optimizer
steps, examples and seconds to the target. The plot shows the loss against
examples and K against steps.

One compilation at capacity K_large serves every K: each step pads its
batch to capacity and runs only its first K micro-batches
(`num_real_microbatches=`, traced), so the noise-driven run does not
recompile when K changes. The fixed runs share one compilation (the
step without the noise scale) and each controller has its own; the seconds
include it, and "compile" says how long the call that compiled took (0 for
a run whose step was compiled by an earlier run).

  python examples/batch_schedule.py [--quick] [--tasks digits lm] [--out PATH.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from noise_scale import CNN  # examples/: the digits CNN without BatchNorm
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from token_weighted_lm import SEQ_LEN, TinyLM, count_tokens, load_paragraphs
from token_weighted_lm import loss_fn as lm_loss_fn

import jaccum

EMA = jaccum.NoiseScaleEMA(decay=0.95)  # about the last 20 steps
Controller = jaccum.BatchSizeController


@dataclasses.dataclass(frozen=True)
class Task:
  """A model, its data as one stream of examples, and the runs' settings."""

  name: str
  init_params: Any
  loss: Callable[..., jax.Array]  # loss(params, *batch): a mean over the batch
  weight_fn: Callable[..., jax.Array] | None  # per micro-batch, e.g. its tokens
  data: tuple[np.ndarray, ...]  # training arrays, one row per example
  eval_loss: Callable[[Any], jax.Array]  # jitted: the loss the target is set on
  microbatch_size: int  # examples per micro-batch
  noise_units_per_microbatch: float  # B_simple's units: examples, or tokens
  k_small: int
  k_large: int
  learning_rate: float  # Adam's, at K = k_small
  budget: int  # examples per run
  num_evals: int  # evaluations within the budget

  def rows(self, offset: int, count: int) -> tuple[np.ndarray, ...]:
    """Examples `offset .. offset + count - 1` of the stream: epochs, each shuffled.

    The stream is a function of the offset alone, so a run that changes its
    batch (or resumes) at offset `o` reads exactly what follows `o`.
    """
    size = len(self.data[0])
    epochs, index = np.divmod(np.arange(offset, offset + count), size)
    rows = np.stack([_permutation(size, int(e)) for e in np.unique(epochs)])
    return tuple(x[rows[epochs - epochs[0], index]] for x in self.data)


@functools.cache
def _permutation(size: int, epoch: int) -> np.ndarray:
  return np.random.default_rng(epoch).permutation(size)


def digits_task(quick: bool) -> Task:
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1]
  x_train, _, y_train, _ = train_test_split(
    images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
  )
  graphdef, params = nnx.split(CNN(nnx.Rngs(0)))

  def loss(params, images, labels):
    logits = nnx.merge(graphdef, params)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  x_all, y_all = jnp.asarray(x_train), jnp.asarray(y_train)
  return Task(
    name="digits CNN",
    init_params=params,
    loss=loss,
    weight_fn=None,
    data=(x_train, y_train),
    eval_loss=jax.jit(lambda p: loss(p, x_all, y_all)),  # the whole training set
    microbatch_size=8,
    noise_units_per_microbatch=8,
    k_small=2,  # batches of 16 images ...
    k_large=4 if quick else 32,  # ... to 512
    learning_rate=3e-3,  # examples/nnx_digits.py's
    budget=(2 if quick else 10) * 1440,  # epochs of the 1,437 training images
    num_evals=4 if quick else 80,
  )


def lm_task(quick: bool) -> Task:
  tokens, lengths = load_paragraphs()
  order = np.random.default_rng(0).permutation(len(tokens))
  held_out, train = order[:256], order[256:]
  mask = (np.arange(SEQ_LEN) < lengths[:, None] - 1).astype(np.float32)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  graphdef, params = nnx.split(TinyLM(nnx.Rngs(0)))

  def loss(params, inputs, targets, mask):
    return lm_loss_fn(nnx.merge(graphdef, params), inputs, targets, mask)[0]

  held = tuple(jnp.asarray(x[held_out]) for x in (inputs, targets, mask))
  tokens_per_sequence = float(mask[train].sum(1).mean())
  return Task(
    name="byte-level LM",
    init_params=params,
    loss=loss,
    # weight_fn sees every argument, params first: the real tokens count.
    weight_fn=lambda params, *batch: count_tokens(*batch),
    data=(inputs[train], targets[train], mask[train]),
    eval_loss=jax.jit(lambda p: loss(p, *held)),  # per token, held out
    microbatch_size=2,  # sequences
    noise_units_per_microbatch=2 * tokens_per_sequence,  # B_simple is in tokens
    k_small=2,  # batches of 4 sequences ...
    k_large=4 if quick else 32,  # ... to 64
    learning_rate=3e-3,  # examples/token_weighted_lm.py's
    budget=1024 if quick else 10 * 2048,  # the 2,284 training paragraphs: ~9 epochs
    num_evals=4 if quick else 80,
  )


@dataclasses.dataclass
class Run:
  """What one run records, per step and per evaluation."""

  name: str
  num_microbatches: list[int] = dataclasses.field(default_factory=list)
  noise_scale: list[float] = dataclasses.field(default_factory=list)
  # (examples, steps, seconds, loss, of the seconds compiling)
  evals: list[tuple[int, int, float, float, float]] = dataclasses.field(
    default_factory=list
  )
  compile_seconds: float = 0.0

  def at(self, examples: int) -> tuple[int, int, float, float, float]:
    """The evaluation at exactly `examples`."""
    return next(e for e in self.evals if e[0] == examples)

  def first_at_or_below(
    self, loss: float
  ) -> tuple[int, int, float, float, float] | None:
    return next((e for e in self.evals if e[3] <= loss), None)


class Trainer:
  """The jitted steps of one task, all at capacity K_large: one per controller.

  A step serves every K (`num_real_microbatches=`), so it compiles once, on
  its first call: once for the fixed runs (no controller), once for each
  controller.
  """

  def __init__(self, task: Task):
    self.task = task
    self.optimizer = optax.adam(task.learning_rate)
    self.steps: dict[Controller | None, Callable] = {}

  def controller(self, headroom: float) -> Controller:
    return jaccum.BatchSizeController(
      self.task.noise_units_per_microbatch,
      max_num_microbatches=self.task.k_large,
      min_num_microbatches=self.task.k_small,
      headroom=headroom,
      lr_scaling="sqrt",
    )

  def compiled_step(self, controller: Controller | None):
    """The train step at capacity K_large; with a controller, the noise scale too.

    `split="contiguous"`: the first n micro-batches are the first n·m rows,
    what a batch padded at its end to capacity needs with a traced K
    (`num_real_microbatches=`).
    """
    if controller in self.steps:
      return self.steps[controller]
    task = self.task
    accumulated = jaccum.accumulate(
      jax.value_and_grad(task.loss),
      task.k_large,
      batch_argnums=tuple(range(1, 1 + len(task.data))),
      weight_fn=task.weight_fn,
      split="contiguous",
      return_stats=controller is not None,
    )

    def step(params, opt_state, ema_state, control, batch, lr_scale, **kwargs):
      out = accumulated(params, *batch, **kwargs)
      (_, grads), stats = out if controller else (out, None)
      updates, opt_state = self.optimizer.update(grads, opt_state, params)
      b_simple = jnp.float32(jnp.nan)
      if controller:
        lr_scale = control.lr_scale
        ema_state, b_simple = EMA.update(ema_state, stats)
        control = controller.update(control, ema_state)
      # Adam's update is the learning rate times a direction: scaling the
      # update scales the learning rate.
      updates = jax.tree.map(lambda u: u * lr_scale, updates)
      params = optax.apply_updates(params, updates)
      return (params, opt_state, ema_state, control), b_simple

    self.steps[controller] = jax.jit(step)
    return self.steps[controller]

  def train_step(self, state, batch, k: int, controller: Controller | None, lr_scale):
    # The one place K enters the step: one compilation at capacity K_large
    # serves every K. The batch is padded at its end to capacity, and only
    # its first k micro-batches run (num_real_microbatches, traced).
    capacity = self.task.k_large
    rows = capacity * self.task.microbatch_size
    padded = jax.tree.map(
      lambda x: np.concatenate([x, np.zeros((rows - len(x), *x.shape[1:]), x.dtype)]),
      batch,
    )
    return self.compiled_step(controller)(
      *state, padded, lr_scale, num_real_microbatches=jnp.int32(k)
    )

  def run(self, name: str, examples: int, *, fixed_k=None, headroom=None) -> Run:
    """Trains from the same start on the same stream for `examples` examples.

    At a fixed K (`fixed_k`), or with K from a `BatchSizeController` (`headroom`).
    """
    task, m = self.task, self.task.microbatch_size
    controller = None if headroom is None else self.controller(headroom)
    lr_scale = 1.0 if fixed_k is None else float(np.sqrt(fixed_k / task.k_small))
    params = task.init_params
    state = (
      params,
      self.optimizer.init(params),
      EMA.init(),
      self.controller(1.0).init(task.k_small),
    )
    record, offset, step, seconds = Run(name), 0, 0, 0.0
    every, next_eval = task.budget // task.num_evals, 0
    while True:
      if offset >= next_eval or offset == task.budget:
        loss = float(task.eval_loss(state[0]))
        record.evals.append((offset, step, seconds, loss, record.compile_seconds))
        next_eval = (offset // every + 1) * every
      if offset >= examples:
        return record
      k = fixed_k or int(state[3].num_microbatches)
      # Every run sees exactly the budget: the step that would cross it
      # takes what is left.
      end = task.budget if offset < task.budget else examples
      k = min(k, (end - offset) // m)
      # Keyed by controller, not by k: every k runs the step at capacity.
      compiled = controller in self.steps
      start = time.perf_counter()
      state, b_simple = self.train_step(
        state, task.rows(offset, k * m), k, controller, lr_scale
      )
      jax.block_until_ready(state)
      elapsed = time.perf_counter() - start
      seconds += elapsed
      if not compiled:  # the step's first call, whatever its k, compiles it
        record.compile_seconds += elapsed
      offset, step = offset + k * m, step + 1
      record.num_microbatches.append(k)
      if controller:
        record.noise_scale.append(float(b_simple))


def report(task: Task, runs: list[Run]) -> None:
  small = runs[0]
  target = small.at(task.budget)[3]
  small_hit = small.first_at_or_below(target)
  assert small_hit is not None
  print(
    f"\n{task.name}: a budget of {task.budget:,} examples (micro-batches of "
    f"{task.microbatch_size}); target: the fixed small batch's loss at the "
    f"budget, {target:.4f}"
  )
  print(
    f"  {'run':<24} {'loss at budget':>14} {'steps':>6} {'seconds':>8} "
    f"{'(compile)':>9} | {'to target: steps':>16} {'examples':>9} {'seconds':>8}"
  )
  for run in runs:
    _, steps, seconds, loss, compile_seconds = run.at(task.budget)
    hit = run.first_at_or_below(target)
    if hit is None:
      to_target = f"{'not reached':>16} {'':>9} {'':>8}"
    else:
      to_target = f"{hit[1]:>16,} {hit[0]:>9,} {hit[2]:>8.1f}"
    print(
      f"  {run.name:<24} {loss:>14.4f} {steps:>6,} {seconds:>8.1f} "
      f"{compile_seconds:>9.1f} | {to_target}"
    )
  for run in runs[1:]:
    hit = run.first_at_or_below(target)
    if hit is None:
      print(f"  {run.name}: does not reach the target within {run.evals[-1][0]:,}")
      continue
    fewer = 1 - hit[1] / small_hit[1]
    more = hit[0] / small_hit[0] - 1
    where = "within" if hit[0] <= task.budget else "beyond"
    print(
      f"  {run.name}: {fewer:.0%} fewer optimizer steps than fixed small to the "
      f"target, with {more:+.0%} examples ({where} the budget)"
    )


def plot(tasks: list[Task], results: list[list[Run]], out: pathlib.Path) -> None:
  fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 4.2 * len(tasks)))
  axes = np.atleast_2d(axes)
  for (ax_loss, ax_k), task, runs in zip(axes, tasks, results, strict=True):
    colors = ("C0", "C3", "C2", "C1")[: len(runs)]
    for run, color in zip(runs, colors, strict=True):
      examples, _, _, loss, _ = np.array(run.evals).T
      ax_loss.plot(examples, loss, color=color, label=run.name)
      ax_k.step(
        np.arange(1, len(run.num_microbatches) + 1),
        run.num_microbatches,
        color=color,
        where="post",
        label=run.name,
      )
      if run.noise_scale:
        ax_k.plot(
          np.arange(1, len(run.noise_scale) + 1),
          np.asarray(run.noise_scale) / task.noise_units_per_microbatch,
          color=color,
          lw=0.8,
          alpha=0.4,
          label=f"{run.name}: B_simple / micro-batch",
        )
    ax_loss.axhline(runs[0].at(task.budget)[3], color="k", lw=0.6, ls=":")
    ax_loss.axvline(task.budget, color="k", lw=0.6, ls="--", label="budget")
    ax_loss.set(
      xlabel="examples seen",
      ylabel="loss",
      yscale="log",
      title=f"{task.name}: loss against examples (dotted: target)",
    )
    ax_loss.legend()
    ax_k.set(
      xlabel="optimizer step",
      ylabel="micro-batches per step (K)",
      xscale="log",
      yscale="log",
      title=f"{task.name}: K against steps ({task.microbatch_size} per micro-batch)",
    )
    ax_k.legend(fontsize="small")
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  print(f"saved {out}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="short runs, for CI")
  parser.add_argument("--tasks", nargs="+", choices=["digits", "lm"], default=None)
  parser.add_argument("--overrun", type=float, default=None)
  parser.add_argument("--out", default="examples/out/batch_schedule.png")
  args = parser.parse_args()
  overrun = args.overrun or (1.5 if args.quick else 3.0)

  makers = {"digits": digits_task, "lm": lm_task}
  tasks = [makers[name](args.quick) for name in args.tasks or makers]
  results = []
  for task in tasks:
    trainer = Trainer(task)
    longer = int(overrun * task.budget) // task.microbatch_size * task.microbatch_size
    runs = [
      trainer.run(f"fixed small (K={task.k_small})", task.budget, fixed_k=task.k_small),
      trainer.run(f"fixed large (K={task.k_large})", longer, fixed_k=task.k_large),
      trainer.run("noise-driven", longer, headroom=1.0),
    ]
    if not args.quick:
      runs.append(trainer.run("noise-driven, headroom 4", longer, headroom=4.0))
    report(task, runs)
    results.append(runs)
  plot(tasks, results, pathlib.Path(args.out))


if __name__ == "__main__":
  main()

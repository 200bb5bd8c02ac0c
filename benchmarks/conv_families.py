"""The convolution part: five families of convolutional networks accumulated on CPU.

On CPU, jaccum rewrites a convolution of the traced micro-step into XLA's
canonical layout where that is faster in a loop body (the rule in
`jaccum/_conv_layout.py`, measured kind by kind by `conv_kinds.py`). This
part measures what the rule gives on whole networks, in Flax NNX, channels
last, with a per-example mean cross-entropy:

* **resnet**: a stem, a residual block and a strided one, BatchNorm after
  every convolution (batch statistics, as in training), on 16x16x3 images;
* **mobilenet**: a stem and three inverted-residual blocks (1x1 expand, 3x3
  depthwise, one of them strided, 1x1 project) on 16x16x3 images;
* **conv1d**: four 1-D convolutions (kernel 5 and 3, two strided, one
  dilated) on 64 steps of 8 channels;
* **unet**: a small U-Net (two levels: a strided convolution down, a strided
  `nnx.ConvTranspose` up, a skip connection) with a per-pixel loss, 16x16x3;
* **conv3d**: three 3-D convolutions (one strided) on 8x8x8x2 volumes.

For each family and K, the variants of one gradient step (`jax.grad` of the
loss at the same effective batch), each one jitted program:

* **whole**: the whole batch, no accumulation;
* **jaccum**: `jax.jit(jaccum.accumulate(grad_fn, K))`, the public path, which
  on CPU rewrites where the rule says;
* **no rewrite** and **rewrite all**: the same call traced with the rule
  replaced by "never" and "always", i.e. the accumulation loop as XLA gets
  it and with every convolution rewritten (what jaccum did before the rule);
* **optax.microbatch**: `optax.microbatching.microbatch(grad_fn, MEAN)`.

Every variant must first give the reference gradient (relative difference
<= 1e-4): the mean over the K strided micro-batches of `jax.grad` on each,
one jitted call per micro-batch; for the families without BatchNorm the whole
batch gives it too. With BatchNorm the statistics are the micro-batch's, so
the whole batch is timed as the baseline only. Then every compiled loop body is
checked to hold the layouts its variant promises. Timings alternate between
variants within every round, in a rotated order; ratios are medians of
per-round ratios.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from optax import microbatching

import jaccum
from benchmarks import _measure
from jaccum._core import rewrites as _conv_layout
from jaccum.inspect import _instructions

TOLERANCE = 1e-4
VARIANTS = ("whole", "jaccum", "no rewrite", "rewrite all", "optax.microbatch")
CANONICAL = {"b0f_0io->b0f", "b01f_01io->b01f", "b012f_012io->b012f"}


# --- the families --------------------------------------------------------------


class ResNet(nnx.Module):
  """A stem, a residual block, a strided residual block, BatchNorm throughout."""

  def __init__(self, rngs: nnx.Rngs, width: int = 16):
    conv = functools.partial(nnx.Conv, kernel_size=(3, 3), use_bias=False, rngs=rngs)
    norm = functools.partial(nnx.BatchNorm, rngs=rngs)
    self.stem, self.stem_norm = conv(3, width), norm(width)
    self.conv1, self.norm1 = conv(width, width), norm(width)
    self.conv2, self.norm2 = conv(width, width), norm(width)
    self.down1, self.down_norm1 = conv(width, 2 * width, strides=2), norm(2 * width)
    self.down2, self.down_norm2 = conv(2 * width, 2 * width), norm(2 * width)
    self.skip = nnx.Conv(width, 2 * width, (1, 1), strides=2, use_bias=False, rngs=rngs)
    self.head = nnx.Linear(2 * width, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem_norm(self.stem(x)))
    y = nnx.relu(self.norm1(self.conv1(x)))
    x = nnx.relu(x + self.norm2(self.conv2(y)))
    y = nnx.relu(self.down_norm1(self.down1(x)))
    x = nnx.relu(self.skip(x) + self.down_norm2(self.down2(y)))
    return self.head(x.mean((1, 2)))


class InvertedResidual(nnx.Module):
  """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project."""

  def __init__(self, rngs: nnx.Rngs, features: int, out: int, stride: int):
    hidden = 4 * features
    self.expand = nnx.Conv(features, hidden, (1, 1), rngs=rngs)
    self.depthwise = nnx.Conv(
      hidden, hidden, (3, 3), strides=stride, feature_group_count=hidden, rngs=rngs
    )
    self.project = nnx.Conv(hidden, out, (1, 1), rngs=rngs)
    self.residual = stride == 1 and features == out

  def __call__(self, x):
    y = nnx.relu6(self.depthwise(nnx.relu6(self.expand(x))))
    y = self.project(y)
    return x + y if self.residual else y


class MobileNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, width: int = 8):
    self.stem = nnx.Conv(3, width, (3, 3), rngs=rngs)
    self.blocks = nnx.List(
      [
        InvertedResidual(rngs, width, width, 1),
        InvertedResidual(rngs, width, 2 * width, 2),
        InvertedResidual(rngs, 2 * width, 2 * width, 1),
      ]
    )
    self.head = nnx.Linear(2 * width, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu6(self.stem(x))
    for block in self.blocks:
      x = block(x)
    return self.head(x.mean((1, 2)))


class Conv1D(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, width: int = 32):
    conv = functools.partial(nnx.Conv, rngs=rngs)
    self.convs = nnx.List(
      [
        conv(8, width, (5,)),
        conv(width, width, (5,), strides=2),
        conv(width, 2 * width, (3,), kernel_dilation=2),
        conv(2 * width, 2 * width, (3,), strides=2),
      ]
    )
    self.head = nnx.Linear(2 * width, 10, rngs=rngs)

  def __call__(self, x):
    for conv in self.convs:
      x = nnx.relu(conv(x))
    return self.head(x.mean(1))


class UNet(nnx.Module):
  """Two levels: down by a strided convolution, up by a transposed one, a skip."""

  def __init__(self, rngs: nnx.Rngs, width: int = 16, classes: int = 4):
    conv = functools.partial(nnx.Conv, kernel_size=(3, 3), rngs=rngs)
    self.encode1, self.encode2 = conv(3, width), conv(width, width)
    self.down = conv(width, 2 * width, strides=2)
    self.middle = conv(2 * width, 2 * width)
    self.up = nnx.ConvTranspose(2 * width, width, (3, 3), strides=(2, 2), rngs=rngs)
    self.decode = conv(2 * width, width)
    self.out = nnx.Conv(width, classes, (1, 1), rngs=rngs)

  def __call__(self, x):
    skip = nnx.relu(self.encode2(nnx.relu(self.encode1(x))))
    x = nnx.relu(self.middle(nnx.relu(self.down(skip))))
    x = nnx.relu(self.up(x))
    x = nnx.relu(self.decode(jnp.concatenate([x, skip], axis=-1)))
    return self.out(x)


class Conv3D(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, width: int = 8):
    conv = functools.partial(nnx.Conv, kernel_size=(3, 3, 3), rngs=rngs)
    self.convs = nnx.List(
      [
        conv(2, width),
        conv(width, 2 * width, strides=2),
        conv(2 * width, 2 * width),
      ]
    )
    self.head = nnx.Linear(2 * width, 10, rngs=rngs)

  def __call__(self, x):
    for conv in self.convs:
      x = nnx.relu(conv(x))
    return self.head(x.mean((1, 2, 3)))


class Family(NamedTuple):
  """A network as this part uses it.

  Attributes:
    make: `make(rngs) -> nnx.Module`.
    example: the shape of one example (channels last).
    labels: the shape of one example's integer labels, `()` for a class.
    description: one line for the tables and the plot.
  """

  make: Callable[[nnx.Rngs], nnx.Module]
  example: tuple[int, ...]
  labels: tuple[int, ...]
  description: str


FAMILIES = {
  "resnet": Family(ResNet, (16, 16, 3), (), "ResNet + BatchNorm, 16x16x3"),
  "mobilenet": Family(MobileNet, (16, 16, 3), (), "MobileNet (depthwise), 16x16x3"),
  "conv1d": Family(Conv1D, (64, 8), (), "Conv1D, 64 steps x 8"),
  "unet": Family(UNet, (16, 16, 3), (16, 16), "UNet (ConvTranspose), 16x16x3"),
  "conv3d": Family(Conv3D, (8, 8, 8, 2), (), "Conv3D, 8x8x8x2"),
}
BATCH_SIZE = 32
QUICK_BATCH_SIZE = 16
KS = (4, 8)
QUICK_KS = (4,)


class Problem(NamedTuple):
  """One family ready to differentiate: params, a batch and the loss's gradient."""

  name: str
  params: Any
  batch: dict[str, np.ndarray]
  grad_fn: Callable[[Any, Any], Any]
  batch_statistics: bool


def build(name: str, batch_size: int) -> Problem:
  """The family's params (drawn with NumPy), a random batch and `jax.grad(loss)`."""
  family = FAMILIES[name]
  graphdef, params, rest = nnx.split(
    nnx.eval_shape(lambda: family.make(nnx.Rngs(0))), nnx.Param, ...
  )
  rng = np.random.default_rng(0)

  def init(path, shape):
    if "scale" in jax.tree_util.keystr(path):
      return np.ones(shape.shape, np.float32)
    if "bias" in jax.tree_util.keystr(path):
      return np.zeros(shape.shape, np.float32)
    fan_in = np.prod(shape.shape[:-1])
    return (rng.normal(size=shape.shape) / np.sqrt(fan_in)).astype(np.float32)

  params = jax.tree_util.tree_map_with_path(init, params)
  # BatchNorm's running statistics: unused in training mode, never updated.
  rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), rest)
  batch = {
    "x": rng.normal(size=(batch_size, *family.example)).astype(np.float32),
    "y": rng.integers(0, 4, (batch_size, *family.labels)).astype(np.int32),
  }

  def loss(params, batch):
    logits = nnx.merge(graphdef, params, rest, copy=True)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  has_norm = any("norm" in jax.tree_util.keystr(p) for p, _ in _leaves(params))
  return Problem(name, params, batch, jax.grad(loss), has_norm)


def _leaves(tree: Any) -> list[tuple[Any, Any]]:
  return jax.tree_util.tree_flatten_with_path(tree)[0]


# --- the variants ----------------------------------------------------------------


def _traced_with_rule(make: Callable[[], Any], rule: Callable[[Any], bool]) -> Any:
  """`make()`'s jitted function, compiled with `rule` deciding what is rewritten."""
  jitted = make()

  def compile_with(*args):
    with mock.patch.object(_conv_layout, "_rewrite_wins", rule):
      return jitted.lower(*args).compile()

  return compile_with


def variants(problem: Problem, num_microbatches: int) -> dict[str, Any]:
  """name -> `compile(*args) -> compiled step`, for each of `VARIANTS`."""
  grad_fn = problem.grad_fn
  accumulated = lambda: jax.jit(jaccum.accumulate(grad_fn, num_microbatches))
  batch_size = len(problem.batch["x"])
  optax_fn = microbatching.microbatch(
    grad_fn,
    argnums=1,
    microbatch_size=batch_size // num_microbatches,
    accumulator=microbatching.AccumulationType.MEAN,
  )
  plain = lambda jitted: lambda *args: jitted.lower(*args).compile()
  return {
    "whole": plain(jax.jit(grad_fn)),
    "jaccum": plain(accumulated()),
    "no rewrite": plain(
      jax.jit(jaccum.accumulate(grad_fn, num_microbatches, conv_rewrite=False))
    ),
    "rewrite all": _traced_with_rule(accumulated, lambda eqn: True),
    "optax.microbatch": plain(jax.jit(optax_fn)),
  }


def loop_layouts(compiled: Any) -> list[str]:
  """The `dim_labels` of the convolutions in the compiled program's loop bodies."""
  return [
    op.text.split("dim_labels=")[1].split(",")[0]
    for op in _instructions(compiled.as_text())
    if op.inside_loop and op.opcode == "convolution" and "rhs_reversal" not in op.text
  ]


def reference(problem: Problem, num_microbatches: int) -> Any:
  """The mean of `jax.grad` over the K strided micro-batches, one jitted call each.

  Micro-batch k holds rows k, k + K, ..., as in jaccum and optax.microbatch.
  """
  grad_fn = jax.jit(problem.grad_fn)
  total = None
  for k in range(num_microbatches):
    micro = jax.tree.map(lambda x, k=k: x[k::num_microbatches], problem.batch)
    grads = jax.tree.map(np.asarray, grad_fn(problem.params, micro))
    total = grads if total is None else jax.tree.map(np.add, total, grads)
  return jax.tree.map(lambda g: g / num_microbatches, total)


def run_family(name: str, quick: bool, rounds: int) -> dict[str, Any]:
  problem = build(name, QUICK_BATCH_SIZE if quick else BATCH_SIZE)
  args = (problem.params, problem.batch)
  rows = []
  for num_microbatches in QUICK_KS if quick else KS:
    compiled = {
      n: make(*args) for n, make in variants(problem, num_microbatches).items()
    }
    outputs = {n: jax.tree.map(np.asarray, c(*args)) for n, c in compiled.items()}
    expected = reference(problem, num_microbatches)
    differences = {}
    for variant, out in outputs.items():
      if variant == "whole" and problem.batch_statistics:
        continue  # the whole batch's statistics: another gradient
      differences[variant] = _measure.relative_difference(out, expected)
      assert differences[variant] <= TOLERANCE, (name, num_microbatches, differences)
    layouts = {n: loop_layouts(c) for n, c in compiled.items()}
    assert layouts["no rewrite"] and set(layouts["no rewrite"]) - CANONICAL
    assert set(layouts["rewrite all"]) <= CANONICAL, layouts["rewrite all"]
    times = _measure.interleaved(
      {n: functools.partial(c, *args) for n, c in compiled.items()}, rounds
    )
    faster = min(("no rewrite", "rewrite all"), key=lambda n: np.median(times[n]))
    row = {
      "family": name,
      "num_microbatches": num_microbatches,
      "step_s": {n: float(np.median(t)) for n, t in times.items()},
      "step_s_rounds": {n: t.tolist() for n, t in times.items()},
      "vs_whole": {n: _measure.paired_ratio(times, n, "whole") for n in times},
      "faster_of_none_and_all": faster,
      "jaccum_vs_faster": _measure.paired_ratio(times, "jaccum", faster),
      "differences": differences,
      "loop_layouts": layouts,
      # Convolutions jaccum's rule leaves as traced in the loop body.
      "kept_as_traced": sorted(set(layouts["jaccum"]) - CANONICAL),
      "num_kept_as_traced": sum(label not in CANONICAL for label in layouts["jaccum"]),
      "num_convolutions_in_loop": len(layouts["jaccum"]),
    }
    rows.append(row)
    print(_line(row), flush=True)
  return {
    "family": name,
    "description": FAMILIES[name].description,
    "batch_size": len(problem.batch["x"]),
    "batch_statistics": problem.batch_statistics,
    "rows": rows,
  }


def _line(row: dict[str, Any]) -> str:
  return (
    f"{row['family']} K={row['num_microbatches']}:"
    + "".join(
      f"  {n} {row['step_s'][n] * 1e3:.1f} ms ({row['vs_whole'][n]:.2f}x)"
      for n in VARIANTS
    )
    + f"  jaccum / {row['faster_of_none_and_all']} {row['jaccum_vs_faster']:.2f}"
  )


def run(quick: bool, rounds: int) -> dict[str, Any]:
  if jax.default_backend() != "cpu":
    backend = jax.default_backend()
    return {"skipped": f"the rewrite is for XLA:CPU; the backend is {backend}"}
  return {
    "rounds": rounds,
    "tolerance": TOLERANCE,
    "variants": list(VARIANTS),
    "families": [run_family(name, quick, rounds) for name in FAMILIES],
  }

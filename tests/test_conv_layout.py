"""canonicalize_convolutions: exact gradients in a scan loop, canonical HLO on CPU.

The accumulation loop traces one micro-step with `jax.make_jaxpr` and evaluates
it with `jax.core.eval_jaxpr` in a `lax.scan`; `scan_accumulate` below is that
loop in miniature, so these tests do not depend on how `accumulate` is built.
"""

import functools
import itertools
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close
from jax.extend.core import jaxprs_in_params, primitives

import jaccum
import jaccum.nnx
from jaccum._core import rewrites as _conv_layout
from jaccum._core.rewrites import canonicalize_convolutions
from jaccum._core.step import cast_varying
from jaccum.inspect import _instructions

NUM_MICROBATCHES = 4
BATCH = 8
CANONICAL_LABELS = {"b0f_0io->b0f", "b01f_01io->b01f", "b012f_012io->b012f"}
TOLERANCE = {"float32": 1e-5, "float64": 1e-12}


def rewriting_everything():
  """Within it, the rewrite takes every convolution the rule would keep too.

  For checks of the rewrite itself: each kind of convolution must come out
  canonical and exact, whatever the rule decides today.
  """
  return mock.patch.object(_conv_layout, "_rewrite_wins", lambda eqn: True)


def scan_accumulate(grad_fn, num_microbatches, *, rewrite=True):
  """The mean of `grad_fn` over strided micro-batches, as the loop computes it.

  Micro-batch k holds rows k, k + K, ...; the micro-step is traced once
  (rewritten as the rule says, unless `rewrite` is False) and evaluated in a
  `lax.scan`.
  """

  def accumulated(params, batch):
    rows = jax.tree.map(lambda x: x.reshape(-1, num_microbatches, *x.shape[1:]), batch)
    take = lambda k: jax.tree.map(
      lambda x: jax.lax.dynamic_index_in_dim(x, k, 1, keepdims=False), rows
    )
    closed, out_shape = jax.make_jaxpr(grad_fn, return_shape=True)(params, take(0))
    if rewrite:
      closed = canonicalize_convolutions(closed)

    def body(total, k):
      args = jax.tree.leaves((params, take(k)))
      out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
      return [t + o for t, o in zip(total, out, strict=True)], None

    # Inside shard_map, outputs vary over the mesh axes; the carry must too.
    zeros = [
      cast_varying(jnp.zeros(a.shape, a.dtype), a.manual_axis_type.varying)
      for a in closed.out_avals
    ]
    total, _ = jax.lax.scan(body, zeros, jnp.arange(num_microbatches))
    mean = [t / num_microbatches for t in total]
    return jax.tree.unflatten(jax.tree.structure(out_shape), mean)

  return jax.jit(accumulated)


def convolutions(jaxpr):
  """Every `conv_general_dilated` equation in `jaxpr` and the jaxprs it nests."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive is jax.lax.conv_general_dilated_p:
      found.append(eqn)
    for sub in jaxprs_in_params(eqn.params):
      found.extend(convolutions(sub))
  return found


def nested_with_convolutions(jaxpr):
  """The primitives, at any depth, whose nested programs hold convolutions."""
  found = set()
  for eqn in jaxpr.eqns:
    for sub in jaxprs_in_params(eqn.params):
      if convolutions(sub):
        found |= {eqn.primitive} | nested_with_convolutions(sub)
  return found


def is_canonical(eqn):
  """`b01f_01io->b01f` (any number of spatial dimensions), no batch groups.

  XLA:CPU expands batch groups into a non-canonical convolution.
  """
  lhs, rhs, out = eqn.params["dimension_numbers"]
  ndim = len(lhs)
  spatial = tuple(range(1, ndim - 1))
  return (
    tuple(lhs) == (0, ndim - 1, *spatial)
    and tuple(rhs) == (ndim - 1, ndim - 2, *range(ndim - 2))
    and tuple(out) == (0, ndim - 1, *spatial)
    and eqn.params["batch_group_count"] == 1
  )


def check_accumulates_exactly(grad_fn, params, batch, dtype):
  """The loop over the micro-step, every convolution rewritten, is the whole batch.

  Returns the traced micro-step, for checks of what it holds.
  """
  micro = jax.tree.map(lambda x: x[: BATCH // NUM_MICROBATCHES], batch)
  with jax.enable_x64(dtype == "float64"), rewriting_everything():
    traced = jax.make_jaxpr(grad_fn)(params, micro)
    rewritten = canonicalize_convolutions(traced)
    # Not vacuous: a backward pass always has non-canonical convolutions.
    assert not all(map(is_canonical, convolutions(traced.jaxpr)))
    assert len(convolutions(rewritten.jaxpr)) == len(convolutions(traced.jaxpr))
    assert all(map(is_canonical, convolutions(rewritten.jaxpr)))

    accumulated = scan_accumulate(grad_fn, NUM_MICROBATCHES)(params, batch)
    whole = jax.jit(grad_fn)(params, batch)
    assert_trees_close(accumulated, whole, rtol=TOLERANCE[dtype])
  return traced


def cast(tree, dtype):
  """Floating leaves as NumPy arrays of `dtype`: no JAX work before the test."""
  return jax.tree.map(
    lambda x: np.asarray(x, dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
    tree,
  )


BOTH = pytest.mark.parametrize("dtype", ["float32", "float64"])
FLOAT64 = pytest.mark.parametrize("dtype", ["float64"])


# --- convolutions written with jax.lax -----------------------------------------

LAYOUTS = {
  ("channels_first", 1): ("NCH", "OIH", "NCH"),
  ("channels_first", 2): ("NCHW", "OIHW", "NCHW"),
  ("channels_first", 3): ("NCDHW", "OIDHW", "NCDHW"),
  ("channels_last", 1): ("NHC", "HIO", "NHC"),
  ("channels_last", 2): ("NHWC", "HWIO", "NHWC"),
  ("channels_last", 3): ("NDHWC", "DHWIO", "NDHWC"),
}
SIZES = {1: (11,), 2: (7, 8), 3: (5, 4, 5)}
# Layers in order: name, options, output channels. Each gradient leaf is
# named by its layer, so a failure says which kind of convolution is off.
LAYERS = [
  ("plain", {}, 4),
  ("strided", {"window_strides": 2}, 4),
  ("dilated", {"rhs_dilation": 2}, 4),
  ("transposed", {"lhs_dilation": 2}, 4),  # as in a transposed convolution
  ("grouped", {"feature_group_count": 2}, 6),
  ("depthwise", {"feature_group_count": 6}, 12),
]


def lax_conv_model(layout, num_spatial, dtype):
  """One convolution of each kind in `LAYERS`, then a linear head."""
  dimension_numbers = LAYOUTS[layout, num_spatial]
  channels_last = layout == "channels_last"

  def conv(x, kernel, window_strides=1, rhs_dilation=1, lhs_dilation=1, **rest):
    return jax.lax.conv_general_dilated(
      x,
      kernel,
      window_strides=(window_strides,) * num_spatial,
      padding="SAME" if lhs_dilation == 1 else [(1, 1)] * num_spatial,
      lhs_dilation=(lhs_dilation,) * num_spatial,
      rhs_dilation=(rhs_dilation,) * num_spatial,
      dimension_numbers=dimension_numbers,
      **rest,
    )

  def loss(params, batch):
    h = batch["x"]
    for name, options, _ in LAYERS:
      h = jnp.tanh(conv(h, params[name], **options))
    spatial = range(1, h.ndim - 1) if channels_last else range(2, h.ndim)
    logits = h.mean(tuple(spatial)) @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  rng = np.random.default_rng(0)
  params, in_channels = {}, 3
  for name, options, out_channels in LAYERS:
    fan_in = in_channels // options.get("feature_group_count", 1)
    shape = (out_channels, fan_in) + (3,) * num_spatial
    kernel = rng.normal(size=shape) / np.sqrt(fan_in * 3**num_spatial)
    params[name] = np.moveaxis(kernel, (0, 1), (-1, -2)) if channels_last else kernel
    in_channels = out_channels
  params["head"] = rng.normal(size=(in_channels, 5))
  x = rng.normal(size=(BATCH, 3, *SIZES[num_spatial]))
  batch = {
    "x": np.moveaxis(x, 1, -1) if channels_last else x,
    "y": np.arange(BATCH) % 5,
  }
  return loss, cast(params, dtype), cast(batch, dtype)


@pytest.mark.parametrize(
  "num_spatial, dtype",
  [(1, "float64"), (2, "float32"), (2, "float64"), (3, "float64")],
)
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_lax_convolutions_accumulate_exactly(layout, num_spatial, dtype):
  loss, params, batch = lax_conv_model(layout, num_spatial, dtype)
  traced = check_accumulates_exactly(jax.grad(loss), params, batch, dtype)
  # Grouped convolutions' kernel gradients group the batch: covered too.
  assert any(e.params["batch_group_count"] > 1 for e in convolutions(traced.jaxpr))


# --- Flax models -----------------------------------------------------------------


class TutorialCNN(nnx.Module):
  """The Flax NNX MNIST tutorial's CNN, on 8x8 inputs."""

  def __init__(self, rngs):
    self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
    self.linear1 = nnx.Linear(64 * 2 * 2, 256, rngs=rngs)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x):
    pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    x = pool(nnx.relu(self.conv1(x)))
    x = pool(nnx.relu(self.conv2(x)))
    x = nnx.relu(self.linear1(x.reshape(x.shape[0], -1)))
    return self.linear2(x)


class Block(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(8, 8, (3, 3), strides=1, rngs=rngs)

  def __call__(self, x):
    return x + nnx.tanh(self.conv(x))


class RematCNN(nnx.Module):
  """Convolutions inside `nnx.remat` and inside `jax.checkpoint`."""

  def __init__(self, rngs):
    self.stem = nnx.Conv(1, 8, (3, 3), strides=2, rngs=rngs)
    self.block1 = Block(rngs)
    self.block2 = Block(rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    x = self.stem(x)
    x = nnx.remat(lambda block, x: block(x))(self.block1, x)
    graphdef, state = nnx.split(self.block2)
    x = jax.checkpoint(lambda state, x: nnx.merge(graphdef, state)(x))(state, x)
    return self.head(x.mean((1, 2)))


class ScanCNN(nnx.Module):
  """Three convolution blocks applied with `nnx.scan` over stacked layers."""

  def __init__(self, rngs):
    self.stem = nnx.Conv(1, 8, (3, 3), rngs=rngs)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return Block(rngs)

    self.blocks = blocks(rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    x = self.stem(x)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def through(x, block):
      return block(x)

    return self.head(through(x, self.blocks).mean((1, 2)))


class LinenCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), (2, 2))
    x = nn.relu(nn.Conv(16, (3, 3), feature_group_count=4, kernel_dilation=2)(x))
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


def digits_batch(dtype):
  x = np.random.default_rng(1).normal(size=(BATCH, 8, 8, 1))
  return cast({"x": x, "y": np.arange(BATCH) % 10}, dtype)


def random_like(shapes, seed=0):
  """Random NumPy values of `shapes` (a tree), scaled by fan-in.

  Initialising with NumPy, not by running the model's initialisers, spares
  each test seconds of eager JAX work.
  """
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: rng.normal(size=s.shape) / np.sqrt(np.prod(s.shape[:-1])), shapes
  )


def nnx_split(model):
  """`(graphdef, params)` of an NNX model, with `random_like` params."""
  graphdef, shapes = nnx.split(nnx.eval_shape(lambda: model(nnx.Rngs(0))))
  return graphdef, random_like(shapes)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# The programs that nest convolutions in each model's gradient.
NESTED = {
  TutorialCNN: set(),
  RematCNN: {primitives.remat_p.name},
  ScanCNN: {primitives.scan_p.name},
}


@pytest.mark.parametrize(
  "model, dtype",
  [
    (TutorialCNN, "float32"),
    (TutorialCNN, "float64"),
    (RematCNN, "float64"),
    (ScanCNN, "float64"),
  ],
)
def test_nnx_models_accumulate_exactly(model, dtype):
  graphdef, params = nnx_split(model)

  def loss(params, batch):
    return cross_entropy(nnx.merge(graphdef, params)(batch["x"]), batch["y"])

  traced = check_accumulates_exactly(
    jax.grad(loss), cast(params, dtype), digits_batch(dtype), dtype
  )
  nested = {primitive.name for primitive in nested_with_convolutions(traced.jaxpr)}
  assert nested >= NESTED[model], nested


@BOTH
def test_linen_model_accumulates_exactly(dtype):
  model = LinenCNN()
  batch = digits_batch(dtype)
  x = jax.ShapeDtypeStruct((1, 8, 8, 1), np.float32)
  params = cast(random_like(jax.eval_shape(model.init, jax.random.key(0), x)), dtype)

  def loss(params, batch):
    return cross_entropy(model.apply(params, batch["x"]), batch["y"])

  check_accumulates_exactly(jax.grad(loss), params, batch, dtype)


# --- nested programs, parameters, sharding -------------------------------------


def nchw_conv(x, kernel):
  return jax.lax.conv_general_dilated(
    x, kernel, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
  )


@jax.custom_jvp
def custom_jvp_layer(x, kernel):
  return jnp.tanh(nchw_conv(x, kernel))


@custom_jvp_layer.defjvp
def _custom_jvp_layer_jvp(primals, tangents):
  return jax.jvp(lambda x, k: jnp.tanh(nchw_conv(x, k)), primals, tangents)


@jax.custom_vjp
def custom_vjp_layer(x, kernel):
  return jnp.tanh(nchw_conv(x, kernel))


def _custom_vjp_fwd(x, kernel):
  return jax.vjp(lambda x, k: jnp.tanh(nchw_conv(x, k)), x, kernel)


custom_vjp_layer.defvjp(_custom_vjp_fwd, lambda vjp, g: vjp(g))


def control_flow_loss(kernel, batch):
  layer = lambda h: jnp.tanh(nchw_conv(h, kernel))
  h = jax.jit(layer)(batch["x"])
  # The same branch for every micro-batch, or they would not add up.
  h = jax.lax.cond(kernel.sum() > 0, layer, lambda h: -layer(h), h)
  h, _ = jax.lax.scan(lambda h, _: (layer(h), None), h, length=2)
  h = custom_vjp_layer(h, kernel)
  return jnp.mean(h**2)


def control_flow_grad(kernel, batch):
  # Not differentiated, so a while loop and custom_jvp_call stay in the program.
  two_layers = lambda c: (c[0] + 1, custom_jvp_layer(c[1], kernel))
  _, h = jax.lax.while_loop(lambda c: c[0] < 2, two_layers, (0, batch["x"]))
  return jax.grad(control_flow_loss)(kernel, batch), jnp.mean(h**2)


@FLOAT64
def test_convolutions_in_jit_cond_while_scan_and_custom_rules(dtype):
  rng = np.random.default_rng(2)
  kernel = cast(rng.normal(size=(3, 3, 3, 3)) / 5, dtype)
  batch = cast({"x": rng.normal(size=(BATCH, 3, 6, 6))}, dtype)
  traced = check_accumulates_exactly(control_flow_grad, kernel, batch, dtype)
  nested = {primitive.name for primitive in nested_with_convolutions(traced.jaxpr)}
  assert nested >= {"jit", "cond", "while", "scan", "custom_jvp_call"}, nested
  jax.extend.core.check_jaxpr(canonicalize_convolutions(traced).jaxpr)


def test_a_program_that_equations_share_is_rewritten_once_and_stays_shared():
  layer = jax.jit(nchw_conv)
  x, kernel = np.ones((2, 3, 5, 5), np.float32), np.ones((3, 3, 3, 3), np.float32)
  traced = jax.make_jaxpr(lambda x, k: layer(layer(x, k), k))(x, kernel)
  rewritten = canonicalize_convolutions(traced)
  for closed in (traced, rewritten):
    first, second = (e.params["jaxpr"] for e in closed.eqns)
    assert first is second
  assert is_canonical(*convolutions(first.jaxpr))


def test_precision_groups_dilations_and_output_type_are_kept():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 8, 9, 10)), jnp.bfloat16)
  kernel = jnp.asarray(rng.normal(size=(6, 4, 3, 2)), jnp.bfloat16)

  def conv(x, kernel):
    return jax.lax.conv_general_dilated(
      x,
      kernel,
      window_strides=(2, 1),
      padding=((1, 2), (0, 1)),
      lhs_dilation=(1, 2),
      rhs_dilation=(2, 1),
      dimension_numbers=("NCHW", "OIHW", "NCHW"),
      feature_group_count=2,
      precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32,
    )

  traced = jax.make_jaxpr(conv)(x, kernel)
  with rewriting_everything():  # the rule keeps this one (groups, lhs_dilation)
    rewritten = canonicalize_convolutions(traced)
  (before,), (after,) = convolutions(traced.jaxpr), convolutions(rewritten.jaxpr)
  assert is_canonical(after) and not is_canonical(before)
  unchanged = lambda params: {
    k: v for k, v in params.items() if k not in ("dimension_numbers", "out_sharding")
  }
  assert unchanged(after.params) == unchanged(before.params)
  assert rewritten.out_avals == traced.out_avals
  out = jax.core.eval_jaxpr(rewritten.jaxpr, rewritten.consts, x, kernel)[0]
  expected = jax.lax.conv_general_dilated(
    x.astype(jnp.float32),
    kernel.astype(jnp.float32),
    window_strides=(2, 1),
    padding=((1, 2), (0, 1)),
    lhs_dilation=(1, 2),
    rhs_dilation=(2, 1),
    dimension_numbers=("NCHW", "OIHW", "NCHW"),
    feature_group_count=2,
    precision=jax.lax.Precision.HIGHEST,
  )
  assert out.dtype == jnp.float32
  assert_trees_close(out, expected, rtol=1e-6)


def test_programs_without_non_canonical_convolutions_come_back_unchanged():
  def mlp_loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)

  def nhwc_forward(kernel, x):  # forward only: canonical already
    return jax.lax.conv_general_dilated(
      x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )

  for fn, args in [
    (jax.grad(mlp_loss), (jnp.ones((3, 3)), jnp.ones((4, 3)))),
    (jax.jit(nhwc_forward), (jnp.ones((3, 3, 2, 4)), jnp.ones((1, 5, 5, 2)))),
  ]:
    closed = jax.make_jaxpr(fn)(*args)
    assert canonicalize_convolutions(closed) is closed


def test_sharded_batches_explicit_mesh_and_shard_map():
  loss, params, batch = lax_conv_model("channels_first", 2, "float32")
  grad_fn = jax.grad(loss)
  whole = jax.jit(grad_fn)(params, batch)
  devices = jax.device_count()

  # Explicit mesh axes: backward convolutions carry an `out_sharding`.
  mesh = jax.make_mesh((devices,), ("data",))
  with jax.set_mesh(mesh):
    sharded = jax.device_put(batch, jax.P("data"))
    replicated = jax.device_put(params, jax.P())
    traced = jax.make_jaxpr(grad_fn)(replicated, sharded)
    assert any(e.params["out_sharding"] is not None for e in convolutions(traced.jaxpr))
    rewritten = canonicalize_convolutions(traced)
    out = jax.jit(
      lambda *args: jax.core.eval_jaxpr(rewritten.jaxpr, rewritten.consts, *args)
    )(*jax.tree.leaves((replicated, sharded)))
    assert_trees_close(jax.tree.unflatten(jax.tree.structure(whole), out), whole, 1e-5)

  # Inside shard_map: the traced types are device-varying.
  mesh = jax.make_mesh(
    (devices // 2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )

  def per_device(params, batch):
    params = jax.lax.pcast(params, "data", to="varying")
    grads = scan_accumulate(grad_fn, 2)(params, batch)
    return jax.lax.pmean(grads, "data")

  step = jax.shard_map(
    per_device, mesh=mesh, in_specs=(jax.P(), jax.P("data")), out_specs=jax.P()
  )
  assert_trees_close(jax.jit(step)(params, batch), whole, rtol=1e-5)


# --- the compiled loop ---------------------------------------------------------


def compiled_convolutions(compiled):
  """`(inside_loop, dim_labels, window)` of each convolution XLA:CPU compiled."""
  found = []
  for instruction in _instructions(compiled.as_text()):
    if instruction.opcode == "convolution":
      text = instruction.text
      labels = text.split("dim_labels=")[1].split(",")[0]
      window = text.split("window={")[1].split("}")[0]
      found.append((instruction.inside_loop, labels, window))
  return found


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's layout rule")
@pytest.mark.parametrize(
  "layout, num_spatial",
  [("channels_first", 1), ("channels_last", 2), ("channels_first", 3)],
)
def test_no_non_canonical_convolution_in_the_compiled_loop_body(layout, num_spatial):
  """With every convolution rewritten; what the rule keeps: the families' test."""
  loss, params, batch = lax_conv_model(layout, num_spatial, "float32")
  grad_fn = jax.grad(loss)
  with rewriting_everything():
    loops = {
      rewrite: [
        (labels, window)
        for inside_loop, labels, window in compiled_convolutions(
          scan_accumulate(grad_fn, NUM_MICROBATCHES, rewrite=rewrite)
          .lower(params, batch)
          .compile()
        )
        if inside_loop
      ]
      for rewrite in (False, True)
    }
  whole = compiled_convolutions(jax.jit(grad_fn).lower(params, batch).compile())
  # XLA swaps the operands of some kernel gradients, reversing the window;
  # no fast kernel takes those, in the entry computation either.
  reversed_windows = lambda convs: sorted(w for _, w in convs if "rhs_reversal" in w)
  assert reversed_windows(loops[True]) == reversed_windows(c[1:] for c in whole)

  non_canonical = {
    rewrite: [c for c in convs if c[0] not in CANONICAL_LABELS]
    for rewrite, convs in loops.items()
  }
  assert len(non_canonical[False]) > len(reversed_windows(loops[False]))
  assert non_canonical[True] == [c for c in loops[True] if "rhs_reversal" in c[1]]
  assert len(loops[True]) >= 2 * len(LAYERS)  # forward and backward are there


# --- through jaccum's own loop ---------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_accumulate_and_jaccum_nnx_run_canonical_convolutions_exactly(dtype):
  """accumulate traces the micro-step once and, on CPU, rewrites that program."""
  graphdef, params = nnx_split(TutorialCNN)
  batch = digits_batch(dtype)

  def loss(params, batch):
    return cross_entropy(nnx.merge(graphdef, params)(batch["x"]), batch["y"])

  with jax.enable_x64(dtype == "float64"):
    params, batch = cast(params, dtype), cast(batch, dtype)
    step = jax.jit(jaccum.accumulate(jax.grad(loss), NUM_MICROBATCHES))
    assert_trees_close(
      step(params, batch), jax.jit(jax.grad(loss))(params, batch), TOLERANCE[dtype]
    )
    if jax.default_backend() == "cpu":
      in_loop = [
        labels
        for inside, labels, window in compiled_convolutions(
          step.lower(params, batch).compile()
        )
        if inside and "rhs_reversal" not in window
      ]
      assert in_loop and set(in_loop) <= CANONICAL_LABELS

  model = TutorialCNN(nnx.Rngs(0))
  nnx_loss = lambda model, x, y: cross_entropy(model(x), y)
  x, y = digits_batch("float32")["x"], digits_batch("float32")["y"]
  _, grads = nnx.jit(jaccum.nnx.value_and_grad(nnx_loss, NUM_MICROBATCHES))(model, x, y)
  _, whole = nnx.jit(nnx.value_and_grad(nnx_loss))(model, x, y)
  assert_trees_close(grads, whole, 1e-5)


# --- which convolutions are rewritten: kind by kind ------------------------------

GROUPS = {"none": 1, "grouped": 4, "depthwise": 8}  # of 8 channels
FORWARDS = {
  "plain": {},
  "strided": {"window_strides": 2},  # input grad: lhs_dilation, kernel grad: rhs
  "transposed": {"lhs_dilation": 2},  # as lax.conv_transpose; kernel grad: lhs
  "dilated": {"rhs_dilation": 2},  # input grad: rhs_dilation
}
SPATIAL = ("forward", "input grad")  # the two that can group features
# What `python -m benchmarks.conv_kinds` measured faster as traced than
# rewritten in a loop body (benchmarks/results/conv_kinds.md), by (dimensions,
# groups, forward, op); the rule keeps these and rewrites every other kind.
FASTER_AS_TRACED = {
  # Depthwise forwards and input gradients (3-96x).
  *((d, "depthwise", f, op) for d in (1, 2, 3) for f in FORWARDS for op in SPATIAL),
  # Grouped, with a dilated input (1.1-3.5x).
  *((d, "grouped", "strided", "input grad") for d in (1, 2)),
  *((d, "grouped", "transposed", "forward") for d in (1, 2)),
  # 3-D: grouped (5-47x) or dilated, whichever the groups (1.2-96x).
  *((3, "grouped", f, op) for f in FORWARDS for op in SPATIAL),
  *((3, g, "strided", op) for g in GROUPS for op in ("input grad", "kernel grad")),
  *((3, g, "transposed", op) for g in GROUPS for op in ("forward", "kernel grad")),
  *((3, g, "dilated", op) for g in GROUPS for op in SPATIAL),
}
# Where channels last and channels first disagreed, the rule follows channels
# last, Flax's layout: it rewrites the kernel gradients of 1-D and 2-D
# transposed convolutions (channels first 2.0x and 1.2x slower rewritten,
# channels last 0.9x) and of 3-D grouped undilated ones (1.7-1.9x, against
# 0.5-0.9x). The 3-D ungrouped dilated kernel gradients are ties (0.7-1.4x);
# the rule keeps them with the other dilated 3-D kinds.


def gradient_convolutions(layout, num_spatial, groups, forward):
  """The program `jax.grad` makes of one convolution and its three convolutions."""
  options = {"window_strides": 1, "lhs_dilation": 1, "rhs_dilation": 1}
  options |= FORWARDS[forward]
  pad = options["rhs_dilation"]  # "SAME" for a 3-wide kernel
  channels, spatial = 8, SIZES[num_spatial]
  x = (BATCH, *spatial, channels)
  w = (3,) * num_spatial + (channels // GROUPS[groups], channels)
  if layout == "channels_first":
    x, w = (BATCH, channels, *spatial), (channels, channels // GROUPS[groups], *w[:-2])

  def loss(x, w):
    out = jax.lax.conv_general_dilated(
      x,
      w,
      **{k: (v,) * num_spatial for k, v in options.items()},
      padding=[(pad, pad)] * num_spatial,
      dimension_numbers=LAYOUTS[layout, num_spatial],
      feature_group_count=GROUPS[groups],
    )
    return jnp.sum(jnp.sin(out))

  shapes = (jax.ShapeDtypeStruct(x, np.float32), jax.ShapeDtypeStruct(w, np.float32))
  traced = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*shapes)
  convs = {}
  for eqn in convolutions(traced.jaxpr):
    shape = eqn.outvars[0].aval.shape
    if eqn.invars == traced.jaxpr.invars:
      convs["forward"] = eqn
    else:
      convs["input grad" if shape == x else "kernel grad"] = eqn
  assert len(convs) == 3, convs
  return traced, convs


@pytest.mark.parametrize("num_spatial", [1, 2, 3])
def test_the_rule_keeps_the_kinds_measured_faster_as_traced(num_spatial):
  kept, rewritten = [], []
  for layout, groups, forward in itertools.product(
    ("channels_last", "channels_first"), GROUPS, FORWARDS
  ):
    traced, convs = gradient_convolutions(layout, num_spatial, groups, forward)
    before = convolutions(traced.jaxpr)
    after = convolutions(canonicalize_convolutions(traced).jaxpr)
    assert len(after) == len(before)
    for op, eqn in convs.items():
      new = after[before.index(eqn)]
      kind = (num_spatial, groups, forward, op)
      if is_canonical(eqn):  # channels-last forwards: nothing to rewrite
        assert new is eqn, kind
      elif kind in FASTER_AS_TRACED:
        assert new is eqn, kind
        kept.append(kind)
      else:
        assert is_canonical(new), kind
        rewritten.append(kind)
  # Both decisions are exercised at every dimensionality.
  assert kept and rewritten


# --- five families, accumulated exactly, each convolution as the rule says -------


class ResNet(nnx.Module):
  """A stem and a strided block, BatchNorm (batch statistics) after each."""

  def __init__(self, rngs):
    conv = functools.partial(nnx.Conv, kernel_size=(3, 3), use_bias=False, rngs=rngs)
    self.stem, self.norm1 = conv(3, 4), nnx.BatchNorm(4, rngs=rngs)
    self.down, self.norm2 = conv(4, 8, strides=2), nnx.BatchNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.norm1(self.stem(x)))
    x = nnx.relu(self.norm2(self.down(x)))
    return self.head(x.mean((1, 2)))


class MobileNet(nnx.Module):
  """An inverted-residual block: 1x1 expand, 3x3 depthwise, 1x1 project."""

  def __init__(self, rngs):
    self.expand = nnx.Conv(3, 8, (1, 1), rngs=rngs)
    self.depthwise = nnx.Conv(8, 8, (3, 3), feature_group_count=8, rngs=rngs)
    self.project = nnx.Conv(8, 4, (1, 1), rngs=rngs)
    self.head = nnx.Linear(4, 10, rngs=rngs)

  def __call__(self, x):
    x = self.project(nnx.relu6(self.depthwise(nnx.relu6(self.expand(x)))))
    return self.head(x.mean((1, 2)))


class Conv1D(nnx.Module):
  def __init__(self, rngs):
    self.conv1 = nnx.Conv(2, 4, (3,), rngs=rngs)
    self.conv2 = nnx.Conv(4, 4, (3,), strides=2, kernel_dilation=1, rngs=rngs)
    self.head = nnx.Linear(4, 10, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.conv2(nnx.relu(self.conv1(x)))).mean(1))


class UNet(nnx.Module):
  """Down by a strided convolution, up by a transposed one, a skip; per pixel."""

  def __init__(self, rngs):
    self.encode = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.down = nnx.Conv(4, 8, (3, 3), strides=2, rngs=rngs)
    self.up = nnx.ConvTranspose(8, 4, (3, 3), strides=(2, 2), rngs=rngs)
    self.out = nnx.Conv(8, 10, (1, 1), rngs=rngs)

  def __call__(self, x):
    skip = nnx.relu(self.encode(x))
    x = nnx.relu(self.up(nnx.relu(self.down(skip))))
    return self.out(jnp.concatenate([x, skip], axis=-1))


class Conv3D(nnx.Module):
  def __init__(self, rngs):
    self.conv1 = nnx.Conv(1, 4, (3, 3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(4, 4, (3, 3, 3), strides=2, rngs=rngs)
    self.head = nnx.Linear(4, 10, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.conv2(nnx.relu(self.conv1(x)))).mean((1, 2, 3)))


# model, one example's shape, its labels' shape, and the convolutions XLA:CPU
# compiles in the loop body in another layout than canonical, by `dim_labels`:
# those the rule keeps as traced (the depthwise input gradient; the 3-D
# strided convolution's kernel gradient, with rhs_dilation 2, and its input
# gradient, with lhs_dilation 2, whose operands XLA swaps into a convolution
# marked rhs_reversal) and one XLA swaps after the rewrite (the transposed
# convolution's kernel gradient, as in the entry computation). The first
# convolution's input gradient is not computed: the input is not
# differentiated.
FAMILIES = {
  "resnet": (ResNet, (8, 8, 3), (), []),
  "mobilenet": (MobileNet, (6, 6, 3), (), ["b01f_01oi->b01f"]),
  "conv1d": (Conv1D, (12, 2), (), []),
  "unet": (UNet, (8, 8, 3), (8, 8), ["01fb_o01i->f01b rhs_reversal"]),
  "conv3d": (
    Conv3D,
    (4, 4, 4, 1),
    (),
    ["012bf_o012i->f012b rhs_reversal", "f012b_i012o->012bf"],
  ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_accumulate_exactly_rewritten_or_not(family):
  model, example, label_shape, layouts = FAMILIES[family]
  graphdef, params = nnx_split(model)
  params = cast(params, "float32")
  rng = np.random.default_rng(4)
  batch = {
    "x": rng.normal(size=(BATCH, *example)).astype(np.float32),
    "y": rng.integers(0, 10, (BATCH, *label_shape)),
  }

  def loss(params, batch):
    return cross_entropy(nnx.merge(graphdef, params)(batch["x"]), batch["y"])

  grad_fn = jax.grad(loss)
  if family == "resnet":
    # Batch statistics: the reference is the mean of the micro-batches' own
    # gradients, micro-batch k holding rows k, k + K, ...
    micro = [
      jax.jit(grad_fn)(
        params, jax.tree.map(lambda x, k=k: x[k::NUM_MICROBATCHES], batch)
      )
      for k in range(NUM_MICROBATCHES)
    ]
    expected = jax.tree.map(lambda *g: sum(g) / NUM_MICROBATCHES, *micro)
  else:
    expected = jax.jit(grad_fn)(params, batch)

  step = jax.jit(jaccum.accumulate(grad_fn, NUM_MICROBATCHES))
  assert_trees_close(step(params, batch), expected, rtol=1e-5)
  plain = scan_accumulate(grad_fn, NUM_MICROBATCHES, rewrite=False)
  assert_trees_close(plain(params, batch), expected, rtol=1e-5)
  with rewriting_everything():
    every = scan_accumulate(grad_fn, NUM_MICROBATCHES)(params, batch)
  assert_trees_close(every, expected, rtol=1e-5)

  if jax.default_backend() == "cpu":
    not_canonical = [
      labels + (" rhs_reversal" if "rhs_reversal" in window else "")
      for inside, labels, window in compiled_convolutions(
        step.lower(params, batch).compile()
      )
      if inside and labels not in CANONICAL_LABELS
    ]
    assert sorted(not_canonical) == sorted(layouts), not_canonical

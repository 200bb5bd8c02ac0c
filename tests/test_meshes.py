"""The meshes big models train on: FSDP with tensor parallelism, NNX and Linen on them.

A (data=4, model=2) mesh, as Flax's miniGPT tutorial builds it, and a
(data=2, fsdp=2, tensor=2) mesh, as MaxText does: params split over the data
axes (FSDP, or HSDP over "fsdp" only) and over the model axes (Megatron's
column- and row-parallel matrices), every `fsdp_mode`, against the whole
batch's `jax.grad`. `CollectiveCounts.by_axis` says what runs where: the
model's own collectives over "model" or "tensor" inside the loop, nothing
over a data axis there in `"gather_once"`.
"""

import contextlib
import os
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaccum
import jaccum.inspect

MODES = ["gather_once", "shard_grads", "shard_all"]
WIDTH, HIDDEN, HEADS = 16, 32, 4


def mesh_2d():
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def mesh_3d():
  return jax.make_mesh(
    (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3
  )


def block_params(seed=0, dtype=jnp.float32):
  """A pre-LN transformer block: attention and MLP, Megatron-shaped."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), dtype)
  return {
    "qkv": normal(WIDTH, 3 * WIDTH),  # column parallel: heads split over model
    "out": normal(WIDTH, WIDTH),  # row parallel
    "up": normal(WIDTH, HIDDEN),  # column parallel
    "down": normal(HIDDEN, WIDTH),  # row parallel
    "scale": jnp.ones(WIDTH, dtype),
  }


def block_specs(data, model):
  """FSDP over `data` on the dimension tensor parallelism leaves whole."""
  return {
    "qkv": P(data, model),
    "out": P(model, data),
    "up": P(data, model),
    "down": P(model, data),
    "scale": P(data),
  }


def block_loss(params, tokens):
  def norm(x):
    x32 = x.astype(jnp.float32)
    scaled = x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + 1e-6)
    return (scaled * params["scale"].astype(jnp.float32)).astype(x.dtype)

  x = tokens
  q, k, v = jnp.split(norm(x) @ params["qkv"], 3, axis=-1)
  heads = lambda t: t.reshape(*t.shape[:2], HEADS, WIDTH // HEADS)
  scores = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / np.sqrt(WIDTH // HEADS)
  causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
  weights = jax.nn.softmax(jnp.where(causal, scores, -1e9).astype(jnp.float32), -1)
  mixed = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(x.dtype), heads(v))
  x = x + mixed.reshape(x.shape) @ params["out"]
  x = x + jax.nn.gelu(norm(x) @ params["up"]) @ params["down"]
  return jnp.mean(x.astype(jnp.float32) ** 2)


def tokens(batch, seed=1, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.normal(size=(batch, 6, WIDTH)), dtype)


def placed(mesh, params, specs, batch, batch_axes):
  params = {
    k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()
  }
  return params, jax.device_put(batch, NamedSharding(mesh, P(batch_axes)))


CASES = {
  # mesh, the batch's axes, the params' FSDP axis, the model axis
  "data4_model2": (mesh_2d, "data", "data", "model"),
  "data2_fsdp2_tensor2": (mesh_3d, ("data", "fsdp"), "fsdp", "tensor"),
}


@contextlib.contextmanager
def stderr_of_xla():
  """What XLA's C++ code writes to stderr meanwhile (file descriptor 2)."""
  with tempfile.TemporaryFile(mode="w+") as file:
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    text: list[str] = []
    try:
      yield text
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      file.seek(0)
      text.append(file.read())


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
  ("mode", "num_microbatches"),
  [("gather_once", 1), ("gather_once", 4), ("shard_grads", 4), ("shard_all", 4)],
)
def test_fsdp_with_tensor_parallelism_is_the_whole_batch_gradient(
  case, mode, num_microbatches, fresh_compiles
):
  """Exact, sharded like the params, and compiled without XLA rematerialising
  whole arrays (it warns on stderr; a spec that dropped the model axis made
  78 such warnings)."""
  make_mesh, batch_axes, fsdp_axis, model_axis = CASES[case]
  mesh = make_mesh()
  specs = block_specs(fsdp_axis, model_axis)
  params, batch = placed(mesh, block_params(), specs, tokens(32), batch_axes)
  step = jax.jit(
    jaccum.data_parallel(
      jax.grad(block_loss),
      num_microbatches,
      mesh=mesh,
      axis=batch_axes,
      param_specs=specs,
      fsdp_mode=mode,
    )
  )
  with stderr_of_xla() as stderr:
    compiled = step.lower(params, batch).compile()
  assert "Involuntary full rematerialization" not in stderr[0], stderr[0][-2000:]
  grads = compiled(params, batch)
  assert_trees_close(grads, jax.grad(block_loss)(params, batch), rtol=2e-5)
  # Gradients leave sharded like their params: FSDP and tensor parallel axes.
  for name, grad in grads.items():
    assert grad.sharding.is_equivalent_to(NamedSharding(mesh, specs[name]), grad.ndim)


def _column_parallel(mesh_shape, fsdp):
  """A column-parallel layer on `jax.make_mesh`'s default (explicit) mesh.

  Its matmul contracts an unsharded dimension, so the model runs on an
  explicit mesh as written; params, batch and the float64 reference.
  """
  rng = np.random.default_rng(0)
  w = (rng.normal(size=(8, 16)) / 3).astype(np.float32)
  v = (rng.normal(size=(16,)) / 4).astype(np.float32)
  x = rng.normal(size=(32, 8)).astype(np.float32)
  devices = jax.devices()[: int(np.prod(mesh_shape))]
  mesh = jax.make_mesh(mesh_shape, ("data", "model"), devices=devices)
  specs = {"w": P("data" if fsdp else None, "model"), "v": P("model")}
  params = {"w": w, "v": v}
  params = {
    k: jax.device_put(a, NamedSharding(mesh, specs[k])) for k, a in params.items()
  }
  batch = jax.device_put(x, NamedSharding(mesh, P("data")))
  with jax.enable_x64():
    want = jax.grad(_column_loss)(
      {"w": np.float64(w), "v": np.float64(v)}, np.float64(x)
    )  # fmt: skip
  return mesh, specs, params, batch, jax.tree.map(np.float32, want)


def _column_loss(params, x):
  return jnp.mean((jnp.tanh(x @ params["w"]) * params["v"]) ** 2)


@pytest.mark.parametrize("mode", MODES)
def test_fsdp_with_tensor_parallelism_on_an_explicit_mesh(mode):
  """On `jax.make_mesh`'s default mesh the gradients arrive typed as sharded
  over "model": the reduce-scatter asserted in JAX (gather_once's after the
  loop, shard_grads' inside it), shard_grads' carry started untyped, and
  shard_all's gradients left without their "model" axis."""
  mesh, specs, params, batch, want = _column_parallel((4, 2), fsdp=True)
  step = jaccum.data_parallel(
    jax.grad(_column_loss), 2, mesh=mesh, param_specs=specs, fsdp_mode=mode
  )
  grads = jax.jit(step)(params, batch)
  assert_trees_close(jax.device_get(grads), want, rtol=1e-5)
  for name, grad in grads.items():
    assert grad.sharding.spec == specs[name], (name, grad.sharding)


@pytest.mark.slow
def test_deterministic_bits_of_tensor_parallel_layouts():
  """`deterministic=True` sums the micro-gradients exactly, but a matmul split
  over "model" sums its partial products inside the micro-step, before the
  sum sees them, in an order that depends on the model axis. So the bits are
  the same on every layout with the same model axis over two or more data
  devices (data 4 or 2 × model 2, FSDP or not), and another model axis, or
  one device, gives others: measured within 2 ulps of each leaf's largest
  entry (up to 1,848 ulps at an entry near 0), each as close to float64;
  asserted within 4, for another build of XLA."""
  params, batch = block_params(), tokens(32)
  total = 8  # micro-batches, K × data

  def run(data, model, fsdp=False):
    devices = jax.devices()[: data * model]
    mesh = jax.make_mesh(
      (data, model), ("data", "model"), devices=devices,
      axis_types=(AxisType.Auto,) * 2,
    )  # fmt: skip
    specs = block_specs("data" if fsdp else None, "model")
    step = jaccum.data_parallel(
      jax.grad(block_loss), total // data, mesh=mesh, param_specs=specs,
      deterministic=True,
    )  # fmt: skip
    return jax.device_get(jax.jit(step)(*placed(mesh, params, specs, batch, "data")))

  bits = lambda tree: [np.asarray(a).view(np.uint32) for a in jax.tree.leaves(tree)]
  model2 = run(4, 2)
  for same in (run(2, 2), run(4, 2, fsdp=True)):
    assert all(map(np.array_equal, bits(same), bits(model2)))
  one = jax.jit(jaccum.accumulate(jax.grad(block_loss), total, deterministic=True))
  with jax.enable_x64():
    want = jax.jit(jax.grad(block_loss))(
      jax.tree.map(np.float64, params), np.float64(batch)
    )  # fmt: skip
  for other in (run(2, 4), jax.device_get(one(params, batch))):
    for a, b, w in zip(*map(jax.tree.leaves, (other, model2, want)), strict=True):
      ulp = np.spacing(np.max(np.abs(b)))
      assert np.max(np.abs(np.float64(a) - np.float64(b))) <= 4 * ulp
      np.testing.assert_allclose(a, w, rtol=0, atol=1e-6 * np.max(np.abs(w)))


def _megatron_loss(params, x):
  """Column- then row-parallel: the hidden activation is split over "model"."""
  hidden = jnp.tanh(x @ params["up"])
  typed = jax.typeof(hidden).sharding
  # Rows as the batch's (over "data" whole, on each device's rows per device).
  rows = NamedSharding(typed.mesh, P(typed.spec[0], None))
  return jnp.mean(jnp.matmul(hidden, params["down"], out_sharding=rows) ** 2)


@pytest.mark.parametrize("mode", MODES)
def test_fsdp_with_tensor_parallel_activations_on_an_explicit_mesh(mode):
  """Issue 36, item 13: "shard_all" tied each gathered shard to an element of
  its use's other operand, here the hidden activation split over "model",
  and JAX refused the slice ("slicing on sharded dims ... not divisible by
  mesh axes"); the whole batch and the other modes ran."""
  rng = np.random.default_rng(3)
  host = {
    "up": (rng.normal(size=(8, 16)) / 3).astype(np.float32),
    "down": (rng.normal(size=(16, 8)) / 4).astype(np.float32),
  }
  x = rng.normal(size=(32, 8)).astype(np.float32)
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  specs = {"up": P("data", "model"), "down": P("model", "data")}
  params = {
    k: jax.device_put(a, NamedSharding(mesh, specs[k])) for k, a in host.items()
  }
  batch = jax.device_put(x, NamedSharding(mesh, P("data")))
  whole = jax.device_get(jax.jit(jax.grad(_megatron_loss))(params, batch))
  step = jax.jit(jaccum.data_parallel(jax.grad(_megatron_loss), 2, fsdp_mode=mode))
  grads = step(params, batch)
  assert_trees_close(jax.device_get(grads), whole, rtol=1e-5)
  for name, grad in grads.items():
    assert grad.sharding.spec == specs[name], (name, grad.sharding)


@pytest.mark.parametrize("fsdp", [False, True], ids=["tensor_parallel", "fsdp_tp"])
def test_deterministic_with_tensor_parallelism_on_an_explicit_mesh(fsdp):
  """The exact sums' maximum reshaped a "model"-sharded gradient, which an
  explicit mesh refuses; the bits are the same whatever K and the devices."""
  bits = []
  for num_microbatches, devices in [(4, 2), (2, 4)]:
    mesh, specs, params, batch, want = _column_parallel((devices, 2), fsdp)
    step = jaccum.data_parallel(
      jax.grad(_column_loss), num_microbatches, mesh=mesh, param_specs=specs,
      deterministic=True,
    )  # fmt: skip
    grads = jax.device_get(jax.jit(step)(params, batch))
    assert_trees_close(grads, want, rtol=1e-5)
    bits.append([np.asarray(g).view(np.uint32) for g in jax.tree.leaves(grads)])
  assert all(map(np.array_equal, *bits))


@pytest.mark.parametrize("case", list(CASES))
def test_by_axis_the_model_axis_communicates_in_the_loop_the_data_axes_after(case):
  """gather_once: whatever the model axes do inside the loop, nothing crosses a
  data axis there; the data axes reduce once after it. With the sharded
  modes, FSDP's gathers and scatters cross only the params' FSDP axis."""
  make_mesh, batch_axes, fsdp_axis, model_axis = CASES[case]
  mesh = make_mesh()
  specs = block_specs(fsdp_axis, model_axis)
  params, batch = placed(mesh, block_params(), specs, tokens(32), batch_axes)
  data_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
  for mode in MODES:
    step = jax.jit(
      jaccum.data_parallel(
        jax.grad(block_loss),
        4,
        mesh=mesh,
        axis=batch_axes,
        param_specs=specs,
        fsdp_mode=mode,
      )
    )
    by_axis = jaccum.inspect.collectives(step, params, batch).by_axis
    over_data = {
      key: count
      for key, count in by_axis.items()
      if key is None or set((key,) if isinstance(key, str) else key) & set(data_axes)
    }
    inside = {key: count.inside_loops for key, count in over_data.items()}
    assert by_axis[model_axis].inside_loops > 0, (mode, dict(by_axis))
    if mode == "gather_once":
      assert not any(inside.values()), (mode, inside)
      # The one reduction: a reduce-scatter of every gradient over the data axes.
      assert sum(c.outside_loops for c in over_data.values()) > 0, over_data
    else:  # FSDP's own: gathers (shard_all) and scatters over the FSDP axis
      assert set(k for k, n in inside.items() if n) == {fsdp_axis}, (mode, inside)


def test_bf16_params_with_fsdp_and_tensor_parallelism_accumulate_in_float32():
  mesh = mesh_2d()
  specs = block_specs("data", "model")
  params32 = block_params()
  params, batch = placed(
    mesh,
    jax.tree.map(lambda p: p.astype(jnp.bfloat16), params32),
    specs,
    tokens(32, dtype=jnp.bfloat16),
    "data",
  )
  expected = jax.grad(block_loss)(
    jax.tree.map(lambda p: p.astype(jnp.float32), params), batch.astype(jnp.float32)
  )
  for mode in MODES:
    step = jax.jit(
      jaccum.data_parallel(
        jax.grad(block_loss), 4, mesh=mesh, param_specs=specs, fsdp_mode=mode
      )
    )
    grads = step(params, batch)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
    # bf16 forward and backward: a few bf16 roundings (2^-8 each) of the
    # float32 result; the float32 accumulator adds none per micro-batch.
    assert_trees_close(
      jax.tree.map(lambda g: g.astype(jnp.float32), grads), expected, rtol=0.05
    )


def nnx_model(mesh, data_spec=None):
  """A miniGPT-style block in NNX, partitioned as the tutorial writes it."""
  from flax import nnx

  def part(init, spec):
    return nnx.with_partitioning(init, NamedSharding(mesh, spec))

  xavier, zeros = nnx.initializers.xavier_uniform(), nnx.initializers.zeros_init()

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.mha = nnx.MultiHeadAttention(
        num_heads=2,
        in_features=WIDTH,
        kernel_init=part(xavier, P(None, "model")),
        bias_init=part(zeros, P("model")),
        decode=False,
        rngs=rngs,
      )
      self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.up = nnx.Linear(
        WIDTH, HIDDEN, kernel_init=part(xavier, P(data_spec, "model")), rngs=rngs
      )
      self.down = nnx.Linear(
        HIDDEN, WIDTH, kernel_init=part(xavier, P("model", data_spec)), rngs=rngs
      )
      self.head = nnx.Linear(WIDTH, 11, rngs=rngs)

    def __call__(self, x):
      mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1])))
      x = self.norm(x + self.mha(x, mask=mask))
      return self.head(x + self.down(nnx.relu(self.up(x))))

  return Block(nnx.Rngs(0))


def nnx_loss(model, batch):
  logits = model(batch[0])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()
  return loss, logits


def nnx_batch(mesh):
  rng = np.random.default_rng(2)
  inputs = jnp.asarray(rng.normal(size=(32, 6, WIDTH)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 11, size=(32, 6)))
  return jax.device_put((inputs, targets), NamedSharding(mesh, P("batch", None)))


@pytest.mark.parametrize("mode", MODES)
def test_the_nnx_minigpt_step_runs_on_its_mesh_with_the_model_as_it_is(
  mode, fresh_compiles
):
  """The tutorial's mesh and partitioning; FSDP from the variables' metadata
  (the MLP's kernels also name "batch"). The port changes the gradient line."""
  from flax import nnx

  import jaccum.nnx

  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("batch", "model"))
  model = nnx_model(mesh, data_spec="batch")
  batch = nnx_batch(mesh)

  @nnx.jit
  def whole(model, batch):
    return nnx.value_and_grad(nnx_loss, has_aux=True)(model, batch)

  @nnx.jit
  def accumulated(model, batch):
    grad_fn = jaccum.nnx.value_and_grad(
      nnx_loss,
      4,
      has_aux=True,
      mesh=mesh,
      axis="batch",
      fsdp_mode=mode,
      reduce=(("mean", "concat"), "mean"),
    )
    return grad_fn(model, batch)

  (loss, logits), grads = whole(model, batch)
  with stderr_of_xla() as stderr:
    (acc_loss, acc_logits), acc_grads = accumulated(model, batch)
  assert "Involuntary full rematerialization" not in stderr[0], stderr[0][-2000:]
  assert_trees_close((acc_loss, acc_logits), (loss, logits), rtol=2e-6)
  # The key projection's bias gets no gradient (softmax ignores a shift of
  # every score): only float32 rounding, below 1e-8, remains there.
  assert_trees_close(acc_grads, grads, rtol=2e-5, atol=1e-8)
  by_axis = jaccum.inspect.collectives(accumulated, model, batch).by_axis
  if mode == "gather_once":
    assert by_axis["batch"].inside_loops == 0, dict(by_axis)
  assert by_axis["model"].inside_loops > 0


def test_linen_on_a_mesh_with_fsdp_and_tensor_parallel_params():
  import flax.linen as nn

  import jaccum.linen

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(HIDDEN, name="up")(x))
      return nn.Dense(1, name="down")(x)[:, 0]

  def loss_fn(params, batch_stats, batch):
    pred = Mlp().apply({"params": params}, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)

  mesh = mesh_2d()
  rng = np.random.default_rng(3)
  batch = {
    "x": jnp.asarray(rng.normal(size=(32, WIDTH)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=32), jnp.float32),
  }
  init = Mlp().init(jax.random.key(0), batch["x"])["params"]
  specs = {
    "up": {"kernel": P("data", "model"), "bias": P("model")},
    "down": {"kernel": P("model"), "bias": P()},
  }
  params = jax.tree.map(
    lambda p, s: jax.device_put(p, NamedSharding(mesh, s)), init, specs
  )
  placed_batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  expected = jax.value_and_grad(loss_fn)(init, {}, batch)
  for mode in MODES:
    grad_fn = jaccum.linen.value_and_grad(
      loss_fn, 2, mesh=mesh, param_specs=specs, fsdp_mode=mode
    )
    got = jax.jit(grad_fn)(params, {}, placed_batch)
    assert_trees_close(got, expected, rtol=2e-6)
    assert got[1]["up"]["kernel"].sharding.is_equivalent_to(
      NamedSharding(mesh, specs["up"]["kernel"]), 2
    )


def test_specs_that_drop_the_model_axis_make_xla_rematerialise_and_the_check_sees_it(
  fresh_compiles,
):
  """The check above can fail: the 2-D kernels given P("batch"), which drops
  their model sharding, is what made XLA rematerialise whole arrays."""
  from flax import nnx

  import jaccum.nnx

  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("batch", "model"))
  model = nnx_model(mesh)
  _, params, _ = nnx.split(model, nnx.Param, ...)
  dropped = jax.tree.map(
    lambda x: P("batch") if x.ndim == 2 and x.shape[0] % 4 == 0 else P(), params
  )

  @nnx.jit
  def accumulated(model, batch):
    return jaccum.nnx.value_and_grad(
      nnx_loss,
      4,
      has_aux=True,
      mesh=mesh,
      axis="batch",
      param_specs=dropped,
      fsdp_mode="shard_all",
    )(model, batch)

  with stderr_of_xla() as stderr:
    accumulated(model, nnx_batch(mesh))
  assert "Involuntary full rematerialization" in stderr[0]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_a_data_axis_of_one_device_runs_the_model_axis_as_the_whole_batch_does(
  axis_type,
):
  """(data=1, model=2), as on a machine of two devices used for tensor
  parallelism: XLA rejects an all-reduce over a manual axis of one device
  whose operand is split over another, so the loop runs as on one device.
  Every mode, a count of shape [1] and deterministic=True stay exact."""
  mesh = jax.make_mesh(
    (1, 2), ("data", "model"), axis_types=(axis_type,) * 2, devices=jax.devices()[:2]
  )
  rng = np.random.default_rng(0)
  whole = {
    "w": (rng.normal(size=(8, 16)) / 3).astype(np.float32),
    "v": (rng.normal(size=(16,)) / 4).astype(np.float32),
  }
  x = rng.normal(size=(16, 8)).astype(np.float32)
  specs = {"w": P("data", "model"), "v": P("model")}
  params = {
    k: jax.device_put(a, NamedSharding(mesh, specs[k])) for k, a in whole.items()
  }
  batch = jax.device_put(x, NamedSharding(mesh, P("data")))
  grad_fn = jax.grad(_column_loss)
  with jax.enable_x64():
    to64 = lambda t: jax.tree.map(np.float64, t)
    want = jax.tree.map(np.float32, grad_fn(to64(whole), np.float64(x)))
    # Three of four micro-batches: rows k, k + 4, ... for k < 3 (strided).
    kept = np.float64(x.reshape(4, 4, 8)[:, :3].reshape(12, 8))
    want_kept = jax.tree.map(np.float32, grad_fn(to64(whole), kept))
  for options in [{"fsdp_mode": m, "param_specs": specs} for m in MODES] + [
    {"deterministic": True}
  ]:
    step = jax.jit(jaccum.data_parallel(grad_fn, 4, mesh=mesh, **options))
    assert_trees_close(jax.device_get(step(params, batch)), want, rtol=1e-5)
  step = jax.jit(jaccum.data_parallel(grad_fn, 4, mesh=mesh, split="strided"))
  got = step(params, batch, num_real_microbatches=jnp.array([3]))
  assert_trees_close(jax.device_get(got), want_kept, rtol=1e-5)


def _nnx_step(**options):
  from flax import nnx

  import jaccum.nnx

  @nnx.jit
  def step(model, batch):
    grad_fn = jaccum.nnx.value_and_grad(
      nnx_loss, 4, has_aux=True, reduce=(("mean", "concat"), "mean"), **options
    )
    return grad_fn(model, batch)

  return step


def test_nnx_on_the_tutorials_auto_mesh_without_mesh_warns_naming_the_batch_axis():
  """The miniGPT port without `mesh=`: XLA partitions the loop over "batch"
  and all-reduces the gradients in every micro-step (1.65x slower on the
  tutorial), silently, although the variables name the mesh's "model" axis."""
  from flax import nnx

  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("batch", "model"))  # auto
  model, batch = nnx_model(mesh), nnx_batch(mesh)
  with pytest.warns(UserWarning) as caught:
    counts = jaccum.inspect.collectives(_nnx_step(), model, batch).by_axis
  messages = [str(w.message) for w in caught if "no param names" in str(w.message)]
  assert messages, [str(w.message) for w in caught]
  assert "the mesh axes ['model']" in messages[0]
  assert "{'batch': 4, 'model': 2} also has 'batch'" in messages[0]
  assert "mesh=<the mesh>, axis='batch'" in messages[0]
  assert caught[0].filename == __file__  # the line that calls the step
  assert counts["batch"].inside_loops > 0  # what it warns of
  # The fix it names: nothing over "batch" inside the loop, and no warning.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fixed = _nnx_step(mesh=mesh, axis="batch")
    counts = jaccum.inspect.collectives(fixed, model, batch).by_axis
    (loss, _), grads = fixed(model, batch)
  assert counts["batch"].inside_loops == 0
  (whole_loss, _), whole = nnx.jit(nnx.value_and_grad(nnx_loss, has_aux=True))(
    model, batch
  )
  assert_trees_close((loss, grads), (whole_loss, whole), rtol=2e-5, atol=1e-8)


def test_nnx_warns_nothing_on_one_device_a_tensor_parallel_mesh_or_batch_axis_of_1():
  from flax import nnx

  import jaccum.nnx

  rng = np.random.default_rng(4)
  inputs = jnp.asarray(rng.normal(size=(8, 6, WIDTH)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 11, size=(8, 6)))
  tensor_parallel = Mesh(np.array(jax.devices()[:2]), ("model",))
  batch_of_one = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("batch", "model"))
  linear = nnx.Linear(WIDTH, 11, rngs=nnx.Rngs(0))  # no sharding metadata
  plain_loss = lambda model, x, y: optax.softmax_cross_entropy_with_integer_labels(
    model(x), y
  ).mean()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    nnx.jit(jaccum.nnx.value_and_grad(plain_loss, 4))(linear, inputs, targets)
    for mesh in (tensor_parallel, batch_of_one):
      _nnx_step()(nnx_model(mesh), (inputs, targets))


def test_linen_with_partitioned_params_on_an_auto_mesh_without_mesh_warns():
  """The same trap in jaccum.linen: params boxed by `nn.with_partitioning`
  (kept boxed, as Flax's SPMD guide does) name "model"; the batch's "data"
  axis is all-reduced over in every micro-step unless mesh= is given."""
  import flax.linen as nn

  import jaccum.linen

  mesh = mesh_2d()
  init = nn.initializers.lecun_normal()

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      up = nn.Dense(
        HIDDEN, kernel_init=nn.with_partitioning(init, (None, "model"), mesh)
      )
      down = nn.Dense(1, kernel_init=nn.with_partitioning(init, ("model", None), mesh))
      return down(nn.relu(up(x)))[:, 0]

  def loss_fn(params, batch_stats, batch):
    pred = Mlp().apply({"params": params}, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)

  rng = np.random.default_rng(5)
  batch = {
    "x": jnp.asarray(rng.normal(size=(32, WIDTH)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=32), jnp.float32),
  }
  params = Mlp().init(jax.random.key(0), batch["x"])["params"]
  placed = jax.device_put(batch, NamedSharding(mesh, P("data")))
  plain = jax.jit(jaccum.linen.value_and_grad(loss_fn, 4))
  with pytest.warns(UserWarning, match=r"the mesh axes \['model'\].*also has 'data'"):
    counts = jaccum.inspect.collectives(plain, params, {}, placed).by_axis
  assert counts["data"].inside_loops > 0
  fixed = jax.jit(jaccum.linen.value_and_grad(loss_fn, 4, mesh=mesh, axis="data"))
  unboxed = nn.meta.unbox(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    counts = jaccum.inspect.collectives(fixed, params, {}, placed).by_axis
    got = fixed(params, {}, placed)
    jax.jit(jaccum.linen.value_and_grad(loss_fn, 4))(unboxed, {}, batch)  # no names
  assert counts["data"].inside_loops == 0
  expected = jax.value_and_grad(loss_fn)(params, {}, batch)
  assert_trees_close(got, expected, rtol=2e-6)

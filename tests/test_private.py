"""`jaccum.dp_value_and_grad`: per-example clipping in the loop, noise once.

The reference (`reference`) does not call jaccum: `jax.vmap` of `jax.grad`
of the loss on one example (a batch of one row), each example's gradient
clipped to C in NumPy over all its leaves, the real ones summed, divided by
the rows given; the loss the mean over real examples. Both norm paths
(`"auto"`: ghost norms and per-example leaves; `"vmap"`) are compared with
it, in float64 to 1e-12 of each leaf's largest magnitude and in float32 to
1e-5, on an MLP, a CNN, a transformer LM (embedding, attention, layer norm,
tied output) and an NNX model, for K = 1, 4, 8, with masks and counts, on
one device and eight.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close
from jax.sharding import PartitionSpec as P

import jaccum
from jaccum._core import clipping, ghost

ROWS = 16
C = 0.5


# Models: `init(rng, dtype) -> params`, `loss(params, batch) -> [rows]`,
# `batch(rng, rows, dtype)`.


def mlp_init(rng, dtype):
  sizes = [(6, 16), (16, 16), (16, 3)]
  params = {}
  for i, (m, n) in enumerate(sizes):
    params[f"w{i}"] = rng.normal(size=(m, n)) / np.sqrt(m)
    params[f"b{i}"] = rng.normal(size=n) / 10
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def cross_entropy(logits, labels):
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]


def mlp_loss(params, batch):
  h = batch["x"]
  for i in range(2):
    h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
  return cross_entropy(h @ params["w2"] + params["b2"], batch["y"])


def mlp_batch(rng, rows, dtype):
  return {
    "x": jnp.asarray(rng.normal(size=(rows, 6)), dtype),
    "y": jnp.asarray(rng.integers(0, 3, rows), jnp.int32),
  }


def cnn_init(rng, dtype):
  params = {
    "k1": rng.normal(size=(3, 3, 1, 4)) / 3,
    "c1": rng.normal(size=4) / 10,
    "k2": rng.normal(size=(3, 3, 4, 6)) / 6,
    "c2": rng.normal(size=6) / 10,
    "w": rng.normal(size=(2 * 2 * 6, 3)) / 5,
    "b": np.zeros(3),
  }
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def cnn_loss(params, batch):
  conv = lambda x, k: jax.lax.conv_general_dilated(
    x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  pool = lambda x: (
    jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
  )
  h = pool(jax.nn.relu(conv(batch["x"], params["k1"]) + params["c1"]))
  h = jax.nn.relu(conv(h, params["k2"]) + params["c2"])
  h = pool(h).reshape(h.shape[0], -1)
  return cross_entropy(h @ params["w"] + params["b"], batch["y"])


def cnn_batch(rng, rows, dtype):
  return {
    "x": jnp.asarray(rng.normal(size=(rows, 8, 8, 1)), dtype),
    "y": jnp.asarray(rng.integers(0, 3, rows), jnp.int32),
  }


VOCAB, WIDTH, LENGTH, HEADS = 11, 8, 6, 2


def lm_init(rng, dtype):
  d = WIDTH
  params = {
    "embed": rng.normal(size=(VOCAB, d)),
    "position": rng.normal(size=(LENGTH, d)) / 10,
    "ln1": {"scale": 1 + rng.normal(size=d) / 10, "bias": rng.normal(size=d) / 10},
    "qkv": rng.normal(size=(d, 3 * d)) / np.sqrt(d),
    "out": rng.normal(size=(d, d)) / np.sqrt(d),
    "ln2": {"scale": 1 + rng.normal(size=d) / 10, "bias": rng.normal(size=d) / 10},
    "up": rng.normal(size=(d, 2 * d)) / np.sqrt(d),
    "up_bias": rng.normal(size=2 * d) / 10,
    "down": rng.normal(size=(2 * d, d)) / np.sqrt(2 * d),
    "ln_f": {"scale": 1 + rng.normal(size=d) / 10, "bias": rng.normal(size=d) / 10},
  }
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def layer_norm(x, p):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def lm_loss(params, batch):
  """A pre-norm transformer block, the output tied to the embedding."""
  tokens = batch["tokens"]
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  rows, length = inputs.shape
  x = params["embed"][inputs] + params["position"][:length]
  q, k, v = jnp.split(layer_norm(x, params["ln1"]) @ params["qkv"], 3, axis=-1)
  heads = lambda t: t.reshape(rows, length, HEADS, -1)
  scores = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / np.sqrt(WIDTH // HEADS)
  causal = jnp.tril(jnp.ones((length, length), bool))
  weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  attended = jnp.einsum("bhqk,bkhd->bqhd", weights, heads(v)).reshape(x.shape)
  x = x + attended @ params["out"]
  h = jax.nn.gelu(layer_norm(x, params["ln2"]) @ params["up"] + params["up_bias"])
  x = x + h @ params["down"]
  logits = layer_norm(x, params["ln_f"]) @ params["embed"].T
  return cross_entropy(logits, targets).mean(-1)


def lm_batch(rng, rows, dtype):
  del dtype
  return {"tokens": jnp.asarray(rng.integers(0, VOCAB, (rows, LENGTH + 1)), jnp.int32)}


MODELS = {
  "mlp": (mlp_init, mlp_loss, mlp_batch),
  "cnn": (cnn_init, cnn_loss, cnn_batch),
  "lm": (lm_init, lm_loss, lm_batch),
}


def setup(name, dtype=jnp.float64, rows=ROWS, seed=0):
  init, loss, make_batch = MODELS[name]
  rng = np.random.default_rng(seed)
  return loss, init(rng, dtype), make_batch(rng, rows, dtype)


def reference(loss, params, batch, mask=None, clip=C, normalize_by=None):
  """`(loss, grads, norms)` of DP-SGD without noise, in float64, without jaccum."""
  rows = jax.tree.leaves(batch)[0].shape[0]
  mask = np.ones(rows, bool) if mask is None else np.asarray(mask, bool)

  def one(params, example):
    return loss(params, jax.tree.map(lambda x: x[None], example))[0]

  losses, per_example = jax.vmap(jax.value_and_grad(one), (None, 0))(params, batch)
  per_example = jax.tree.map(lambda g: np.asarray(g, np.float64), per_example)
  norms = np.sqrt(
    sum(np.sum(g.reshape(rows, -1) ** 2, 1) for g in jax.tree.leaves(per_example))
  )
  factor = np.where(mask, np.minimum(1, clip / np.maximum(norms, 1e-300)), 0)
  normalize_by = rows if normalize_by is None else normalize_by
  grads = jax.tree.map(lambda g: np.tensordot(factor, g, 1) / normalize_by, per_example)
  real = np.asarray(losses, np.float64)[mask]
  mean = real.mean() if real.size else 0.0
  return mean, grads, np.where(mask, norms, 0)


def check(out, expected, rtol):
  loss, grads, norms = out
  want_loss, want_grads, want_norms = expected
  np.testing.assert_allclose(float(loss), want_loss, rtol=rtol, atol=rtol)
  grads = jax.tree.map(lambda g: np.asarray(g, np.float64), grads)
  assert_trees_close(grads, want_grads, rtol)
  np.testing.assert_allclose(norms, want_norms, rtol=rtol, atol=rtol * want_norms.max())


def private(loss, k, **options):
  options = {"l2_clip_norm": C, "noise_multiplier": 0.0, **options}
  return jax.jit(jaccum.dp_value_and_grad(loss, k, return_norms=True, **options))


def some_mask(rows=ROWS, seed=1):
  mask = np.random.default_rng(seed).random(rows) < 0.7
  mask[0] = False  # a padding row among the first micro-batch's
  return mask


CASES = [(n, "auto", k) for n in MODELS for k in (1, 4, 8)]
CASES += [(n, "vmap", 4) for n in MODELS]


@pytest.mark.parametrize(("name", "norms", "num_microbatches"), CASES)
def test_float64_matches_reference(name, norms, num_microbatches):
  with jax.enable_x64(True):
    loss, params, batch = setup(name)
    mask = some_mask()
    step = private(loss, num_microbatches, norms=norms)
    out = step(params, batch, example_mask=mask)
    check(out, reference(loss, params, batch, mask), 1e-12)


@pytest.mark.parametrize("name", list(MODELS))
def test_float32_matches_float64_reference(name):
  loss, params, batch = setup(name, jnp.float32)
  mask = some_mask()
  out = private(loss, 4)(params, batch, example_mask=mask)
  assert (
    out[1]["b0" if name == "mlp" else "position" if name == "lm" else "b"].dtype
    == jnp.float32
  )
  with jax.enable_x64(True):
    as64 = lambda tree: jax.tree.map(
      lambda x: (
        jnp.asarray(x, jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x
      ),
      tree,
    )
    expected = reference(loss, as64(params), as64(batch), mask)
  check(out, expected, 1e-5)


# Which leaves take the ghost path (their norms from activations and
# cotangents), and which form their per-example gradients.
PATHS = {
  "mlp": {
    "['w0']": "ghost dot_general (gram)",
    "['w1']": "ghost dot_general (gram)",
    "['w2']": "ghost dot_general (gram)",
    "['b0']": "per-example",
    "['b1']": "per-example",
    "['b2']": "per-example",
  },
  "cnn": {
    "['k1']": "ghost conv (outer)",
    "['k2']": "ghost conv (outer)",
    "['w']": "ghost dot_general (gram)",
    "['c1']": "per-example",
    "['c2']": "per-example",
    "['b']": "per-example",
  },
  "lm": {
    # The tied embedding reaches the loss twice (gather and output matmul).
    "['embed']": "per-example",
    "['position']": "per-example",
    "['qkv']": "ghost dot_general (outer)",
    "['out']": "ghost dot_general (outer)",
    "['up']": "ghost dot_general (outer)",
    "['down']": "ghost dot_general (outer)",
    "['up_bias']": "per-example",
    **{
      f"['{n}']['{p}']": "per-example"
      for n in ("ln1", "ln2", "ln_f")
      for p in ("scale", "bias")
    },
  },
}


def describe(loss, params, batch):
  names = [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  one = clipping.one_example(loss, clipping.Layout((1,), None), [params, batch], {})
  _, analysis = ghost.trace(one, params, (batch,), None)
  return analysis.describe(names)


@pytest.mark.parametrize("name", list(MODELS))
def test_which_uses_take_the_ghost_path(name):
  loss, params, batch = setup(name, jnp.float32)
  assert describe(loss, params, batch) == dict(sorted(PATHS[name].items()))


def test_a_count_and_a_mask_serve_every_batch_size_with_one_compilation():
  """A batch padded at its end: `num_real_microbatches` skips the micro-batches
  of padding, the mask the padding rows of the last real one."""
  traces = []

  def counted(params, batch):
    traces.append(1)
    return mlp_loss(params, batch)

  with jax.enable_x64(True):
    _, params, batch = setup("mlp")
    step = private(counted, 8, split="contiguous")
    for real in (16, 11, 5, 2):
      count = -(-real // 2)  # micro-batches of 2 rows holding real rows
      mask = np.arange(ROWS) < real
      out = step(params, batch, example_mask=mask, num_real_microbatches=count)
      first = jax.tree.map(lambda x, real=real: x[:real], batch)
      loss, grads, norms = reference(mlp_loss, params, first, normalize_by=ROWS)
      check(out, (loss, grads, np.pad(norms, (0, ROWS - real))), 1e-12)
  assert len(traces) == 1


def test_a_count_without_a_split_names_the_split():
  _, params, batch = setup("mlp", jnp.float32)
  with pytest.raises(ValueError, match='split="contiguous"'):
    private(mlp_loss, 4)(params, batch, num_real_microbatches=2)


def on_mesh(devices):
  return jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])


@pytest.mark.parametrize("name", list(MODELS))
def test_eight_devices_match_the_reference(name):
  with jax.enable_x64(True):
    loss, params, batch = setup(name)
    mask = some_mask()
    step = private(loss, 2, mesh=on_mesh(8))
    check(
      step(params, batch, example_mask=mask),
      reference(loss, params, batch, mask),
      1e-12,
    )


def test_eight_devices_with_counts_per_device():
  """Each device runs its own count of its rows; the mask marks the rest."""
  with jax.enable_x64(True):
    _, params, batch = setup("mlp", rows=32)
    counts = np.array([2, 0, 1, 2, 2, 1, 0, 2])  # of 2 micro-batches of 2 rows
    rows = np.arange(32).reshape(8, 4)
    real = (rows % 4) < 2 * counts[:, None]
    mask = real.reshape(-1) & some_mask(32)
    step = private(mlp_loss, 2, mesh=on_mesh(8), split="contiguous")
    out = step(params, batch, example_mask=mask, num_real_microbatches=counts)
    expected = reference(mlp_loss, params, batch, mask)
    check(out, expected, 1e-12)


def test_inside_the_users_shard_map():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.enable_x64(True):
    _, params, batch = setup("mlp", rows=32)
    mask = some_mask(32)
    grad_fn = jaccum.dp_value_and_grad(
      mlp_loss, 2, l2_clip_norm=C, noise_multiplier=0.0, axis_name="data"
    )
    step = jax.jit(
      jax.shard_map(
        lambda p, b, m: grad_fn(p, b, example_mask=m),
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=(P(), P()),
      )
    )
    loss, grads = step(params, batch, mask)
    want_loss, want_grads, _ = reference(mlp_loss, params, batch, mask)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-12)
    assert_trees_close(grads, want_grads, 1e-12)


def test_fsdp_gather_once():
  """Params sharded over the data axis: their gradients leave sharded too."""
  with jax.enable_x64(True):
    _, params, batch = setup("mlp")
    specs = {k: P("data") if k == "w1" else P() for k in params}
    step = private(mlp_loss, 2, mesh=on_mesh(8), param_specs=specs)
    mask = some_mask()
    out = step(params, batch, example_mask=mask)
    check(out, reference(mlp_loss, params, batch, mask), 1e-12)
    assert out[1]["w1"].sharding.spec[0] == "data"


def test_a_model_with_sharding_constraints_runs():
  """The constraints name the batch axis: one example's program reads them as
  values (jax_privacy's per-example vmap fails on them)."""
  auto = jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((8,), ("data",), axis_types=(auto,))
  rows = jax.sharding.NamedSharding(mesh, P("data"))

  def constrained(params, batch):
    h = jax.lax.with_sharding_constraint(batch["x"], rows)
    for i in range(2):
      h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
      h = jax.lax.with_sharding_constraint(h, rows)
    return cross_entropy(h @ params["w2"] + params["b2"], batch["y"])

  with jax.enable_x64(True):
    _, params, batch = setup("mlp")
    mask = some_mask()
    for norms in ("auto", "vmap"):
      step = private(constrained, 2, mesh=mesh, norms=norms)
      out = step(params, batch, example_mask=mask)
      check(out, reference(mlp_loss, params, batch, mask), 1e-12)


def test_an_nnx_model_of_params_alone():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(6, 16, rngs=rngs, param_dtype=jnp.float64)
      self.norm = nnx.LayerNorm(16, rngs=rngs, param_dtype=jnp.float64)
      self.out = nnx.Linear(16, 3, rngs=rngs, param_dtype=jnp.float64)

    def __call__(self, x):
      return self.out(jnp.tanh(self.norm(self.hidden(x))))

  def loss_fn(model, x, y):
    return cross_entropy(model(x), y)

  with jax.enable_x64(True):
    model = Model(nnx.Rngs(0))
    _, _, batch = setup("mlp")
    mask = some_mask()
    step = jaccum.nnx.dp_value_and_grad(
      loss_fn, 4, l2_clip_norm=C, noise_multiplier=0.0, return_norms=True
    )
    loss, grads, norms = nnx.jit(step)(model, batch["x"], batch["y"], example_mask=mask)
    graphdef, params = nnx.split(model)
    pure = lambda p, b: loss_fn(nnx.merge(graphdef, p), b["x"], b["y"])
    want_loss, want_grads, want_norms = reference(pure, params, batch, mask)
    assert isinstance(grads, nnx.State)
    check((loss, grads, norms), (want_loss, want_grads, want_norms), 1e-12)


def test_an_nnx_model_with_batch_statistics_is_refused_by_name():
  from flax import nnx

  model = nnx.Sequential(
    nnx.Linear(6, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0))
  )
  step = jaccum.nnx.dp_value_and_grad(
    lambda m, x: m(x).sum(-1), 2, l2_clip_norm=1.0, noise_multiplier=0.0
  )
  with pytest.raises(ValueError, match=r"layers/1/mean \(BatchStat\).*couples|mix"):
    step(model, jnp.ones((4, 6)))


def noise_of(devices, num_microbatches, key, sigma=1.3, **options):
  """The noise `dp_value_and_grad` adds, on `devices` devices: noisy - clean."""
  _, params, batch = setup("mlp", jnp.float32, rows=16)
  params = {**params, "wide": jnp.zeros((64, 64))}  # more draws per call
  loss = lambda p, b: mlp_loss(p, b) + 0 * jnp.sum(p["wide"])
  mesh = {} if devices == 1 else {"mesh": on_mesh(devices)}
  noisy = jaccum.dp_value_and_grad(
    loss,
    num_microbatches,
    l2_clip_norm=0.7,
    noise_multiplier=sigma,
    normalize_by=5.0,
    **mesh,
    **options,
  )
  clean = jaccum.dp_value_and_grad(
    loss,
    num_microbatches,
    l2_clip_norm=0.7,
    noise_multiplier=0.0,
    normalize_by=5.0,
    **mesh,
    **options,
  )
  _, with_noise = jax.jit(noisy)(params, batch, noise_key=key)
  _, without = jax.jit(clean)(params, batch)
  return jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), with_noise, without)


def test_the_noise_has_std_sigma_c_over_normalize_by_on_eight_devices():
  draws = np.concatenate(
    [
      np.concatenate(
        [x.ravel() for x in jax.tree.leaves(noise_of(8, 1, jax.random.key(i)))]
      )
      for i in range(8)
    ]
  )
  assert draws.size > 30_000
  want = 1.3 * 0.7 / 5.0
  assert abs(draws.std() / want - 1) < 0.03, draws.std() / want
  assert abs(draws.mean()) < 3 * want / np.sqrt(draws.size)


def test_the_noise_is_the_same_on_any_number_of_devices():
  key = jax.random.key(7)
  one = noise_of(1, 8, key)
  for devices in (2, 4, 8):
    assert_trees_close(noise_of(devices, 8 // devices, key), one, 1e-5)


def test_deterministic_gives_the_same_bits_whatever_k_and_the_devices():
  key = jax.random.key(3)
  _, params, batch = setup("lm", jnp.float32, rows=16)
  mask = some_mask()

  def run(devices, num_microbatches):
    mesh = {} if devices == 1 else {"mesh": on_mesh(devices)}
    step = jaccum.dp_value_and_grad(
      lm_loss,
      num_microbatches,
      l2_clip_norm=C,
      noise_multiplier=1.0,
      deterministic=True,
      return_norms=True,
      **mesh,
    )
    out = jax.jit(step)(params, batch, noise_key=key, example_mask=mask)
    return [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(out)]

  first = run(1, 8)
  for devices, k in ((2, 4), (4, 2), (8, 1)):
    assert all(map(np.array_equal, run(devices, k), first)), (devices, k)


def test_bf16_params_sum_in_float32():
  loss, params, batch = setup("mlp", jnp.float32)
  as_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  _, grads, _ = private(loss, 4)(
    as_bf16, {**batch, "x": batch["x"].astype(jnp.bfloat16)}
  )
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  _, want, _ = reference(loss, params, batch)
  assert_trees_close(
    jax.tree.map(lambda g: np.asarray(g, np.float64), grads), want, 3e-2
  )


def test_each_example_draws_its_own_key():
  """`rng_argnum`: example j of micro-batch k (strided: row k + j·K) draws
  from `fold_in(fold_in(key, k), j)`."""

  def dropped(params, batch, key):
    keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
    return mlp_loss(params, {**batch, "x": jnp.where(keep, batch["x"] * 2, 0)})

  with jax.enable_x64(True):
    _, params, batch = setup("mlp")
    key = jax.random.key(5)
    out = private(dropped, 4, rng_argnum=2)(params, batch, key)
    k_of_row = np.arange(ROWS) % 4
    j_of_row = np.arange(ROWS) // 4
    keys = [
      jax.random.fold_in(jax.random.fold_in(key, k), j)
      for k, j in zip(k_of_row, j_of_row, strict=True)
    ]
    per_row = jax.vmap(
      lambda x, y, k: jax.value_and_grad(
        lambda p: dropped(p, {"x": x[None], "y": y[None]}, k)[0]
      )(params)
    )
    losses, grads = per_row(batch["x"], batch["y"], jnp.stack(keys))
    norms = np.sqrt(
      sum(
        np.sum(np.asarray(g).reshape(ROWS, -1) ** 2, 1) for g in jax.tree.leaves(grads)
      )
    )
    factor = np.minimum(1, C / norms)
    want = jax.tree.map(lambda g: np.tensordot(factor, np.asarray(g), 1) / ROWS, grads)
    check(out, (float(np.mean(losses)), want, norms), 1e-12)


def test_without_return_norms_it_returns_the_loss_and_grads():
  _, params, batch = setup("mlp", jnp.float32)
  step = jaccum.dp_value_and_grad(mlp_loss, 2, l2_clip_norm=1.0, noise_multiplier=0.5)
  out = jax.jit(step)(params, batch, noise_key=jax.random.key(0))
  assert len(out) == 2
  assert jax.tree.structure(out[1]) == jax.tree.structure(params)


BAD = [
  (
    dict(loss=lambda p, b: mlp_loss(p, b).mean()),
    TypeError,
    "one floating loss per example",
  ),
  (dict(l2_clip_norm=0.0), ValueError, "l2_clip_norm must be a finite number > 0"),
  (dict(l2_clip_norm=-1.0), ValueError, "l2_clip_norm must be a finite number > 0"),
  (
    dict(l2_clip_norm=jnp.float32(1.0)),
    TypeError,
    "l2_clip_norm must be a Python number",
  ),
  (
    dict(noise_multiplier=-0.1),
    ValueError,
    "noise_multiplier must be a finite number >= 0",
  ),
  (dict(noise_multiplier=1.0, call={}), ValueError, "noise_key is missing"),
  (
    dict(call={"example_mask": np.ones(8, bool)}),
    ValueError,
    r"example_mask must be one bool per row of the batch, shape \(16,\)",
  ),
  (dict(call={"noise_key": 3}), TypeError, "noise_key must be a PRNG key"),
  (dict(norms="ghost"), ValueError, "norms must be one of"),
  (dict(batch_argnums=0), ValueError, "includes 0, the params' position"),
  (dict(reduce="mean"), TypeError, "reduce is not an option of dp_value_and_grad"),
  (dict(weight_fn=lambda p, b: 1.0), TypeError, "weight_fn is not an option"),
  (dict(state_argnum=2), TypeError, "state_argnum is not an option"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD)
def test_bad_input_gets_a_clear_error(change, error, message):
  _, params, batch = setup("mlp", jnp.float32)
  change = dict(change)
  loss = change.pop("loss", mlp_loss)
  call = change.pop("call", {"noise_key": jax.random.key(0)})
  options = {"l2_clip_norm": 1.0, "noise_multiplier": 0.0, **change}
  with pytest.raises(error, match=message):
    step = jaccum.dp_value_and_grad(loss, 2, **options)
    jax.jit(lambda p, b: step(p, b, **call))(params, batch)


def test_integer_params_are_refused_by_path():
  _, params, batch = setup("mlp", jnp.float32)
  step = jaccum.dp_value_and_grad(mlp_loss, 2, l2_clip_norm=1.0, noise_multiplier=0.0)
  with pytest.raises(TypeError, match=r"params\['count'\] is int32"):
    step({**params, "count": jnp.int32(0)}, batch)


@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated")
def test_agrees_with_jax_privacy():
  """Its `clipped_grad` (per-example `vmap`) on the same loss, if installed."""
  clipping_lib = pytest.importorskip(
    "jax_privacy.clipping", reason="jax-privacy is not installed"
  )
  loss, params, batch = setup("mlp", jnp.float32)
  total = lambda p, b: jnp.sum(loss(p, b))
  theirs = clipping_lib.clipped_grad(
    total, l2_clip_norm=C, batch_argnums=1, keep_batch_dim=True, normalize_by=ROWS
  )(params, batch)
  _, ours, _ = private(loss, 4)(params, batch)
  assert_trees_close(ours, theirs, 1e-5)


def uses_loss(params, batch):
  """Every kind of use the ghost path reads, in less common forms."""
  x, ids = batch["x"], batch["ids"]  # [rows, 4, 5], [rows, 4]
  h = jnp.einsum("fd,btd->btf", params["lhs"], x)  # the param as the lhs
  heads = h.reshape(*h.shape[:2], 2, 3)
  h = jnp.einsum("bthd,hde->bthe", heads, params["per_head"])  # a batch dim
  h = h.reshape(*h.shape[:2], -1) @ params["chain"].reshape(56).reshape(7, 8).T
  image = jax.lax.conv_general_dilated(  # NCHW, strided and dilated
    x[:, None],
    params["kernel"],
    (2, 1),
    [(1, 2), (0, 1)],
    rhs_dilation=(1, 2),
    dimension_numbers=("NCHW", "OIHW", "NCHW"),
  )
  table = jnp.take(params["table"], ids, axis=0, mode="clip")  # ids beyond it
  return (
    jnp.sum(jnp.tanh(h) ** 2, (1, 2))
    + jnp.sum(jnp.sin(image), (1, 2, 3))
    + jnp.sum(jnp.cos(table), (1, 2))
  )


def uses_setup(dtype=jnp.float64):
  rng = np.random.default_rng(4)
  params = {
    "lhs": rng.normal(size=(6, 5)),
    "per_head": rng.normal(size=(2, 3, 4)) / 2,
    "chain": rng.normal(size=(7, 8)) / 3,
    "kernel": rng.normal(size=(3, 1, 2, 2)),
    "table": rng.normal(size=(5, 3)),
  }
  params = jax.tree.map(lambda v: jnp.asarray(v, dtype), params)
  batch = {
    "x": jnp.asarray(rng.normal(size=(ROWS, 4, 5)), dtype),
    "ids": jnp.asarray(rng.integers(0, 7, (ROWS, 4)), jnp.int32),
  }
  return params, batch


@pytest.mark.parametrize("how", ["gram", "outer"])
def test_every_kind_of_use_both_ways(how, monkeypatch):
  """Each kind's ghost norm and kept product, against the reference."""
  monkeypatch.setattr(ghost, "_how", lambda activations, product: how)
  with jax.enable_x64(True):
    params, batch = uses_setup()
    described = describe(uses_loss, params, batch)
    kinds = {
      "lhs": "dot_general",
      "per_head": "dot_general",
      "chain": "dot_general",
      "kernel": "conv",
      "table": "gather",
    }
    assert described == {
      f"['{n}']": f"ghost {k} ({how})" for n, k in sorted(kinds.items())
    }
    mask = some_mask()
    out = private(uses_loss, 4)(params, batch, example_mask=mask)
    check(out, reference(uses_loss, params, batch, mask), 1e-12)

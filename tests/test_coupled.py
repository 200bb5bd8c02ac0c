"""`jaccum.accumulate_coupled` against the whole batch's `value_and_grad`.

Each loss couples the batch: contrastive losses whose negatives are the other
rows (CLIP with a learnable temperature, SigLIP, retrieval with hard
negatives), and a mixture-of-experts load-balancing loss built from the
whole batch's expert fractions. The reference is
`jax.value_and_grad(lambda p, b: loss_fn(p, encode_fn(p, b)))` on the whole
batch, in float32 (relative error ≤ 1e-5) and float64 (≤ 1e-12).
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import _leaf_errors, assert_trees_close, max_rel_error
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaccum
import jaccum.inspect

BATCH = 64
DEVICES = 8
WIDTH, EMBED, TOKENS, EXPERTS = 6, 4, 3, 4


def dense(key, *shape, dtype=jnp.float32):
  return (jax.random.normal(key, shape, dtype) / np.sqrt(shape[0])).astype(dtype)


def tower(params, x):
  return jnp.tanh(x @ params["w1"]) @ params["w2"]


def tower_params(key, dtype):
  k1, k2 = jax.random.split(key)
  return {
    "w1": dense(k1, WIDTH, 8, dtype=dtype),
    "w2": dense(k2, 8, EMBED, dtype=dtype),
  }


def normalize(x):
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


# Two towers: images and texts (CLIP, SigLIP).
def two_towers(params, batch):
  return {
    "image": normalize(tower(params["image"], batch["image"])),
    "text": normalize(tower(params["text"], batch["text"])),
  }


def clip_loss(params, reps):
  logits = jnp.exp(params["log_temp"]) * reps["image"] @ reps["text"].T
  labels = jnp.arange(logits.shape[0])
  ce = optax.softmax_cross_entropy_with_integer_labels
  return (ce(logits, labels).mean() + ce(logits.T, labels).mean()) / 2


def siglip_loss(params, reps):
  logits = jnp.exp(params["log_temp"]) * reps["image"] @ reps["text"].T + params["bias"]
  signs = 2 * jnp.eye(logits.shape[0], dtype=logits.dtype) - 1
  return -jnp.sum(jax.nn.log_sigmoid(signs * logits)) / logits.shape[0]


# Retrieval: a query against every positive and hard negative document.
def retrieval_towers(params, batch):
  return {
    "query": tower(params["query"], batch["query"]),
    "positive": tower(params["doc"], batch["positive"]),
    "negative": tower(params["doc"], batch["negative"]),
  }


def hard_negative_loss(params, reps):
  docs = jnp.concatenate([reps["positive"], reps["negative"]])
  logits = reps["query"] @ docs.T / params["temp"]
  labels = jnp.arange(reps["query"].shape[0])
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# Mixture of experts: per-token routing, a per-token loss, and Switch's
# load-balancing term from the whole batch's fraction of tokens per expert.
def moe_encoder(params, batch):
  probs = jax.nn.softmax(batch["tokens"] @ params["router"], axis=-1)
  experts = jnp.einsum("btw,ewo->bteo", batch["tokens"], params["experts"])
  out = jnp.einsum("bte,bteo->bto", probs, experts)
  return {"probs": probs, "token_loss": jnp.sum((out - batch["target"]) ** 2, -1)}


def moe_loss(params, reps):
  probs = reps["probs"].reshape(-1, EXPERTS)
  fraction = jnp.mean(jax.nn.one_hot(jnp.argmax(probs, -1), EXPERTS), 0)
  balance = EXPERTS * jnp.sum(fraction * jnp.mean(probs, 0))
  return jnp.mean(reps["token_loss"]) + params["alpha"] * balance


def make_problem(name, dtype=jnp.float32):
  """`(encode_fn, loss_fn, params, batch)` for one of the coupled losses."""
  keys = iter(jax.random.split(jax.random.key(0), 8))
  normal = lambda *shape: jax.random.normal(next(keys), shape, dtype)
  if name in ("clip", "siglip"):
    params = {
      "image": tower_params(next(keys), dtype),
      "text": tower_params(next(keys), dtype),
      "log_temp": jnp.asarray(1.5, dtype),
    }
    if name == "siglip":
      params["bias"] = jnp.asarray(-2.0, dtype)
    batch = {"image": normal(BATCH, WIDTH), "text": normal(BATCH, WIDTH)}
    return two_towers, clip_loss if name == "clip" else siglip_loss, params, batch
  if name == "hard_negative":
    params = {
      "query": tower_params(next(keys), dtype),
      "doc": tower_params(next(keys), dtype),
      "temp": jnp.asarray(0.5, dtype),
    }
    batch = {k: normal(BATCH, WIDTH) for k in ("query", "positive", "negative")}
    return retrieval_towers, hard_negative_loss, params, batch
  params = {
    "router": normal(WIDTH, EXPERTS),
    "experts": normal(EXPERTS, WIDTH, 2) / np.sqrt(WIDTH),
    "alpha": jnp.asarray(0.1, dtype),
  }
  batch = {"tokens": normal(BATCH, TOKENS, WIDTH), "target": normal(BATCH, TOKENS, 2)}
  return moe_encoder, moe_loss, params, batch


def whole_batch(encode_fn, loss_fn):
  return jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, encode_fn(p, b))))


@functools.cache
def expected(name, dtype="float32"):
  """The whole batch's `(loss, grads)` for a problem, computed once per module."""
  with jax.enable_x64(dtype == "float64"):
    encode_fn, loss_fn, params, batch = make_problem(name, jnp.dtype(dtype))
    return jax.device_get(whole_batch(encode_fn, loss_fn)(params, batch))


# Every K of 1, 2, 8, 16 and 64 (one row per micro-batch) in float32 and in
# float64, each loss at two or three of them.
CASES = [
  ("clip", 1, "float32"),
  ("clip", 8, "float32"),
  ("clip", 64, "float64"),
  ("siglip", 16, "float32"),
  ("siglip", 2, "float64"),
  ("hard_negative", 64, "float32"),
  ("hard_negative", 8, "float64"),
  ("moe", 2, "float32"),
  ("moe", 16, "float64"),
  ("moe", 1, "float64"),
]


@pytest.mark.parametrize(("name", "num_microbatches", "dtype"), CASES)
def test_matches_whole_batch(name, num_microbatches, dtype):
  with jax.enable_x64(dtype == "float64"):
    encode_fn, loss_fn, params, batch = make_problem(name, jnp.dtype(dtype))
    step = jax.jit(jaccum.accumulate_coupled(encode_fn, loss_fn, num_microbatches))
    got = step(params, batch)
  rtol = 1e-12 if dtype == "float64" else 1e-5
  assert_trees_close(got, expected(name, dtype), rtol=rtol)


def test_plain_accumulate_of_a_coupled_loss_is_another_objective():
  # What accumulate_coupled is for: the per-micro-batch loss is not the loss.
  encode_fn, loss_fn, params, batch = make_problem("clip")
  loss = lambda p, b: loss_fn(p, encode_fn(p, b))
  plain = jax.jit(jaccum.accumulate(jax.value_and_grad(loss), 8))(params, batch)
  whole = expected("clip")
  assert abs(float(plain[0]) - float(whole[0])) > 0.5
  assert max_rel_error(plain[1], whole[1]) > 0.1


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_loss_fn_sees_rows_in_batch_order(split):
  # A loss that weighs each row by its position tells any other order apart.
  def encode_fn(params, x):
    return {"row": jnp.tanh(x @ params), "label": jnp.int32(1) + x[:, 0].astype(int)}

  def loss_fn(params, reps):
    position = jnp.arange(1.0, reps["row"].shape[0] + 1)
    return jnp.sum(position[:, None] * reps["row"] ** 2) + jnp.sum(reps["label"])

  params = dense(jax.random.key(1), WIDTH, 3)
  x = jax.random.normal(jax.random.key(2), (BATCH, WIDTH))
  step = jaccum.accumulate_coupled(encode_fn, loss_fn, 4, split=split)
  got = jax.jit(step)(params, x)
  assert_trees_close(got, whole_batch(encode_fn, loss_fn)(params, x), rtol=1e-5)


def dropout_towers(params, batch, key):
  keep = jax.random.bernoulli(key, 0.7, (batch["image"].shape[0], 8))
  hidden = jnp.tanh(batch["image"] @ params["image"]["w1"]) * keep / 0.7
  return {
    "image": normalize(hidden @ params["image"]["w2"]),
    "text": normalize(tower(params["text"], batch["text"])),
  }


def dropout_reference(params, batch, key, num_microbatches, num_devices=1):
  """Whole-batch value_and_grad, each micro-batch's rows with its documented key.

  Device d of `num_devices` holds a contiguous block of rows and folds the
  key with d (d > 0) first; its micro-batch k (rows k, k + K, … of the
  block) draws `fold_in(that key, k)`.
  """
  rows = BATCH // num_devices // num_microbatches
  # [devices, K, rows, ...]: block d's strided micro-batch k.
  to_micro = lambda x: jnp.swapaxes(
    x.reshape(num_devices, rows, num_microbatches, *x.shape[1:]), 1, 2
  )
  from_micro = lambda x: jnp.swapaxes(x, 1, 2).reshape(BATCH, *x.shape[3:])
  device_keys = [key] + [jax.random.fold_in(key, d) for d in range(1, num_devices)]
  keys = jnp.stack(
    [
      jnp.stack([jax.random.fold_in(dk, k) for k in range(num_microbatches)])
      for dk in device_keys
    ]
  )
  encode = jax.vmap(jax.vmap(dropout_towers, (None, 0, 0)), (None, 0, 0))

  def loss(params):
    reps = encode(params, jax.tree.map(to_micro, batch), keys)
    return clip_loss(params, jax.tree.map(from_micro, reps))

  return jax.jit(jax.value_and_grad(loss))(params)


def test_dropout_draws_the_same_keys_in_both_passes():
  _, _, params, batch = make_problem("clip")
  key = jax.random.key(3)
  step = jaccum.accumulate_coupled(dropout_towers, clip_loss, 8, rng_argnum=2)
  got = jax.jit(step)(params, batch, key)
  assert_trees_close(got, dropout_reference(params, batch, key, 8), rtol=1e-5)


@pytest.mark.parametrize("route", ["one device", "explicit"])
def test_bf16_params_sum_in_float32(route):
  encode_fn, loss_fn, params, batch = make_problem("clip", jnp.bfloat16)
  if route == "one device":
    step, args = (
      jax.jit(jaccum.accumulate_coupled(encode_fn, loss_fn, 32)),
      (
        params,
        batch,
      ),
    )
  else:
    step, args = explicit_route(encode_fn, loss_fn, 4, params, batch)
  loss, grads = jax.device_get(step(*args))
  whole_loss, whole_grads = whole_batch(encode_fn, loss_fn)(params, batch)
  assert loss.dtype == whole_loss.dtype  # optax's cross-entropy: float32
  assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(
    lambda p: p.dtype, params
  )
  # The truth: the same bf16 params and batch, computed in float32. Summed in
  # float32, every leaf is as close to it as the whole batch's own bf16 step
  # is, within one bf16 rounding (2^-8 relative to the leaf's largest entry).
  upcast = jax.tree.map(lambda x: x.astype(jnp.float32), (params, batch))
  truth = jax.device_get(whole_batch(encode_fn, loss_fn)(*upcast)[1])
  errors = [e / s for _, e, s in _leaf_errors(grads, truth)]
  whole = [e / s for _, e, s in _leaf_errors(jax.device_get(whole_grads), truth)]
  assert all(e <= w + 2.0**-8 for e, w in zip(errors, whole, strict=True)), (
    errors,
    whole,
  )


def test_encode_fn_is_traced_once_per_compilation_plus_one_shape_check():
  traces = []

  def counted(params, batch):
    traces.append(batch["image"].shape)
    return two_towers(params, batch)

  _, _, params, batch = make_problem("clip")
  jax.jit(jaccum.accumulate_coupled(counted, clip_loss, 8)).lower(params, batch)
  assert traces == [(8, WIDTH), (16, WIDTH)]  # the passes, then the check


class BatchNormTower(nn.Module):
  """A Linen tower with BatchNorm: its statistics are state."""

  train: bool

  @nn.compact
  def __call__(self, x):
    x = nn.BatchNorm(use_running_average=not self.train)(nn.Dense(8)(x))
    return nn.Dense(EMBED)(jnp.tanh(x))


def batch_norm_encoder(train):
  """`encode_fn(params, x, stats) -> (reps, stats)`, as Linen's `mutable=` gives."""

  def encode_fn(params, x, stats):
    variables = {"params": params, "batch_stats": stats}
    out, new = BatchNormTower(train).apply(variables, x, mutable=["batch_stats"])
    return {"x": out}, new["batch_stats"]

  return encode_fn


def spread_loss(params, reps):  # couples the rows: their spread, batch-wide
  return jnp.sum(jnp.var(reps["x"], axis=0))


def batch_norm_problem():
  x = jax.random.normal(jax.random.key(5), (BATCH, WIDTH))
  variables = BatchNormTower(False).init(jax.random.key(6), x)
  stats = jax.tree.map(lambda s: s + 0.5, variables["batch_stats"])  # not 0, 1
  return variables["params"], x, stats


def test_state_that_is_only_read_passes_through():
  params, x, stats = batch_norm_problem()
  encode_fn = batch_norm_encoder(train=False)  # running statistics, only read
  step = jaccum.accumulate_coupled(encode_fn, spread_loss, 4, state_argnum=2)
  (loss, grads), new_stats = jax.jit(step)(params, x, stats)
  assert_trees_close(new_stats, stats, rtol=0)
  expected = jax.jit(
    jax.value_and_grad(lambda p: spread_loss(p, encode_fn(p, x, stats)[0]))
  )(params)
  # The last bias's gradient is 0 in exact arithmetic (the spread ignores a
  # shift): only rounding is left there.
  assert_trees_close((loss, grads), expected, rtol=1e-5, atol=1e-7)


# Many devices.


def shard_rows(mesh, tree):
  return jax.device_put(tree, NamedSharding(mesh, P("data")))


def explicit_mesh():
  return jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Explicit,))


def auto_mesh():
  return jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))


def explicit_route(encode_fn, loss_fn, num_microbatches, params, batch):
  """Plain jit, the batch sharded over an explicit mesh axis."""
  step = jax.jit(jaccum.accumulate_coupled(encode_fn, loss_fn, num_microbatches))
  return step, (params, shard_rows(explicit_mesh(), batch))


def mesh_route(encode_fn, loss_fn, num_microbatches, params, batch):
  """`mesh=` on an auto mesh, as `data_parallel` takes it."""
  step = jaccum.accumulate_coupled(
    encode_fn, loss_fn, num_microbatches, mesh=auto_mesh()
  )
  return jax.jit(step), (params, batch)


def shard_map_route(encode_fn, loss_fn, num_microbatches, params, batch):
  """`axis_name` inside the user's own shard_map, which checks types."""
  mesh = explicit_mesh()
  coupled = jaccum.accumulate_coupled(
    encode_fn, loss_fn, num_microbatches, axis_name="data"
  )
  step = jax.shard_map(coupled, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  return jax.jit(step), (params, shard_rows(mesh, batch))


ROUTES = {"explicit": explicit_route, "mesh": mesh_route, "shard_map": shard_map_route}


def nbytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize(
  ("route", "name", "num_microbatches", "dtype"),
  [
    ("explicit", "clip", 2, "float32"),
    ("explicit", "hard_negative", 1, "float64"),
    ("mesh", "siglip", 8, "float32"),
    ("shard_map", "moe", 4, "float32"),
  ],
)
def test_on_eight_devices_one_gather_one_reduction(
  route, name, num_microbatches, dtype
):
  with jax.enable_x64(dtype == "float64"):
    encode_fn, loss_fn, params, batch = make_problem(name, jnp.dtype(dtype))
    step, args = ROUTES[route](encode_fn, loss_fn, num_microbatches, params, batch)
    counts = jaccum.inspect.collectives(step, *args)
    got = jax.device_get(step(*args))
    reps = jax.eval_shape(encode_fn, params, batch)
  rtol = 1e-12 if dtype == "float64" else 1e-5
  assert_trees_close(got, expected(name, dtype), rtol=rtol)
  assert counts.inside_loops == 0, counts
  # The batch's reps gathered once; the gradients and the loss summed once.
  assert counts.all_gather.bytes_outside_loops == nbytes(reps), counts
  assert counts.all_reduce.outside_loops == 1, counts
  assert counts.all_reduce.bytes_outside_loops == nbytes((params, got[0])), counts


def test_dropout_on_a_mesh_draws_per_device_keys():
  _, _, params, batch = make_problem("clip")
  key = jax.random.key(4)
  step = jax.jit(jaccum.accumulate_coupled(dropout_towers, clip_loss, 2, rng_argnum=2))
  got = jax.device_get(step(params, shard_rows(explicit_mesh(), batch), key))
  expected = dropout_reference(params, batch, key, 2, DEVICES)
  assert_trees_close(got, expected, rtol=1e-5)


def test_a_closure_over_a_placed_array_runs_as_the_whole_batch_with_a_warning():
  # JAX's shard_map cannot close over it; the whole batch's step runs (a
  # contrastive loss's B x B logits of reps sharded on both axes would not).
  encode_fn, loss_fn, params, batch = make_problem("moe")
  mesh = explicit_mesh()
  alpha = jax.device_put(jnp.float32(0.3), NamedSharding(mesh, P()))
  closing = lambda p, reps: loss_fn({**p, "alpha": alpha}, reps)
  step = jax.jit(jaccum.accumulate_coupled(encode_fn, closing, 2))
  placed = jax.device_put(params, NamedSharding(mesh, P()))
  with pytest.warns(UserWarning, match="could not run encode_fn and loss_fn"):
    got = step(placed, shard_rows(mesh, batch))
  expected = whole_batch(encode_fn, loss_fn)({**params, "alpha": 0.3}, batch)
  expected[1]["alpha"] = jnp.zeros(())  # closed over: no gradient
  assert_trees_close(jax.device_get(got), expected, rtol=1e-5)


# Refusals: what cannot be exact, and bad arguments.


def refused(encode_fn, loss_fn=lambda p, reps: jnp.sum(reps["x"]), **options):
  params = {"w": jnp.ones((WIDTH, 2))}
  x = jnp.ones((BATCH, WIDTH))
  step = jaccum.accumulate_coupled(encode_fn, loss_fn, options.pop("k", 4), **options)
  return lambda *args: jax.jit(step)(*(args or (params, x)))


@pytest.mark.parametrize(
  ("encode_fn", "match"),
  [
    (lambda p, x: {"x": x @ p["w"], "s": jnp.sum(x)}, r"reps\['s'\].*shape \(\)"),
    (lambda p, x: {"x": jnp.mean(x @ p["w"], 0)}, r"reps\['x'\].*shape \(2,\)"),
    # 16 rows per micro-batch, and 16 columns summed over them: only happens to match.
    (
      lambda p, x: {"x": jnp.sum(x[:, :1] * jnp.ones((1, 16)), 0)},
      r"reps\['x'\].*only happens to match",
    ),
  ],
  ids=["scalar", "reduced", "coincidence"],
)
def test_refuses_reps_without_one_row_per_example(encode_fn, match):
  with pytest.raises(ValueError, match=match):
    refused(encode_fn)()


def test_refuses_state_that_encode_fn_changes():
  params, x, stats = batch_norm_problem()
  encode_fn = batch_norm_encoder(train=True)  # batch statistics, updated
  step = jaccum.accumulate_coupled(encode_fn, spread_loss, 4, state_argnum=2)
  with pytest.raises(
    ValueError,
    match=r"changes the state at state_argnum=2 \(new state\['BatchNorm_0'\]",
  ):
    jax.jit(step)(params, x, stats)


def test_refuses_bad_arguments():
  encode = lambda p, x: {"x": x @ p["w"]}
  params, x = {"w": jnp.ones((WIDTH, 2))}, jnp.ones((BATCH, WIDTH))
  with pytest.raises(ValueError, match="batch_argnums points at argument 0"):
    refused(encode, batch_argnums=0)(params, x)
  with pytest.raises(
    TypeError, match=r"params leaf args\[0\]\['n'\] must be a floating"
  ):
    refused(encode)({**params, "n": jnp.int32(3)}, x)
  with pytest.raises(TypeError, match=r"loss_fn.*must return a real floating scalar"):
    refused(encode, loss_fn=lambda p, reps: reps["x"])(params, x)
  with pytest.raises(TypeError, match="encode_fn must be callable"):
    jaccum.accumulate_coupled(None, encode, 4)
  with pytest.raises(ValueError, match=r"axis_name.*mesh=/axis=.*pass one"):
    jaccum.accumulate_coupled(encode, encode, 4, axis_name="data", axis="data")
  with pytest.raises(ValueError, match="divisible by num_microbatches"):
    refused(encode, k=5)(params, x)
  with pytest.raises(ValueError, match=r"devices × num_microbatches = 8 × 16"):
    refused(encode, k=16, mesh=auto_mesh())(params, x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the accepted call warns about nothing
    refused(encode, k=8, mesh=auto_mesh())(params, x)


# big_vision's SigLIP trainer (big_vision/trainers/proj/image_text/siglip.py,
# `update_fn`) and its two-towers model (models/proj/image_text/two_towers.py),
# kept line for line where they touch the loss; the towers are small stand-ins
# for its ViT and text transformer (which need TensorFlow to import).
class BigVisionTwoTowers(nn.Module):
  temperature_init: float = 10.0
  bias_init: float = -10.0

  @nn.compact
  def __call__(self, image, text=None, **kw):
    out = {}
    ztxt = nn.Dense(EMBED, name="txt")(nn.Embed(50, 8)(text).mean(axis=1))
    out["txt/norm"] = jnp.linalg.norm(ztxt, axis=1, keepdims=True)
    out["txt/normalized"] = ztxt = ztxt / (out["txt/norm"] + 1e-8)
    zimg = nn.Dense(EMBED, name="img")(nn.gelu(nn.Dense(8)(image)))
    out["img/norm"] = jnp.linalg.norm(zimg, axis=1, keepdims=True)
    out["img/normalized"] = zimg = zimg / (out["img/norm"] + 1e-8)
    temp_init = jnp.log(self.temperature_init)
    t = self.param(
      "t",
      lambda key, shape, dtype: temp_init * jnp.ones(shape, dtype),
      (1,),
      jnp.float32,
    )
    out["t"] = jnp.exp(t)
    b_init = self.bias_init
    out["b"] = self.param(
      "b", lambda k, s, d: b_init * jnp.ones(s, d), (1,), jnp.float32
    )
    return zimg, ztxt, out


def big_vision_siglip_loss(logits, eye):
  # The lines of big_vision's loss_fn after `eye = ...`, unchanged.
  m1_diag1 = -jnp.ones_like(logits) + 2 * eye
  loglik = jax.nn.log_sigmoid(m1_diag1 * logits)
  nll = -jnp.sum(loglik, axis=-1)
  return jnp.mean(nll)


def test_big_vision_siglip_update_fn_ports_by_splitting_its_loss_fn():
  """big_vision's update_fn, whole batch as written, against the port: its
  loss_fn cut after `model.apply` into encode_fn (the towers, per row) and
  loss_fn (the B x B sigmoid loss with the learnt t and b), then one
  `accumulate_coupled` call. Loss, gradients and the optimizer's update agree."""
  model = BigVisionTwoTowers()
  images = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
  labels = jax.random.randint(jax.random.key(2), (BATCH, 6), 0, 50)
  batch = {"image": images, "labels": labels}
  params = model.init(jax.random.key(0), images, labels)["params"]
  tx = optax.adam(1e-2)
  opt = tx.init(params)
  rng_model = jax.random.key(4)

  def update_fn(params, opt, batch, loss_and_grads):
    loss, grads = loss_and_grads(params, batch)
    updates, opt = tx.update(grads, opt, params)
    return loss, grads, optax.apply_updates(params, updates)

  def whole_batch(params, batch):  # big_vision's own loss_fn
    def loss_fn(params):
      zimg, ztxt, extras = model.apply(
        {"params": params},
        batch["image"],
        batch["labels"],
        train=True,
        rngs={"dropout": rng_model},
      )
      logits = jnp.dot(zimg, ztxt.T)
      logits = logits * extras["t"] + extras["b"]
      eye = jnp.eye(zimg.shape[0])
      return big_vision_siglip_loss(logits, eye)

    return jax.value_and_grad(loss_fn)(params)

  def encode_fn(params, batch, rng):  # the port: the towers ...
    zimg, ztxt, _ = model.apply(
      {"params": params},
      batch["image"],
      batch["labels"],
      train=True,
      rngs={"dropout": rng},
    )
    return zimg, ztxt

  def loss_fn(params, reps):  # ... and the loss that couples their rows
    zimg, ztxt = reps
    logits = jnp.dot(zimg, ztxt.T)
    logits = logits * jnp.exp(params["t"]) + params["b"]
    return big_vision_siglip_loss(logits, jnp.eye(zimg.shape[0]))

  accumulated = jaccum.accumulate_coupled(encode_fn, loss_fn, 4, rng_argnum=2)
  want = jax.jit(update_fn, static_argnums=3)(params, opt, batch, whole_batch)
  got = jax.jit(update_fn, static_argnums=3)(
    params, opt, batch, lambda p, b: accumulated(p, b, rng_model)
  )
  assert_trees_close(got, want, rtol=1e-5)
  # The objective is the whole batch's: plain accumulation's loss is not.
  whole_loss = lambda p, b: loss_fn(p, encode_fn(p, b, rng_model))
  plain = jaccum.accumulate(jax.value_and_grad(whole_loss), 4)
  # (9.25 against 10.45: each row sees 15 negatives, not 63.)
  assert abs(float(plain(params, batch)[0]) / float(want[0]) - 1) > 0.05


def test_a_data_axis_of_one_device_runs_as_one_device():
  """(data=1, model=2) with params split over "model": XLA rejects an
  all-reduce over a manual axis of one device, so both passes run as on one
  device, the model axis left to XLA."""
  mesh = jax.make_mesh(
    (1, 2),
    ("data", "model"),
    axis_types=(AxisType.Auto,) * 2,
    devices=jax.devices()[:2],
  )
  encode_fn, loss_fn, params, batch = make_problem("clip")
  model_split = {"w1": P(None, "model"), "w2": P("model", None)}
  params = {
    k: {n: jax.device_put(w, NamedSharding(mesh, model_split[n])) for n, w in v.items()}
    if isinstance(v, dict)
    else v
    for k, v in params.items()
  }
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  step = jaccum.accumulate_coupled(encode_fn, loss_fn, 4, mesh=mesh, axis="data")
  assert_trees_close(
    jax.jit(step)(params, batch),
    whole_batch(encode_fn, loss_fn)(params, batch),
    rtol=1e-5,
  )


# Collectives the user already wrote: jaccum gathers the reps and reduces the
# gradients over the data axes itself.


def lit_gathering_loss(params, reps):
  """big_vision's LiT loss_fn as ported: its all_gather over the data axis kept."""
  gathered = {k: jax.lax.all_gather(v, "data", tiled=True) for k, v in reps.items()}
  return clip_loss(params, gathered)


def psum_loss(params, reps):  # the loss averaged over devices, as under pmap
  return jax.lax.pmean(clip_loss(params, reps), "data")


def device_loss(params, reps):  # rows weighed by the device: differs per device
  return clip_loss(params, reps) * (1 + jax.lax.axis_index("data"))


def synced_towers(params, batch):  # reps centred on the mean over all devices
  reps = tower(params["image"], batch["image"])
  return {
    "image": normalize(reps - jax.lax.pmean(jnp.mean(reps, 0), "data")),
    "text": normalize(tower(params["text"], batch["text"])),
  }


@pytest.mark.parametrize(
  ("route", "encode_fn", "loss_fn", "match"),
  [
    ("shard_map", two_towers, lit_gathering_loss, r"loss_fn runs all_gather over"),
    ("mesh", two_towers, lit_gathering_loss, r"loss_fn runs all_gather over"),
    ("explicit", two_towers, lit_gathering_loss, r"loss_fn runs all_gather over"),
    ("shard_map", two_towers, psum_loss, r"loss_fn runs psum(_invariant)? over"),
    ("mesh", two_towers, psum_loss, r"loss_fn runs psum(_invariant)? over"),
    ("shard_map", synced_towers, clip_loss, r"encode_fn runs psum(_invariant)? over"),
    ("mesh", two_towers, device_loss, r"loss_fn runs axis_index over"),
  ],
  ids=[
    "gather-shard_map",
    "gather-mesh",
    "gather-explicit",
    "psum-shard_map",
    "psum-mesh",
    "encode_psum-shard_map",
    "device_index-mesh",
  ],
)
def test_refuses_collectives_over_the_data_axes(route, encode_fn, loss_fn, match):
  # Before: the gathered loss saw every row 8 times (9.22 for 7.14), silently.
  _, _, params, batch = make_problem("clip")
  step, args = ROUTES[route](encode_fn, loss_fn, 2, params, batch)
  with pytest.raises(ValueError, match=match + r" the data axes \('data',\)") as info:
    step(*args)
  message = str(info.value)
  assert "gives loss_fn the whole batch's reps" in message
  assert "Remove" in message


def test_a_collective_over_another_axis_is_the_users():
  # Tensor parallel: a pmean over "model" (of a value alike over it) is kept.
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

  def model_synced(params, reps):
    return jax.lax.pmean(clip_loss(params, reps), "model")

  encode_fn, _, params, batch = make_problem("clip")
  coupled = jaccum.accumulate_coupled(encode_fn, model_synced, 2, axis_name="data")
  step = jax.shard_map(coupled, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  got = jax.jit(step)(params, shard_rows(mesh, batch))
  assert_trees_close(jax.device_get(got), expected("clip"), rtol=1e-5)


# Call-time keywords: accumulate's count and reduce_state are not for this front.


@pytest.mark.parametrize(
  ("keyword", "value", "match"),
  [
    (
      "num_real_microbatches",
      2,
      r"does not take num_real_microbatches \(got ~?int32\[\]\).*mask",
    ),
    ("reduce_state", {"a": 1}, r"accumulate_coupled does not take reduce_state"),
  ],
)
def test_refuses_accumulates_call_time_keywords_by_name(keyword, value, match):
  # An encode_fn that takes **kwargs ignored them (the full batch's loss
  # came back); one that does not raised an unclear TypeError.
  def open_towers(params, batch, **kwargs):
    return two_towers(params, batch)

  _, _, params, batch = make_problem("clip")
  for encode_fn in (open_towers, two_towers):
    step = jax.jit(jaccum.accumulate_coupled(encode_fn, clip_loss, 4))
    with pytest.raises(TypeError, match=match):
      step(params, batch, **{keyword: value})
  step = jax.jit(jaccum.accumulate_coupled(open_towers, clip_loss, 4))
  assert_trees_close(
    step(params, batch, **{keyword: None}), expected("clip"), rtol=1e-5
  )


def masked_clip_loss(params, reps):
  """CLIP over the real rows only: padding is no negative and has no loss."""
  real = reps["real"]
  logits = jnp.exp(params["log_temp"]) * reps["image"] @ reps["text"].T
  logits = jnp.where(real[:, None] & real[None, :], logits, -1e9)
  labels = jnp.arange(logits.shape[0])
  ce = optax.softmax_cross_entropy_with_integer_labels
  both = (ce(logits, labels) + ce(logits.T, labels)) / 2
  return jnp.sum(jnp.where(real, both, 0)) / jnp.sum(real)


@pytest.mark.parametrize("route", ["one device", "explicit"])
def test_a_mask_in_reps_is_the_way_to_pad_a_batch(route):
  # What the refusal of num_real_microbatches advises: 40 real rows padded
  # to 64, the mask a bool reps leaf; the loss of the 40 rows alone.
  _, _, params, batch = make_problem("clip")
  real = jnp.arange(BATCH) < 40
  padded = {**batch, "real": real}

  def masked_towers(params, batch):
    return {**two_towers(params, batch), "real": batch["real"]}

  if route == "explicit":  # the mask gathered with the reps
    step, args = explicit_route(masked_towers, masked_clip_loss, 2, params, padded)
  else:
    step = jax.jit(jaccum.accumulate_coupled(masked_towers, masked_clip_loss, 4))
    args = (params, padded)
  got = jax.device_get(step(*args))
  real_rows = jax.tree.map(lambda x: x[:40], batch)
  want = whole_batch(two_towers, clip_loss)(params, real_rows)
  assert_trees_close(got, want, rtol=1e-5)


# has_aux: measurements of the whole batch from loss_fn, per-row ones from
# encode_fn, as the whole batch's value_and_grad(has_aux=True) returns them.


def towers_with_row_aux(params, batch, stats=None):
  """`(reps, row_aux)` (and the read-only state, when given): per-row norms,
  an integer and a bool per row beside the unit embeddings."""
  shift = 0 if stats is None else stats["shift"]
  image = tower(params["image"], batch["image"] - shift)
  text = tower(params["text"], batch["text"])
  reps = {"image": normalize(image), "text": normalize(text)}
  norm = jnp.linalg.norm(image, axis=-1)
  row_aux = {"norm": norm, "nearest": jnp.argmax(image, -1), "long": norm > 1}
  return (reps, row_aux) if stats is None else ((reps, row_aux), stats)


def lit_loss_with_aux(params, reps):
  """big_vision's LiT loss_fn: the loss, and measurements from its logits."""
  logits = jnp.exp(params["log_temp"]) * reps["image"] @ reps["text"].T
  labels = jnp.arange(logits.shape[0])
  ce = optax.softmax_cross_entropy_with_integer_labels
  loss = (ce(logits, labels).mean() + ce(logits.T, labels).mean()) / 2
  return loss, {
    "t": jnp.exp(params["log_temp"]),
    "ncorrect": jnp.sum(jnp.argmax(logits, 1) == labels),
    "logits": logits,
    "finite": jnp.all(jnp.isfinite(logits)),
  }


def whole_batch_with_aux(params, batch, *state):
  """The reference: one function of the whole batch, both auxes returned."""
  out = towers_with_row_aux(params, batch, *state)
  reps, row_aux = out[0] if state else out
  loss, aux = lit_loss_with_aux(params, reps)
  return loss, (aux, row_aux)


def aux_step(route, num_microbatches, stateful):
  """The jitted accumulated step with has_aux on `route`, and how to place the batch."""
  options = {"has_aux": True, "state_argnum": 2 if stateful else None}
  if route == "mesh":
    options["mesh"] = auto_mesh()
  if route == "shard_map":
    options["axis_name"] = "data"
  coupled = jaccum.accumulate_coupled(
    towers_with_row_aux, lit_loss_with_aux, num_microbatches, **options
  )
  if route in ("one", "mesh"):
    return jax.jit(coupled), lambda batch: batch
  mesh = explicit_mesh()
  if route == "explicit":
    return jax.jit(coupled), functools.partial(shard_rows, mesh)
  out = ((P(), (P(), P("data"))), P())  # row_aux: each device's rows
  step = jax.shard_map(
    coupled,
    mesh=mesh,
    in_specs=(P(), P("data")) + ((P(),) if stateful else ()),
    out_specs=(out, P()) if stateful else out,
  )
  return jax.jit(step), functools.partial(shard_rows, mesh)


@pytest.mark.parametrize(
  ("route", "num_microbatches", "stateful"),
  [
    ("one", 8, False),
    ("one", 1, True),
    ("shard_map", 2, False),
    ("shard_map", 4, True),
    ("mesh", 2, True),
    ("explicit", 8, False),
  ],
)
def test_has_aux_matches_the_whole_batch(route, num_microbatches, stateful):
  with jax.enable_x64(True):
    _, _, params, batch = make_problem("clip", jnp.float64)
    state = ({"shift": jnp.linspace(-0.5, 0.5, WIDTH)},) if stateful else ()
    want = jax.jit(jax.value_and_grad(whole_batch_with_aux, has_aux=True))(
      params, batch, *state
    )
    step, place = aux_step(route, num_microbatches, stateful)
    got = jax.device_get(step(params, place(batch), *state))
    if route != "one":  # row_aux stays on its device: only the reps are gathered
      counts = jaccum.inspect.collectives(step, params, place(batch), *state)
      reps = jax.eval_shape(towers_with_row_aux, params, batch)[0]
      assert counts.inside_loops == 0, counts
      assert counts.all_gather.bytes_outside_loops == nbytes(reps), counts
  if stateful:
    got, new_state = got
    assert_trees_close(new_state, state[0], rtol=0)
  assert_trees_close(got, jax.device_get(want), rtol=1e-12)


def test_has_aux_traces_each_function_once_plus_one_shape_check():
  traces = []

  def counted_encode(params, batch):
    traces.append(("encode_fn", batch["image"].shape[0]))
    return towers_with_row_aux(params, batch)

  def counted_loss(params, reps):
    traces.append(("loss_fn", reps["image"].shape[0]))
    return lit_loss_with_aux(params, reps)

  _, _, params, batch = make_problem("clip")
  step = jaccum.accumulate_coupled(counted_encode, counted_loss, 8, has_aux=True)
  jax.jit(step).lower(params, batch)
  rows = BATCH // 8
  assert traces == [("encode_fn", rows), ("encode_fn", 2 * rows), ("loss_fn", BATCH)]


def test_has_aux_refuses_outputs_that_are_not_pairs():
  _, _, params, batch = make_problem("clip")

  def run(encode_fn, loss_fn):
    step = jaccum.accumulate_coupled(encode_fn, loss_fn, 4, has_aux=True)
    return jax.jit(step)(params, batch)

  with pytest.raises(TypeError, match=r"has_aux=True, encode_fn must return \(reps, "):
    run(two_towers, lit_loss_with_aux)
  with pytest.raises(TypeError, match=r"has_aux=True, loss_fn must return \(loss, aux"):
    run(towers_with_row_aux, clip_loss)
  scalar_aux = lambda p, b: (two_towers(p, b), {"mean": jnp.mean(b["image"])})
  with pytest.raises(ValueError, match=r"row_aux\['mean'\] \(encode_fn's output\)"):
    run(scalar_aux, lit_loss_with_aux)
  with pytest.raises(TypeError, match="has_aux must be True or False"):
    jaccum.accumulate_coupled(two_towers, clip_loss, 4, has_aux="yes")

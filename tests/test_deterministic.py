"""`deterministic=True`: the same bits whatever K and the number of devices.

Micro-batch m is rows m·R .. (m+1)·R - 1 of the global batch and draws its
key from `fold_in(key, m)`; every K × devices split of the same batch must
give the same bits, which these tests compare with `np.array_equal` on the
raw bits. Each result is also checked against an independent reference: a
Python loop over the micro-batches, summed in float64.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, max_rel_error

import jaccum

ROWS = 4  # per micro-batch
MICROBATCHES = 8
# (K, devices, per-device counts or None): 8 micro-batches, divided every way,
# and elastically: 3 devices of 3 slots over a padded batch, the last empty.
SPLITS = [(8, 1, None), (4, 2, None), (2, 4, None), (1, 8, None), (3, 3, (3, 3, 2))]


def _bits(tree):
  arrays = [np.asarray(x) for x in jax.tree.leaves(tree)]
  return [x.view(f"u{x.dtype.itemsize}") for x in arrays]


def assert_same_bits(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(_bits(actual), _bits(expected), strict=True):
    assert a.dtype == e.dtype and np.array_equal(a, e), np.flatnonzero(a != e)[:5]


def _normal(seed, shape, scale=1.0):
  return scale * np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _ce(logits, labels, mask):
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1)


def mlp(rows, keep=0.8):
  """An MLP with dropout (the key; none with `keep=1`) and padded rows (a mask)."""
  params = {"w": _normal(0, (6, 16), 0.4), "b": np.zeros(16, np.float32)}
  params["v"] = _normal(1, (16, 3), 0.25)
  mask = (np.random.default_rng(2).random(rows) < 0.7).astype(np.float32)
  batch = {"x": _normal(3, (rows, 6)), "y": np.arange(rows) % 3, "mask": mask}

  def loss(params, batch, key):
    h = jnp.tanh(batch["x"].astype(params["w"].dtype) @ params["w"] + params["b"])
    if keep < 1:
      h = jnp.where(jax.random.bernoulli(key, keep, h.shape), h / keep, 0)
    return _ce(h @ params["v"], batch["y"], batch["mask"])

  return params, batch, loss


def cnn(rows):
  params = {"k": _normal(0, (3, 3, 2, 4), 0.3), "d": _normal(1, (6 * 6 * 4, 3), 0.1)}
  mask = (np.random.default_rng(2).random(rows) < 0.7).astype(np.float32)
  batch = {"x": _normal(3, (rows, 6, 6, 2)), "y": np.arange(rows) % 3, "mask": mask}

  def loss(params, batch, key):
    del key
    h = jax.lax.conv_general_dilated(
      batch["x"].astype(params["k"].dtype),
      params["k"],
      (1, 1),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    logits = jax.nn.relu(h).reshape(h.shape[0], -1) @ params["d"]
    return _ce(logits, batch["y"], batch["mask"])

  return params, batch, loss


def lm(rows):
  """A one-block causal transformer; the mask marks real target tokens."""
  vocab, dim, length = 16, 16, 6
  params = {
    "embed": _normal(0, (vocab, dim), 0.3),
    "qkv": _normal(1, (dim, 3 * dim), 0.25),
    "head": _normal(2, (dim, vocab), 0.25),
  }
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, vocab, (rows, length + 1))
  lengths = rng.integers(1, length + 1, rows)
  mask = (np.arange(length) < lengths[:, None]).astype(np.float32)
  batch = {"tokens": tokens, "mask": mask}

  def loss(params, batch, key):
    del key
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    x = params["embed"][inputs]
    q, k, v = jnp.split(x @ params["qkv"], 3, axis=-1)
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(dim)
    causal = jnp.tril(jnp.ones((length, length), bool))
    x = x + jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1) @ v
    return _ce(x @ params["head"], targets, batch["mask"])

  return params, batch, loss


MODELS = {"mlp": mlp, "cnn": cnn, "lm": lm}


def real_count(params, batch, key):
  del params, key
  return batch["mask"].sum()


def _pad(batch, rows):
  """`batch` with zero rows appended up to `rows` (their mask is 0)."""
  return jax.tree.map(
    lambda x: np.concatenate([x, np.zeros((rows - len(x), *x.shape[1:]), x.dtype)]),
    batch,
  )


def accumulated(loss, split, weighted, **options):
  """`split`'s gradient function: `f(params, batch, key)` on the global batch."""
  num_microbatches, devices, counts = split
  options = dict(rng_argnum=2, deterministic=True, **options)
  if weighted:
    options["weight_fn"] = real_count
  grad_fn = jax.grad(loss)
  if devices == 1:
    return jax.jit(jaccum.accumulate(grad_fn, num_microbatches, **options))
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
  step = jaccum.data_parallel(grad_fn, num_microbatches, mesh=mesh, **options)
  if counts is None:
    return jax.jit(step)
  slots = num_microbatches * devices * ROWS
  jitted = jax.jit(step)
  return lambda p, b, k: jitted(
    p, _pad(b, slots), k, num_real_microbatches=jnp.array(counts)
  )


def reference(loss, params, batch, key, weighted):
  """Σ_m w_m g_m / Σ_m w_m over micro-batch m = rows m·R .., key fold_in(key, m)."""
  grad = jax.jit(jax.grad(loss))
  terms, weights = [], []
  for m in range(MICROBATCHES):
    micro = jax.tree.map(lambda x, m=m: x[m * ROWS : (m + 1) * ROWS], batch)
    terms.append(grad(params, micro, jax.random.fold_in(key, m)))
    weights.append(float(micro["mask"].sum()) if weighted else 1.0)

  def mean(*gs):
    pairs = zip(weights, gs, strict=True)
    return sum(w * np.asarray(g, np.float64) for w, g in pairs) / sum(weights)

  return jax.tree.map(mean, *terms)


@pytest.mark.parametrize("model", ["mlp", "cnn", "lm"])
def test_every_split_of_k_and_devices_gives_the_same_bits(model):
  """Weighted by real tokens/rows, with dropout keys: one set of bits for all."""
  params, batch, loss = MODELS[model](MICROBATCHES * ROWS)
  key = jax.random.key(7)
  results = [accumulated(loss, s, True)(params, batch, key) for s in SPLITS]
  for split, result in zip(SPLITS[1:], results[1:], strict=True):
    assert_same_bits(result, results[0]), split
  expected = reference(loss, params, batch, key, weighted=True)
  assert_trees_close(
    jax.tree.map(lambda x: np.asarray(x, np.float64), results[0]),
    expected,
    rtol=2e-6,
  )


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "cnn", "lm"])
def test_bf16_params_give_the_same_bits_whatever_the_split(model):
  params, batch, loss = MODELS[model](MICROBATCHES * ROWS)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  key = jax.random.key(3)
  results = [accumulated(loss, s, False)(params, batch, key) for s in SPLITS]
  assert jax.tree.leaves(results[0])[0].dtype == jnp.bfloat16
  for result in results[1:]:
    assert_same_bits(result, results[0])
  expected = reference(loss, params, batch, key, weighted=False)
  # One rounding to bf16 from the float32 sum: within half a bf16 ulp (2^-9).
  assert_trees_close(
    jax.tree.map(lambda x: np.asarray(x, np.float64), results[0]),
    expected,
    rtol=2**-8,
  )


def test_a_state_with_arrays_is_refused_an_empty_one_threads():
  """Threading state is refused only when there is state to thread: an empty
  one (what `jaccum.nnx` passes for a model of params alone) changes no bit."""
  params, batch, loss = mlp(MICROBATCHES * ROWS, keep=1)
  key = jax.random.key(0)

  def with_state(params, batch, state, key):
    return jax.grad(loss)(params, batch, key), state

  plain = jaccum.accumulate(jax.grad(loss), 4, rng_argnum=2, deterministic=True)
  stateful = jaccum.accumulate(
    with_state, 4, rng_argnum=3, state_argnum=2, deterministic=True
  )
  grads, state = jax.jit(stateful)(params, batch, {}, key)
  assert state == {}
  assert_same_bits(grads, jax.jit(plain)(params, batch, key))
  with pytest.raises(ValueError, match="deterministic=True and state_argnum=2 do not"):
    jax.jit(stateful)(params, batch, {"count": jnp.int32(0)}, key)


def test_wrappers_name_the_variables_they_would_thread_not_a_state_argnum():
  """jaccum.nnx and jaccum.linen pass their state at a position the caller
  never wrote: the refusal names the model's variables or `batch_stats`, and
  the key-passing way out runs, the same bits for every split."""
  flax = pytest.importorskip("flax")
  import flax.linen as nn

  import jaccum.linen
  import jaccum.nnx

  nnx = flax.nnx
  x, y = _normal(0, (32, 8)), np.arange(32) % 4

  def held(model, x, y):  # the model's own nnx.Rngs feeds its dropout
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

  rngs = nnx.Rngs(0)
  model = nnx.Sequential(nnx.Linear(8, 4, rngs=rngs), nnx.Dropout(0.2, rngs=rngs))
  refused = r"deterministic=True and a model .*layers/1/rngs/count \(RngCount\)"
  with pytest.raises(ValueError, match=refused):
    jaccum.nnx.grad(held, 4, deterministic=True)(model, x, y)

  def keyed(model, x, y, key):  # the way out the message names
    logits = nnx.Dropout(0.2)(model(x), rngs=nnx.Rngs(dropout=key))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  key, grads = jax.random.key(1), []
  for k, devices in [(8, 1), (2, 4)]:
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    grad = jaccum.nnx.grad(keyed, k, deterministic=True, rng_argnum=3, mesh=mesh)
    grads.append(nnx.jit(grad)(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), x, y, key))
  assert_same_bits(grads[1], grads[0])

  class Norm(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))

  variables = Norm().init(jax.random.key(2), x)

  def linen_loss(params, batch_stats, batch):
    logits, new = Norm().apply(
      {"params": params, "batch_stats": batch_stats}, batch["x"],
      mutable=["batch_stats"],
    )  # fmt: skip
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean(), new

  step = jaccum.linen.value_and_grad(linen_loss, 4, has_aux=True, deterministic=True)
  with pytest.raises(ValueError, match="deterministic=True and batch_stats holding"):
    step(variables["params"], variables["batch_stats"], {"x": x, "y": y})


def test_exact_sums_are_order_free_and_within_their_bound():
  """Terms over eleven decades, summed in orders and groupings (devices) at random."""
  from fractions import Fraction

  from jaccum._core import exact as _exact

  rng = np.random.default_rng(0)
  scales = 10.0 ** rng.uniform(-8, 3, size=24)
  terms = [(rng.standard_normal(64) * s).astype(np.float32) for s in scales]
  add = jax.jit(_exact.add)

  def total(order, groups):
    """Each group summed on its own, then merged as devices merge (aligned)."""
    parts = []
    for group in np.array_split(order, groups):
      acc = _exact.zeros((64,), jnp.float32)
      for i in group:
        acc = add(acc, terms[i])
      parts.append(acc)
    top = max(p.top for p in parts)
    bins = [sum(b) for b in zip(*[_exact._align(p, top) for p in parts], strict=True)]
    return np.asarray(_exact.value(_exact.Acc(tuple(bins), top, jnp.bool_(False))))

  expected = total(np.arange(len(terms)), 1)
  for groups in (2, 3, 8):
    got = total(rng.permutation(len(terms)), groups)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
  exact = np.array(
    [float(sum(Fraction(float(t[j])) for t in terms)) for j in range(64)]
  )
  largest = max(np.abs(t).max() for t in terms)
  ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
  bound = len(terms) * 2.0**-32 * largest + 1.5 * ulp
  assert np.all(np.abs(expected - exact) <= bound)
  # A non-finite term makes the whole leaf NaN.
  bad = add(_exact.zeros((64,), jnp.float32), np.where(np.arange(64) == 3, np.inf, 1))
  assert np.isnan(np.asarray(_exact.value(bad))).all()


@pytest.mark.parametrize(
  "options, named",
  [
    ({"split": "strided"}, 'split="strided"'),
    ({"reduce_fn": lambda g, axes, s: (g, s)}, "reduce_fn"),
    ({"reduce_dtype": jnp.bfloat16}, "reduce_dtype=bfloat16"),
  ],
)
def test_options_that_depend_on_k_and_devices_are_refused_by_name(options, named):
  with pytest.raises(ValueError, match=rf"deterministic=True and {named} do not"):
    jaccum.accumulate(jax.grad(mlp(8)[2]), 2, deterministic=True, **options)


def test_sharded_fsdp_modes_many_terms_and_complex_leaves_are_refused():
  params, batch, loss = mlp(16)
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  specs = jax.tree.map(
    lambda p: jax.P("data") if p.shape[0] % 4 == 0 else jax.P(), params
  )
  sharded = jaccum.data_parallel(
    jax.grad(loss),
    2,
    mesh=mesh,
    param_specs=specs,
    fsdp_mode="shard_grads",
    deterministic=True,
  )
  with pytest.raises(
    ValueError, match="deterministic=True and fsdp_mode='shard_grads'"
  ):
    sharded(params, batch, jax.random.key(0))
  rows = np.zeros((_exact_max() + 1, 1), np.float32)
  many = jaccum.accumulate(lambda w, x: jnp.mean(x) * w, len(rows), deterministic=True)
  with pytest.raises(ValueError, match="at most 512 micro-batches per device"):
    many(1.0, rows)
  complex_grad = jaccum.accumulate(lambda w, x: w * jnp.mean(x), 2, deterministic=True)
  with pytest.raises(TypeError, match="complex64"):
    complex_grad(jnp.complex64(1), np.ones(4, np.complex64))


def _exact_max():
  from jaccum._core import exact as _exact

  return _exact.MAX_TERMS


def _adam_run(params, opt_state, steps, split):
  """Adam steps `steps` on a fresh batch and key each, the gradient from `split`."""
  _, batch, loss = mlp(MICROBATCHES * ROWS)
  grad_fn = accumulated(loss, split, weighted=True)
  adam = optax.adam(1e-2)

  @jax.jit
  def update(grads, opt_state, params):
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for step in steps:
    batch = dict(batch, x=_normal(100 + step, batch["x"].shape))
    grads = grad_fn(params, batch, jax.random.fold_in(jax.random.key(5), step))
    params, opt_state = update(grads, opt_state, params)
  return params, opt_state


@pytest.mark.slow
def test_twenty_adam_steps_match_across_splits_and_a_move_to_four_devices(tmp_path):
  """(8, 1) and (1, 8) for 20 steps; and 8 devices for 10, checkpointed, then 4."""
  import orbax.checkpoint as ocp

  params = mlp(8)[0]
  state = optax.adam(1e-2).init(params)
  one_device, _ = _adam_run(params, state, range(20), (8, 1, None))
  eight = _adam_run(params, state, range(10), (1, 8, None))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "step10", {"params": eight[0], "state": eight[1]})
  eight_devices, _ = _adam_run(*eight, range(10, 20), (1, 8, None))
  # The job loses half its devices: restore onto 4, with 2 micro-batches each.
  four = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.NamedSharding(four, jax.P())
    ),
    {"params": eight[0], "state": eight[1]},
  )
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "step10", target)
  moved, _ = _adam_run(
    restored["params"], restored["state"], range(10, 20), (2, 4, None)
  )
  assert_same_bits(eight_devices, one_device)
  assert_same_bits(moved, one_device)
  assert not np.array_equal(one_device["w"], params["w"])


def test_statistics_counts_and_routes_give_the_same_bits():
  """return_stats; a count on a sharded batch; axis_name; FSDP's gather_once."""
  params, batch, loss = mlp(MICROBATCHES * ROWS)
  key = jax.random.key(1)
  options = dict(rng_argnum=2, deterministic=True, return_stats=True)
  one = jax.jit(jaccum.accumulate(jax.grad(loss), 8, **options))(params, batch, key)
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  parallel = jaccum.data_parallel(jax.grad(loss), 2, mesh=mesh, **options)
  assert_same_bits(jax.jit(parallel)(params, batch, key), one)
  # Inside the user's own shard_map, with axis_name.
  sharded = jax.device_put(batch, jax.NamedSharding(mesh, jax.P("data")))
  inner = jaccum.accumulate(jax.grad(loss), 2, axis_name="data", **options)
  mapped = jax.shard_map(
    inner,
    mesh=mesh,
    in_specs=(jax.P(), jax.P("data"), jax.P()),
    out_specs=jax.P(),
    check_vma=False,
  )
  assert_same_bits(jax.jit(mapped)(params, sharded, key), one)
  # FSDP gathering once: gradients reduce-scattered after the loop, as integers.
  specs = {"w": jax.P(), "b": jax.P("data"), "v": jax.P("data")}
  fsdp = jaccum.data_parallel(
    jax.grad(loss), 2, mesh=mesh, param_specs=specs, rng_argnum=2, deterministic=True
  )
  assert_same_bits(jax.jit(fsdp)(params, batch, key), one[0])
  # A count on a batch sharded over an explicit mesh: global micro-batches 0..4.
  counted = jaccum.accumulate(jax.grad(loss), 2, **options)
  five = jax.jit(jaccum.accumulate(jax.grad(loss), 5, **options))
  first_five = jax.tree.map(lambda x: x[: 5 * ROWS], batch)
  assert_same_bits(
    jax.jit(counted)(params, sharded, key, num_real_microbatches=5),
    five(params, first_five, key),
  )
  # And on one device: 5 of a capacity of 8.
  capacity = jax.jit(jaccum.accumulate(jax.grad(loss), 8, **options))
  assert_same_bits(
    capacity(params, batch, key, num_real_microbatches=5),
    five(params, first_five, key),
  )


def test_accuracy_against_float64_is_within_twice_the_float32_path():
  """Weighted means of real gradients, K = 8, against the whole batch in float64."""
  errors = {}
  for name, model in [("mlp", lambda r: mlp(r, keep=1.0)), ("cnn", cnn), ("lm", lm)]:
    params, batch, loss = model(MICROBATCHES * ROWS)
    key = jax.random.key(0)
    with jax.enable_x64(True):
      to64 = lambda t: jax.tree.map(
        lambda x: np.asarray(x, np.float64) if x.dtype == np.float32 else x, t
      )
      expected = jax.jit(jax.grad(loss))(to64(params), to64(batch), key)
      expected = jax.tree.map(np.asarray, expected)
    options = dict(weight_fn=real_count, split="contiguous")
    plain = jax.jit(jaccum.accumulate(jax.grad(loss), 8, **options))
    exact = accumulated(loss, (8, 1, None), weighted=True)
    errors[name] = (
      max_rel_error(plain(params, batch, key), expected),
      max_rel_error(exact(params, batch, key), expected),
    )
  for name, (plain_error, exact_error) in errors.items():
    assert 0 < exact_error <= 2 * plain_error, (name, errors)


def test_multisteps_windows_are_order_free_and_equal_accumulate():
  """A window of 8 micro-gradients, shuffled: the bits of accumulate's K = 8."""
  params, batch, _ = mlp(MICROBATCHES * ROWS)

  def loss(params, batch, key):  # a plain mean: no traced division to rewrite
    h = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    h = jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h / 0.8, 0)
    logits = h @ params["v"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  key = jax.random.key(3)
  grad = jax.jit(jax.grad(loss))
  micro = [
    grad(params, jax.tree.map(lambda x, m=m: x[m * ROWS : (m + 1) * ROWS], batch), k)
    for m, k in ((m, jax.random.fold_in(key, m)) for m in range(MICROBATCHES))
  ]
  expected = jax.jit(
    jaccum.accumulate(jax.grad(loss), 8, rng_argnum=2, deterministic=True)
  )(params, batch, key)
  window = jaccum.MultiSteps(optax.identity(), 8, deterministic=True)
  weights = [3.0, 0.0, 1.0, 7.0, 2.0, 5.0, 1.0, 4.0]
  means = []
  for order in ([3, 7, 0, 5, 1, 6, 2, 4], [6, 2, 4, 0, 1, 7, 5, 3]):
    state, weighted = window.init(params), window.init(params)
    for m in order:
      mean, state = window.update(micro[m], state, params)
      weighted_mean, weighted = window.update(
        micro[m], weighted, params, weight=weights[m]
      )
    assert bool(state.emitted) and bool(weighted.emitted)
    assert_same_bits(mean, expected)
    means.append(weighted_mean)
  assert_same_bits(means[0], means[1])

  def weighted_mean(*grads):
    pairs = zip(weights, grads, strict=True)
    return sum(w * np.asarray(g, np.float64) for w, g in pairs) / sum(weights)

  reference = jax.tree.map(weighted_mean, *micro)
  assert_trees_close(
    jax.tree.map(lambda x: np.asarray(x, np.float64), means[0]), reference, rtol=1e-6
  )
  with pytest.raises(TypeError, match="deterministic=True"):
    window.update(micro[0], jaccum.MultiSteps(optax.identity(), 8).init(params), params)


@pytest.mark.slow
def test_jax_ai_stack_digits_tutorial_trains_to_the_same_bits_on_any_split():
  """jax-ai-stack's neural_net_basics tutorial (SimpleNN on scikit-learn's
  digits, `nnx.jit` train step, SGD), its `nnx.grad` line replaced by
  `jaccum.nnx.grad(..., deterministic=True)`: ten steps end in the same bits
  with K = 8 on one device, K = 4 on 2 devices and K = 1 on 8, and within
  float32 rounding of the tutorial's own whole-batch step."""
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec
  from sklearn.datasets import load_digits

  import jaccum.nnx

  class SimpleNN(nnx.Module):  # as the tutorial writes it
    def __init__(self, n_features=64, n_hidden=100, n_targets=10, *, rngs):
      self.n_features = n_features
      self.layer1 = nnx.Linear(n_features, n_hidden, rngs=rngs)
      self.layer2 = nnx.Linear(n_hidden, n_hidden, rngs=rngs)
      self.layer3 = nnx.Linear(n_hidden, n_targets, rngs=rngs)

    def __call__(self, x):
      x = x.reshape(x.shape[0], self.n_features)
      x = nnx.selu(self.layer1(x))
      x = nnx.selu(self.layer2(x))
      return self.layer3(x)

  def loss_fun(model, data, labels):
    logits = model(data)
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=labels
    ).mean()
    return loss, logits

  digits = load_digits()
  data = digits.images[:512].astype(np.float32) / 16
  labels = digits.target[:512]

  def train(gradient, mesh=None):
    model = SimpleNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(learning_rate=0.05), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, data, labels):
      grads, _logits = gradient(loss_fun, has_aux=True)(model, data, labels)
      optimizer.update(model, grads)

    batch = (data, labels)
    if mesh is not None:
      batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
    for _ in range(10):
      train_step(model, optimizer, *batch)
    return nnx.state(model, nnx.Param)

  def accumulated(num_microbatches, devices):
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    options = dict(deterministic=True, reduce=("mean", "concat"), mesh=mesh)
    grad = lambda fn, has_aux: jaccum.nnx.grad(
      fn, num_microbatches, has_aux=has_aux, **options
    )
    return grad, mesh

  one_device = train(*accumulated(8, 1))
  assert_same_bits(train(*accumulated(4, 2)), one_device)
  assert_same_bits(train(*accumulated(1, 8)), one_device)
  assert_trees_close(one_device, train(nnx.grad), rtol=2e-5)


# --- The exact sums' corners: zero terms, the ends of float32's range, the
# derivative of a sum, the last micro-batch, and windows past the bins.


def _row_sums(terms, **options):
  """`accumulate` whose micro-batch m's term is row m of `terms`, summed exactly."""
  summed = jaccum.accumulate(
    lambda w, x: w * x[0], len(terms), reduce="sum", deterministic=True, **options
  )
  return np.asarray(jax.jit(summed)(jnp.float32(1), terms))


def _assert_within_the_bound(got, terms):
  """|value - Σx| <= n·2^-32·F + 1.5 ulp, Σx summed exactly (math.fsum)."""
  exact = np.array([math.fsum(column) for column in terms.astype(np.float64).T])
  assert np.all(np.abs(exact) >= np.finfo(np.float32).tiny)  # normal sums
  largest = np.abs(terms).max()
  ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
  bound = len(terms) * 2.0**-32 * largest + 1.5 * ulp
  error = np.abs(got.astype(np.float64) - exact)
  assert np.all(error <= bound), (error / bound).max()


@pytest.mark.parametrize("scale", [1e-7, 1e-9])
def test_an_all_zero_term_does_not_move_the_scale(scale):
  """Micro-batches whose term is all zeros (padding, weight 0, an expert no
  token reached), first and in the middle: the bound holds at the scale of
  the terms, not at the 2^0 that frexp(0)'s exponent would set."""
  rng = np.random.default_rng(0)
  terms = (rng.uniform(0.5, 1, (8, 64)) * scale).astype(np.float32)
  terms *= rng.choice(np.float32([-1, 1]), terms.shape)
  terms[[0, 5]] = 0
  _assert_within_the_bound(_row_sums(terms), terms)


def test_a_padding_microbatch_changes_no_bit_of_a_weighted_mean():
  """A token-weighted mean with one all-padding micro-batch (weight 0) is the
  same bits as the batch without it, and within float32 of float64; a
  MultiSteps window with a skipped and a weight-0 mini-step is accumulate's."""
  params, batch, loss = mlp(MICROBATCHES * ROWS, keep=1)
  batch = dict(batch, mask=batch["mask"].copy())
  batch["mask"][3 * ROWS : 4 * ROWS] = 0  # micro-batch 3: all padding
  kept = np.r_[0 : 3 * ROWS, 4 * ROWS : MICROBATCHES * ROWS]
  without = jax.tree.map(lambda x: x[kept], batch)
  key = jax.random.key(0)
  options = dict(rng_argnum=2, weight_fn=real_count, deterministic=True)
  padded = jax.jit(jaccum.accumulate(jax.grad(loss), 8, **options))
  seven = jax.jit(jaccum.accumulate(jax.grad(loss), 7, **options))
  got = padded(params, batch, key)
  assert_same_bits(got, seven(params, without, key))
  expected = reference(loss, params, batch, key, weighted=True)
  assert_trees_close(
    jax.tree.map(lambda x: np.asarray(x, np.float64), got), expected, rtol=2e-6
  )

  def plain_loss(params, batch, key):  # a plain mean: the same bits in both
    del key
    h = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    ce = optax.softmax_cross_entropy_with_integer_labels(h @ params["v"], batch["y"])
    return ce.mean()

  grad = jax.jit(jax.grad(plain_loss))
  micro = [
    grad(params, jax.tree.map(lambda x, m=m: x[m * ROWS : (m + 1) * ROWS], batch), key)
    for m in range(MICROBATCHES)
  ]
  expected = jax.jit(
    jaccum.accumulate(jax.grad(plain_loss), 8, rng_argnum=2, deterministic=True)
  )(params, batch, key)
  window = jaccum.MultiSteps(
    optax.identity(), 8, should_skip_update_fn=optax.skip_not_finite, deterministic=True
  )
  state = window.init(params)
  nan = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), micro[0])
  for m in range(7):
    if m == 2:  # a skipped mini-step, then one of weight 0, mid-window
      _, state = window.update(nan, state, params)
      _, state = window.update(micro[7], state, params, weight=0.0)
    mean, state = window.update(micro[m], state, params, weight=1.0)
  # The weight-0 mini-step is one of the 8 the window holds (the skipped one
  # is not): its mean is that of micro-batches 0..6.
  assert bool(state.emitted) and int(state.num_skipped) == 1
  expected = jax.jit(
    jaccum.accumulate(jax.grad(plain_loss), 7, rng_argnum=2, deterministic=True)
  )(params, jax.tree.map(lambda x: x[: 7 * ROWS], batch), key)
  assert_same_bits(mean, expected)


@pytest.mark.parametrize("scale", [1e-30, 1e-35, 1e-37, 1e30, 1e37])
def test_the_bound_holds_over_float32s_normal_range(scale):
  """Leaves of tiny terms (1e-35: two decades above the subnormals) and of
  huge ones (1e37: eight make 8e37, near float32's largest) meet the bound."""
  rng = np.random.default_rng(1)
  terms = (rng.uniform(0.5, 1, (8, 64)) * scale).astype(np.float32)
  if scale > 1e-35:  # signs that cancel; at 1e-37 a sum could fall subnormal
    terms *= rng.choice(np.float32([-1, 1]), terms.shape)
  _assert_within_the_bound(_row_sums(terms), terms)


@pytest.mark.parametrize("scale", [1e-300, 1e306])
def test_the_bound_holds_over_float64s_normal_range(scale):
  """Five bins: n·2^-64·F + 1.5 ulp, against the exact sum (fractions)."""
  from fractions import Fraction

  rng = np.random.default_rng(2)
  terms = rng.uniform(0.5, 1, (8, 16)) * scale * rng.choice([-1.0, 1.0], (8, 16))
  with jax.enable_x64(True):
    got = _row_sums(terms)
  assert got.dtype == np.float64
  exact = [sum(map(Fraction, column)) for column in terms.T]
  ulp = np.spacing(np.abs(np.array([float(e) for e in exact])))
  bound = [Fraction(8 * 2.0**-64 * np.abs(terms).max() + 1.5 * u) for u in ulp]
  errors = [abs(Fraction(g) - e) for g, e in zip(got, exact, strict=True)]
  assert all(error <= b for error, b in zip(errors, bound, strict=True))


@pytest.mark.parametrize("scale", [1e-35, 1e33])
def test_weights_at_the_ends_of_float32s_range_give_the_weighted_mean(scale):
  """`weight_fn` weights scaled by 1e-35 (w·g of a small gradient entry is
  subnormal in float32) and by 1e33 (Σ w near 1e35): every split the same
  bits, within float32 rounding of the float64 weighted mean."""
  params, batch, loss = mlp(MICROBATCHES * ROWS)
  key = jax.random.key(4)
  scaled = lambda params, batch, key: scale * batch["mask"].sum()
  results = []
  for split in SPLITS:
    grad_fn = accumulated(loss, split, False, weight_fn=scaled)
    results.append(grad_fn(params, batch, key))
  for result in results[1:]:
    assert_same_bits(result, results[0])
  expected = reference(loss, params, batch, key, weighted=True)
  assert_trees_close(
    jax.tree.map(lambda x: np.asarray(x, np.float64), results[0]), expected, rtol=2e-6
  )


def _penalty(grad_fn, batch, key):
  """A gradient penalty: |accumulated gradient|², a function of the params."""
  return lambda params: sum(
    jnp.sum(g**2) for g in jax.tree.leaves(grad_fn(params, batch, key))
  )


def test_the_exact_sums_differentiate_as_sums():
  """grad of a gradient penalty, and a jvp, through deterministic=True equal
  those through the plain step and the whole batch: the exact sum has the
  derivative of a sum, on one device, over devices and through FSDP."""
  params, batch, loss = mlp(MICROBATCHES * ROWS, keep=1)
  key = jax.random.key(2)
  whole = _penalty(jax.grad(loss), batch, key)
  plain = jaccum.accumulate(
    jax.grad(loss), 8, rng_argnum=2, weight_fn=real_count, split="contiguous"
  )
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  fsdp = jaccum.data_parallel(
    jax.grad(loss),
    2,
    mesh=mesh,
    param_specs={"w": jax.P(), "b": jax.P("data"), "v": jax.P("data")},
    rng_argnum=2,
    weight_fn=real_count,
    deterministic=True,
  )
  # Differentiating through a shard_map (data_parallel's, or the user's) needs
  # its mesh in context, with or without deterministic=True.
  routes = [(accumulated(loss, s, True), _devices(s[1])) for s in SPLITS[:4]]
  routes.append((jax.jit(fsdp), _devices(4)))
  tangent = jax.tree.map(lambda p: _normal(9, p.shape), params)
  expected = jax.grad(_penalty(plain, batch, key))(params)
  assert_trees_close(expected, jax.grad(whole)(params), rtol=1e-4)
  expected_jvp = jax.jvp(_penalty(plain, batch, key), (params,), (tangent,))[1]
  for route, mesh in routes:
    penalty = _penalty(route, batch, key)
    with jax.set_mesh(mesh):
      assert_trees_close(jax.grad(penalty)(params), expected, rtol=1e-4)
      jvp = jax.jvp(penalty, (params,), (tangent,))[1]
    np.testing.assert_allclose(jvp, expected_jvp, rtol=1e-4)
  # A count (a while loop: forward mode only) on 3 devices, 3, 3 and 2 each.
  elastic = _penalty(accumulated(loss, SPLITS[4], True), batch, key)
  with jax.set_mesh(_devices(3)):
    jvp = jax.jvp(elastic, (params,), (tangent,))[1]
  np.testing.assert_allclose(jvp, expected_jvp, rtol=1e-4)
  # Inside the user's shard_map (axis_name): the psum over devices too.
  mesh = _devices(4)
  inner = jaccum.accumulate(
    jax.grad(loss), 2, axis_name="data", rng_argnum=2, weight_fn=real_count,
    deterministic=True,
  )  # fmt: skip
  mapped = jax.jit(
    jax.shard_map(
      inner, mesh=mesh, in_specs=(jax.P(), jax.P("data"), jax.P()), out_specs=jax.P()
    )
  )
  sharded = jax.device_put(batch, jax.NamedSharding(mesh, jax.P("data")))
  penalty = _penalty(mapped, sharded, key)
  with jax.set_mesh(mesh):
    assert_trees_close(jax.grad(penalty)(params), expected, rtol=1e-4)
    jvp = jax.jvp(penalty, (params,), (tangent,))[1]
  np.testing.assert_allclose(jvp, expected_jvp, rtol=1e-4)


def _devices(count):
  return jax.make_mesh((count,), ("data",), devices=jax.devices()[:count])


def test_multisteps_exact_windows_refuse_differentiation_by_name():
  """MultiSteps' exact windows keep int32 bins across calls: no derivative
  flows through them, so differentiating is refused rather than zero."""
  params = {"w": jnp.ones(3)}
  window = jaccum.MultiSteps(optax.identity(), 1, deterministic=True)
  state = window.init(params)
  update = lambda g: jnp.sum(window.update({"w": g}, state, params)[0]["w"] ** 2)
  with pytest.raises(TypeError, match="MultiSteps\\(deterministic=True\\)"):
    jax.grad(update)(jnp.arange(3.0))


def _with_last(loss):
  """grad_fn with aux: the micro-batch's loss and its rows' first feature."""

  def grad_fn(params, batch, key):
    value, grads = jax.value_and_grad(loss)(params, batch, key)
    return grads, (value, batch["x"][:, 0])

  return grad_fn


def test_last_is_the_global_last_microbatch_on_every_split_and_route():
  """reduce="last" with deterministic=True: micro-batch 7 of the global order
  (rows 28..31), whatever K and the devices; with counts, the last that ran."""
  params, batch, loss = mlp(MICROBATCHES * ROWS, keep=1)
  key = jax.random.key(5)
  last_rows = jax.tree.map(lambda x: x[-ROWS:], batch)
  value = jax.jit(loss)(params, last_rows, jax.random.fold_in(key, 7))
  expected = (np.asarray(value), batch["x"][-ROWS:, 0])
  options = dict(reduce=("mean", "last"), deterministic=True, rng_argnum=2)
  grad_fn = _with_last(loss)
  one = jax.jit(jaccum.accumulate(grad_fn, 8, **options))(params, batch, key)
  assert_trees_close(one[1], expected, rtol=1e-6)
  last_loss = lambda p: loss(p, last_rows, jax.random.fold_in(key, 7))
  expected_jvp = jax.jvp(last_loss, (params,), (params,))[1]
  for devices, k in [(1, 8), (2, 4), (8, 1)]:
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    step = jaccum.data_parallel(grad_fn, k, mesh=mesh, **options)
    assert_same_bits(jax.jit(step)(params, batch, key), one)
    with jax.set_mesh(mesh):  # its derivative is the last micro-batch's too
      last = lambda p, step=step: jax.jit(step)(p, batch, key)[1][0]
      jvp = jax.jvp(last, (params,), (params,))[1]
    np.testing.assert_allclose(jvp, expected_jvp, rtol=1e-5)
    explicit = jax.make_mesh(
      (devices,),
      ("data",),
      axis_types=(jax.sharding.AxisType.Explicit,),
      devices=jax.devices()[:devices],
    )
    sharded = jax.device_put(batch, jax.NamedSharding(explicit, jax.P("data")))
    step = jaccum.accumulate(grad_fn, k, **options)
    with jax.set_mesh(explicit):
      assert_same_bits(jax.jit(step)(params, sharded, key), one)
    inner = jaccum.accumulate(grad_fn, k, axis_name="data", **options)
    mapped = jax.shard_map(
      inner, mesh=mesh, in_specs=(jax.P(), jax.P("data"), jax.P()), out_specs=jax.P()
    )
    placed = jax.device_put(batch, jax.NamedSharding(mesh, jax.P("data")))
    assert_same_bits(jax.jit(mapped)(params, placed, key), one)
  # Elastic: 3 devices of 3 slots running 3, 3 and 2; the last real is
  # micro-batch 7, on the last device.
  mesh = jax.make_mesh((3,), ("data",), devices=jax.devices()[:3])
  step = jax.jit(jaccum.data_parallel(grad_fn, 3, mesh=mesh, **options))
  counts = jnp.array([3, 3, 2])
  padded = _pad(batch, 9 * ROWS)
  assert_same_bits(step(params, padded, key, num_real_microbatches=counts), one)
  # Nothing ran: zeros, as a count of 0 gives on one device.
  none = step(params, padded, key, num_real_microbatches=jnp.zeros(3, jnp.int32))
  assert_same_bits(none[1], jax.tree.map(np.zeros_like, one[1]))


def test_multisteps_windows_past_the_bins_are_refused_or_cut_short():
  """A window holds at most 2^15 - 1 exact mini-steps. A longer int window, or
  a schedule whose value is known when it is read, is refused; a schedule
  traced under jit that asks for more ends the window there (its mean exact,
  never a wrapped sum) and counts it in `num_clamped`."""
  params = {"w": jnp.zeros(3)}
  limit = 2**15 - 1
  with pytest.raises(ValueError, match=rf"every_k_schedule=70000.*at most {limit}"):
    jaccum.MultiSteps(optax.sgd(1.0), 70000, deterministic=True)
  constant = jaccum.MultiSteps(optax.sgd(1.0), lambda step: 70000, deterministic=True)
  with pytest.raises(ValueError, match=r"every_k_schedule\(gradient_step\)=70000"):
    constant.init(params)
  grows = lambda step: jnp.where(step == 0, 2, 70000)
  window = jaccum.MultiSteps(optax.identity(), grows, deterministic=True)
  state = window.init(params)
  gradient = {"w": jnp.full(3, 32000.0)}
  for _ in range(2):
    _, state = window.update(gradient, state, params)
  with pytest.raises(ValueError, match=r"every_k_schedule\(gradient_step\)=70000"):
    window.update(gradient, state, params)  # gradient_step 1, read eagerly

  @jax.jit
  def run(state):
    def call(state, _):
      updates, state = window.update(gradient, state, params)
      return state, (updates["w"][0], state.emitted)

    return jax.lax.scan(call, state, None, length=limit + 2)

  state, (updates, emitted) = run(window.init(params))
  assert np.flatnonzero(emitted).tolist() == [1, limit + 1]
  assert updates[limit + 1] == 32000.0  # the exact mean of the window, cut short
  assert int(state.num_clamped) == 1 and int(state.gradient_step) == 2

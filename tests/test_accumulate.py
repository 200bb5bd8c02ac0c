"""`jaccum.accumulate` against the whole-batch computation it replaces."""

from typing import NamedTuple

import chex
import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, max_rel_error

import jaccum

BATCH = 10


class Head(NamedTuple):
  w: jax.Array
  b: jax.Array


def init_params(key, dtype):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "hidden": [
      {"w": jax.random.normal(k1, (3, 4), dtype), "b": jnp.zeros(4, dtype)},
      {"w": jax.random.normal(k2, (4, 4), dtype), "b": jnp.full(4, 0.1, dtype)},
    ],
    "head": Head(jax.random.normal(k3, (4, 2), dtype), jnp.zeros(2, dtype)),
  }


def predict(params, x):
  for layer in params["hidden"]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return x @ params["head"].w + params["head"].b


def loss(params, x, y):
  """A per-example mean, so the whole-batch mean is the mean of micro means."""
  return jnp.mean((predict(params, x) - y) ** 2)


def loss_with_aux(params, x, y):
  errors = predict(params, x) - y
  return jnp.mean(errors**2), {"mae": jnp.mean(jnp.abs(errors)), "bias": errors.mean(0)}


def make_data(key, dtype, batch=BATCH):
  kx, ky, kp = jax.random.split(key, 3)
  x = jax.random.normal(kx, (batch, 3), dtype)
  y = jax.random.normal(ky, (batch, 2), dtype)
  return init_params(kp, dtype), x, y


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  return jax.jit if request.param else (lambda f: f)


GRAD_FNS = {
  "grad": jax.grad(loss),
  "value_and_grad": jax.value_and_grad(loss),
  "has_aux": jax.value_and_grad(loss_with_aux, has_aux=True),
}


@pytest.mark.parametrize("num_microbatches", [1, 2, 5, BATCH])
@pytest.mark.parametrize("grad_name", list(GRAD_FNS))
@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_matches_whole_batch_float64(num_microbatches, grad_name, split, maybe_jit):
  grad_fn = GRAD_FNS[grad_name]
  with jax.enable_x64(True):
    params, x, y = make_data(jax.random.key(0), jnp.float64)
    accumulated = maybe_jit(
      jaccum.accumulate(grad_fn, num_microbatches, batch_argnums=(1, 2), split=split)
    )
    assert_trees_close(accumulated(params, x, y), grad_fn(params, x, y), rtol=1e-12)


@pytest.mark.parametrize("num_microbatches", [1, 2, 5, BATCH])
@pytest.mark.parametrize("grad_name", list(GRAD_FNS))
def test_matches_whole_batch_float32(num_microbatches, grad_name, maybe_jit):
  grad_fn = GRAD_FNS[grad_name]
  params, x, y = make_data(jax.random.key(1), jnp.float32)
  accumulated = maybe_jit(
    jaccum.accumulate(grad_fn, num_microbatches, batch_argnums=(1, 2))
  )
  assert_trees_close(accumulated(params, x, y), grad_fn(params, x, y), rtol=1e-5)


def test_batch_argument_can_be_a_pytree_and_kwargs_pass_through():
  def grad_fn(params, batch, *, scale):
    return jax.grad(lambda p: scale * loss(p, batch["x"], batch["y"]))(params)

  params, x, y = make_data(jax.random.key(2), jnp.float32)
  batch = {"x": x, "y": y}
  accumulated = jax.jit(jaccum.accumulate(grad_fn, 5), static_argnames="scale")
  expected = grad_fn(params, batch, scale=3.0)
  assert_trees_close(accumulated(params, batch, scale=3.0), expected, rtol=1e-5)


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_reduce_tree_mixes_modes(split, maybe_jit):
  """concat restores row order; max, sum and last act as documented."""

  def stats_fn(params, x, y):
    per_example = jnp.sum((predict(params, x) - y) ** 2, axis=1)
    return {
      "mean": per_example.mean(),
      "per_example": per_example,
      "max": per_example.max(),
      "count": jnp.sum(per_example > 1.0),
      "last": x[0],
    }

  num_microbatches = 5
  params, x, y = make_data(jax.random.key(3), jnp.float32)
  reduce = {
    "mean": "mean",
    "per_example": "concat",
    "max": "max",
    "count": "sum",
    "last": "last",
  }
  accumulated = maybe_jit(
    jaccum.accumulate(
      stats_fn, num_microbatches, batch_argnums=(1, 2), reduce=reduce, split=split
    )
  )
  got = accumulated(params, x, y)
  whole = stats_fn(params, x, y)
  last_rows = (
    x[num_microbatches - 1 :: num_microbatches]
    if split == "strided"
    else x[-BATCH // num_microbatches :]
  )
  np.testing.assert_allclose(got["per_example"], whole["per_example"], rtol=1e-6)
  np.testing.assert_allclose(got["mean"], whole["mean"], rtol=1e-6)
  # The largest of the micro-batch maxima is the largest row, exactly; the
  # whole batch's own matmul may round that row differently.
  assert got["max"] == got["per_example"].max()
  np.testing.assert_allclose(got["max"], whole["max"], rtol=1e-6)
  assert got["count"] == whole["count"] and got["count"].dtype == whole["count"].dtype
  np.testing.assert_array_equal(got["last"], last_rows[0])


def test_split_microbatches_orders():
  x = jnp.arange(12).reshape(6, 2)
  strided = jaccum.split_microbatches({"x": x}, 3)["x"]
  contiguous = jaccum.split_microbatches({"x": x}, 3, split="contiguous")["x"]
  assert strided.shape == contiguous.shape == (3, 2, 2)
  for k in range(3):
    np.testing.assert_array_equal(strided[k], x[k::3])
    np.testing.assert_array_equal(contiguous[k], x[2 * k : 2 * k + 2])


# Token weighting: a per-token mean over padded sequences of uneven length.

SEQ = 16


def token_batch(lengths):
  lengths = np.asarray(lengths)
  mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)
  x = jax.random.normal(jax.random.key(4), (len(lengths), SEQ, 3))
  return {"x": x, "mask": jnp.asarray(mask)}


def token_loss(w, batch):
  """Mean over real tokens; 0/0 = NaN when a micro-batch holds no real token."""
  per_token = jnp.sum(jnp.tanh(batch["x"] @ w) ** 2, axis=-1)
  return jnp.sum(per_token * batch["mask"]) / jnp.sum(batch["mask"])


def num_tokens(w, batch):
  return batch["mask"].sum()


W = jnp.array([[0.3, -0.2], [0.5, 0.1], [-0.4, 0.7]])


def test_weight_fn_gives_the_whole_batch_token_mean(maybe_jit):
  # Strided, K=2: micro-batch 0 holds the long rows, micro-batch 1 the short.
  batch = token_batch([16, 1, 15, 2, 16, 1, 14, 1])
  grad_fn = jax.value_and_grad(token_loss)
  expected = grad_fn(W, batch)
  naive = maybe_jit(jaccum.accumulate(grad_fn, 2))(W, batch)
  exact = maybe_jit(jaccum.accumulate(grad_fn, 2, weight_fn=num_tokens))(W, batch)
  assert max_rel_error(naive, expected) > 0.05  # the field's bug, clearly visible
  assert_trees_close(exact, expected, rtol=1e-6)


def test_zero_weight_microbatch_contributes_nothing_even_if_nan():
  # Contiguous, K=4: the last micro-batch is all padding, its loss is 0/0.
  lengths = [16, 3, 9, 12, 5, 16, 0, 0]
  batch = token_batch(lengths)
  grad_fn = jax.value_and_grad(token_loss)
  assert np.isnan(grad_fn(W, jax.tree.map(lambda a: a[6:], batch))[0])
  exact = jaccum.accumulate(grad_fn, 4, weight_fn=num_tokens, split="contiguous")
  got = exact(W, batch)
  assert_trees_close(got, grad_fn(W, batch), rtol=1e-6)
  without_padding = jaccum.accumulate(grad_fn, 3, weight_fn=num_tokens)
  assert_trees_close(
    got, without_padding(W, jax.tree.map(lambda a: a[:6], batch)), 1e-6
  )


def test_total_weight_zero_gives_zeros_not_nan(maybe_jit):
  batch = token_batch([0] * 8)
  got = maybe_jit(
    jaccum.accumulate(jax.value_and_grad(token_loss), 4, weight_fn=num_tokens)
  )(W, batch)
  for leaf in jax.tree.leaves(got):
    np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


def test_float32_accumulator_beats_bf16_sum():
  num_microbatches, rows = 256, 4

  def bf16_loss(w, x):
    return jnp.mean(jnp.sum(w * x, axis=-1))  # gradient = mean of x: one sign

  x = jax.random.uniform(jax.random.key(5), (num_microbatches * rows, 8), minval=0.5)
  x = x.astype(jnp.bfloat16)
  w = jnp.ones(8, jnp.bfloat16)
  truth = np.asarray(x, np.float64).mean(0)
  grad_fn = jax.grad(bf16_loss)
  wide = jax.jit(jaccum.accumulate(grad_fn, num_microbatches))(w, x)
  narrow = jax.jit(jaccum.accumulate(grad_fn, num_microbatches, accum_dtype=None))(w, x)
  assert wide.dtype == narrow.dtype == jnp.bfloat16
  wide_error = np.abs(np.asarray(wide, np.float64) - truth).max()
  narrow_error = np.abs(np.asarray(narrow, np.float64) - truth).max()
  bf16_ulp = float(jnp.finfo(jnp.bfloat16).eps) * np.abs(truth).max()
  assert wide_error <= bf16_ulp
  assert narrow_error >= 5 * wide_error


def test_output_dtypes_follow_inputs():
  params, x, y = make_data(jax.random.key(6), jnp.bfloat16)
  grads = jaccum.accumulate(jax.grad(loss), 5, batch_argnums=(1, 2))(params, x, y)
  assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(
    lambda p: p.dtype, params
  )


# RNG: one distinct key per micro-batch, deterministic.


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_each_microbatch_gets_its_own_key(make_key, maybe_jit):
  num_microbatches = 8

  def raw(key):
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    return jax.random.key_data(key) if typed else key

  def dropout_fn(params, x, key):
    mask = jax.random.bernoulli(key, 0.5, x.shape)
    key_data = raw(key)
    return {
      "key": jnp.broadcast_to(key_data, (x.shape[0], *key_data.shape)),
      "mask": mask,
      "value": jnp.mean(mask * x * params),
    }

  x = jnp.ones((num_microbatches * 2, 64))
  accumulated = maybe_jit(
    jaccum.accumulate(
      dropout_fn,
      num_microbatches,
      rng_argnum=2,
      reduce={"key": "concat", "mask": "concat", "value": "mean"},
      split="contiguous",
    )
  )
  first = accumulated(2.0, x, make_key(0))
  second = accumulated(2.0, x, make_key(0))
  keys = np.asarray(first["key"])[::2]  # one row per micro-batch
  assert len({k.tobytes() for k in keys}) == num_microbatches
  masks = np.asarray(first["mask"])[::2]
  assert len({m.tobytes() for m in masks}) == num_microbatches
  chex.assert_trees_all_equal(first, second)
  # The caller's key itself is never handed to a micro-batch.
  assert np.asarray(raw(make_key(0))).tobytes() not in {k.tobytes() for k in keys}


# State threading: Linen BatchNorm statistics travel through the micro-batches.


class BatchNormNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(6)(x)
    x = nn.BatchNorm(use_running_average=False, momentum=0.8)(x)
    return nn.Dense(1)(jnp.tanh(x))


def test_state_threads_batchnorm_statistics_in_order(maybe_jit):
  model = BatchNormNet()
  num_microbatches = 4
  x = jax.random.normal(jax.random.key(7), (16, 3)) * 3 + 1
  y = jax.random.normal(jax.random.key(8), (16, 1))
  variables = model.init(jax.random.key(9), x)

  def grad_fn(params, batch_stats, x, y):
    def loss_fn(p):
      out, updates = model.apply(
        {"params": p, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
      )
      return jnp.mean((out - y) ** 2), updates["batch_stats"]

    (value, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return (value, grads), new_stats

  accumulated = maybe_jit(
    jaccum.accumulate(grad_fn, num_microbatches, batch_argnums=(2, 3), state_argnum=1)
  )
  (value, grads), stats = accumulated(
    variables["params"], variables["batch_stats"], x, y
  )

  stats_ref, outs = variables["batch_stats"], []
  for k in range(num_microbatches):
    out, stats_ref = jax.jit(grad_fn)(
      variables["params"], stats_ref, x[k::num_microbatches], y[k::num_microbatches]
    )
    outs.append(out)
  expected = jax.tree.map(lambda *o: sum(o) / num_microbatches, *outs)
  assert_trees_close(stats, stats_ref, rtol=1e-6)
  # Dense_0's bias gradient is zero in exact arithmetic (BatchNorm follows it).
  assert_trees_close((value, grads), expected, rtol=1e-6, atol=1e-7)
  # The statistics moved K times, not once: K=1 on the whole batch differs.
  _, one_step = jax.jit(grad_fn)(variables["params"], variables["batch_stats"], x, y)
  assert max_rel_error(stats, one_step) > 1e-2


# Compilation: one trace, no unrolling.


def test_traces_once_over_repeated_calls():
  params, _, _ = make_data(jax.random.key(10), jnp.float32)
  accumulated = jaccum.accumulate(jax.grad(loss), 5, batch_argnums=(1, 2))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, x, y):
    return accumulated(params, x, y)

  for seed in range(3):
    _, x, y = make_data(jax.random.key(seed), jnp.float32)
    step(params, x, y)


def test_program_size_does_not_grow_with_k():
  params, x, y = make_data(jax.random.key(11), jnp.float32, batch=512)

  def hlo_length(num_microbatches):
    accumulated = jaccum.accumulate(
      jax.grad(loss), num_microbatches, batch_argnums=(1, 2)
    )
    return len(jax.jit(accumulated).lower(params, x, y).as_text())

  small, large = hlo_length(2), hlo_length(256)
  assert abs(large - small) / small < 0.02, (small, large)


# Property test: random shapes, K and tree structures.


@st.composite
def problems(draw):
  num_microbatches = draw(st.sampled_from([1, 2, 3, 4]))
  batch = num_microbatches * draw(st.integers(1, 4))
  widths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
  nested = draw(st.booleans())
  split = draw(st.sampled_from(["strided", "contiguous"]))
  return num_microbatches, batch, widths, nested, split, draw(st.integers(0, 2**16))


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(problems())
def test_property_matches_whole_batch(problem):
  num_microbatches, batch, widths, nested, split, seed = problem
  with jax.enable_x64(True):
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(widths) + 1))
    params = {"weights": [jax.random.normal(next(keys), (w, 2)) for w in widths]}
    if nested:
      params["extra"] = {"head": Head(*jax.random.normal(next(keys), (2, 2)))}
    xs = tuple(jax.random.normal(next(keys), (batch, w)) for w in widths)

    def tree_loss(params, xs):
      out = sum(jnp.sin(x @ w) for x, w in zip(xs, params["weights"], strict=True))
      if "extra" in params:
        out = out * params["extra"]["head"].w + params["extra"]["head"].b
      return jnp.mean(jnp.sum(out**2, axis=-1))

    grad_fn = jax.value_and_grad(tree_loss)
    got = jax.jit(jaccum.accumulate(grad_fn, num_microbatches, split=split))(params, xs)
    assert_trees_close(got, jax.jit(grad_fn)(params, xs), rtol=1e-12)


@pytest.mark.parametrize("route", ["accumulate", "data_parallel"])
def test_conv_rewrite_false_leaves_the_traced_convolutions_as_they_are(route):
  """On CPU the loop body's convolutions are rewritten unless conv_rewrite=False."""

  def loss(kernel, x):  # NCHW, as PyTorch ports write it: never canonical
    h = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME")
    return jnp.mean(jnp.tanh(h) ** 2)

  kernel = jax.random.normal(jax.random.key(0), (4, 3, 3, 3))
  x = jax.random.normal(jax.random.key(1), (16, 3, 6, 6))
  mesh = jax.make_mesh((8,), ("data",))

  def step(**options):
    if route == "accumulate":
      return jax.jit(jaccum.accumulate(jax.grad(loss), 2, **options))
    return jax.jit(jaccum.data_parallel(jax.grad(loss), 2, mesh=mesh, **options))

  def loop_labels(step):
    text = step.lower(kernel, x).compile().as_text()
    bodies = {
      line.split("body=")[1].split(",")[0].strip("%")
      for line in text.splitlines()
      if " while(" in line
    }
    labels, current = set(), None
    for line in text.splitlines():
      if not line.startswith(" ") and "{" in line:
        current = line.split()[0].strip("%")
      elif current in bodies and "dim_labels=" in line:
        labels.add(line.split("dim_labels=")[1].split(",")[0])
    return labels

  expected = jax.grad(loss)(kernel, x)
  for options, canonical in (({}, True), ({"conv_rewrite": False}, False)):
    accumulated = step(**options)
    assert_trees_close(accumulated(kernel, x), expected, rtol=1e-5)
    labels = loop_labels(accumulated)
    assert labels, "no convolution found in the loop body"
    assert (labels == {"b01f_01io->b01f"}) is canonical, labels
  with pytest.raises(TypeError, match="conv_rewrite must be True or False"):
    jaccum.accumulate(jax.grad(loss), 2, conv_rewrite="no")


def _weighted_reference(grads, weights):
  """Σ_k w_k g_k / Σ_k w_k in float64 NumPy, zeros for a total of 0."""
  grads, weights = np.asarray(grads, np.float64), np.asarray(weights, np.float64)
  total = weights.sum()
  return np.zeros(grads.shape[1:]) if total == 0 else weights @ grads / total


@pytest.mark.parametrize(
  "weights", [[1, -1, 1], [1, -1, 0], [2, -3, 0.5], [0, 0, 0], [-1, -2, -4]]
)
def test_any_real_weights_give_the_exact_weighted_mean(weights):
  """Σ w·g / Σ w for negative weights too; a total of 0 gives zeros, never NaN.

  Before, the running mean divided by 1 whenever a partial total was exactly
  0: weights [1, -1, 1] returned g2, and [1, -1, 0] returned 2·g0 - g1.
  """
  x = jnp.arange(3.0 * 4).reshape(3, 4) + 1.0  # micro-batch k: one row, x[k]
  w = jnp.asarray(weights, jnp.float32)

  def grad_fn(params, x, w):
    return jax.grad(lambda p: jnp.sum(p * x[0]) ** 2 / 2)(params)

  params = jnp.linspace(0.1, 0.4, 4)
  step = jax.jit(
    jaccum.accumulate(
      grad_fn,
      3,
      batch_argnums=(1, 2),
      weight_fn=lambda p, x, w: w[0],
      split="contiguous",
    )
  )
  got = step(params, x, w)
  per_micro = [
    np.asarray(grad_fn(params, x[k : k + 1], w[k : k + 1])) for k in range(3)
  ]
  np.testing.assert_allclose(got, _weighted_reference(per_micro, weights), rtol=1e-6)
  assert np.all(np.isfinite(got))


def test_uneven_negative_weights_across_devices_give_the_exact_mean():
  """Per-device totals of 0 (weights cancelling on a device) combine exactly."""
  mesh = jax.make_mesh((8,), ("data",))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 4)).astype(np.float32)
  w = rng.choice([-2.0, -1.0, 0.0, 1.0, 3.0], size=32).astype(np.float32)
  w[:8] = [1, -1, 1, -1, 0, 0, 0, 0]  # devices 0 and 1: their weights cancel

  def grad_fn(params, x, w):
    return jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p)))(params)

  step = jax.jit(
    jaccum.data_parallel(
      grad_fn, 2, mesh=mesh, batch_argnums=(1, 2), weight_fn=lambda p, x, w: w.sum()
    )
  )
  sharded = [jax.device_put(a, jax.NamedSharding(mesh, jax.P("data"))) for a in (x, w)]
  params = jnp.linspace(-1, 1, 4)
  got = step(params, *sharded)
  # Micro-batch k of device d holds its rows k, k+2 (4 rows per device).
  micros = [(x[4 * d :][k:4:2], w[4 * d :][k:4:2]) for d in range(8) for k in range(2)]
  per_micro = [np.asarray(grad_fn(params, xm, wm)) for xm, wm in micros]
  expected = _weighted_reference(per_micro, [wm.sum() for _, wm in micros])
  np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("weight_dtype", ["int32", "float32"])
def test_float64_weighted_means_are_float64_accurate(weight_dtype):
  """Under x64, an int32 or float32 weight no longer rounds the mean to float32."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 3))
    counts = rng.integers(1, 1000, size=12).astype(weight_dtype)

    def grad_fn(params, x, counts):
      return jax.grad(lambda p: jnp.sum(jnp.sin(x @ p)))(params)

    params = jnp.asarray([0.3, -0.2, 0.7], jnp.float64)
    step = jax.jit(
      jaccum.accumulate(
        grad_fn,
        6,
        batch_argnums=(1, 2),
        weight_fn=lambda p, x, c: c.sum(),
        split="contiguous",
      )
    )
    got = step(params, jnp.asarray(x), jnp.asarray(counts))
    assert got.dtype == jnp.float64
    per_micro = [
      np.asarray(grad_fn(params, x[2 * k : 2 * k + 2], None)) for k in range(6)
    ]
    weights = [counts[2 * k : 2 * k + 2].astype(np.float64).sum() for k in range(6)]
    expected = _weighted_reference(per_micro, weights)
    assert max_rel_error(got, expected) <= 1e-12

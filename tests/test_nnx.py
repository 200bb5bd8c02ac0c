"""Tests for jaccum.nnx: whole-batch equivalence, BatchNorm, dropout, training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaccum.nnx


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def use_jit(request):
  return request.param


def maybe_jit(fn, use_jit):
  return nnx.jit(fn) if use_jit else fn


def assert_tree_close(actual, expected, rtol, atol=0.0):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


class MLP(nnx.Module):
  def __init__(self, rngs, din=5, dhidden=16, dout=3):
    self.hidden = nnx.Linear(din, dhidden, rngs=rngs)
    self.out = nnx.Linear(dhidden, dout, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.tanh(self.hidden(x)))


def mse(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def mse_with_aux(model, x, y):
  pred = model(x)
  return jnp.mean((pred - y) ** 2), {"pred_mean": pred.mean()}


def regression_batch(batch_size=16, seed=0):
  rng = np.random.default_rng(seed)
  return normal(rng, batch_size, 5), normal(rng, batch_size, 3)


def normal(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def jit_value_and_grad(loss_fn, **kwargs):
  """The reference: nnx.value_and_grad on the whole batch, jitted for speed."""
  return nnx.jit(nnx.value_and_grad(loss_fn, **kwargs))


@pytest.mark.parametrize(
  "use_jit, num_microbatches, split",
  [(False, 4, "strided"), (True, 1, "strided"), (True, 16, "contiguous")],
)
def test_value_and_grad_matches_whole_batch(use_jit, num_microbatches, split):
  model = MLP(nnx.Rngs(0))
  x, y = regression_batch()
  accumulated = jaccum.nnx.value_and_grad(mse, num_microbatches, split=split)
  loss, grads = maybe_jit(accumulated, use_jit)(model, x, y)
  whole_loss, whole_grads = jit_value_and_grad(mse)(model, x, y)
  assert isinstance(grads, nnx.State)
  assert all(
    isinstance(v, nnx.Param)
    for v in jax.tree.leaves(grads, is_leaf=lambda v: isinstance(v, nnx.Variable))
  )
  np.testing.assert_allclose(loss, whole_loss, rtol=1e-5)
  assert_tree_close(grads, whole_grads, rtol=1e-5, atol=1e-7)


def test_has_aux_and_grad_match_nnx(use_jit):
  model = MLP(nnx.Rngs(1))
  x, y = regression_batch(seed=1)
  (loss, aux), grads = maybe_jit(
    jaccum.nnx.value_and_grad(mse_with_aux, 4, has_aux=True), use_jit
  )(model, x, y)
  (whole_loss, whole_aux), whole_grads = jit_value_and_grad(mse_with_aux, has_aux=True)(
    model, x, y
  )
  np.testing.assert_allclose(loss, whole_loss, rtol=1e-5)
  np.testing.assert_allclose(aux["pred_mean"], whole_aux["pred_mean"], rtol=1e-5)
  assert_tree_close(grads, whole_grads, rtol=1e-5, atol=1e-7)

  grads_aux, aux = maybe_jit(jaccum.nnx.grad(mse_with_aux, 4, has_aux=True), use_jit)(
    model, x, y
  )
  assert_tree_close(grads_aux, whole_grads, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(aux["pred_mean"], whole_aux["pred_mean"], rtol=1e-5)


def test_batch_argnums_count_from_the_model_and_kwargs_go_whole():
  model = MLP(nnx.Rngs(2))
  x, y = regression_batch(seed=2)

  def scaled(model, scale, x, y):
    return scale * mse(model, x, y)

  # batch_argnums counts as in the call: 0 is the model, 1 the scale.
  grads = jaccum.nnx.grad(scaled, 4, batch_argnums=(2, -1))(model, 3.0, x, y)
  expected = nnx.jit(nnx.grad(scaled))(model, 3.0, x, y)
  assert_tree_close(grads, expected, rtol=1e-5, atol=1e-7)

  def offset_loss(model, x, *, offset):
    return jnp.mean((model(x) - offset) ** 2)

  offset = jnp.arange(3.0)  # Not a batch: every micro-batch sees all of it.
  grads = jaccum.nnx.grad(offset_loss, 4)(model, x, offset=offset)
  # nnx.grad resolves keywords to positions, so it needs a closure.
  expected = nnx.jit(nnx.grad(lambda m, x: offset_loss(m, x, offset=offset)))(model, x)
  assert_tree_close(grads, expected, rtol=1e-5, atol=1e-7)


def test_wrt_selects_the_variables_like_nnx_diffstate():
  model = MLP(nnx.Rngs(4))
  x, y = regression_batch(seed=4)
  head_only = nnx.PathContains("out")
  grads = nnx.jit(jaccum.nnx.grad(mse, 4, wrt=head_only))(model, x, y)
  expected = nnx.jit(nnx.grad(mse, argnums=nnx.DiffState(0, head_only)))(model, x, y)
  assert set(grads.keys()) == {"out"}
  assert_tree_close(grads, expected, rtol=1e-5, atol=1e-7)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=head_only)
  hidden_before = nnx.state(model.hidden)
  optimizer.update(model, grads)
  assert_tree_close(nnx.state(model.hidden), hidden_before, rtol=0)


def test_weight_fn_gives_the_whole_batch_per_token_mean():
  # Uneven numbers of real tokens per micro-batch: the per-token mean of the
  # whole batch is the token-weighted mean of the micro-batch per-token means.
  model = MLP(nnx.Rngs(3), din=4, dout=4)
  rng = np.random.default_rng(3)
  x, target = normal(rng, 8, 6, 4), normal(rng, 8, 6, 4)
  lengths = jnp.array([6, 1, 3, 2, 5, 1, 4, 2])
  mask = (jnp.arange(6)[None, :] < lengths[:, None]).astype(jnp.float32)

  def token_loss(model, x, target, mask):
    per_token = jnp.mean((model(x) - target) ** 2, axis=-1)
    return jnp.sum(per_token * mask) / jnp.maximum(mask.sum(), 1.0)

  weighted = jaccum.nnx.value_and_grad(token_loss, 4, weight_fn=lambda x, t, m: m.sum())
  loss, grads = nnx.jit(weighted)(model, x, target, mask)
  whole_loss, whole_grads = jit_value_and_grad(token_loss)(model, x, target, mask)
  np.testing.assert_allclose(loss, whole_loss, rtol=1e-5)
  assert_tree_close(grads, whole_grads, rtol=1e-5, atol=1e-7)
  # Micro-batches hold 11, 2, 7 and 4 tokens (strided rows k, k + 4): the mean
  # of their means would not be the whole-batch mean, so the test can fail.
  np.testing.assert_array_equal(mask.sum(1).reshape(2, 4).sum(0), [11, 2, 7, 4])


class BatchNormNet(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, momentum=0.8, epsilon=1e-5, rngs=rngs)
    self.head = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(jax.nn.relu(self.norm(self.linear(x))))


def bn_loss(model, x, y):
  return jnp.mean((model(x)[:, 0] - y) ** 2)


@pytest.mark.parametrize(
  "use_jit, split", [(False, "strided"), (True, "contiguous")], ids=["eager", "jit"]
)
def test_batchnorm_statistics_follow_sequential_microbatches(use_jit, split):
  num_microbatches = 4
  model = BatchNormNet(nnx.Rngs(0))
  rng = np.random.default_rng(5)
  x, y = normal(rng, 16, 3) * 2.0 + 1.0, normal(rng, 16)
  kernel = np.asarray(model.linear.kernel[...], np.float64)
  bias = np.asarray(model.linear.bias[...], np.float64)
  params_before = nnx.state(model, nnx.Param)

  _, grads = maybe_jit(
    jaccum.nnx.value_and_grad(bn_loss, num_microbatches, split=split), use_jit
  )(model, x, y)

  # By hand: K forward passes, in the split's order, each updating the
  # running statistics with its own micro-batch's statistics.
  rows = np.arange(16).reshape(-1, num_microbatches).T  # rows[k]: strided micro k
  if split == "contiguous":
    rows = np.arange(16).reshape(num_microbatches, -1)
  hidden = np.asarray(x, np.float64) @ kernel + bias
  mean, var = np.zeros(4), np.ones(4)
  for k in range(num_microbatches):
    micro = hidden[rows[k]]
    mean = 0.8 * mean + 0.2 * micro.mean(0)
    var = 0.8 * var + 0.2 * micro.var(0)
  np.testing.assert_allclose(model.norm.mean[...], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(model.norm.var[...], var, rtol=1e-5, atol=1e-6)
  # One whole-batch pass would give other statistics: the test can fail.
  assert not np.allclose(0.2 * hidden.mean(0), mean, atol=1e-3)
  # Parameters are untouched; gradients are the mean of per-micro-batch ones.
  assert_tree_close(nnx.state(model, nnx.Param), params_before, rtol=0)
  reference = BatchNormNet(nnx.Rngs(0))
  reference_grad = nnx.jit(nnx.grad(bn_loss))
  micro_grads = [reference_grad(reference, x[rows[k]], y[rows[k]]) for k in range(4)]
  mean_grads = jax.tree.map(lambda *g: sum(g) / 4, *micro_grads)
  assert_tree_close(grads, mean_grads, rtol=1e-5, atol=1e-6)
  assert_tree_close(
    nnx.state(model, nnx.BatchStat), nnx.state(reference, nnx.BatchStat), rtol=1e-5
  )


def test_batchnorm_in_eval_mode_keeps_statistics_and_matches_whole_batch():
  model = BatchNormNet(nnx.Rngs(0))
  model.eval()
  x, y = normal(np.random.default_rng(7), 8, 3), jnp.arange(8.0)
  before = nnx.state(model, nnx.BatchStat)
  loss, grads = jaccum.nnx.value_and_grad(bn_loss, 4)(model, x, y)
  whole_loss, whole_grads = jit_value_and_grad(bn_loss)(model, x, y)
  np.testing.assert_allclose(loss, whole_loss, rtol=1e-5)
  assert_tree_close(grads, whole_grads, rtol=1e-5, atol=1e-7)
  assert_tree_close(nnx.state(model, nnx.BatchStat), before, rtol=0)


class DropoutNet(nnx.Module):
  def __init__(self, rngs):
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.linear = nnx.Linear(6, 1, rngs=rngs)

  def __call__(self, x):
    kept = self.dropout(x)
    return self.linear(kept)[:, 0], kept


def dropout_loss(model, x):
  out, kept = model(x)
  return jnp.mean(out**2), kept


def test_dropout_masks_are_fresh_per_microbatch_and_reproducible():
  # Under nnx.jit only: the eager write-back is the BatchNorm tests' code path.
  num_microbatches = 4
  x = jnp.ones((8, 6))
  # "concat" puts each row's dropped-out input back in its own row.
  step = nnx.jit(
    jaccum.nnx.grad(
      dropout_loss, num_microbatches, has_aux=True, reduce=("mean", "concat")
    )
  )
  model = DropoutNet(nnx.Rngs(42))
  _, kept = step(model, x)
  masks = np.asarray(kept != 0).reshape(2, num_microbatches, 6)  # [row, micro, :]
  per_micro = [masks[:, k] for k in range(num_microbatches)]
  for a in range(num_microbatches):
    for b in range(a + 1, num_microbatches):
      assert not np.array_equal(per_micro[a], per_micro[b])

  # The same seed gives the same masks; they are those of K sequential calls.
  twin = DropoutNet(nnx.Rngs(42))
  _, twin_kept = step(twin, x)
  np.testing.assert_array_equal(twin_kept, kept)
  sequential = DropoutNet(nnx.Rngs(42))
  for k in range(num_microbatches):
    np.testing.assert_array_equal(sequential(x[k::num_microbatches])[1], kept[k::4])
  assert int(model.dropout.rngs.count[...]) == num_microbatches

  # The next step draws new masks, again as the sequential calls would.
  _, kept_again = step(model, x)
  assert not np.array_equal(kept_again, kept)
  np.testing.assert_array_equal(sequential(x[0::4])[1], kept_again[0::4])


def test_rng_argnum_gives_each_microbatch_its_own_key():
  model = DropoutNet(nnx.Rngs(0))

  def loss_with_key(model, x, key):
    kept = model.dropout(x, rngs=key)
    return jnp.mean(model.linear(kept) ** 2), kept

  key = jax.random.key(9)
  _, kept = jaccum.nnx.grad(
    loss_with_key, 2, has_aux=True, reduce=("mean", "concat"), rng_argnum=2
  )(model, jnp.ones((4, 6)), key)
  for k in range(2):
    expected = model.dropout(jnp.ones((2, 6)), rngs=jax.random.fold_in(key, k))
    np.testing.assert_array_equal(kept[k::2], expected)


def test_training_follows_the_whole_batch_trajectory():
  x, y = regression_batch(batch_size=32, seed=10)

  def train(value_and_grad):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
      loss, grads = value_and_grad(model, x, y)
      optimizer.update(model, grads)
      return loss

    losses = [float(train_step(model, optimizer, x, y)) for _ in range(20)]
    return losses, nnx.state(model, nnx.Param)

  losses, params = train(jaccum.nnx.value_and_grad(mse, 8))
  whole_losses, whole_params = train(nnx.value_and_grad(mse))
  assert whole_losses[-1] < 0.7 * whole_losses[0]  # It does train.
  np.testing.assert_allclose(losses, whole_losses, rtol=1e-4)
  assert_tree_close(params, whole_params, rtol=1e-4, atol=1e-5)


def test_nnx_jit_does_not_retrace():
  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  traces = []

  @nnx.jit
  def train_step(model, optimizer, x, y):
    traces.append(None)
    loss, grads = jaccum.nnx.value_and_grad(mse, 4)(model, x, y)
    optimizer.update(model, grads)
    return loss

  x, y = regression_batch()
  for _ in range(3):
    train_step(model, optimizer, x, y)
  assert len(traces) == 1


def test_errors_name_the_argument():
  model = MLP(nnx.Rngs(0))
  x, y = regression_batch()
  with pytest.raises(
    TypeError, match=r"first argument must be the nnx.Module.*ArrayImpl"
  ):
    jaccum.nnx.value_and_grad(lambda x, model, y: mse(model, x, y), 4)(x, model, y)
  with pytest.raises(TypeError, match=r"got float on a micro-batch"):
    jaccum.nnx.grad(lambda m, x: (1.0, None), 4, has_aux=True)(model, x)
  with pytest.raises(TypeError, match=r"loss_fn must be callable"):
    jaccum.nnx.grad("mse", 4)
  with pytest.raises(TypeError, match=r"scalar loss of shape \(\), got shape \(4, 3\)"):
    jaccum.nnx.value_and_grad(lambda m, x: m(x), 4)(model, x)
  with pytest.raises(TypeError, match=r"got shape \(\) int32"):
    jaccum.nnx.grad(lambda m, x: jnp.sum(x > 0), 4)(model, x)
  with pytest.raises(TypeError, match=r"returned a tuple of 2.*has_aux=True"):
    jaccum.nnx.value_and_grad(mse_with_aux, 4)(model, x, y)
  with pytest.raises(
    TypeError, match=r"has_aux=True, loss_fn must return \(loss, aux\)"
  ):
    jaccum.nnx.value_and_grad(mse, 4, has_aux=True)(model, x, y)
  with pytest.raises(
    ValueError, match=r"batch_size=16 \(of args\[1\]\).*num_microbatches=3"
  ):
    jaccum.nnx.grad(mse, 3)(model, x, y)
  with pytest.raises(
    ValueError, match=r"num_microbatches must be a positive int, got 0"
  ):
    jaccum.nnx.grad(mse, 0)
  with pytest.raises(ValueError, match=r"batch_argnums=\(0, 1\) must not include 0"):
    jaccum.nnx.grad(mse, 4, batch_argnums=(0, 1))
  with pytest.raises(TypeError, match=r"state_argnum is not an option"):
    jaccum.nnx.grad(mse, 4, state_argnum=1)
  with pytest.raises(ValueError, match=r"no variables matching wrt="):
    jaccum.nnx.grad(mse, 4, wrt=nnx.BatchStat)(model, x, y)
  with pytest.raises(ValueError, match=r"model only"):
    jaccum.nnx.grad(lambda m: jnp.sum(m.out.bias[...]), 4)(model)


# Paths users take: data parallelism, wrt with BatchStat, Flax's MNIST tutorial.

DEVICES = 8


def sharded_rows(mesh, *arrays):
  sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
  return [jax.device_put(a, sharding) for a in arrays]


def test_data_parallel_gradients_are_exact_on_an_explicit_mesh_and_in_shard_map():
  """The params reach every micro-step as an argument: no ×devices gradients."""
  x, y = regression_batch(batch_size=64)
  model = MLP(nnx.Rngs(0))
  _, whole = jit_value_and_grad(mse)(model, x, y)
  explicit = jax.make_mesh((DEVICES,), ("data",))
  step = nnx.jit(jaccum.nnx.value_and_grad(mse, 2))
  _, grads = step(model, *sharded_rows(explicit, x, y))
  assert_tree_close(grads, whole, rtol=1e-5, atol=1e-7)

  auto = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  graphdef, state = nnx.split(model)

  def body(state, x, y):
    local = nnx.merge(graphdef, state)
    _, grads = jaccum.nnx.value_and_grad(mse, 2, axis_name="data")(local, x, y)
    return grads

  grads = jax.jit(
    jax.shard_map(
      body,
      mesh=auto,
      in_specs=(jax.P(), jax.P("data"), jax.P("data")),
      out_specs=jax.P(),
    )
  )(state, x, y)
  assert_tree_close(grads, whole, rtol=1e-5, atol=1e-7)


def test_wrt_with_batch_stats_differentiates_and_updates_them_like_nnx_grad():
  x, y = regression_batch(batch_size=16)
  x = x[:, :3]
  wrt = nnx.Any(nnx.Param, nnx.BatchStat)
  model, reference = BatchNormNet(nnx.Rngs(0)), BatchNormNet(nnx.Rngs(0))
  grads = jaccum.nnx.grad(bn_loss, 1, wrt=wrt)(model, x, y[:, 0])
  whole = nnx.grad(bn_loss, argnums=nnx.DiffState(0, wrt))(reference, x, y[:, 0])
  assert_tree_close(grads, whole, rtol=1e-5, atol=1e-7)
  assert "mean" in grads["norm"]
  # The statistics moved, as nnx.grad moved them.
  assert not np.allclose(model.norm.mean[...], 0.0)
  assert_tree_close(
    nnx.state(model, nnx.BatchStat), nnx.state(reference, nnx.BatchStat), rtol=1e-6
  )


class TutorialCNN(nnx.Module):
  """The CNN of Flax's NNX MNIST tutorial, with the dropout it adds, on 8×8 digits."""

  def __init__(self, *, rngs: nnx.Rngs):
    # A normal init: the default truncated normal takes seconds to compile
    # eagerly on CPU for every kernel shape, and the values do not matter here.
    init = nnx.initializers.normal(0.2)
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), kernel_init=init, rngs=rngs)
    self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), kernel_init=init, rngs=rngs)
    self.linear1 = nnx.Linear(16 * 2 * 2, 32, rngs=rngs)
    self.dropout = nnx.Dropout(0.3)
    self.linear2 = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = pool(nnx.relu(self.conv1(x)))
    x = pool(nnx.relu(self.conv2(x)))
    x = x.reshape(x.shape[0], -1)
    x = self.dropout(nnx.relu(self.linear1(x)), rngs=rngs)
    return self.linear2(x)


def tutorial_loss(model, batch, rngs):
  logits = model(batch["image"], rngs=rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, logits


@pytest.mark.parametrize("rngs_as", ["positional", "keyword"])
def test_the_nnx_mnist_tutorial_train_step_runs_with_rngs_as_an_argument(rngs_as):
  digits = np.random.default_rng(0)
  batch = {
    "image": jnp.asarray(digits.random((32, 8, 8, 1)), jnp.float32),
    "label": jnp.asarray(digits.integers(0, 10, 32)),
  }
  model = TutorialCNN(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
  metrics = nnx.MultiMetric(
    accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
  )
  grad_fn = jaccum.nnx.value_and_grad(
    tutorial_loss, 4, has_aux=True, reduce=(("mean", "concat"), "mean")
  )

  @nnx.jit
  def train_step(model, optimizer, metrics, batch, rngs):
    if rngs_as == "positional":
      (loss, logits), grads = grad_fn(model, batch, rngs)
    else:
      (loss, logits), grads = grad_fn(model, batch, rngs=rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)
    return logits

  rngs = nnx.Rngs(dropout=1)
  logits = train_step(model, optimizer, metrics, batch, rngs)
  assert logits.shape == (32, 10)
  # Four micro-batches drew four dropout masks: the stream advanced four times.
  assert int(rngs.dropout.count[...]) == 4
  # With dropout off, the step's gradient is the whole batch's.
  model.eval()
  (_, logits), grads = nnx.jit(grad_fn)(model, batch, nnx.Rngs(dropout=1))
  (_, whole_logits), whole = nnx.jit(nnx.value_and_grad(tutorial_loss, has_aux=True))(
    model, batch, nnx.Rngs(dropout=1)
  )
  assert_tree_close(grads, whole, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(logits, whole_logits, rtol=1e-5, atol=1e-6)
  assert float(metrics.compute()["loss"]) > 0


def test_averaging_per_example_aux_warns_once_with_the_fix():
  model = TutorialCNN(rngs=nnx.Rngs(0))
  batch = {"image": jnp.ones((8, 8, 8, 1)), "label": jnp.zeros(8, jnp.int32)}
  grad_fn = jaccum.nnx.value_and_grad(tutorial_loss, 2, has_aux=True)
  with pytest.warns(UserWarning, match=r"aux has shape \(4, 10\).*\"concat\""):
    grad_fn(model, batch, nnx.Rngs(dropout=1))


def test_batch_argnums_may_not_point_at_the_model_or_a_graph_node():
  model = MLP(nnx.Rngs(0))
  x, _ = regression_batch()
  with pytest.raises(
    ValueError, match=r"batch_argnums=-2 resolves to position 0, the model's"
  ):
    jaccum.nnx.grad(lambda m, x: mse(m, x, 0.0), 4, batch_argnums=-2)(model, x)
  with pytest.raises(ValueError, match=r"resolves to position 2, the Rngs's"):
    jaccum.nnx.grad(lambda m, x, r: mse(m, x, 0.0), 4, batch_argnums=(1, 2))(
      model, x, nnx.Rngs(0)
    )


def test_jaccum_nnx_traces_the_loss_once():
  traces = []

  def counted(model, x, y):
    traces.append(None)
    return mse(model, x, y)

  model = MLP(nnx.Rngs(0))
  x, y = regression_batch()
  nnx.jit(jaccum.nnx.value_and_grad(counted, 4))(model, x, y)
  assert len(traces) == 1


class WithRngs(nnx.Module):
  """A model that holds its nnx.Rngs, as Flax's tutorials write it."""

  def __init__(self, rngs):
    self.rngs = rngs
    self.linear = nnx.Linear(3, 2, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.dropout(self.linear(x))


def test_an_argument_sharing_variables_with_the_model_is_refused_as_nnx_grad_does():
  """The model's own Rngs, or its submodule, passed again: two copies, refused.

  Before, the first drew the same keys on both paths and the second dropped
  the gradient through the argument (relative error 0.74).
  """
  rngs = nnx.Rngs(0, dropout=1)
  model = WithRngs(rngs)
  x = jnp.ones((8, 3))

  def with_rngs(model, x, rngs):
    return jnp.mean(model(x) ** 2) + jnp.mean(rngs.dropout() != 0)

  def with_submodule(model, x, linear):
    return jnp.mean(model(x) ** 2) + jnp.mean(linear(x) ** 2)

  for loss_fn, extra, what in [
    (with_rngs, rngs, "RngKey|RngCount"),
    (with_submodule, model.linear, "Param"),
  ]:
    with pytest.raises(ValueError, match="Inconsistent aliasing"):
      nnx.grad(loss_fn)(model, x, extra)  # what nnx itself does
    with pytest.raises(
      ValueError, match=rf"args\[2\] shares variables with the model \(({what})"
    ):
      jaccum.nnx.grad(loss_fn, 2)(model, x, extra)
  # Passed once, each works: here the Rngs only as an argument.
  free = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  grads = jaccum.nnx.grad(lambda m, x, r: jnp.mean(m(x) ** 2), 2)(free, x, rngs)
  whole = nnx.grad(lambda m, x: jnp.mean(m(x) ** 2))(free, x)
  assert_tree_close(grads, whole, rtol=1e-6)


def test_plain_accumulate_refuses_a_module_whose_state_it_would_drop():
  """nnx.grad of a BatchNorm model under plain accumulate: stuck statistics."""

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 2, rngs=rngs)
      self.norm = nnx.BatchNorm(2, rngs=rngs)

    def __call__(self, x):
      return self.norm(self.linear(x))

  model, x = Net(nnx.Rngs(0)), jax.random.normal(jax.random.key(0), (8, 3))
  loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
  with pytest.raises(
    ValueError,
    match=r"args\[0\] holds a Flax NNX Net.*BatchStat.*jaccum\.nnx\.value_and_grad",
  ):
    jaccum.accumulate(nnx.grad(loss_fn), 2)(model, x)
  # jaccum.nnx threads them: the running mean moves, as in nnx.grad.
  before = model.norm.mean[...]
  jaccum.nnx.grad(loss_fn, 2)(model, x)
  assert not np.allclose(model.norm.mean[...], before)
  # A module of parameters only has nothing to lose: plain accumulate is exact.
  linear = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
  params_only = lambda m, x: jnp.mean(m(x) ** 2)
  assert_tree_close(
    jaccum.accumulate(nnx.grad(params_only), 2)(linear, x),
    nnx.grad(params_only)(linear, x),
    rtol=1e-6,
  )

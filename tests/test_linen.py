"""Tests for Linen: the `accumulate` recipe and `jaccum.linen.value_and_grad`.

The second half follows Flax's `examples/imagenet` train step (a ResNet with
BatchNorm, a `TrainState` with `batch_stats`, `pmap` with axis_name='batch'),
with a small ResNet of our own that also has dropout.
"""

import functools
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from helpers import assert_trees_close

import jaccum
import jaccum.inspect
import jaccum.linen

NUM_MICROBATCHES = 4


class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    # No bias before BatchNorm: it brings its own, and this one's gradient
    # would be 0 up to rounding.
    x = nn.Dense(6, use_bias=False, name="dense")(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.8, name="norm")(x)
    x = nn.Dropout(0.25, deterministic=not train)(nn.relu(x))
    return nn.Dense(1)(x)[:, 0]


class TrainState(train_state.TrainState):
  batch_stats: Any


def loss_fn(params, batch_stats, x, y, key):
  pred, updates = Net().apply(
    {"params": params, "batch_stats": batch_stats},
    x,
    train=True,
    mutable=["batch_stats"],
    rngs={"dropout": key},
  )
  return jnp.mean((pred - y) ** 2), updates["batch_stats"]


# The recipe: a micro-step returns (out, new_batch_stats); `state_argnum`
# threads the statistics through the micro-batches, `rng_argnum` gives each
# micro-batch its own dropout key.
def micro_step(params, batch_stats, x, y, key):
  (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
    params, batch_stats, x, y, key
  )
  return (loss, grads), batch_stats


accumulated = jaccum.accumulate(
  micro_step, NUM_MICROBATCHES, batch_argnums=(2, 3), state_argnum=1, rng_argnum=4
)


def train_step(state, x, y, key):
  (loss, grads), batch_stats = accumulated(state.params, state.batch_stats, x, y, key)
  return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss


def reference_grads(params, batch_stats, x, y, key):
  """What `accumulated` computes, as a Python loop over the strided micro-batches."""
  losses, all_grads = [], []
  for k in range(NUM_MICROBATCHES):
    rows = slice(k, None, NUM_MICROBATCHES)
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, batch_stats, x[rows], y[rows], jax.random.fold_in(key, k)
    )
    losses.append(loss)
    all_grads.append(grads)
  grads = jax.tree.map(lambda *g: sum(g) / NUM_MICROBATCHES, *all_grads)
  return (sum(losses) / NUM_MICROBATCHES, grads), batch_stats


def reference_step(state, x, y, key):
  (loss, grads), batch_stats = reference_grads(
    state.params, state.batch_stats, x, y, key
  )
  return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss


# Plain SGD: the parameters after a step show the gradients undistorted. One
# optimizer object, so that jit, to which it is static, compiles each step once.
SGD = optax.sgd(0.1)


def make_state(x):
  variables = Net().init(jax.random.key(0), x, train=False)
  return TrainState.create(
    apply_fn=None,  # Unused: loss_fn applies Net itself.
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    tx=SGD,
  )


# Module-level, so the tests share the compiled steps.
jit_train_step, jit_reference_step = jax.jit(train_step), jax.jit(reference_step)


def make_batch(seed=0, batch_size=16):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((batch_size, 3)) * 2 + 1, jnp.float32)
  return x, jnp.asarray(rng.standard_normal(batch_size), jnp.float32)


def assert_tree_close(actual, expected, rtol, atol=0.0):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_one_step_matches_sequential_microbatches(use_jit):
  x, y = make_batch()
  state, key = make_state(x), jax.random.key(1)
  new_state, loss = (jit_train_step if use_jit else train_step)(state, x, y, key)
  expected_state, expected_loss = jit_reference_step(state, x, y, key)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  assert_tree_close(new_state.params, expected_state.params, rtol=1e-5, atol=1e-6)
  assert_tree_close(new_state.batch_stats, expected_state.batch_stats, rtol=1e-5)

  # The running statistics by hand: K BatchNorm updates in strided order.
  kernel = np.asarray(state.params["dense"]["kernel"], np.float64)
  hidden = np.asarray(x, np.float64) @ kernel
  mean, var = np.zeros(6), np.ones(6)
  for k in range(NUM_MICROBATCHES):
    micro = hidden[k::NUM_MICROBATCHES]
    mean = 0.8 * mean + 0.2 * micro.mean(0)
    var = 0.8 * var + 0.2 * micro.var(0)
  stats = new_state.batch_stats["norm"]
  np.testing.assert_allclose(stats["mean"], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats["var"], var, rtol=1e-5, atol=1e-6)
  # A single whole-batch update would differ: the check has teeth.
  assert not np.allclose(0.2 * hidden.mean(0), mean, atol=1e-3)


def test_ten_steps_follow_the_sequential_reference():
  x, y = make_batch(seed=1)
  state = reference = make_state(x)
  losses, ref_losses = [], []
  for i in range(10):
    key = jax.random.key(100 + i)
    state, loss = jit_train_step(state, x, y, key)
    reference, ref_loss = jit_reference_step(reference, x, y, key)
    losses.append(float(loss))
    ref_losses.append(float(ref_loss))
  assert losses[-1] < 0.8 * losses[0]  # It does train.
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
  assert_tree_close(state.params, reference.params, rtol=1e-4, atol=1e-5)
  assert_tree_close(state.batch_stats, reference.batch_stats, rtol=1e-4, atol=1e-5)


def test_eval_mode_gradients_match_the_whole_batch():
  # With running averages and no dropout, the loss is a per-example mean, so
  # the accumulated gradient is the whole-batch gradient.
  x, y = make_batch(seed=2)
  state = make_state(x)

  def eval_loss(params, x, y):
    pred = Net().apply({"params": params, "batch_stats": state.batch_stats}, x, False)
    return jnp.mean((pred - y) ** 2)

  grads = jax.jit(jaccum.accumulate(jax.grad(eval_loss), 4, batch_argnums=(1, 2)))(
    state.params, x, y
  )
  assert_tree_close(
    grads, jax.grad(eval_loss)(state.params, x, y), rtol=1e-5, atol=1e-7
  )


# jaccum.linen: Flax's imagenet train step with one line changed.

IMAGE_SHAPE = (6, 6, 3)
NUM_CLASSES = 4


class ResNetBlock(nn.Module):
  filters: int
  norm: Any

  @nn.compact
  def __call__(self, x):
    y = nn.relu(self.norm()(nn.Conv(self.filters, (3, 3), use_bias=False)(x)))
    y = self.norm()(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """A small ResNet as in Flax's imagenet example, with dropout before the head."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = functools.partial(
      nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5
    )
    x = nn.Conv(8, (3, 3), use_bias=False, name="conv_init")(x)
    x = nn.relu(norm(name="bn_init")(x))
    x = ResNetBlock(8, norm)(x)
    x = nn.Dropout(0.25, deterministic=not train)(jnp.mean(x, axis=(1, 2)))
    return nn.Dense(NUM_CLASSES)(x)


def cross_entropy_loss(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def compute_metrics(logits, labels, axis_name=None):
  metrics = {
    "loss": cross_entropy_loss(logits, labels),
    "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels),
  }
  return metrics if axis_name is None else jax.lax.pmean(metrics, axis_name)


def whole_batch(loss_fn):
  return jax.value_and_grad(loss_fn, has_aux=True)


def with_jaccum(loss_fn, **kwargs):
  return jaccum.linen.value_and_grad(
    loss_fn, 2, has_aux=True, reduce=(("mean", "concat"), "mean"), **kwargs
  )


def make_train_step(value_and_grad, train=True, axis_name=None, pmeans=True):
  """Flax's imagenet `train_step`, its loss taking its inputs as arguments.

  `value_and_grad` is the gradient line: `whole_batch` is the original, and
  `with_jaccum` the one line that changes. `pmeans` keeps the example's
  `pmean`s of the gradients and statistics under pmap.
  """

  def train_step(state, batch, dropout_key):
    def loss_fn(params, batch_stats, batch, rng):
      logits, new_model_state = state.apply_fn(
        {"params": params, "batch_stats": batch_stats},
        batch["image"],
        train=train,
        mutable=["batch_stats"],
        rngs={"dropout": rng},
      )
      loss = cross_entropy_loss(logits, batch["label"])
      weight_l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
      return loss + 1e-4 * 0.5 * weight_l2, (new_model_state, logits)

    aux, grads = value_and_grad(loss_fn)(
      state.params, state.batch_stats, batch, dropout_key
    )
    new_model_state, logits = aux[1]
    batch_stats = new_model_state["batch_stats"]
    if axis_name is not None and pmeans:
      grads = jax.lax.pmean(grads, axis_name)
      batch_stats = jax.lax.pmean(batch_stats, axis_name)
    metrics = compute_metrics(logits, batch["label"], axis_name)
    new_state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    return new_state, metrics

  return train_step


def resnet_state():
  variables = ResNet().init(jax.random.key(0), jnp.ones((1, *IMAGE_SHAPE)), False)
  return TrainState.create(
    apply_fn=ResNet().apply,
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    tx=SGD,
  )


def image_batch(batch_size=16, seed=0):
  rng = np.random.default_rng(seed)
  image = rng.standard_normal((batch_size, *IMAGE_SHAPE)) + 0.5
  label = rng.integers(0, NUM_CLASSES, batch_size)
  return {"image": jnp.asarray(image, jnp.float32), "label": jnp.asarray(label)}


def sequential_grads(loss_fn, params, batch_stats, batch, key, num_microbatches):
  """The reference: micro-batch k is rows k, k+K, …, with key fold_in(key, k)."""
  losses, grads, logits = [], [], []
  for k in range(num_microbatches):
    micro = jax.tree.map(lambda x, k=k: x[k::num_microbatches], batch)
    (loss, (new_model_state, micro_logits)), micro_grads = whole_batch(loss_fn)(
      params, batch_stats, micro, jax.random.fold_in(key, k)
    )
    batch_stats = new_model_state["batch_stats"]
    losses.append(loss)
    grads.append(micro_grads)
    logits.append(micro_logits)
  # The concatenated rows are 0, K, 2K, …, 1, K+1, …: put them back in order.
  batch_size = len(jax.tree.leaves(batch)[0])
  order = np.arange(batch_size).reshape(-1, num_microbatches).T.reshape(-1)
  logits = jnp.concatenate(logits)[np.argsort(order)]
  mean = lambda *xs: sum(xs) / num_microbatches
  loss_and_aux = (mean(*losses), ({"batch_stats": batch_stats}, logits))
  return loss_and_aux, jax.tree.map(mean, *grads)


def with_sequential_loop(loss_fn):
  return lambda *args: sequential_grads(loss_fn, *args, num_microbatches=2)


def test_imagenet_step_in_eval_mode_equals_the_whole_batch():
  # Running averages and no dropout: every leaf is a mean over examples (or a
  # row per example), so the accumulated step is the whole-batch step.
  state, batch, key = resnet_state(), image_batch(), jax.random.key(1)
  got_state, got_metrics = jax.jit(make_train_step(with_jaccum, train=False))(
    state, batch, key
  )
  want_state, want_metrics = jax.jit(make_train_step(whole_batch, train=False))(
    state, batch, key
  )
  assert_trees_close(got_metrics, want_metrics, rtol=1e-6)
  assert_trees_close(got_state.params, want_state.params, rtol=1e-5, atol=1e-7)
  assert_trees_close(got_state.batch_stats, state.batch_stats, rtol=0)


def test_imagenet_step_in_train_mode_follows_sequential_microbatches():
  state, batch, key = resnet_state(), image_batch(seed=1), jax.random.key(2)
  got_state, got_metrics = jax.jit(make_train_step(with_jaccum))(state, batch, key)
  want_state, want_metrics = jax.jit(make_train_step(with_sequential_loop))(
    state, batch, key
  )
  # The metrics come from the logits: "concat" put them in the batch's order.
  assert_trees_close(got_metrics, want_metrics, rtol=1e-6)
  assert_trees_close(got_state.params, want_state.params, rtol=1e-5, atol=1e-7)
  assert_trees_close(got_state.batch_stats, want_state.batch_stats, rtol=1e-5)
  # Two BatchNorm updates of momentum 0.9: the statistics moved off their
  # initial values, and a single whole-batch step would give others.
  whole_state, _ = jax.jit(make_train_step(whole_batch))(state, batch, key)
  initial = state.batch_stats["bn_init"]["mean"]
  assert not np.allclose(got_state.batch_stats["bn_init"]["mean"], initial)
  assert not np.allclose(
    got_state.batch_stats["bn_init"]["mean"],
    whole_state.batch_stats["bn_init"]["mean"],
    atol=1e-4,
  )


def test_imagenet_step_under_pmap_reduces_once_and_follows_the_devices_loops():
  num_devices, rows = 8, 2 * 2  # two micro-batches of 2 rows per device
  state, key = resnet_state(), jax.random.key(3)
  batch = image_batch(batch_size=num_devices * rows, seed=2)
  sharded = jax.tree.map(lambda x: x.reshape(num_devices, rows, *x.shape[1:]), batch)

  def p_train_step(value_and_grad, pmeans=True):
    step = make_train_step(value_and_grad, axis_name="batch", pmeans=pmeans)
    return jax.pmap(step, "batch", in_axes=(None, 0, None), out_axes=(None, 0))

  jaccum_alone = p_train_step(lambda f: with_jaccum(f, axis_name="batch"), pmeans=False)
  got_state, got_metrics = jaccum_alone(state, sharded, key)

  # The reference: each device runs its two micro-batches in order from the
  # same statistics (its key folded with the device index, but on device 0,
  # which draws as one device would; then with k);
  # gradients average over all, statistics over devices.
  def loss_fn(params, batch_stats, batch, rng):
    logits, new_model_state = ResNet().apply(
      {"params": params, "batch_stats": batch_stats},
      batch["image"],
      mutable=["batch_stats"],
      rngs={"dropout": rng},
    )
    loss = cross_entropy_loss(logits, batch["label"])
    weight_l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
    return loss + 1e-4 * 0.5 * weight_l2, (new_model_state, logits)

  per_device = [
    jax.jit(sequential_grads, static_argnums=(0, 5))(
      loss_fn,
      state.params,
      state.batch_stats,
      jax.tree.map(lambda x, d=d: x[d], sharded),
      jax.random.fold_in(key, d) if d else key,
      2,
    )
    for d in range(num_devices)
  ]
  mean = lambda *xs: sum(xs) / num_devices
  grads = jax.tree.map(mean, *(g for _, g in per_device))
  batch_stats = jax.tree.map(mean, *(aux[1][0] for aux, _ in per_device))
  want = state.apply_gradients(grads=grads, batch_stats=batch_stats["batch_stats"])
  assert_trees_close(got_state.params, want.params, rtol=1e-5, atol=1e-7)
  assert_trees_close(got_state.batch_stats, want.batch_stats, rtol=1e-5)
  logits = jnp.stack([aux[1][1] for aux, _ in per_device])
  want_accuracy = jnp.mean(jnp.argmax(logits, -1) == sharded["label"])
  np.testing.assert_allclose(got_metrics["accuracy"], want_accuracy, rtol=1e-6)

  # The example's pmeans of gradients and statistics change nothing now, but
  # cost all-reduces of their own after jaccum's; without them the step has
  # one, jaccum's combined with the metrics' pmean, as the whole-batch step.
  with_pmeans = p_train_step(lambda f: with_jaccum(f, axis_name="batch"))
  kept_state, _ = with_pmeans(state, sharded, key)
  assert_trees_close(kept_state.params, got_state.params, rtol=1e-6)
  counts = {
    name: jaccum.inspect.collectives(step, state, sharded, key)
    for name, step in [
      ("whole batch", p_train_step(whole_batch)),
      ("jaccum, pmeans kept", with_pmeans),
      ("jaccum alone", jaccum_alone),
    ]
  }
  assert all(c.inside_loops == 0 for c in counts.values()), counts
  alone = counts["jaccum alone"].all_reduce.outside_loops
  assert alone == counts["whole batch"].all_reduce.outside_loops == 1, counts
  assert counts["jaccum, pmeans kept"].all_reduce.outside_loops > alone, counts


# jaccum.linen: where the statistics sit, options, errors.


def net_apply(params, batch_stats, batch, rng, train=True):
  """Net on a batch dict: (predictions, {"batch_stats": new statistics})."""
  return Net().apply(
    {"params": params, "batch_stats": batch_stats},
    batch["x"],
    train=train,
    mutable=["batch_stats"],
    rngs={} if rng is None else {"dropout": rng},
  )


def mse(pred, batch):
  return jnp.mean((pred - batch["y"]) ** 2)


# Where Flax code puts the new statistics in aux: imagenet, the BatchNorm
# guide, the mutable dict alone, the bare statistics.
LAYOUTS = {
  "(new_model_state, logits)": lambda pred, updates: (updates, pred),
  "(logits, updates)": lambda pred, updates: (pred, updates),
  "updates": lambda pred, updates: updates,
  "batch_stats": lambda pred, updates: updates["batch_stats"],
}


STATS_IN = {
  "(new_model_state, logits)": lambda aux: aux[0]["batch_stats"],
  "(logits, updates)": lambda aux: aux[1]["batch_stats"],
  "updates": lambda aux: aux["batch_stats"],
  "batch_stats": lambda aux: aux,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_statistics_are_found_where_flax_code_puts_them(layout):
  def loss_fn(params, batch_stats, batch, rng):
    pred, updates = net_apply(params, batch_stats, batch, rng)
    return mse(pred, batch), LAYOUTS[layout](pred, updates)

  x, y = make_batch(seed=3)
  state, key = make_state(x), jax.random.key(4)
  (loss, aux), grads = jaccum.linen.value_and_grad(
    loss_fn, 4, has_aux=True, reduce=(("mean", "concat"), "mean")
  )(state.params, state.batch_stats, {"x": x, "y": y}, key)
  (want_loss, want_grads), want_stats = reference_grads(
    state.params, state.batch_stats, x, y, key
  )
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)
  # loss_fn's aux structure, with the final statistics in their slot.
  expected = LAYOUTS[layout](jnp.zeros(16), {"batch_stats": want_stats})
  assert_trees_close(STATS_IN[layout](aux), want_stats, rtol=1e-5, atol=1e-6)
  assert jax.tree.structure(aux) == jax.tree.structure(expected)


def test_without_aux_or_statistics_it_is_jax_value_and_grad_on_the_whole_batch():
  x, y = make_batch(seed=5)
  state = make_state(x)
  batch = {"x": x, "y": y}

  def eval_loss(params, batch_stats, batch):
    return mse(net_apply(params, batch_stats, batch, None, train=False)[0], batch)

  got = jax.jit(jaccum.linen.value_and_grad(eval_loss, 4))(
    state.params, state.batch_stats, batch
  )
  want = jax.value_and_grad(eval_loss)(state.params, state.batch_stats, batch)
  assert_trees_close(got, want, rtol=1e-5, atol=1e-7)

  # A model without BatchNorm: empty statistics, any aux.
  def dense_loss(params, batch_stats, batch):
    pred = nn.Dense(1).apply({"params": params}, batch["x"])[:, 0]
    return mse(pred, batch), {"pred_mean": pred.mean()}

  params = nn.Dense(1).init(jax.random.key(1), x)["params"]
  got = jaccum.linen.value_and_grad(dense_loss, 4, has_aux=True)(params, {}, batch)
  want = jax.value_and_grad(dense_loss, has_aux=True)(params, {}, batch)
  assert_trees_close(got, want, rtol=1e-5, atol=1e-7)


def test_weight_fn_receives_the_micro_batch():
  # A per-token mean with unevenly masked rows: the token count as weight
  # gives the whole batch's per-token mean, where the mean of means does not.
  x, y = make_batch(seed=6)
  state = make_state(x)
  mask = jnp.asarray(np.arange(16) % 4 != 0) | (jnp.arange(16) < 2)
  batch = {"x": x, "y": y, "mask": mask.astype(jnp.float32)}

  def masked_loss(params, batch_stats, batch):
    pred = net_apply(params, batch_stats, batch, None, train=False)[0]
    return jnp.sum((pred - batch["y"]) ** 2 * batch["mask"]) / batch["mask"].sum()

  weighted = jaccum.linen.value_and_grad(
    masked_loss, 4, weight_fn=lambda batch: batch["mask"].sum()
  )
  want = jax.value_and_grad(masked_loss)(state.params, state.batch_stats, batch)
  assert_trees_close(
    weighted(state.params, state.batch_stats, batch), want, rtol=1e-5, atol=1e-7
  )
  unweighted = jaccum.linen.value_and_grad(masked_loss, 4)
  loss, _ = unweighted(state.params, state.batch_stats, batch)
  assert abs(float(loss) - float(want[0])) > 1e-3 * abs(float(want[0]))


def test_averaged_per_example_aux_warns_and_concat_keeps_the_rows():
  x, y = make_batch(seed=7)
  state, batch, key = make_state(x), {"x": x, "y": y}, jax.random.key(8)

  def loss_fn(params, batch_stats, batch, rng):
    pred, updates = net_apply(params, batch_stats, batch, rng)
    return mse(pred, batch), (updates, pred)

  args = (state.params, state.batch_stats, batch, key)
  with pytest.warns(UserWarning, match=r'reduce=\(\("mean", "concat"\), "mean"\)'):
    jaccum.linen.value_and_grad(loss_fn, 4, has_aux=True)(*args)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    (_, (_, pred)), _ = jaccum.linen.value_and_grad(
      loss_fn, 4, has_aux=True, reduce=(("mean", "concat"), "mean")
    )(*args)
  (_, (_, want_pred)), _ = sequential_grads(loss_fn, *args, num_microbatches=4)
  assert_trees_close(pred, want_pred, rtol=1e-6)


def test_errors_name_the_problem():
  x, y = make_batch()
  state, batch = make_state(x), {"x": x, "y": y}

  def loss_fn(params, batch_stats, batch):
    pred, _ = net_apply(params, batch_stats, batch, None, train=False)
    return mse(pred, batch), pred

  for name in ("batch_argnums", "rng_argnum", "state_argnum", "grad_leaves"):
    with pytest.raises(TypeError, match=f"{name} is not an option"):
      jaccum.linen.value_and_grad(loss_fn, 4, **{name: 1})
  with pytest.raises(TypeError, match="f\\(params, batch_stats, batch\\)"):
    jaccum.linen.value_and_grad(loss_fn, 4, has_aux=True)(state.params, batch)
  with pytest.raises(TypeError, match="found none in aux"):
    jaccum.linen.value_and_grad(
      loss_fn, 4, has_aux=True, reduce=(("mean", "concat"), "mean")
    )(state.params, state.batch_stats, batch)

  def twice(params, batch_stats, batch):
    pred, updates = net_apply(params, batch_stats, batch, None, train=False)
    return mse(pred, batch), (updates, updates)

  with pytest.raises(TypeError, match="found 2 \\(ambiguous\\)"):
    jaccum.linen.value_and_grad(twice, 4, has_aux=True)(
      state.params, state.batch_stats, batch
    )
  with pytest.raises(ValueError, match="divisible"):
    jaccum.linen.value_and_grad(loss_fn, 3, has_aux=True)(
      state.params, state.batch_stats, batch
    )


def test_loss_fn_is_traced_once_per_compilation():
  x, y = make_batch(seed=9)
  state, batch, key = make_state(x), {"x": x, "y": y}, jax.random.key(0)
  traces = []

  def loss_fn(params, batch_stats, batch, rng):
    traces.append(1)
    pred, updates = net_apply(params, batch_stats, batch, rng)
    return mse(pred, batch), (updates, pred)

  step = jax.jit(
    jaccum.linen.value_and_grad(
      loss_fn, 4, has_aux=True, reduce=(("mean", "concat"), "mean")
    )
  )
  for _ in range(3):
    step(state.params, state.batch_stats, batch, key)
  assert len(traces) == 1


def test_return_stats_passes_through_and_measures_the_gradients():
  model = nn.Sequential(
    [nn.Dense(8), nn.BatchNorm(use_running_average=False), nn.relu, nn.Dense(1)]
  )
  x = jax.random.normal(jax.random.key(0), (32, 4))
  variables = model.init(jax.random.key(1), x)

  def loss_fn(params, batch_stats, batch):
    pred, new = model.apply(
      {"params": params, "batch_stats": batch_stats},
      batch["x"],
      mutable=["batch_stats"],
    )
    return jnp.mean((pred[:, 0] - batch["y"]) ** 2), new

  step = jax.jit(
    jaccum.linen.value_and_grad(loss_fn, 4, has_aux=True, return_stats=True)
  )
  ((_, new), grads), stats = step(
    variables["params"], variables["batch_stats"], {"x": x, "y": x.sum(1)}
  )
  squared = sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(grads))
  np.testing.assert_allclose(stats.grad_sq_norm, squared, rtol=1e-5)
  assert float(stats.total_weight) == 32 and float(stats.microbatch_weight) == 8
  assert "batch_stats" in new


def test_rng_by_keyword_gives_every_micro_batch_its_own_key():
  """f(params, batch_stats, batch, rng=key) is the positional call: fold_in(key, k).

  Before, the keyword went whole to every micro-batch: the same dropout mask.
  """
  state, batch, key = resnet_state(), image_batch(seed=3), jax.random.key(4)

  def loss_fn(params, batch_stats, batch, rng):
    logits, new_model_state = state.apply_fn(
      {"params": params, "batch_stats": batch_stats},
      batch["image"],
      mutable=["batch_stats"],
      rngs={"dropout": rng},
    )
    return cross_entropy_loss(logits, batch["label"]), (new_model_state, logits)

  grad_fn = jax.jit(with_jaccum(loss_fn))
  by_keyword = grad_fn(state.params, state.batch_stats, batch, rng=key)
  by_position = grad_fn(state.params, state.batch_stats, batch, key)
  assert_trees_close(by_keyword, by_position, rtol=0)
  expected = sequential_grads(loss_fn, state.params, state.batch_stats, batch, key, 2)
  assert_trees_close(by_keyword, expected, rtol=1e-5, atol=1e-7)
  # Not vacuous: dropout differs between keys, so one key for all would differ.
  shared = jax.jit(
    lambda *a: sequential_grads(lambda p, s, b, r: loss_fn(p, s, b, key), *a, 2)
  )(state.params, state.batch_stats, batch, key)
  assert not np.allclose(
    shared[1]["Dense_0"]["kernel"], expected[1]["Dense_0"]["kernel"]
  )
  with pytest.raises(TypeError, match="rng was passed both by position and by keyword"):
    grad_fn(state.params, state.batch_stats, batch, key, rng=key)

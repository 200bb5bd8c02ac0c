"""Tests for the Linen recipe: a TrainState with batch_stats and `accumulate`."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaccum

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

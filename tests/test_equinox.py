"""Tests for Equinox: `accumulate` on filtered gradients, modules and `eqx.nn.State`.

Small equivalents of Equinox's MNIST and stateful examples: a CNN whose
layers list holds functions and pooling modules (non-array leaves), and a
model with BatchNorm and SpectralNorm whose state is an `eqx.nn.State`.
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import jaccum

NUM_MICROBATCHES = 4


class CNN(eqx.Module):
  """Equinox's MNIST CNN, scaled to 8x8 images."""

  layers: list

  def __init__(self, key):
    key1, key2, key3 = jax.random.split(key, 3)
    self.layers = [
      eqx.nn.Conv2d(1, 3, kernel_size=3, key=key1),
      eqx.nn.MaxPool2d(kernel_size=2),
      jax.nn.relu,
      jnp.ravel,
      eqx.nn.Linear(3 * 5 * 5, 32, key=key2),
      jax.nn.sigmoid,
      eqx.nn.Linear(32, 10, key=key3),
      jax.nn.log_softmax,
    ]

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


def loss(model, x, y):
  pred_y = jax.vmap(model)(x)
  return -jnp.mean(jnp.take_along_axis(pred_y, y[:, None], axis=1))


def digits(batch_size=32, offset=0):
  """Images of 1x8x8 whose labels follow their pixels: something to learn."""
  rng = np.random.default_rng(offset)
  x = rng.uniform(size=(batch_size, 1, 8, 8)).astype(np.float32)
  y = np.argmax(x.reshape(batch_size, -1)[:, :10], axis=1)
  return jnp.asarray(x), jnp.asarray(y)


def test_filter_jit_of_accumulate_does_not_warn_and_is_the_whole_batch():
  model, (x, y) = CNN(jax.random.key(0)), digits()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    accumulated = eqx.filter_jit(
      jaccum.accumulate(
        eqx.filter_value_and_grad(loss), NUM_MICROBATCHES, batch_argnums=(1, 2)
      )
    )
    value, grads = accumulated(model, x, y)
  want_value, want_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, x, y)
  # Functions and pooling modules are leaves of the model; their gradients are
  # None, as eqx.filter_value_and_grad gives them on the whole batch.
  assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-7)


def test_partitioned_params_and_static_parts_go_through_unchanged():
  # The pattern of Equinox's MNIST example without filter_*: params are the
  # arrays, the static part holds the rest and is passed whole.
  model, (x, y) = CNN(jax.random.key(1)), digits(offset=32)
  params, static = eqx.partition(model, eqx.is_array)

  def loss2(params, static, x, y):
    return loss(eqx.combine(params, static), x, y)

  accumulated = jaccum.accumulate(jax.value_and_grad(loss2), 8, batch_argnums=(2, 3))
  want = jax.value_and_grad(loss2)(params, static, x, y)
  assert_trees_close(accumulated(params, static, x, y), want, rtol=1e-5, atol=1e-7)
  got = eqx.filter_jit(accumulated)(params, static, x, y)
  assert_trees_close(got, want, rtol=1e-5, atol=1e-7)


def test_mnist_style_training_follows_the_whole_batch():
  optim = optax.adamw(3e-3)

  def make_make_step(value_and_grad):
    @eqx.filter_jit
    def make_step(model, opt_state, x, y):
      loss_value, grads = value_and_grad(loss)(model, x, y)
      updates, opt_state = optim.update(
        grads, opt_state, eqx.filter(model, eqx.is_array)
      )
      return eqx.apply_updates(model, updates), opt_state, loss_value

    return make_step

  accumulated_step = make_make_step(
    lambda f: jaccum.accumulate(
      eqx.filter_value_and_grad(f), NUM_MICROBATCHES, batch_argnums=(1, 2)
    )
  )
  whole_step = make_make_step(eqx.filter_value_and_grad)
  model = reference = CNN(jax.random.key(2))
  opt_state = ref_state = optim.init(eqx.filter(model, eqx.is_array))
  losses, ref_losses = [], []
  for step in range(8):
    x, y = digits(offset=32 * step)
    model, opt_state, loss_value = accumulated_step(model, opt_state, x, y)
    reference, ref_state, ref_loss = whole_step(reference, ref_state, x, y)
    losses.append(float(loss_value))
    ref_losses.append(float(ref_loss))
  assert losses[-1] < losses[0]  # It trains.
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
  assert_trees_close(
    eqx.filter(model, eqx.is_array),
    eqx.filter(reference, eqx.is_array),
    rtol=1e-4,
    atol=1e-6,
  )


# The stateful example: BatchNorm and SpectralNorm keep their state in an
# eqx.nn.State, which `state_argnum` threads through the micro-batches.


class StatefulModel(eqx.Module):
  norm1: eqx.nn.BatchNorm
  spectral_linear: eqx.nn.SpectralNorm
  norm2: eqx.nn.BatchNorm
  linear: eqx.nn.Linear

  def __init__(self, key, mode):
    key1, key2, key3 = jax.random.split(key, 3)
    self.norm1 = eqx.nn.BatchNorm(3, axis_name="batch", mode=mode, momentum=0.8)
    self.spectral_linear = eqx.nn.SpectralNorm(
      eqx.nn.Linear(3, 16, key=key1), weight_name="weight", key=key2
    )
    self.norm2 = eqx.nn.BatchNorm(16, axis_name="batch", mode=mode, momentum=0.8)
    self.linear = eqx.nn.Linear(16, 3, key=key3)

  def __call__(self, x, state):
    x, state = self.norm1(x, state)
    x, state = self.spectral_linear(x, state)
    x, state = self.norm2(jax.nn.relu(x), state)
    return self.linear(x), state


def compute_loss(model, state, xs, ys):
  batch_model = jax.vmap(
    model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
  )
  pred_ys, state = batch_model(xs, state)
  return jnp.mean((pred_ys - ys) ** 2), state


# What accumulate needs: (out, new_state). The example's grad line returns
# ((loss, state), grads); three lines turn it around.
def micro_step(model, state, xs, ys):
  grad_fn = eqx.filter_value_and_grad(compute_loss, has_aux=True)
  (loss_value, state), grads = grad_fn(model, state, xs, ys)
  return (loss_value, grads), state


def regression_data(batch_size=24, seed=0):
  rng = np.random.default_rng(seed)
  xs = jnp.asarray(rng.standard_normal((batch_size, 3)) * 2 + 1, jnp.float32)
  return xs, jnp.sin(xs) + 1


def sequential(model, state, xs, ys):
  """The reference: micro_step on rows k, k+K, … for k = 0, …, K-1, in order."""
  outs = []
  for k in range(NUM_MICROBATCHES):
    rows = slice(k, None, NUM_MICROBATCHES)
    out, state = micro_step(model, state, xs[rows], ys[rows])
    outs.append(out)
  mean = lambda *leaves: sum(leaves) / NUM_MICROBATCHES
  return jax.tree.map(mean, *outs), state


@pytest.mark.parametrize("mode", ["batch", "ema"])
def test_eqx_state_follows_sequential_microbatches(mode):
  model, state = eqx.nn.make_with_state(StatefulModel)(jax.random.key(3), mode)
  xs, ys = regression_data()
  accumulated = eqx.filter_jit(
    jaccum.accumulate(
      micro_step, NUM_MICROBATCHES, batch_argnums=(2, 3), state_argnum=1
    )
  )
  (loss_value, grads), new_state = accumulated(model, state, xs, ys)
  (want_loss, want_grads), want_state = eqx.filter_jit(sequential)(model, state, xs, ys)
  np.testing.assert_allclose(loss_value, want_loss, rtol=1e-5)
  assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  # Counters and flags compared as they are, floats to rounding.
  for got, want in zip(
    jax.tree.leaves(new_state), jax.tree.leaves(want_state), strict=True
  ):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  if mode == "batch":
    # The layers advanced once per micro-batch: K, not 1, per step.
    counters = [
      new_state.get(layer.batch_counter) for layer in (model.norm1, model.norm2)
    ]
    assert [int(c) for c in counters] == [NUM_MICROBATCHES] * 2


def test_eqx_state_trains_and_serves_inference_from_the_threaded_state():
  model, state = eqx.nn.make_with_state(StatefulModel)(jax.random.key(4), "batch")
  optim = optax.adam(1e-2)
  opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
  accumulated = jaccum.accumulate(
    micro_step, NUM_MICROBATCHES, batch_argnums=(2, 3), state_argnum=1
  )

  @eqx.filter_jit
  def make_step(model, state, opt_state, xs, ys, step_fn):
    (loss_value, grads), state = step_fn(model, state, xs, ys)
    updates, opt_state = optim.update(grads, opt_state)
    return eqx.apply_updates(model, updates), state, opt_state, loss_value

  reference = (model, state, opt_state)
  losses = []
  for step in range(5):
    xs, ys = regression_data(seed=step)
    model, state, opt_state, loss_value = make_step(
      model, state, opt_state, xs, ys, accumulated
    )
    *reference, _ = make_step(*reference, xs, ys, sequential)
    losses.append(float(loss_value))
  assert losses[-1] < losses[0]
  assert_trees_close(
    eqx.filter(model, eqx.is_array),
    eqx.filter(reference[0], eqx.is_array),
    rtol=1e-4,
    atol=1e-6,
  )
  # Inference reads the running statistics, debiased by the counter: 5 steps
  # of K micro-batches each.
  counter = state.get(model.norm1.batch_counter)
  assert int(counter) == 5 * NUM_MICROBATCHES
  inference_model = eqx.nn.inference_mode(model)
  test_xs, _ = regression_data(batch_size=5, seed=99)
  got, _ = jax.vmap(inference_model, axis_name="batch", in_axes=(0, None))(
    test_xs, state
  )
  want, _ = jax.vmap(
    eqx.nn.inference_mode(reference[0]), axis_name="batch", in_axes=(0, None)
  )(test_xs, reference[1])
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_stateful_examples_grad_line_is_already_out_and_new_state():
  # Equinox's stateful example: `grads, state = eqx.filter_grad(compute_loss,
  # has_aux=True)(model, state, xs, ys)` returns (out, new_state) as it is.
  model, state = eqx.nn.make_with_state(StatefulModel)(jax.random.key(5), "batch")
  xs, ys = regression_data(seed=7)
  grads, new_state = eqx.filter_jit(
    jaccum.accumulate(
      eqx.filter_grad(compute_loss, has_aux=True),
      NUM_MICROBATCHES,
      batch_argnums=(2, 3),
      state_argnum=1,
    )
  )(model, state, xs, ys)
  (_, want_grads), want_state = eqx.filter_jit(sequential)(model, state, xs, ys)
  assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)
  for got, want in zip(
    jax.tree.leaves(new_state), jax.tree.leaves(want_state), strict=True
  ):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

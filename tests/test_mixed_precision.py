"""Tests for the mixed-precision recipe: Flax's `DynamicScale` with `accumulate`.

The recipe (docs/guides/mixed-precision.md): each micro-batch runs
`dynamic_scale.value_and_grad` on its loss divided by K, so that every
example's backward pass is scaled as in the whole batch; the micro-batches'
losses and gradients are summed, their `finite` flags and their proposed
scales reduced with `"min"`. That is one finiteness decision per step, and
the scale DynamicScale would have chosen on the whole batch.
"""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale, DynamicScaleResult
from helpers import assert_trees_close

import jaccum

NUM_MICROBATCHES = 4


class MLP(nn.Module):
  """Float16 compute, float32 params, as Flax's examples' half_precision."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32, dtype=jnp.float16)(x))
    return nn.Dense(4, dtype=jnp.float16)(x)


def loss_fn(params, batch):
  logits = MLP().apply({"params": params}, batch["x"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_grad_fn(num_microbatches, axis_name=None, reduce_scale="min"):
  """The recipe; `reduce_scale="last"` is what keeping the last micro-batch's does."""
  num_terms = num_microbatches

  def micro_step(params, dynamic_scale, batch):
    # Under pmap, "sum" also adds the devices: divide by them too.
    terms = num_terms if axis_name is None else num_terms * jax.lax.axis_size(axis_name)
    scaled_loss = lambda params, batch: loss_fn(params, batch) / terms
    return dynamic_scale.value_and_grad(scaled_loss)(params, batch)

  reduce = DynamicScaleResult(
    dynamic_scale=reduce_scale, finite=reduce_scale, aux="sum", grad="sum"
  )
  return jaccum.accumulate(
    micro_step, num_microbatches, batch_argnums=2, reduce=reduce, axis_name=axis_name
  )


def whole_batch(params, dynamic_scale, batch):
  return dynamic_scale.value_and_grad(loss_fn)(params, batch)


def make_train_step(grad_fn):
  """Flax's imagenet half-precision step: skip the update if not finite."""
  tx = optax.sgd(0.05)

  def train_step(params, opt_state, dynamic_scale, batch):
    dynamic_scale, is_finite, loss, grads = grad_fn(params, dynamic_scale, batch)
    updates, new_opt_state = tx.update(grads, opt_state)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(is_finite, new, old)
    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    return params, opt_state, dynamic_scale, is_finite, loss

  return jax.jit(train_step), tx


def make_batch(batch_size=32, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch_size, 8)).astype(np.float32)
  return {"x": jnp.asarray(x), "y": jnp.asarray(rng.integers(0, 4, batch_size))}


PARAMS = MLP().init(jax.random.key(0), jnp.ones((1, 8)))["params"]


def dynamic_scale(scale, fin_steps=0, growth_interval=2000):
  return DynamicScale(
    growth_interval=growth_interval,
    fin_steps=jnp.int32(fin_steps),
    scale=jnp.float32(scale),
  )


def assert_same_decision(got, want):
  np.testing.assert_array_equal(got.finite, want.finite)
  np.testing.assert_array_equal(got.dynamic_scale.scale, want.dynamic_scale.scale)
  np.testing.assert_array_equal(
    got.dynamic_scale.fin_steps, want.dynamic_scale.fin_steps
  )


@pytest.mark.parametrize(
  "scale, fin_steps", [(2.0**10, 0), (2.0**15, 2000)], ids=["finite", "growth"]
)
def test_a_finite_step_matches_the_whole_batch(scale, fin_steps):
  batch = make_batch()
  ds = dynamic_scale(scale, fin_steps)
  got = jax.jit(make_grad_fn(NUM_MICROBATCHES))(PARAMS, ds, batch)
  want = jax.jit(whole_batch)(PARAMS, ds, batch)
  assert_same_decision(got, want)
  assert bool(got.finite)
  if fin_steps == 2000:  # growth_interval finite steps: the scale doubles once
    assert float(got.dynamic_scale.scale) == 2 * scale
  # float16 compute: the micro-batches round differently from the batch.
  np.testing.assert_allclose(got.aux, want.aux, rtol=1e-3)
  assert_trees_close(got.grad, want.grad, rtol=1e-2, atol=1e-5)


def test_an_overflow_in_one_microbatch_halves_the_scale_once_and_skips_the_step():
  batch = make_batch(seed=1)
  # Row 5 is in micro-batch 1 of 4 (rows 1, 5, 9, …): 1e5 is inf in float16.
  batch["x"] = batch["x"].at[5, 0].set(1e5)
  ds = dynamic_scale(2.0**10, fin_steps=7)
  got = jax.jit(make_grad_fn(NUM_MICROBATCHES))(PARAMS, ds, batch)
  want = jax.jit(whole_batch)(PARAMS, ds, batch)
  assert_same_decision(got, want)
  assert not bool(got.finite)
  assert float(got.dynamic_scale.scale) == 2.0**9
  assert int(got.dynamic_scale.fin_steps) == 0
  # Keeping the last micro-batch's result, which was finite, misses it.
  last = jax.jit(make_grad_fn(NUM_MICROBATCHES, reduce_scale="last"))(PARAMS, ds, batch)
  assert bool(last.finite)
  assert float(last.dynamic_scale.scale) == 2.0**10

  train_step, tx = make_train_step(make_grad_fn(NUM_MICROBATCHES))
  params, _, new_ds, is_finite, _ = train_step(PARAMS, tx.init(PARAMS), ds, batch)
  assert not bool(is_finite)
  assert_trees_close(params, PARAMS, rtol=0)
  assert float(new_ds.scale) == 2.0**9


def sequential_grad_fn(params, ds, batch):
  """The reference, as PyTorch's GradScaler with accumulation does it.

  `scaler.scale(loss / K).backward()` per micro-batch, then one check of the
  summed gradients and one update of the scale: Flax's rule written out.
  """
  losses, grads, finite = [], [], True
  for k in range(NUM_MICROBATCHES):
    micro = jax.tree.map(lambda x, k=k: x[k::NUM_MICROBATCHES], batch)
    scaled = lambda params, batch: loss_fn(params, batch) / NUM_MICROBATCHES
    result = ds.value_and_grad(scaled)(params, micro)
    losses.append(result.aux)
    grads.append(result.grad)
  grads = jax.tree.map(lambda *g: sum(g), *grads)
  finite = jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
  grow = ds.fin_steps == ds.growth_interval
  scale = jnp.where(
    finite,
    jnp.where(grow, ds.scale * ds.growth_factor, ds.scale),
    jnp.maximum(ds.scale * ds.backoff_factor, ds.minimum_scale),
  )
  fin_steps = jnp.where(grow | ~finite, 0, ds.fin_steps + 1)
  new_ds = ds.replace(scale=scale, fin_steps=fin_steps)
  return DynamicScaleResult(new_ds, finite, sum(losses), grads)


def test_the_scale_follows_one_decision_per_step_over_a_trajectory():
  # From a scale that overflows float16 in the backward pass, the scale backs
  # off and grows again (growth_interval 2), step by step as the reference.
  accumulated_step, tx = make_train_step(make_grad_fn(NUM_MICROBATCHES))
  reference_step, _ = make_train_step(sequential_grad_fn)
  state = reference = (PARAMS, tx.init(PARAMS), dynamic_scale(2.0**21, 0, 2))
  decisions, want_decisions = [], []
  for step in range(10):
    batch = make_batch(seed=10 + step)
    *state, is_finite, _ = accumulated_step(*state, batch)
    *reference, want_finite, _ = reference_step(*reference, batch)
    decisions.append((bool(is_finite), float(state[2].scale), int(state[2].fin_steps)))
    want_decisions.append(
      (bool(want_finite), float(reference[2].scale), int(reference[2].fin_steps))
    )
  assert decisions == want_decisions
  scales = [2.0**21] + [scale for _, scale, _ in decisions]
  steps = list(itertools.pairwise(scales))
  assert sum(new < old for old, new in steps) >= 2  # it backed off,
  assert any(new > old for old, new in steps)  # and grew again
  assert_trees_close(state[0], reference[0], rtol=1e-5, atol=1e-7)


def test_without_the_division_by_k_microbatches_overflow_at_a_k_times_lower_scale():
  # Scaling each micro-batch's own mean by the whole scale s computes, bit for
  # bit, what the recipe computes at scale K·s (K = 4 is a power of two): every
  # example's backward is K times larger than in the whole batch, so it
  # overflows at a scale K times lower.
  batch = make_batch(seed=2)

  def undivided_micro_step(params, dynamic_scale, batch):
    return dynamic_scale.value_and_grad(loss_fn)(params, batch)

  undivided = jax.jit(
    jaccum.accumulate(
      undivided_micro_step,
      NUM_MICROBATCHES,
      batch_argnums=2,
      reduce=DynamicScaleResult("min", "min", "mean", "mean"),
    )
  )
  recipe, whole = jax.jit(make_grad_fn(NUM_MICROBATCHES)), jax.jit(whole_batch)
  exponents = range(10, 30)
  finite = lambda fn, shift=0: [
    bool(fn(PARAMS, dynamic_scale(2.0 ** (e + shift)), batch).finite) for e in exponents
  ]
  assert finite(undivided) == finite(recipe, shift=2)
  assert True in finite(recipe) and False in finite(recipe)
  # On this batch the recipe overflows exactly where the whole batch does (in
  # general float16 sums over N/K rows can overflow later than over N).
  assert finite(recipe) == finite(whole)
  assert finite(undivided) != finite(whole)


def test_under_pmap_every_device_takes_the_global_decision():
  num_devices = 8
  grad_fn = make_grad_fn(2, axis_name="batch")
  p_grad_fn = jax.pmap(grad_fn, "batch", in_axes=(None, None, 0))
  batch = make_batch(batch_size=num_devices * 4, seed=3)
  sharded = jax.tree.map(lambda x: x.reshape(num_devices, 4, *x.shape[1:]), batch)
  ds = dynamic_scale(2.0**12, fin_steps=3)
  got = p_grad_fn(PARAMS, ds, sharded)
  want = jax.jit(whole_batch)(PARAMS, ds, batch)  # the global batch on one device
  for device in range(num_devices):
    on_device = jax.tree.map(lambda x, d=device: x[d], got)
    assert_same_decision(on_device, want)
    assert_trees_close(on_device.grad, want.grad, rtol=1e-2, atol=1e-5)

  # An overflow on device 5 only: every device skips the step and halves.
  bad = jax.tree.map(lambda x: x, sharded)
  bad["x"] = bad["x"].at[5, 2, 0].set(1e5)
  got = p_grad_fn(PARAMS, ds, bad)
  np.testing.assert_array_equal(got.finite, [False] * num_devices)
  np.testing.assert_array_equal(got.dynamic_scale.scale, [2.0**11] * num_devices)


# With BatchNorm: the recipe inside a micro-step that also threads batch_stats.


class NormNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, use_bias=False, dtype=jnp.float16)(x)
    x = nn.BatchNorm(use_running_average=False, momentum=0.9, dtype=jnp.float16)(x)
    return nn.Dense(4, dtype=jnp.float16)(nn.relu(x))


def norm_loss_fn(params, batch_stats, batch):
  logits, new_model_state = NormNet().apply(
    {"params": params, "batch_stats": batch_stats},
    batch["x"],
    mutable=["batch_stats"],
  )
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), batch["y"]
  ).mean()
  return loss, (new_model_state, logits)


def norm_micro_step(params, batch_stats, dynamic_scale, batch):
  def scaled_loss(params):
    loss, aux = norm_loss_fn(params, batch_stats, batch)
    return loss / NUM_MICROBATCHES, aux

  grad_fn = dynamic_scale.value_and_grad(scaled_loss, has_aux=True)
  dynamic_scale, is_finite, (loss, (new_model_state, logits)), grads = grad_fn(params)
  result = DynamicScaleResult(dynamic_scale, is_finite, (loss, logits), grads)
  return result, new_model_state["batch_stats"]


def test_the_recipe_threads_batch_stats_with_state_argnum():
  batch = make_batch(seed=4)
  variables = NormNet().init(jax.random.key(1), batch["x"])
  params, batch_stats = variables["params"], variables["batch_stats"]
  ds = dynamic_scale(2.0**12, fin_steps=5)
  grad_fn = jaccum.accumulate(
    norm_micro_step,
    NUM_MICROBATCHES,
    batch_argnums=3,
    state_argnum=1,
    reduce=DynamicScaleResult("min", "min", ("sum", "concat"), "sum"),
  )
  got, got_stats = jax.jit(grad_fn)(params, batch_stats, ds, batch)

  results, stats = [], batch_stats
  for k in range(NUM_MICROBATCHES):
    micro = jax.tree.map(lambda x, k=k: x[k::NUM_MICROBATCHES], batch)
    result, stats = jax.jit(norm_micro_step)(params, stats, ds, micro)
    results.append(result)
  assert_trees_close(got_stats, stats, rtol=1e-6)
  assert bool(got.finite) and int(got.dynamic_scale.fin_steps) == 6
  np.testing.assert_allclose(got.aux[0], sum(r.aux[0] for r in results), rtol=1e-6)
  sums = jax.tree.map(lambda *g: sum(g), *(r.grad for r in results))
  assert_trees_close(got.grad, sums, rtol=1e-6, atol=1e-8)
  np.testing.assert_array_equal(got.aux[1][1::NUM_MICROBATCHES], results[1].aux[1])

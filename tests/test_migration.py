"""One test per row of docs/guides/migration.md: what people use today, and jaccum.

Each test writes the other library's accumulation as a small function of our
own, faithful to its source (named in the docstring), runs it and jaccum with
the settings the guide gives on a small model, and compares the numbers:
bit for bit where the guide says "reproduces", to float32 rounding where the
arithmetic differs, and shows where jaccum's defaults improve on it.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import jaccum
import jaccum.inspect

K = 4


def assert_trees_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


# A small image classifier with dropout, for the vision_transformer row.


class Classifier(nn.Module):
  @nn.compact
  def __call__(self, images, train):
    x = nn.gelu(nn.Dense(16)(images.reshape(images.shape[0], -1)))
    x = nn.Dropout(0.3, deterministic=not train)(x)
    return nn.Dense(5)(x)


def image_batch(batch_size=16, seed=0):
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.standard_normal((batch_size, 4, 4, 3)), jnp.float32)
  labels = jax.nn.one_hot(rng.integers(0, 5, batch_size), 5)
  return images, labels


CLASSIFIER_PARAMS = Classifier().init(
  jax.random.key(0), jnp.ones((1, 4, 4, 3)), train=False
)["params"]


def vit_accumulate_gradient(loss_and_grad_fn, params, images, labels, accum_steps):
  """vision_transformer's `vit_jax/utils.py` and big_vision's `utils.py`.

  Micro-batch 0 is the first slice of `images` and runs before the loop; a
  `fori_loop` over 1..K-1 takes contiguous `dynamic_slice`s, adds losses and
  gradients to the running sums, and the sums are divided by K at the end.
  """
  if accum_steps <= 1:
    return loss_and_grad_fn(params, images, labels)
  size = images.shape[0] // accum_steps
  first = loss_and_grad_fn(params, images[:size], labels[:size])

  def add_microbatch(i, sums):
    micro_images = jax.lax.dynamic_slice_in_dim(images, i * size, size)
    micro_labels = jax.lax.dynamic_slice_in_dim(labels, i * size, size)
    micro = loss_and_grad_fn(params, micro_images, micro_labels)
    return jax.tree.map(jnp.add, sums, micro)

  sums = jax.lax.fori_loop(1, accum_steps, add_microbatch, first)
  return jax.tree.map(lambda x: x / accum_steps, sums)


def vit_loss(dropout_rng):
  """vit_jax's train step: the loss closes over one dropout key."""

  def loss_fn(params, images, labels):
    logits = Classifier().apply(
      {"params": params}, images, train=True, rngs={"dropout": dropout_rng}
    )
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=1))

  return loss_fn


def test_vit_accumulate_gradient_is_contiguous_without_rng_argnum_bit_for_bit():
  images, labels = image_batch()
  dropout_rng = jax.random.key(1)
  loss_fn = vit_loss(dropout_rng)
  theirs = jax.jit(
    lambda params, images, labels: vit_accumulate_gradient(
      jax.value_and_grad(loss_fn), params, images, labels, K
    )
  )(CLASSIFIER_PARAMS, images, labels)
  # The one-line change.
  ours = jax.jit(
    jaccum.accumulate(
      jax.value_and_grad(loss_fn), K, batch_argnums=(1, 2), split="contiguous"
    )
  )(CLASSIFIER_PARAMS, images, labels)
  assert_trees_equal(ours, theirs)

  # jaccum's defaults: a key per micro-batch (rng_argnum) and strided rows.
  # Rows 0, 4, 8, 12 then see dropout masks of their own, as in a loop of K
  # steps with fresh keys.
  def loss_with_key(params, images, labels, rng):
    return vit_loss(rng)(params, images, labels)

  improved = jax.jit(
    jaccum.accumulate(
      jax.value_and_grad(loss_with_key), K, batch_argnums=(1, 2), rng_argnum=3
    )
  )(CLASSIFIER_PARAMS, images, labels, dropout_rng)
  micro = [
    jax.value_and_grad(loss_with_key)(
      CLASSIFIER_PARAMS, images[k::K], labels[k::K], jax.random.fold_in(dropout_rng, k)
    )
    for k in range(K)
  ]
  want = jax.tree.map(lambda *xs: sum(xs) / K, *micro)
  assert_trees_close(improved, want, rtol=1e-6, atol=1e-7)
  assert not np.allclose(improved[0], theirs[0], rtol=1e-3)


# optax.microbatching.microbatch: micro-batch size instead of K, SUM by default.


def regression_loss(params, x, y):
  hidden = jnp.tanh(x @ params["w1"])
  return jnp.mean((hidden @ params["w2"] - y) ** 2)


def regression_problem(batch_size=16, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  params = {
    "w1": jnp.asarray(rng.standard_normal((3, 8)), dtype),
    "w2": jnp.asarray(rng.standard_normal((8, 1)) / 3, dtype),
  }
  x = jnp.asarray(rng.standard_normal((batch_size, 3)), dtype)
  y = jnp.asarray(rng.standard_normal((batch_size, 1)), dtype)
  return params, x, y


@pytest.mark.parametrize("accumulation", ["SUM", "MEAN"])
def test_optax_microbatch_is_accumulate_with_the_same_reduction(accumulation):
  params, x, y = regression_problem()
  grad_fn = jax.value_and_grad(regression_loss)
  theirs = jax.jit(
    optax.microbatching.microbatch(
      grad_fn,
      argnums=(1, 2),
      microbatch_size=len(x) // K,  # rows per micro-batch, not K
      accumulator=getattr(optax.microbatching.AccumulationType, accumulation),
    )
  )(params, x, y)
  ours = jax.jit(
    jaccum.accumulate(grad_fn, K, batch_argnums=(1, 2), reduce=accumulation.lower())
  )(params, x, y)
  # Both take rows k, k+K, … as micro-batch k and add in the same order.
  assert_trees_equal(ours, theirs)
  whole = grad_fn(params, x, y)
  if accumulation == "SUM":  # K times the whole-batch mean
    assert_trees_close(ours, jax.tree.map(lambda g: K * g, whole), rtol=1e-5)
  else:
    assert_trees_close(ours, whole, rtol=1e-5)


def test_optax_microbatch_concat_and_bfloat16_accumulators():
  params, x, y = regression_problem(batch_size=64, dtype=jnp.bfloat16, seed=1)
  types = optax.microbatching.AccumulationType

  def grad_and_rows(params, x, y):
    return jax.grad(regression_loss)(params, x, y), jnp.tanh(x @ params["w1"])

  theirs = jax.jit(
    optax.microbatching.microbatch(
      grad_and_rows, (1, 2), len(x) // 16, accumulator=(types.MEAN, types.CONCAT)
    )
  )(params, x, y)
  # optax adds bfloat16 gradients in bfloat16; accum_dtype=None does the same.
  same = jax.jit(
    jaccum.accumulate(
      grad_and_rows,
      16,
      batch_argnums=(1, 2),
      reduce=("mean", "concat"),
      accum_dtype=None,
    )
  )(params, x, y)
  assert_trees_equal(same, theirs)
  np.testing.assert_array_equal(same[1], jnp.tanh(x @ params["w1"]))

  # The default float32 accumulator is closer to the float64 mean of the
  # same bfloat16 micro-batch gradients.
  ours = jax.jit(
    jaccum.accumulate(
      grad_and_rows, 16, batch_argnums=(1, 2), reduce=("mean", "concat")
    )
  )(params, x, y)
  micro = [jax.grad(regression_loss)(params, x[k::16], y[k::16]) for k in range(16)]
  exact = jax.tree.map(
    lambda *g: np.mean([np.asarray(m, np.float64) for m in g], axis=0), *micro
  )

  def error(grads):
    return max(
      float(np.max(np.abs(np.asarray(g, np.float64) - e)))
      for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(exact), strict=True)
    )

  assert error(ours[0]) < error(theirs[0])


# optax.MultiSteps: the same constructor, or one call instead of K.


def test_optax_multisteps_becomes_jaccum_multisteps_or_one_accumulated_step():
  params, x, y = regression_problem(batch_size=3 * 16, seed=2)
  windows = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 48, 16)]

  def run(opt):
    state, p = opt.init(params), params
    for wx, wy in windows:
      for k in range(K):  # K mini-steps of the window's contiguous quarters
        rows = slice(k * 4, (k + 1) * 4)
        grads = jax.grad(regression_loss)(p, wx[rows], wy[rows])
        updates, state = opt.update(grads, state, p)
        p = optax.apply_updates(p, updates)
    return p

  theirs = run(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=K))
  assert_trees_close(
    run(jaccum.MultiSteps(optax.adam(1e-2), every_k_schedule=K)),
    theirs,
    rtol=1e-6,
    atol=1e-7,
  )
  # Or accumulate the window in one step and call adam once per window.
  adam, accumulated = (
    optax.adam(1e-2),
    jax.jit(
      jaccum.accumulate(
        jax.grad(regression_loss), K, batch_argnums=(1, 2), split="contiguous"
      )
    ),
  )
  state, p = adam.init(params), params
  for wx, wy in windows:
    updates, state = adam.update(accumulated(p, wx, wy), state, p)
    p = optax.apply_updates(p, updates)
  assert_trees_close(p, theirs, rtol=1e-6, atol=1e-7)


# A small token model for the MaxText, Levanter and Hugging Face rows: padded
# sequences of uneven length, so per-token means weigh micro-batches unevenly.


VOCAB = 11


class TokenModel(nn.Module):
  @nn.compact
  def __call__(self, tokens, train):
    x = nn.Embed(VOCAB, 8)(tokens)
    x = nn.Dropout(0.2, deterministic=not train)(jnp.tanh(nn.Dense(8)(x)))
    return nn.Dense(VOCAB)(x)


TOKEN_PARAMS = TokenModel().init(
  jax.random.key(0), jnp.ones((1, 6), jnp.int32), train=False
)["params"]


def token_batch(batch_size=16, length=6, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, VOCAB, (batch_size, length + 1))
  # Uneven lengths: early rows are long, late rows short.
  lengths = np.linspace(length, 1, batch_size).round().astype(int)
  mask = np.arange(length)[None, :] < lengths[:, None]
  return {
    "inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
    "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
    "targets_segmentation": jnp.asarray(mask, jnp.int32),
  }


def token_losses(params, batch, rng, train=True):
  logits = TokenModel().apply(
    {"params": params},
    batch["inputs"],
    train=train,
    rngs={"dropout": rng} if train else {},
  )
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return losses * batch["targets_segmentation"]


def token_sum_loss(params, batch, rng, train=True):
  """MaxText's loss under gradient accumulation: the sum over real tokens."""
  return token_losses(params, batch, rng, train).sum()


def token_mean_loss(params, batch, rng, train=True):
  """The usual loss: the mean over the micro-batch's real tokens."""
  count = batch["targets_segmentation"].sum()
  return token_losses(params, batch, rng, train).sum() / count


def num_tokens(params, batch, *rest):
  return batch["targets_segmentation"].sum()


def maxtext_accumulate(params, data, dropout_rng, num_microbatches):
  """MaxText's `gradient_accumulation_loss_and_grad`.

  The batch is reshaped to (N/K, K, …) and swapped, so micro-batch k holds
  rows k, k+K, …; a `lax.scan` adds each micro-batch's gradient of the summed
  token loss and its token count; both sums are divided by the total count.
  Every micro-batch gets the same dropout key.
  """

  def to_microbatches(x):
    x = x.reshape(x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)

  def add_microbatch(sums, micro):
    loss, grads = jax.value_and_grad(token_sum_loss)(params, micro, dropout_rng)
    weight = micro["targets_segmentation"].sum()
    return jax.tree.map(jnp.add, sums, (loss, grads, weight)), None

  zeros = (0.0, jax.tree.map(jnp.zeros_like, params), 0)
  (loss, grads, total), _ = jax.lax.scan(
    add_microbatch, zeros, jax.tree.map(to_microbatches, data)
  )
  return loss / total, jax.tree.map(lambda g: g / total, grads)


def test_maxtext_is_a_token_weighted_strided_accumulation_with_one_key():
  batch, dropout_rng = token_batch(), jax.random.key(3)
  theirs = jax.jit(maxtext_accumulate, static_argnums=3)(
    TOKEN_PARAMS, batch, dropout_rng, K
  )
  # The key is passed whole (no rng_argnum), as MaxText does.
  ours = jax.jit(
    jaccum.accumulate(jax.value_and_grad(token_mean_loss), K, weight_fn=num_tokens)
  )(TOKEN_PARAMS, batch, dropout_rng)
  assert_trees_close(ours, theirs, rtol=1e-5, atol=1e-7)

  # Without dropout both are the whole batch's per-token mean.
  deterministic = jax.value_and_grad(lambda p, b, r: token_mean_loss(p, b, r, False))
  whole = deterministic(TOKEN_PARAMS, batch, dropout_rng)
  ours = jaccum.accumulate(deterministic, K, weight_fn=num_tokens)(
    TOKEN_PARAMS, batch, dropout_rng
  )
  assert_trees_close(ours, whole, rtol=1e-5, atol=1e-7)


def levanter_microbatched(fn, num_microbatches):
  """Levanter's `grad_accum.microbatched` (MEAN, accum_dtype None).

  The batch is reshaped to (K, N/K, …): micro-batch k holds the k-th
  contiguous block. The `key` keyword is split into K keys, one per
  micro-batch. Losses and gradients are summed in their own dtype and
  divided by K.
  """

  def wrapped(params, batch, key):
    keys = jax.random.split(key, num_microbatches)
    blocks = jax.tree.map(
      lambda x: x.reshape(num_microbatches, -1, *x.shape[1:]), batch
    )
    shapes = jax.eval_shape(fn, params, jax.tree.map(lambda x: x[0], blocks), key)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def add_microbatch(sums, block_and_key):
      block, micro_key = block_and_key
      return jax.tree.map(jnp.add, sums, fn(params, block, micro_key)), None

    sums, _ = jax.lax.scan(add_microbatch, zeros, (blocks, keys))
    return jax.tree.map(lambda x: x / num_microbatches, sums)

  return wrapped


def test_levanter_is_a_contiguous_mean_of_means_with_split_keys():
  batch, key = token_batch(seed=1), jax.random.key(4)
  grad_fn = jax.value_and_grad(token_mean_loss)
  theirs = jax.jit(levanter_microbatched(grad_fn, K))(TOKEN_PARAMS, batch, key)

  # Levanter's keys are split(key, K): pass them as a batch argument with a
  # row per example, key k repeated over the rows of micro-batch k.
  def with_key_rows(params, batch, keys):
    return grad_fn(params, batch, keys[0])

  keys = jnp.repeat(jax.random.split(key, K), len(batch["inputs"]) // K)
  ours = jax.jit(
    jaccum.accumulate(with_key_rows, K, batch_argnums=(1, 2), split="contiguous")
  )(TOKEN_PARAMS, batch, keys)
  assert_trees_equal(ours, theirs)

  # The mean of per-micro-batch means is not the batch's per-token mean when
  # micro-batches hold different numbers of tokens; weight_fn makes it so.
  deterministic = jax.value_and_grad(lambda p, b, r: token_mean_loss(p, b, r, False))
  whole = deterministic(TOKEN_PARAMS, batch, key)
  mean_of_means = jaccum.accumulate(deterministic, K, split="contiguous")(
    TOKEN_PARAMS, batch, key
  )
  weighted = jaccum.accumulate(
    deterministic, K, split="contiguous", weight_fn=num_tokens
  )(TOKEN_PARAMS, batch, key)
  assert_trees_close(weighted, whole, rtol=1e-5, atol=1e-7)
  assert abs(float(mean_of_means[0]) - float(whole[0])) > 1e-3


# PyTorch / Hugging Face `gradient_accumulation_steps`: K backward passes,
# optimizer.step() once; `no_sync` so that DDP all-reduces only on the last.


def hf_accumulate(params, microbatches, num_items_in_batch=None):
  """Hugging Face Trainer's accumulation, on micro-batches in dataloader order.

  Before 4.46 each micro-batch's loss is its own per-token mean, divided by
  K (`loss / gradient_accumulation_steps`); from 4.46 it is the sum over its
  tokens divided by `num_items_in_batch`, the token count of all K. `.grad`
  adds the K backward passes.
  """
  grads = jax.tree.map(jnp.zeros_like, params)
  for micro in microbatches:
    if num_items_in_batch is None:
      loss = lambda p, m=micro: token_mean_loss(p, m, None, False) / len(microbatches)
    else:
      loss = lambda p, m=micro: token_sum_loss(p, m, None, False) / num_items_in_batch
    grads = jax.tree.map(jnp.add, grads, jax.grad(loss)(params))
  return grads


def test_hugging_face_gradient_accumulation_before_and_after_4_46():
  batch = token_batch(seed=2)
  # The dataloader's K consecutive batches are the contiguous micro-batches.
  microbatches = [
    jax.tree.map(lambda x, k=k: x[k * 4 : (k + 1) * 4], batch) for k in range(K)
  ]
  grad_fn = jax.grad(lambda p, b: token_mean_loss(p, b, None, False))

  old = hf_accumulate(TOKEN_PARAMS, microbatches)
  ours_old = jaccum.accumulate(grad_fn, K, split="contiguous")(TOKEN_PARAMS, batch)
  assert_trees_close(ours_old, old, rtol=1e-5, atol=1e-7)

  num_items = sum(int(m["targets_segmentation"].sum()) for m in microbatches)
  new = hf_accumulate(TOKEN_PARAMS, microbatches, num_items_in_batch=num_items)
  ours_new = jaccum.accumulate(grad_fn, K, weight_fn=num_tokens)(TOKEN_PARAMS, batch)
  assert_trees_close(ours_new, new, rtol=1e-5, atol=1e-7)
  assert_trees_close(ours_new, grad_fn(TOKEN_PARAMS, batch), rtol=1e-5, atol=1e-7)
  # The fix mattered here: the two conventions differ.
  assert not np.allclose(old["Dense_1"]["bias"], new["Dense_1"]["bias"], rtol=1e-3)


def test_ddp_no_sync_is_one_reduction_after_the_loop():
  # Eight ranks, each with K micro-batches of its own rows (contiguous
  # blocks of the global batch): DDP with no_sync all-reduces once per step
  # and averages the ranks; jaccum.data_parallel does the same in one step.
  num_ranks, rows = 8, 8
  batch = token_batch(batch_size=num_ranks * rows, seed=3)
  grad_fn = jax.grad(lambda p, b: token_mean_loss(p, b, None, False))
  mesh = jax.make_mesh(
    (num_ranks,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  ranks = [
    [
      jax.tree.map(
        lambda x, r=r, k=k: x[r * rows + 2 * k : r * rows + 2 * k + 2], batch
      )
      for k in range(K)
    ]
    for r in range(num_ranks)
  ]
  # Before 4.46: each rank's mean of means, averaged over ranks by DDP.
  per_rank = [hf_accumulate(TOKEN_PARAMS, micro) for micro in ranks]
  ddp = jax.tree.map(lambda *g: sum(g) / num_ranks, *per_rank)
  step = jax.jit(jaccum.data_parallel(grad_fn, K, mesh=mesh, split="contiguous"))
  assert_trees_close(step(TOKEN_PARAMS, batch), ddp, rtol=1e-5, atol=1e-7)
  counts = jaccum.inspect.collectives(step, TOKEN_PARAMS, batch)
  assert counts.inside_loops == 0
  assert counts.all_reduce.outside_loops >= 1

  # From 4.46 with average_tokens_across_devices: the global token count.
  num_items = int(batch["targets_segmentation"].sum())
  per_rank = [
    hf_accumulate(TOKEN_PARAMS, micro, num_items_in_batch=num_items) for micro in ranks
  ]
  ddp = jax.tree.map(lambda *g: sum(g), *per_rank)  # loss × world size / world size
  weighted = jax.jit(jaccum.data_parallel(grad_fn, K, mesh=mesh, weight_fn=num_tokens))
  assert_trees_close(weighted(TOKEN_PARAMS, batch), ddp, rtol=1e-5, atol=1e-7)

"""A traced number of real micro-batches: K is the capacity, only the first n run.

`accumulate(grad_fn, K)(..., num_real_microbatches=n)` runs micro-batches
0..n-1 in split order, skips the rest (a while loop, not a mask) and divides
by what ran: the result equals a static K=n on the first n micro-batches.
Under `data_parallel` each device may run its own count. optax's
`num_real_microbatches` cases are ported at the end.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaccum
import jaccum.inspect

K, ROWS = 8, 4  # capacity, rows per micro-batch
DIM = 3


def loss(w, x, y):
  return 0.5 * jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def data(seed=0, batch=K * ROWS):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, DIM)).astype(np.float32)
  return x, rng.normal(size=batch).astype(np.float32)


W = jnp.asarray([0.3, -0.7, 1.1])


def rows_that_ran(counts, batch_size):
  """The batch's rows that device d's first counts[d] micro-batches hold."""
  per_device = batch_size // len(counts)
  return np.concatenate(
    [
      first(n, np.arange(d * per_device, (d + 1) * per_device))
      for d, n in enumerate(counts)
    ]
  )


def first(n, x, split="strided", capacity=K):
  """The rows of micro-batches 0..n-1 of `x`, in that split's order."""
  if split == "contiguous":
    return x[: n * len(x) // capacity]
  return (
    np.asarray(x)
    .reshape(-1, capacity, *np.shape(x)[1:])[:, :n]
    .reshape(-1, *np.shape(x)[1:])
  )


@pytest.mark.parametrize("split", ["strided", "contiguous"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_a_traced_count_equals_a_static_k_of_that_count(n, split):
  """Gradients, the loss and the noise-scale figures, one compilation for all n."""
  x, y = data()
  step = jax.jit(
    jaccum.accumulate(
      jax.value_and_grad(loss), K, batch_argnums=(1, 2), split=split, return_stats=n > 1
    )
  )
  got = step(W, x, y, num_real_microbatches=jnp.int32(n))
  xs, ys = first(n, x, split), first(n, y, split)
  static = jaccum.accumulate(
    jax.value_and_grad(loss), n, batch_argnums=(1, 2), split=split, return_stats=n > 1
  )
  assert_trees_close(got, jax.jit(static)(W, xs, ys), rtol=1e-5, atol=1e-7)
  if n > 1:
    (_, grads), _ = got
  else:
    _, grads = got
  assert_trees_close(grads, jax.grad(loss)(W, xs, ys), rtol=1e-5)


def test_one_compilation_serves_every_count():
  x, y = data()
  traces = []

  def grad_fn(w, x, y):
    traces.append(None)
    return jax.grad(loss)(w, x, y)

  step = jax.jit(jaccum.accumulate(grad_fn, K, batch_argnums=(1, 2), split="strided"))
  for n in range(K + 1):
    step(W, x, y, num_real_microbatches=jnp.int32(n))
  assert len(traces) == 1


def test_zero_real_micro_batches_give_zeros_not_nan():
  x, y = data()
  for options in ({}, {"weight_fn": lambda w, x, y: jnp.float32(len(x))}):
    step = jax.jit(
      jaccum.accumulate(
        jax.value_and_grad(loss), K, batch_argnums=(1, 2), split="strided", **options
      )
    )
    value, grads = step(W, x, y, num_real_microbatches=jnp.int32(0))
    assert float(value) == 0.0 and np.all(np.asarray(grads) == 0)


def test_weights_count_only_the_real_micro_batches():
  """With weight_fn, Σ w·g / Σ w over the micro-batches that ran."""
  x, y = data(1)
  tokens = np.random.default_rng(2).integers(0, 5, size=K * ROWS).astype(np.float32)

  def token_loss(w, x, y, t):
    per_row = 0.5 * (jnp.tanh(x @ w) - y) ** 2
    return jnp.sum(per_row * t) / jnp.maximum(jnp.sum(t), 1)

  step = jax.jit(
    jaccum.accumulate(
      jax.grad(token_loss),
      K,
      batch_argnums=(1, 2, 3),
      weight_fn=lambda w, x, y, t: jnp.sum(t),
      split="strided",
    )
  )
  got = step(W, x, y, tokens, num_real_microbatches=5)
  xs, ys, ts = (first(5, a) for a in (x, y, tokens))
  assert_trees_close(got, jax.grad(token_loss)(W, xs, ys, ts), rtol=1e-5)


def test_state_advances_once_per_real_micro_batch():
  x, y = data(3)

  def counted(w, count, x, y):
    return jax.grad(loss)(w, x, y), count + 1

  step = jax.jit(
    jaccum.accumulate(counted, K, batch_argnums=(2, 3), state_argnum=1, split="strided")
  )
  _, count = step(W, jnp.int32(0), x, y, num_real_microbatches=jnp.int32(5))
  assert int(count) == 5


def test_concat_keeps_the_real_rows_and_zeros_the_skipped():
  x, y = data(4)
  per_row = lambda w, x, y: jnp.tanh(x @ w) - y
  step = jax.jit(
    jaccum.accumulate(
      per_row, K, batch_argnums=(1, 2), reduce="concat", split="strided"
    )
  )
  got = np.asarray(step(W, x, y, num_real_microbatches=jnp.int32(3)))
  expected = np.asarray(
    jax.vmap(lambda xi, yi: per_row(W, xi[None], yi[None])[0])(x, y)
  )
  real = (np.arange(K * ROWS) % K) < 3  # strided: rows k, k+K, ... of micro-batch k
  np.testing.assert_allclose(got[real], expected[real], rtol=1e-6, atol=1e-6)
  assert np.all(got[~real] == 0)


def test_a_count_above_the_capacity():
  """Static: a clear error now. Traced: clamped to [0, K], as documented."""
  x, y = data()
  step = jaccum.accumulate(jax.grad(loss), K, batch_argnums=(1, 2), split="strided")
  with pytest.raises(ValueError, match=r"num_real_microbatches=9 must be in \[0, "):
    step(W, x, y, num_real_microbatches=9)
  with pytest.raises(ValueError, match=r"must be in \[0, num_microbatches=8\]"):
    step(W, x, y, num_real_microbatches=-1)
  with pytest.raises(TypeError, match=r"num_real_microbatches must be an int"):
    step(W, x, y, num_real_microbatches=2.5)
  clamped = jax.jit(step)(W, x, y, num_real_microbatches=jnp.int32(100))
  assert_trees_close(clamped, jax.grad(loss)(W, x, y), rtol=1e-5)


def test_devices_with_different_counts_give_the_exact_weighted_result():
  """4 devices running 8, 3, 5 and 1 micro-batches: nothing in the loop waits."""
  mesh = jax.make_mesh(
    (4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4]
  )
  x, y = data(5, batch=4 * K * ROWS)
  counts = np.array([8, 3, 5, 1], np.int32)
  step = jax.jit(
    jaccum.data_parallel(
      jax.grad(loss), K, mesh=mesh, batch_argnums=(1, 2), split="strided"
    )
  )
  batch = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y)]
  got = step(W, *batch, num_real_microbatches=jnp.asarray(counts))
  rows = rows_that_ran(counts, len(x))
  assert_trees_close(got, jax.grad(loss)(W, x[rows], y[rows]), rtol=1e-5)
  assert (
    jaccum.inspect.collectives(
      step, W, *batch, num_real_microbatches=jnp.asarray(counts)
    ).inside_loops
    == 0
  )
  # One count for all devices is the unsharded meaning on the explicit route.
  explicit = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  sharded = [jax.device_put(a, NamedSharding(explicit, P("data"))) for a in (x, y)]
  plain = jax.jit(
    jaccum.accumulate(jax.grad(loss), K, batch_argnums=(1, 2), split="strided")
  )
  assert_trees_close(
    plain(W, *sharded, num_real_microbatches=jnp.int32(3)),
    jax.grad(loss)(W, first(3, x), first(3, y)),
    rtol=1e-5,
  )
  with pytest.raises(ValueError, match=r"must be a scalar, got shape \(4,\)"):
    plain(W, *sharded, num_real_microbatches=jnp.asarray(counts))


def test_multisteps_takes_a_window_of_changing_counts():
  """Two calls of 3 and 8 real micro-batches, weighted by what ran: one update."""
  x, y = data(6)
  step = jax.jit(
    jaccum.accumulate(jax.grad(loss), K, batch_argnums=(1, 2), split="strided")
  )
  opt = jaccum.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
  state = opt.init(W)
  updates = None
  for n in (3, 8):
    grads = step(W, x, y, num_real_microbatches=jnp.int32(n))
    updates, state = opt.update(grads, state, W, weight=jnp.float32(n * ROWS))
  rows = np.concatenate([first(3, np.arange(len(x))), np.arange(len(x))])
  assert_trees_close(updates, -jax.grad(loss)(W, x[rows], y[rows]), rtol=1e-5)


# optax's num_real_microbatches cases (optax/microbatching/_microbatching_test.py),
# each with jaccum's spelling of the same call.


def test_optax_early_stopping_concat():
  x = jnp.arange(12).astype(jnp.float32) + 1
  output = jaccum.accumulate(
    lambda x: x, 4, batch_argnums=0, reduce="concat", split="contiguous"
  )(x, num_real_microbatches=2)
  assert int(jnp.sum(output != 0)) == 6


def test_optax_dynamic_steps():
  @jax.jit
  def fun(x, steps):
    return jaccum.accumulate(
      jnp.sum, 32, batch_argnums=0, reduce="sum", split="contiguous"
    )(x, num_real_microbatches=steps)

  x = jnp.ones(128)
  assert fun(x, 4) == x[:16].sum()


def test_optax_micro_vmap_and_micro_grad_early_stopping():
  x = jnp.ones(16)
  summed = jaccum.accumulate(
    jnp.sum, 4, batch_argnums=0, reduce="sum", split="contiguous"
  )
  assert float(summed(x, num_real_microbatches=3)) == 12.0
  grad_fn = jaccum.accumulate(
    jax.grad(lambda c, x: c * x.sum()), 4, reduce="sum", split="contiguous"
  )
  assert float(grad_fn(1.0, x, num_real_microbatches=3)) == 12.0


def test_one_count_per_device_on_an_explicit_mesh_as_the_caller_makes_it():
  """A `[devices]` count made with jnp.asarray, not laid out over the mesh:
  jaccum's per-device loop refused it on an explicit mesh with JAX's
  "in_specs passed to shard_map ... does not match" about its own shard_map."""
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])  # explicit
  x, y = data(7, batch=4 * K * ROWS)
  counts = np.array([2, 0, 8, 5], np.int32)
  step = jax.jit(
    jaccum.data_parallel(
      jax.grad(loss), K, mesh=mesh, batch_argnums=(1, 2), split="strided"
    )
  )
  batch = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y)]
  got = step(W, *batch, num_real_microbatches=jnp.asarray(counts))
  rows = rows_that_ran(counts, len(x))
  assert_trees_close(got, jax.grad(loss)(W, x[rows], y[rows]), rtol=1e-5)


def test_a_count_where_the_per_device_loop_cannot_run_names_the_count_alone():
  """A tensor-parallel model whose matmul JAX refuses on an explicit 2-D mesh
  (its contraction is split over "model"): without a count the step runs as
  the whole batch does and fails with JAX's message; with one, the error
  names num_real_microbatches, not a reduce_fn that was never given."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))  # explicit
  specs = {"w": P(None, "model"), "v": P("model")}

  def tp_loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)

  params = {"w": jnp.ones((3, 4)), "v": jnp.ones(4)}
  params = {
    n: jax.device_put(a, NamedSharding(mesh, specs[n])) for n, a in params.items()
  }
  x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in data(7, batch=32))
  step = jaccum.data_parallel(
    jax.grad(tp_loss),
    2,
    mesh=mesh,
    batch_argnums=(1, 2),
    param_specs=specs,
    split="strided",
  )
  with pytest.raises(ValueError) as caught:
    jax.jit(step)(params, x, y, num_real_microbatches=jnp.asarray([2, 1, 0, 2]))
  message = str(caught.value)
  assert message.startswith("num_real_microbatches needs the per-device loop")
  assert "reduce_fn" not in message and "Contracting dimensions are sharded" in message


FOUR = 4  # devices of the routes that split the batch over devices


def _one_device(**options):
  return jaccum.accumulate(jax.grad(loss), K, batch_argnums=(1, 2), **options)


def _in_a_shard_map(**options):
  mesh = jax.make_mesh(
    (FOUR,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:FOUR]
  )
  inner = jaccum.accumulate(
    jax.grad(loss), K, batch_argnums=(1, 2), axis_name="data", **options
  )
  spread = jax.shard_map(
    lambda w, x, y, n: inner(w, x, y, num_real_microbatches=n),
    mesh=mesh,
    in_specs=(P(), P("data"), P("data"), P()),
    out_specs=P(),
  )
  return lambda w, x, y, num_real_microbatches: spread(w, x, y, num_real_microbatches)


def _data_parallel(**options):
  mesh = jax.make_mesh((FOUR,), ("data",), devices=jax.devices()[:FOUR])
  return jaccum.data_parallel(
    jax.grad(loss), K, mesh=mesh, batch_argnums=(1, 2), **options
  )


# route: its step, whose rows the split cuts, the rows n strided micro-batches hold
ROUTES = {
  "one device": (
    _one_device,
    "the whole batch",
    lambda n, size: first(n, np.arange(size)),
  ),
  "axis_name": (
    _in_a_shard_map,
    "each device's rows",
    lambda n, size: rows_that_ran([n] * FOUR, size),
  ),
  "data_parallel": (
    _data_parallel,
    "each device's rows",
    lambda n, size: rows_that_ran([n] * FOUR, size),
  ),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_count_with_the_split_left_out_is_refused_naming_both_splits(route):
  """The default strided split runs rows k, k + K, … of the first n
  micro-batches: a batch padded at its end lost real rows (25 of 40 summed)
  and kept padding, with no word."""
  make, whose, strided_rows = ROUTES[route]
  x, y = data(8, batch=FOUR * K * ROWS)
  with pytest.raises(ValueError) as caught:
    jax.jit(make())(W, x, y, num_real_microbatches=jnp.int32(5))
  message = str(caught.value)
  assert "num_real_microbatches" in message and "K=8" in message
  assert f"rows k, k + K, k + 2K, … of {whose}" in message  # what strided runs
  assert 'split="contiguous"' in message and "padded at its end" in message
  assert 'split="strided"' in message  # to keep the strided order
  # Named, the strided order runs as it did.
  named = jax.jit(make(split="strided"))(W, x, y, num_real_microbatches=jnp.int32(5))
  rows = strided_rows(5, len(x))
  assert_trees_close(named, jax.grad(loss)(W, x[rows], y[rows]), rtol=1e-5)


def test_deterministic_splits_contiguously_and_takes_a_count_unnamed():
  x, y = data(8)
  step = jaccum.accumulate(jax.grad(loss), K, batch_argnums=(1, 2), deterministic=True)
  assert_trees_close(
    jax.jit(step)(W, x, y, num_real_microbatches=jnp.int32(5)),
    jax.grad(loss)(W, x[: 5 * ROWS], y[: 5 * ROWS]),
    rtol=1e-5,
  )


def test_a_count_on_a_batch_accumulate_shards_points_at_what_runs_there():
  """There `split="contiguous"` with a count is refused (the first
  micro-batches live on the first devices): the message names the ways that
  work, a count per device with data_parallel or the strided rows."""
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])  # explicit
  x, y = data(9, batch=4 * K * ROWS)
  sharded = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y)]
  step = jax.jit(jaccum.accumulate(jax.grad(loss), K, batch_argnums=(1, 2)))
  with pytest.raises(ValueError) as caught:
    step(W, *sharded, num_real_microbatches=jnp.int32(5))
  message = str(caught.value)
  assert "rows k, k + K, k + 2K, … of the whole batch" in message
  assert "jaccum.data_parallel" in message and "count per device" in message
  assert 'split="strided"' in message and "modulo K" in message


def test_contiguous_on_a_batch_padded_at_its_end_is_the_real_rows_whole_batch():
  """40 real rows of a capacity of 64 (K=8 of 8 rows): the first 5
  micro-batches are the real rows, the padding (NaN) never runs. On devices,
  each device's rows are padded at their end and it runs its own count."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(10)
    w = jnp.asarray(W, jnp.float64)
    real = 40
    x, y = rng.normal(size=(real, DIM)), rng.normal(size=real)
    padded = [
      np.concatenate([a, np.full((64 - real, *a.shape[1:]), np.nan)]) for a in (x, y)
    ]
    step = jax.jit(
      jaccum.accumulate(jax.grad(loss), K, batch_argnums=(1, 2), split="contiguous")
    )
    expected = jax.grad(loss)(w, x, y)
    got = step(w, *padded, num_real_microbatches=jnp.int32(real // 8))
    assert_trees_close(got, expected, rtol=1e-12)
    # Four devices, 16 rows each (K=8 of 2): 16, 10, 0 and 14 real rows.
    mesh = jax.make_mesh((FOUR,), ("data",), devices=jax.devices()[:FOUR])
    counts = np.array([8, 5, 0, 7], np.int32)
    shards, real_rows = [[], []], [[], []]
    for n in counts:
      for i, a in enumerate((x, y)):
        rows = rng.normal(size=(2 * n, *a.shape[1:]))
        real_rows[i].append(rows)
        pad = np.full((16 - 2 * n, *a.shape[1:]), np.nan)
        shards[i].append(np.concatenate([rows, pad]))
    batch = [
      jax.device_put(np.concatenate(s), NamedSharding(mesh, P("data"))) for s in shards
    ]
    dp = jaccum.data_parallel(
      jax.grad(loss), K, mesh=mesh, batch_argnums=(1, 2), split="contiguous"
    )
    got = jax.jit(dp)(w, *batch, num_real_microbatches=jnp.asarray(counts))
    whole = [np.concatenate(r) for r in real_rows]
    assert_trees_close(got, jax.grad(loss)(w, *whole), rtol=1e-12)

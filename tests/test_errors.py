"""Every bad input to `accumulate` is a clear error that names what is wrong."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaccum


def loss(w, batch):
  return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


W = jnp.ones(3)
BATCH = {"x": jnp.ones((8, 3)), "y": jnp.ones(8)}


GRAD = jax.grad(loss)


def call(grad_fn=GRAD, num_microbatches=2, args=(W, BATCH), **kwargs):
  return jaccum.accumulate(grad_fn, num_microbatches, **kwargs)(*args)


@pytest.mark.parametrize(
  ("num_microbatches", "error"),
  [
    (0, ValueError),
    (-1, ValueError),
    (2.5, TypeError),
    (True, TypeError),
    ("2", TypeError),
  ],
)
def test_num_microbatches_must_be_a_positive_int(num_microbatches, error):
  with pytest.raises(error, match=r"num_microbatches must be a positive int"):
    jaccum.accumulate(jax.grad(loss), num_microbatches)


def test_num_microbatches_must_be_static():
  @jax.jit
  def step(num_microbatches):
    return jaccum.accumulate(jax.grad(loss), num_microbatches)

  with pytest.raises(TypeError, match=r"num_microbatches must be a static Python int"):
    step(2)


def test_numpy_integer_num_microbatches_is_fine():
  np.testing.assert_allclose(
    call(num_microbatches=np.int64(4)), jax.grad(loss)(W, BATCH)
  )


def test_batch_leaves_must_share_a_leading_size():
  batch = {"x": jnp.ones((8, 3)), "y": jnp.ones(6)}
  with pytest.raises(
    ValueError, match=r"args\[1\]\['x'\] has 8 rows but args\[1\]\['y'\] has 6"
  ):
    call(args=(W, batch))


def test_batch_size_must_be_divisible():
  batch = {"x": jnp.ones((10, 3)), "y": jnp.ones(10)}
  with pytest.raises(ValueError, match=r"batch_size=10.*num_microbatches=4.*\[2, 5\]"):
    call(num_microbatches=4, args=(W, batch))


def test_num_microbatches_cannot_exceed_batch_size():
  with pytest.raises(ValueError, match=r"num_microbatches=16 exceeds the batch size 8"):
    call(num_microbatches=16)


def test_batch_leaf_cannot_be_a_scalar():
  batch = {"x": jnp.ones((8, 3)), "y": jnp.ones(8), "scale": jnp.float32(2.0)}
  with pytest.raises(
    TypeError, match=r"args\[1\]\['scale'\] must have a leading batch axis"
  ):
    call(args=(W, batch))


def test_batch_leaf_must_be_an_array():
  batch = {"x": jnp.ones((8, 3)), "y": jnp.ones(8), "name": "digits"}
  with pytest.raises(TypeError, match=r"args\[1\]\['name'\] must be an array.*got str"):
    call(args=(W, batch))


@pytest.mark.parametrize("batch_argnums", [2, -3, (1, 5)])
def test_batch_argnums_must_be_in_range(batch_argnums):
  with pytest.raises(
    ValueError, match=r"batch_argnums=-?\d is out of range .* 2 positional"
  ):
    call(batch_argnums=batch_argnums)


@pytest.mark.parametrize("batch_argnums", ["1", 1.0, (), None])
def test_batch_argnums_must_be_ints(batch_argnums):
  with pytest.raises(TypeError, match=r"batch_argnums must be an int or a non-empty"):
    call(batch_argnums=batch_argnums)


def test_rng_argnum_cannot_overlap_the_batch():
  with pytest.raises(ValueError, match=r"rng_argnum=1 is also in batch_argnums"):
    call(rng_argnum=1)


def test_state_argnum_cannot_overlap_the_batch():
  with pytest.raises(ValueError, match=r"state_argnum=1 is also in batch_argnums"):
    call(state_argnum=-1)


def test_unknown_reduce_string():
  with pytest.raises(ValueError, match=r"reduce must be one of .* got 'avg'"):
    jaccum.accumulate(jax.grad(loss), 2, reduce="avg")
  with pytest.raises(ValueError, match=r"got 'mena' at reduce\['b'\]"):
    jaccum.accumulate(jax.grad(loss), 2, reduce={"a": "mean", "b": "mena"})


def test_reduce_tree_must_match_the_output():
  grad_fn = jax.value_and_grad(loss)
  with pytest.raises(
    ValueError, match=r"reduce=.* must be a reduction string or a pytree prefix"
  ):
    call(grad_fn, reduce={"loss": "mean", "grads": "mean"})
  with pytest.raises(ValueError, match=r"pytree prefix"):
    call(grad_fn, reduce=("mean", "mean", "mean"))


def test_mean_of_an_integer_leaf():
  def counts(w, batch):
    return {"correct": jnp.sum(batch["x"] > 0), "loss": loss(w, batch)}

  with pytest.raises(
    TypeError, match=r"\"mean\" needs a floating leaf.*output\['correct'\].*int32"
  ):
    call(counts)
  got = call(counts, reduce={"correct": "sum", "loss": "mean"})
  assert got["correct"] == 24


@pytest.mark.parametrize(
  ("weight", "error", "message"),
  [
    (
      lambda w, b: b["y"],
      ValueError,
      r"weight_fn must return a scalar, got shape \(4,\)",
    ),
    (lambda w, b: "tokens", TypeError, r"weight_fn must return a numeric scalar.*str"),
    (lambda w, b: None, TypeError, r"weight_fn must return a numeric scalar.*NoneType"),
    (lambda w, b: b["y"].sum() > 0, TypeError, r"numeric scalar"),
  ],
  ids=["vector", "string", "none", "bool"],
)
def test_weight_fn_must_return_a_numeric_scalar(weight, error, message):
  with pytest.raises(error, match=message):
    call(weight_fn=weight)


def test_weight_fn_must_be_callable():
  with pytest.raises(TypeError, match=r"weight_fn must be callable"):
    jaccum.accumulate(jax.grad(loss), 2, weight_fn=3)


@pytest.mark.parametrize("key", [jnp.zeros(2), jnp.zeros(2, jnp.int32), 0, "seed"])
def test_rng_argnum_must_point_at_a_key(key):
  def grad_fn(w, batch, key):
    return jax.grad(loss)(w, batch)

  with pytest.raises(TypeError, match=r"rng_argnum=2 must point at a PRNG key"):
    call(grad_fn, args=(W, BATCH, key), rng_argnum=2)


STATE = {"count": jnp.zeros((), jnp.int32), "ema": jnp.zeros(3)}


@pytest.mark.parametrize(
  ("returned", "message"),
  [
    (lambda g, s: g, r"must return \(out, new_state\)"),
    (lambda g, s: (g, s["ema"]), r"new_state with the structure of the state"),
    (
      lambda g, s: (g, {**s, "count": s["count"] + 1.0}),
      r"new_state\['count'\].*int32.*float32",
    ),
    (
      lambda g, s: (g, {**s, "ema": jnp.zeros(4)}),
      r"new_state\['ema'\].*\(3,\).*\(4,\)",
    ),
  ],
  ids=["no-tuple", "structure", "dtype", "shape"],
)
def test_state_argnum_needs_out_and_matching_state(returned, message):
  def grad_fn(w, state, batch):
    return returned(jax.grad(loss)(w, batch), state)

  with pytest.raises(TypeError, match=message):
    call(grad_fn, args=(W, STATE, BATCH), batch_argnums=2, state_argnum=1)


def test_unknown_split():
  with pytest.raises(ValueError, match=r"split must be one of .* got 'random'"):
    jaccum.accumulate(jax.grad(loss), 2, split="random")
  with pytest.raises(ValueError, match=r"split must be one of"):
    jaccum.split_microbatches(BATCH, 2, split="interleaved")


@pytest.mark.parametrize("accum_dtype", [jnp.int32, jnp.bool_, "int8", "nonsense"])
def test_accum_dtype_must_be_floating(accum_dtype):
  with pytest.raises(TypeError, match=r"accum_dtype must be a floating dtype"):
    jaccum.accumulate(jax.grad(loss), 2, accum_dtype=accum_dtype)


def test_concat_needs_per_example_outputs():
  with pytest.raises(
    TypeError, match=r"\"concat\" needs per-example outputs.*output is a scalar"
  ):
    call(loss, reduce="concat")


def test_split_microbatches_checks_like_accumulate():
  with pytest.raises(ValueError, match=r"batch_size=8 .* num_microbatches=3"):
    jaccum.split_microbatches(BATCH, 3)


def test_a_batch_passed_first_is_met_with_the_batch_argnums_hint():
  """loss(batch, params), default batch_argnums=1: say which option split what."""
  swapped = jax.grad(lambda batch, w: loss(w, batch), argnums=1)
  with pytest.raises(
    ValueError, match=r"args\[1\] is the batch because batch_argnums=1 \(the default\)"
  ):
    jaccum.accumulate(swapped, 2)(BATCH, W)
  got = jaccum.accumulate(swapped, 2, batch_argnums=0)(BATCH, W)
  np.testing.assert_allclose(got, GRAD(W, BATCH), rtol=1e-6)


def test_param_specs_sharding_a_dimension_the_devices_do_not_divide():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  step = jaccum.data_parallel(GRAD, 1, mesh=mesh, param_specs=jax.P("data"))
  batch = jax.tree.map(lambda x: jnp.tile(x, (8,) + (1,) * (x.ndim - 1)), BATCH)
  with pytest.raises(
    ValueError, match=r"shards dimension 0 of size 3 over the 8 devices.*P\(\)"
  ):
    jax.jit(step)(W, batch)


def test_axis_name_of_a_vmap_accumulates_per_instance_then_combines():
  """Under jax.vmap(axis_name=...) each instance accumulates, then one psum."""
  batches = jax.tree.map(lambda x: jnp.stack([x, 2 * x, 3 * x, x + 1]), BATCH)
  accumulated = jaccum.accumulate(GRAD, 2, axis_name="i")
  got = jax.vmap(accumulated, in_axes=(None, 0), axis_name="i")(W, batches)
  whole = GRAD(W, jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batches))
  np.testing.assert_allclose(got, jnp.broadcast_to(whole, got.shape), rtol=1e-6)

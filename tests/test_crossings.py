"""Where two options meet: each crossing a user found wrong, now exact or refused.

Every test here failed before the fix it names (issue 28, section 1): a
count of real micro-batches with FSDP's sharded modes, devices with
different counts and in-loop reduce-scatters, bf16 on the wire with those
modes, `reduce_fn`'s return value and state, an int64 count, and the
warnings' source lines. References are the whole-batch gradient of the rows
that ran, computed independently.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaccum
import jaccum.inspect

DEVICES, K, ROWS = 8, 4, 4  # devices, micro-batches per device, rows of each
SHARDED_MODES = ["shard_grads", "shard_all"]
MODES = ["gather_once", *SHARDED_MODES]


def loss(params, x):
  h = jnp.tanh(x @ params["w"] + params["b"])
  return jnp.mean((h @ params["v"]) ** 2)


def problem(seed=0):
  rng = np.random.default_rng(seed)
  params = {
    "w": jnp.asarray(rng.normal(size=(8, 16)) / 3, jnp.float32),
    "b": jnp.asarray(rng.normal(size=16) / 3, jnp.float32),
    "v": jnp.asarray(rng.normal(size=(16, 4)) / 4, jnp.float32),
  }
  x = jnp.asarray(rng.normal(size=(DEVICES * K * ROWS, 8)), jnp.float32)
  specs = {"w": P(None, "data"), "b": P("data"), "v": P("data")}
  return params, x, specs


def auto_mesh():
  return jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))


def rows_that_ran(x, counts):
  """Device d's first counts[d] strided micro-batches of its own rows."""
  shards = np.split(np.asarray(x), DEVICES)
  kept = [
    shard.reshape(-1, K, shard.shape[-1])[:, :n].reshape(-1, shard.shape[-1])
    for shard, n in zip(shards, counts, strict=True)
  ]
  return np.concatenate(kept)


def fsdp_step(mode, specs, **options):
  return jax.jit(
    jaccum.data_parallel(
      jax.grad(loss), K, mesh=auto_mesh(), param_specs=specs, fsdp_mode=mode, **options
    )
  )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("count", [1, 3, K])
def test_a_count_with_every_fsdp_mode_is_the_gradient_of_the_rows_that_ran(mode, count):
  """Item 1: the sharded modes returned 1/ROWS of it (0.25x here), for any n."""
  params, x, specs = problem()
  step = fsdp_step(mode, specs, split="strided")
  grads = step(params, x, num_real_microbatches=jnp.int32(count))
  expected = jax.grad(loss)(params, rows_that_ran(x, [count] * DEVICES))
  assert_trees_close(grads, expected, rtol=2e-6)


@pytest.mark.parametrize("mode", MODES)
def test_devices_with_different_counts_join_the_scatters_and_are_exact(mode):
  """Item 2: the sharded modes ran a different number of reduce-scatters per
  device, and XLA aborted waiting for the idle ones. Devices with fewer (or
  no) micro-batches now join every collective with zeros."""
  params, x, specs = problem(1)
  counts = [3, 1, 4, 0, 2, 4, 4, 1]
  grads = fsdp_step(mode, specs, return_stats=True, split="strided")(
    params, x, num_real_microbatches=jnp.asarray(counts, jnp.int32)
  )
  grads, stats = grads
  expected = jax.grad(loss)(params, rows_that_ran(x, counts))
  assert_trees_close(grads, expected, rtol=2e-6)
  # Padding micro-batches count for nothing in the noise scale either.
  assert float(stats.total_weight) == sum(counts) * ROWS
  assert float(stats.microbatch_weight) == ROWS


def test_a_nan_in_a_padding_micro_batch_of_an_idle_device_stays_out():
  """A micro-batch that only keeps devices in step weighs 0, even if it is NaN."""
  params, x, specs = problem(2)
  counts = [4, 4, 4, 4, 4, 4, 4, 0]
  x = x.at[-K * ROWS :].set(jnp.nan)  # the last device's rows: all padding
  grads = fsdp_step("shard_all", specs, split="strided")(
    params, x, num_real_microbatches=jnp.asarray(counts, jnp.int32)
  )
  expected = jax.grad(loss)(params, rows_that_ran(x, counts))
  assert_trees_close(grads, expected, rtol=2e-6)


def test_per_device_counts_and_grad_fns_own_collectives_are_refused():
  """Synchronised statistics would mix an idle device's padding rows in."""

  def synced(params, x):
    centre = jax.lax.pmean(jnp.mean(x, axis=0), "data")
    return loss(params, x - centre)

  params, x, _ = problem()
  step = jax.jit(
    jaccum.data_parallel(jax.grad(synced), K, mesh=auto_mesh(), split="strided")
  )
  with pytest.raises(ValueError, match=r"num_real_microbatches.*communicates.*data"):
    step(params, x, num_real_microbatches=jnp.arange(DEVICES) % (K + 1))
  # One count for every device keeps them in step: exact as a static K.
  step(params, x, num_real_microbatches=jnp.int32(2))


def scatter_dtypes(step, *args):
  """The dtypes the reduce-scatters send, read from the program before XLA
  optimises it (XLA:CPU widens a bf16 collective when it compiles; the wire
  a GPU or TPU sends is the lowered one)."""
  lowered = step.lower(*args).as_text(dialect="hlo")
  return re.findall(r"= (\w+)\[[^\]]*\]\S* reduce-scatter\(", lowered)


@pytest.mark.parametrize("mode", SHARDED_MODES)
def test_bf16_on_the_wire_narrows_the_in_loop_reduce_scatters(mode):
  """Item 3: reduce_dtype was silently ignored by the sharded modes."""
  params, x, specs = problem(3)
  exact_step = fsdp_step(mode, specs)
  step = fsdp_step(mode, specs, reduce_dtype=jnp.bfloat16)
  # One reduce-scatter per param, each micro-step.
  assert set(scatter_dtypes(exact_step, params, x)) == {"f32"}
  assert set(scatter_dtypes(step, params, x)) == {"bf16"}
  exact, grads = exact_step(params, x), step(params, x)
  # Summed in float32 across micro-batches; each scatter rounds to bf16 once.
  assert_trees_close(grads, exact, rtol=2**-7)
  assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(
    lambda g: g.dtype, exact
  )


def test_reduce_fn_and_reduce_dtype_are_refused_together():
  with pytest.raises(ValueError, match=r"reduce_fn and reduce_dtype"):
    jaccum.data_parallel(
      jax.grad(loss), K, reduce_fn=jaccum.PowerSGD(), reduce_dtype=jnp.bfloat16
    )


def vector_problem():
  """A gradient that is one array of leading size 2: unpacks as two rows."""
  w = jnp.asarray([0.5, -1.5])
  x = jnp.asarray(np.random.default_rng(4).normal(size=(DEVICES * K, 2)), jnp.float32)
  return (lambda w, x: jnp.mean((x @ w) ** 2)), w, x


@pytest.mark.parametrize(
  ("returned", "message"),
  [
    (lambda g, axes, s: jax.lax.psum(g, axes), r"got an array of shape \(2,\)"),
    (lambda g, axes, s: {"grads": g, "state": s}, r"got dict"),
    (lambda g, axes, s: (jax.lax.psum(g, axes)[:1], s), r"reduced_grads is"),
    (lambda g, axes, s: (jax.lax.psum(g, axes), ()), r"new_state is"),
  ],
)
def test_what_reduce_fn_returns_is_checked_against_what_it_got(returned, message):
  """Items 4 and 5: forgetting the state unpacked the gradient's two rows."""
  vector_loss, w, x = vector_problem()
  step = jax.jit(
    jaccum.data_parallel(jax.grad(vector_loss), K, mesh=auto_mesh(), reduce_fn=returned)
  )
  with pytest.raises(
    TypeError, match=r"must return a pair \(reduced_grads, new_sta.*" + message
  ):
    step(w, x, reduce_state=None)


def test_powersgd_without_its_state_says_how_to_make_it():
  params, x, _ = problem()
  step = jax.jit(
    jaccum.data_parallel(
      jax.grad(loss), K, mesh=auto_mesh(), reduce_fn=jaccum.PowerSGD()
    )
  )
  with pytest.raises(TypeError, match=r"PowerSGD needs its state.*init"):
    step(params, x)


def test_a_powersgd_state_for_other_devices_is_named():
  params, x, _ = problem()
  powersgd = jaccum.PowerSGD(rank=2, min_compression=1)
  step = jax.jit(
    jaccum.data_parallel(jax.grad(loss), K, mesh=auto_mesh(), reduce_fn=powersgd)
  )
  with pytest.raises(ValueError, match=r"reduce_state\.q\['v'\] has shape \(4, .*8"):
    step(params, x, reduce_state=powersgd.init(params, num_devices=4))
  _, state = step(params, x, reduce_state=powersgd.init(params, num_devices=DEVICES))
  assert state.q["w"].shape == (DEVICES, 16, 2)


def test_a_traced_int64_count_above_int32_is_clamped_to_k():
  """Item 7: it was cast to int32 first, wrapping 2**32 + 1 to 1."""
  w = jnp.asarray([0.3, -0.7])
  x = jnp.asarray(np.random.default_rng(5).normal(size=(16, 2)))
  vector_loss = lambda w, x: jnp.mean((x @ w) ** 2)
  with jax.enable_x64(True):
    step = jax.jit(jaccum.accumulate(jax.grad(vector_loss), 4, split="strided"))
    w64, x64 = w.astype(jnp.float64), x.astype(jnp.float64)
    for count, ran in [(2**32 + 1, 4), (2**31, 4), (-(2**32) + 1, 0), (3, 3)]:
      got = step(w64, x64, num_real_microbatches=jnp.int64(count))
      expected = (
        jax.grad(vector_loss)(w64, x64.reshape(-1, 4, 2)[:, :ran].reshape(-1, 2))
        if ran
        else jnp.zeros(2, jnp.float64)
      )
      assert_trees_close(got, expected, rtol=1e-12)


def test_an_eager_count_outside_zero_to_k_is_an_error_and_a_jitted_one_is_clamped():
  """What the docstring says now: concrete counts are checked, traced ones
  (every count under jit) are clamped to [0, K]."""
  w = jnp.asarray([0.3, -0.7])
  x = jnp.asarray(np.random.default_rng(6).normal(size=(16, 2)), jnp.float32)
  vector_loss = lambda w, x: jnp.mean((x @ w) ** 2)
  grad_fn = jaccum.accumulate(jax.grad(vector_loss), 4, split="strided")
  with pytest.raises(ValueError, match=r"must be in \[0, num_microbatches=4\]"):
    grad_fn(w, x, num_real_microbatches=-1)
  zeros = jax.jit(grad_fn)(w, x, num_real_microbatches=-1)
  assert np.array_equal(zeros, np.zeros(2, np.float32))
  assert "a traced count (any count under `jit`)" in " ".join(
    jaccum.accumulate.__doc__.split()
  )


def test_nnx_warns_about_averaged_per_example_outputs_at_the_users_line():
  """Item 12: the warning pointed at jaccum's own file."""
  from flax import nnx

  import jaccum.nnx

  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

  def loss_fn(model, x):
    logits = model(x)
    return jnp.mean(logits**2), logits

  x = jnp.ones((8, 3))
  step = jaccum.nnx.value_and_grad(loss_fn, 4, has_aux=True)
  with pytest.warns(UserWarning, match=r"averaged over micro-batches") as record:
    step(model, x)
  assert [w.filename for w in record] == [__file__]


def test_a_bare_spec_constraint_runs_per_device():
  """Item 9, then issue 36 item 3. JAX resolves a bare P against the mesh in
  context, whose data axes are manual inside the per-device loop, and
  refuses it there. jaccum traces grad_fn outside the loop, where the spec
  resolves against the mesh, and runs its program per device with the data
  axes taken out of the constraint, as for a NamedSharding: no warning, no
  collective inside the loop, exact. Before, the step ran as the whole
  batch does, with a warning."""
  mesh = auto_mesh()
  params, x, _ = problem(7)

  def constrained(sharding):
    def loss_with_constraint(params, x):
      h = jnp.tanh(x @ params["w"] + params["b"])
      h = jax.lax.with_sharding_constraint(h, sharding)
      return jnp.mean((h @ params["v"]) ** 2)

    return loss_with_constraint

  expected = jax.grad(loss)(params, x)
  with jax.set_mesh(mesh):
    for sharding in (P("data", None), NamedSharding(mesh, P("data", None))):
      step = jax.jit(jaccum.data_parallel(jax.grad(constrained(sharding)), K))
      with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = step(params, x)
      assert jaccum.inspect.collectives(step, params, x).inside_loops == 0
      assert_trees_close(grads, expected, rtol=2e-6)

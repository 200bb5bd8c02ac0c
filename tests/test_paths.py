"""Every way users reach their params, on every path: exact, or a clear refusal.

The reference is always the plain whole-batch gradient on one device. Cases
come from an adversarial sweep: params by closure, `functools.partial` and
keyword; `data_parallel`, `accumulate(axis_name=...)` inside the user's own
`shard_map`, plain `accumulate` under `jit` on an explicit mesh, `pmap`; auto
and explicit meshes.
"""

import functools
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

DEVICES = 8


def loss(w, x):
  return jnp.mean(jnp.tanh(x @ w) ** 2)


W = jnp.linspace(-1, 1, 4)
X = jax.random.normal(jax.random.key(0), (64, 4))
WHOLE = jax.grad(loss)(W, X)


def mesh_of(kind):
  return jax.make_mesh((DEVICES,), ("data",), axis_types=(kind,))


def sharded(mesh, x):
  return jax.device_put(x, NamedSharding(mesh, P("data")))


# Each style: (grad_fn, keyword arguments of the call).
STYLES = {
  "positional": lambda w: (jax.grad(loss, argnums=0), {}),
  "closure": lambda w: (lambda x: jax.grad(loss)(w, x), {}),
  "partial": lambda w: (functools.partial(jax.grad(loss), w), {}),
  "keyword": lambda w: (lambda x, *, w: jax.grad(loss)(w, x), {"w": w}),
}


def call(style, fn, x, kwargs, w):
  """Calls an accumulated grad_fn the way each style's user would."""
  return fn(w, x) if style == "positional" else fn(x, **kwargs)


def batch_argnum(style):
  return 1 if style == "positional" else 0


@pytest.mark.parametrize(
  "kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
@pytest.mark.parametrize("style", list(STYLES))
def test_data_parallel_is_exact_and_collective_free_however_params_arrive(kind, style):
  mesh = mesh_of(kind)
  grad_fn, kwargs = STYLES[style](W)
  step = jax.jit(
    lambda p, x, **kw: call(
      style,
      jaccum.data_parallel(grad_fn, 2, mesh=mesh, batch_argnums=batch_argnum(style)),
      x,
      kw,
      p,
    )
  )
  x = sharded(mesh, X)
  assert_trees_close(step(W, x, **kwargs), WHOLE, rtol=1e-5)
  counts = jaccum.inspect.collectives(step, W, x, **kwargs)
  assert counts.inside_loops == 0, counts
  assert counts.all_reduce.outside_loops == 1, counts


@pytest.mark.parametrize("style", list(STYLES))
def test_plain_jit_on_an_explicit_mesh_is_exact_however_params_arrive(style):
  mesh = mesh_of(AxisType.Explicit)
  grad_fn, kwargs = STYLES[style](W)
  accumulated = jaccum.accumulate(grad_fn, 2, batch_argnums=batch_argnum(style))
  step = jax.jit(lambda p, x, **kw: call(style, accumulated, x, kw, p))
  x = sharded(mesh, X)
  assert_trees_close(step(W, x, **kwargs), WHOLE, rtol=1e-5)
  assert jaccum.inspect.collectives(step, W, x, **kwargs).inside_loops == 0


@pytest.mark.parametrize(
  "kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
@pytest.mark.parametrize("style", ["positional", "partial", "keyword"])
def test_inside_a_users_shard_map_arguments_partial_and_keywords_are_exact(kind, style):
  mesh = mesh_of(kind)

  def body(w, x):
    grad_fn, kwargs = STYLES[style](w)
    accumulated = jaccum.accumulate(
      grad_fn, 2, batch_argnums=batch_argnum(style), axis_name="data"
    )
    return call(style, accumulated, x, kwargs, w)

  step = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  )
  x = sharded(mesh, X)
  assert_trees_close(step(W, x), WHOLE, rtol=1e-5)
  counts = jaccum.inspect.collectives(step, W, x)
  assert counts.inside_loops == 0 and counts.all_reduce.outside_loops == 1, counts


@pytest.mark.parametrize(
  "kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
def test_inside_a_users_shard_map_a_differentiated_closure_is_refused(kind):
  """JAX sums a closed-over param's gradient in every micro-step: say so."""
  mesh = mesh_of(kind)

  def body(x):
    return jaccum.accumulate(
      lambda x: jax.grad(loss)(W, x), 2, batch_argnums=0, axis_name="data"
    )(x)

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))
  with pytest.raises(
    ValueError, match=r"closed over: float32\[4\].*Pass these arrays .* as arguments"
  ):
    step(sharded(mesh, X))


def test_a_closure_not_differentiated_inside_shard_map_is_fine():
  """A closed-over constant (no gradient taken) is no reason to refuse."""
  mesh = mesh_of(AxisType.Auto)
  scale = jnp.float32(3.0)

  def body(w, x):
    return jaccum.accumulate(
      lambda w, x: jax.grad(lambda w: scale * loss(w, x))(w), 2, axis_name="data"
    )(w, x)

  step = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  )
  assert_trees_close(step(W, sharded(mesh, X)), 3 * WHOLE, rtol=1e-5)


@pytest.mark.parametrize("style", list(STYLES))
def test_pmap_is_exact_however_params_arrive(style):
  grad_fn, kwargs = STYLES[style](W)
  accumulated = jaccum.accumulate(
    grad_fn, 2, batch_argnums=batch_argnum(style), axis_name="devices"
  )
  pmapped = jax.pmap(
    lambda w, x: call(style, accumulated, x, kwargs, w),
    axis_name="devices",
    in_axes=(None, 0),
  )
  got = pmapped(W, X.reshape(DEVICES, -1, 4))
  assert_trees_close(got[0], WHOLE, rtol=1e-5)


# Plain accumulate on an explicit mesh means what it means unsharded.


def test_explicit_route_returns_the_unsharded_result_for_every_reduction():
  mesh = mesh_of(AxisType.Explicit)

  def fn(w, x):
    per_example = jnp.tanh(x @ w)
    return {
      "grad": jax.grad(loss)(w, x),
      "rows": per_example,
      "last_rows": x,
      "max": per_example.max(),
      "min": per_example.min(),
      "count": jnp.sum(per_example > 0),
      "all_positive": jnp.all(per_example > -2.0),
    }

  reduce = {
    "grad": "mean",
    "rows": "concat",
    "last_rows": "last",
    "max": "max",
    "min": "min",
    "count": "sum",
    "all_positive": "min",
  }
  accumulated = jax.jit(jaccum.accumulate(fn, 4, reduce=reduce))
  unsharded = accumulated(W, X)
  got = accumulated(W, sharded(mesh, X))
  assert_trees_close(got, unsharded, rtol=1e-6)
  np.testing.assert_array_equal(got["last_rows"], X[3::4])
  np.testing.assert_allclose(got["rows"], jnp.tanh(X @ W), rtol=1e-6)


def test_explicit_route_refuses_what_it_cannot_reproduce():
  mesh = mesh_of(AxisType.Explicit)
  x = sharded(mesh, X)
  # 64 rows, 16 micro-batches: 4 rows each cannot be shared by 8 devices.
  with pytest.raises(
    ValueError, match=r"batch_size=64 must be divisible by devices × num_microbatches"
  ):
    jax.jit(jaccum.accumulate(jax.grad(loss), 16))(W, x)
  with pytest.raises(ValueError, match=r'reduce="last" .*needs one row per example'):
    jax.jit(jaccum.accumulate(lambda w, x: x[0, 0], 2, reduce="last"))(W, x)
  with pytest.raises(ValueError, match=r'split="contiguous".*last contiguous'):
    jax.jit(jaccum.accumulate(lambda w, x: x, 2, reduce="last", split="contiguous"))(
      W, x
    )


def batchnorm_like(w, state, x):
  """A cross-example statistic threaded as state, and a gradient that uses it."""
  centred = x - x.mean(0)
  new_state = 0.9 * state + 0.1 * x.mean()
  return jax.grad(lambda w: jnp.mean(jnp.tanh(centred @ w) ** 2))(w), new_state


def test_explicit_route_with_state_warns_and_means_per_device_statistics():
  mesh = mesh_of(AxisType.Explicit)
  x = sharded(mesh, X)
  state = jnp.float32(0.0)
  with pytest.warns(UserWarning, match=r"per-device statistics"):
    got = jax.jit(
      jaccum.accumulate(batchnorm_like, 2, batch_argnums=2, state_argnum=1)
    )(W, state, x)
  expected = jax.jit(
    jaccum.data_parallel(batchnorm_like, 2, mesh=mesh, batch_argnums=2, state_argnum=1)
  )(W, state, x)
  assert_trees_close(got, expected, rtol=1e-6)
  # Per device: each device's rows, strided, then averaged over devices.
  blocks = np.asarray(X).reshape(DEVICES, -1, 4)
  finals = []
  for rows in blocks:
    s = 0.0
    for k in range(2):
      s = 0.9 * s + 0.1 * rows[k::2].mean()
    finals.append(s)
  np.testing.assert_allclose(got[1], np.mean(finals), rtol=1e-5)


def test_explicit_route_handles_static_args_set_mesh_arrays_and_sharded_params():
  mesh = mesh_of(AxisType.Explicit)
  with jax.set_mesh(mesh):
    w = jnp.linspace(-1, 1, 4)  # typed on the explicit mesh
    x = sharded(mesh, X)

    def grad_fn(w, x, how, *, bias):
      assert how == "tanh"
      return jax.grad(lambda w: loss(w, x) + jnp.sum(bias * w))(w)

    accumulated = jax.jit(
      jaccum.accumulate(grad_fn, 2), static_argnums=2
    )  # a static string argument, passed through
    expected = WHOLE + 0.5
    assert_trees_close(
      accumulated(w, x, "tanh", bias=jnp.float32(0.5)), expected, rtol=1e-5
    )
    # JAX's shard_map cannot close over arrays placed on an explicit mesh:
    # jaccum traces the function outside it and passes them in, so the loop
    # still runs per device, with no warning and no collective inside it.
    closure = jax.jit(
      jaccum.accumulate(lambda x: jax.grad(loss)(w, x), 2, batch_argnums=0)
    )
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      assert_trees_close(closure(x), WHOLE, rtol=1e-5)
    assert jaccum.inspect.collectives(closure, x).inside_loops == 0
    # Params sharded over the data axis are gathered once, before the loop.
    w_sharded = jax.device_put(jnp.linspace(-1, 1, 8), NamedSharding(mesh, P("data")))
    x8 = sharded(mesh, jax.random.normal(jax.random.key(1), (64, 8)))
    step = jax.jit(jaccum.accumulate(jax.grad(loss), 2))
    assert_trees_close(
      step(w_sharded, x8),
      jax.grad(loss)(np.asarray(w_sharded), np.asarray(x8)),
      rtol=1e-5,
    )
    assert step(w_sharded, x8).sharding.spec == P("data")
    assert jaccum.inspect.collectives(step, w_sharded, x8).inside_loops == 0


def test_a_replicated_batch_leaf_follows_the_sharded_one():
  """One leaf sharded over "data", one replicated: still no collective in the loop."""
  mesh = mesh_of(AxisType.Explicit)
  y = jax.random.normal(jax.random.key(2), (64,))

  def mse(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

  step = jax.jit(jaccum.accumulate(jax.grad(mse), 2, batch_argnums=(1, 2)))
  x = sharded(mesh, X)
  y_replicated = jax.device_put(y, NamedSharding(mesh, P()))
  assert_trees_close(step(W, x, y_replicated), jax.grad(mse)(W, X, y), rtol=1e-5)
  assert jaccum.inspect.collectives(step, W, x, y_replicated).inside_loops == 0


# What data_parallel accepts, and what it refuses clearly.


def test_data_parallel_passes_static_arguments_and_keys_in_state():
  mesh = mesh_of(AxisType.Explicit)

  def fn(w, state, x, activation):
    key, count, flag = state
    noise = jax.random.normal(key, ())
    grads = jax.grad(lambda w: jnp.mean(getattr(jnp, activation)(x @ w) ** 2))(w)
    return (grads, noise), (key, count + 1, flag & True)

  state = (jax.random.key(3), jnp.int32(0), jnp.bool_(True))
  step = jax.jit(
    jaccum.data_parallel(fn, 2, mesh=mesh, batch_argnums=2, state_argnum=1),
    static_argnums=3,
  )
  (grads, _), (key, count, flag) = step(W, state, sharded(mesh, X), "tanh")
  assert_trees_close(grads, WHOLE, rtol=1e-5)
  # Keys in threaded state are folded with the device index (each device draws
  # its own numbers); a key the loop leaves unchanged comes back unchanged.
  np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(state[0]))
  assert int(count) == 2 and bool(flag)


def test_data_parallel_errors_name_the_problem():
  mesh = mesh_of(AxisType.Explicit)
  x = sharded(mesh, X)
  params = {"w": W}
  dict_loss = lambda p, x: loss(p["w"], x)
  with pytest.raises(ValueError, match=r'reduce="last" at output.*needs one row per'):
    jax.jit(jaccum.data_parallel(lambda w, x: loss(w, x), 2, mesh=mesh, reduce="last"))(
      W, x
    )
  with pytest.raises(
    ValueError, match=r"param_specs must be a PartitionSpec or a pytree prefix"
  ):
    jaccum.data_parallel(jax.grad(dict_loss), 2, mesh=mesh, param_specs={"v": P()})(
      params, x
    )
  with pytest.raises(
    ValueError, match=r"params, which must be argument 0.*is the batch"
  ):
    jaccum.data_parallel(
      lambda x, p: jax.grad(dict_loss)(p, x),
      2,
      mesh=mesh,
      batch_argnums=0,
      param_specs={"w": P("data")},
    )(x, params)
  # A spec naming another mesh axis (tensor parallel) is kept, not refused.
  model_mesh = jax.make_mesh((4, 2), ("data", "model"))
  grads = jaccum.data_parallel(
    jax.grad(dict_loss), 2, mesh=model_mesh, param_specs={"w": P("model")}
  )(params, jax.device_put(X, NamedSharding(model_mesh, P("data"))))
  assert grads["w"].sharding.spec == P("model")
  assert_trees_close(grads["w"], WHOLE, rtol=1e-5)


def test_fsdp_marks_gradients_by_position_not_by_shape():
  """A per-parameter max |grad| shaped like the params stays whole and replicated."""
  mesh = mesh_of(AxisType.Auto)
  params = {"w": jax.random.normal(jax.random.key(4), (4, 8))}

  def fn(p, x):
    grads = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(p)
    return grads, jax.tree.map(jnp.abs, grads)

  step = jax.jit(
    jaccum.data_parallel(
      fn, 2, mesh=mesh, reduce=("mean", "max"), param_specs={"w": P(None, "data")}
    )
  )
  p = {"w": jax.device_put(params["w"], NamedSharding(mesh, P(None, "data")))}
  grads, amax = step(p, sharded(mesh, X))
  assert grads["w"].shape == amax["w"].shape == (4, 8)
  assert grads["w"].sharding.spec == P(None, "data")
  assert_trees_close(grads, fn(params, X)[0], rtol=1e-5)


# Inputs that used to fail obscurely.


def test_python_scalar_and_float0_outputs():
  int_loss = lambda w, n, x: jnp.mean(jnp.tanh(x @ w) ** 2) * n
  grad_fn = jax.grad(int_loss, argnums=(0, 1), allow_int=True)
  n = jnp.int32(2)
  got = jax.jit(jaccum.accumulate(grad_fn, 4, batch_argnums=2))(W, n, X)
  expected = grad_fn(W, n, X)
  assert_trees_close(got[0], expected[0], rtol=1e-5)
  assert got[1].dtype == jax.dtypes.float0 and got[1].shape == ()
  constant = jaccum.accumulate(lambda w, x: (jax.grad(loss)(w, x), 1.5), 4)(W, X)
  assert float(constant[1]) == 1.5


def test_narrow_leaves_with_large_weights_stay_finite():
  """Token counts of 30,000 must not meet float16 or bfloat16 arithmetic."""
  x = jax.random.normal(jax.random.key(5), (8, 4))
  tokens = jnp.array([30000.0, 1.0, 29000.0, 2.0, 31000.0, 5.0, 30500.0, 7.0])

  def weighted(w, x, tokens):
    return jax.grad(lambda w: jnp.sum(tokens * jnp.tanh(x @ w) ** 2) / tokens.sum())(w)

  with jax.enable_x64(True):
    expected = weighted(
      W.astype(jnp.float64), x.astype(jnp.float64), tokens.astype(jnp.float64)
    )
  for dtype in (jnp.float16, jnp.bfloat16):
    got = jaccum.accumulate(
      lambda w, x, t, dtype=dtype: weighted(w, x, t).astype(dtype),
      4,
      batch_argnums=(1, 2),
      accum_dtype=None,
      weight_fn=lambda w, x, t: t.sum(),
    )(W, x, tokens)
    assert got.dtype == dtype and bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(
      np.asarray(got, np.float64), expected, rtol=2e-2, atol=1e-3
    )


def test_errors_for_bad_calls_name_the_argument():
  with pytest.raises(
    TypeError, match=r"weight_fn receives every positional argument.*2 arguments"
  ):
    jaccum.accumulate(jax.grad(loss), 2, weight_fn=lambda x: 1.0)(W, X)
  with pytest.raises(
    ValueError, match=r"axis_name='data' is not bound here.*data_parallel"
  ):
    jax.jit(jaccum.accumulate(jax.grad(loss), 2, axis_name="data"))(W, X)
  with pytest.raises(TypeError, match=r"unroll must be a positive int or a bool.*'x'"):
    jaccum.accumulate(jax.grad(loss), 2, unroll="x")
  with pytest.raises(ValueError, match=r"Keyword arguments \(x\) are never split"):
    jaccum.accumulate(lambda w, *, x: jax.grad(loss)(w, x), 2)(W, x=X)


def count_traces(make_step, *args):
  """How often the loss's Python runs while one step is traced and compiled."""
  traces = []

  def counted_loss(w, x):
    traces.append(None)
    return loss(w, x)

  jax.jit(make_step(jax.value_and_grad(counted_loss))).lower(*args).compile()
  return len(traces)


@pytest.mark.parametrize(
  "kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
def test_the_loss_is_traced_at_most_twice_on_every_path(kind):
  mesh = mesh_of(kind)
  x = sharded(mesh, X)
  w8 = jnp.ones((4, 8))
  x8 = x
  assert count_traces(lambda f: jaccum.accumulate(f, 4), W, X) == 1
  assert count_traces(lambda f: jaccum.data_parallel(f, 2, mesh=mesh), W, x) == 1
  fsdp = lambda f: jaccum.data_parallel(f, 2, mesh=mesh, param_specs=P(None, "data"))
  w_sharded = jax.device_put(w8, NamedSharding(mesh, P(None, "data")))
  assert count_traces(fsdp, w_sharded, x8) == 1
  if kind == AxisType.Explicit:
    assert count_traces(lambda f: jaccum.accumulate(f, 2), W, x) == 1


def test_no_warnings_on_the_common_paths():
  mesh = mesh_of(AxisType.Explicit)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.jit(jaccum.accumulate(jax.value_and_grad(loss), 2))(W, sharded(mesh, X))
    jax.jit(jaccum.data_parallel(jax.grad(loss), 2, mesh=mesh))(W, sharded(mesh, X))


# The quiet fallbacks of the sharded route (what jaccum can and cannot see).


def test_custom_vjp_with_a_fresh_constant_cotangent_works_under_data_parallel():
  @jax.custom_vjp
  def scaled(w, x):
    return x @ w

  scaled.defvjp(
    lambda w, x: (x @ w, x),
    # The cotangent for x is a fresh constant, the same on every device.
    lambda x, g: (x.T @ g, jnp.zeros(x.shape)),
  )
  custom_loss = lambda w, x: jnp.mean(jnp.tanh(scaled(w, x)) ** 2)
  for kind in (AxisType.Auto, AxisType.Explicit):
    mesh = mesh_of(kind)
    step = jax.jit(jaccum.data_parallel(jax.grad(custom_loss), 2, mesh=mesh))
    assert_trees_close(
      step(W, sharded(mesh, X)), jax.grad(custom_loss)(W, X), rtol=1e-5
    )


def test_split_microbatches_names_rows_devices_and_what_works():
  x = sharded(mesh_of(AxisType.Explicit), X)
  with pytest.raises(
    ValueError,
    match=r"N=64 rows sharded over 8 devices.*num_microbatches=16.*\[2, 4, 8\]",
  ):
    jaccum.split_microbatches(x, 16)
  assert jaccum.split_microbatches(x, 8).shape == (8, 8, 4)


def test_a_list_of_per_example_arrays_warns():
  examples = [X[i] for i in range(8)]  # eight rows of shape (4,)
  with pytest.warns(UserWarning, match=r"list of 8 arrays of shape \(4,\).*jnp.stack"):
    jaccum.split_microbatches(examples, 2)


def test_a_sharding_given_only_by_in_shardings_is_invisible_to_accumulate():
  """Documented: the traced batch carries no sharding, so accumulate runs the
  loop as on one device (exact, with XLA's all-reduce in the loop); data_parallel
  lays the batch out itself and has none."""
  mesh = mesh_of(AxisType.Explicit)
  in_shardings = (NamedSharding(mesh, P()), NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    plain = jax.jit(jaccum.accumulate(jax.grad(loss), 2), in_shardings=in_shardings)
    parallel = jax.jit(
      jaccum.data_parallel(jax.grad(loss), 2), in_shardings=in_shardings
    )
    w, x = np.asarray(W), np.asarray(X)  # as a data loader yields them
    assert_trees_close(plain(w, x), WHOLE, rtol=1e-5)
    assert_trees_close(parallel(w, x), WHOLE, rtol=1e-5)
    assert jaccum.inspect.collectives(plain, w, x).inside_loops >= 1
    assert jaccum.inspect.collectives(parallel, w, x).inside_loops == 0


def test_weight_fn_may_return_a_python_number():
  """len(x) or x.shape[0]: a literal in the traced program, still a weight."""
  got = jaccum.accumulate(jax.grad(loss), 4, weight_fn=lambda w, x: x.shape[0])(W, X)
  assert_trees_close(got, WHOLE, rtol=1e-5)


@pytest.mark.parametrize(
  "route", ["data_parallel-auto", "data_parallel-explicit", "explicit-jit"]
)
@pytest.mark.parametrize("mode", ["last", "concat"])
def test_a_value_that_only_happens_to_have_the_rows_per_device_is_refused(route, mode):
  """A (4, 3) value with 4 rows per micro-batch and device: not per-example.

  Before, it came back stacked over devices, (32, 3) where one device gives
  (4, 3), on an auto mesh, and failed with JAX's internal in_specs error on
  an explicit one. Per-example rows still come back together.
  """
  kind = AxisType.Auto if route.endswith("auto") else AxisType.Explicit
  mesh = mesh_of(kind)
  x = sharded(mesh, X)  # 64 rows: 8 devices × K=2 × 4 rows
  table = jnp.ones((4, 3))

  def make(fn):
    if route == "explicit-jit":
      return jax.jit(jaccum.accumulate(fn, 2, reduce=mode))
    return jax.jit(jaccum.data_parallel(fn, 2, mesh=mesh, reduce=mode))

  not_per_example = lambda table, x: table * jnp.mean(x)
  with pytest.raises(ValueError, match=r"only happens to match the 4 rows per device"):
    make(not_per_example)(table, x)
  per_example = lambda table, x: x[:, :3] * table[0]
  got = make(per_example)(table, x)
  if mode == "concat":
    np.testing.assert_allclose(got, np.asarray(X)[:, :3], rtol=1e-6)
  else:  # each device's last micro-batch: its odd rows, so the batch's odd rows
    np.testing.assert_allclose(got, np.asarray(X)[1::2, :3], rtol=1e-6)

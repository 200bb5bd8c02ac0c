"""Every model family on every route: what runs whole-batch runs accumulated, exactly.

The invariant (DESIGN.md, 9): if the whole-batch step compiles and runs on a
route, the accumulated step does too, gives the same result, and nothing
communicates inside its loop. Where JAX refuses the whole batch (e.g. params
that are host arrays on an explicit mesh: a contraction over the sharded
batch has no sharding), jaccum either gives the unsharded result or fails
with the same kind of error as the whole batch, never something worse.

Families: an MLP; CNNs written with `lax.conv`, Flax Linen and Flax NNX; a
transformer LM (one-hot embedding, head reshapes); a BatchNorm model with
its statistics threaded (`state_argnum`); an embedding gathered by token ids
(indices sharded with the batch); a loss with `lax.cond` and `lax.switch` on
batch data. Routes: one device; `data_parallel` on auto and
explicit meshes; plain `accumulate` on a batch sharded over an explicit mesh;
`accumulate(axis_name=...)` in the user's own `shard_map`; FSDP
(`param_specs`). Params are placed on the mesh, or passed as host arrays.
"""

import functools
import math
import warnings
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaccum
import jaccum.inspect

# Slow (about 150 cases, each compiling two steps): `pytest -m slow`, run by CI.
pytestmark = pytest.mark.slow

DEVICES = 8
K = 2
BATCH = DEVICES * K * 4


class Family(NamedTuple):
  params: Any
  batch: Any
  loss: Any  # loss(params, batch) -> scalar, or with state (params, state, batch)
  state: Any = None  # threaded with state_argnum=1 when not None


def _labels(n, classes, seed):
  return jax.random.randint(jax.random.key(seed), (n,), 0, classes)


def _images(seed=1):
  return jax.random.normal(jax.random.key(seed), (BATCH, 8, 8, 3))


def mlp():
  kw, kv = jax.random.split(jax.random.key(0))
  params = {
    "w": jax.random.normal(kw, (6, 16)) / 3,
    "b": jnp.zeros(16),
    "v": jax.random.normal(kv, (16, 3)) / 4,
  }
  batch = {
    "x": jax.random.normal(jax.random.key(1), (BATCH, 6)),
    "y": _labels(BATCH, 3, 2),
  }

  def loss(params, batch):
    x = batch["x"].astype(params["w"].dtype)  # bf16 params compute in bf16
    h = jnp.tanh(x @ params["w"] + params["b"])
    logits = h @ params["v"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return Family(params, batch, loss)


def lax_cnn():
  kk, kd = jax.random.split(jax.random.key(0))
  params = {
    "k": jax.random.normal(kk, (3, 3, 3, 4)) / 4,
    "d": jax.random.normal(kd, (8 * 8 * 4, 5)) / 16,
  }
  batch = {"x": _images(), "y": _labels(BATCH, 5, 2)}

  def loss(params, batch):
    h = jax.lax.conv_general_dilated(
      batch["x"].astype(params["k"].dtype),
      params["k"],
      (1, 1),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    logits = jnp.tanh(h).reshape(h.shape[0], -1) @ params["d"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return Family(params, batch, loss)


class LinenCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    x = nn.relu(nn.Conv(4, (3, 3), strides=(2, 2))(x))
    return nn.Dense(5)(x.reshape(x.shape[0], -1))


def linen_cnn():
  model = LinenCNN()
  params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
  batch = {"x": _images(), "y": _labels(BATCH, 5, 2)}

  def loss(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return Family(params, batch, loss)


class NNXCNN(nnx.Module):
  def __init__(self, rngs):
    self.conv1 = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(4, 8, (3, 3), rngs=rngs)
    self.linear = nnx.Linear(8 * 4 * 4, 5, rngs=rngs)

  def __call__(self, x):
    x = nnx.avg_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
    x = nnx.relu(self.conv2(x))
    return self.linear(x.reshape(x.shape[0], -1))


def nnx_cnn():
  graphdef, state = nnx.split(NNXCNN(nnx.Rngs(0)))
  params = jax.tree.map(lambda v: v, nnx.to_pure_dict(state))
  batch = {"x": _images(), "y": _labels(BATCH, 5, 2)}

  def loss(params, batch):
    model = nnx.merge(graphdef, nnx.State(params))
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return Family(params, batch, loss)


def lm():
  vocab, dim, heads, length = 16, 16, 2, 8
  keys = jax.random.split(jax.random.key(0), 5)
  params = {
    "embed": jax.random.normal(keys[0], (vocab, dim)) / 4,
    "qkv": jax.random.normal(keys[1], (dim, 3 * dim)) / 4,
    "out": jax.random.normal(keys[2], (dim, dim)) / 4,
    "head": jax.random.normal(keys[3], (dim, vocab)) / 4,
  }
  tokens = jax.random.randint(keys[4], (BATCH, length + 1), 0, vocab)

  def loss(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    batch, steps = inputs.shape
    x = jax.nn.one_hot(inputs, vocab) @ params["embed"]  # one-hot embedding
    q, k, v = jnp.split(x @ params["qkv"], 3, axis=-1)
    split = lambda t: t.reshape(batch, steps, heads, dim // heads)
    scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / math.sqrt(dim)
    mask = jnp.tril(jnp.ones((steps, steps), bool))
    weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, split(v))
    x = x + attended.reshape(batch, steps, dim) @ params["out"]
    logits = (x.reshape(batch * steps, dim) @ params["head"]).reshape(
      batch, steps, vocab
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return Family(params, tokens, loss)


def embedding_gather():
  """An embedding looked up by token ids: a gather by batch-sharded indices."""
  params = {
    "table": jax.random.normal(jax.random.key(0), (16, 4)) / 2,
    "head": jax.random.normal(jax.random.key(1), (4, 16)) / 2,
  }
  tokens = jax.random.randint(jax.random.key(2), (BATCH, 5), 0, 16)

  def loss(params, tokens):
    hidden = jnp.tanh(params["table"][tokens[:, :-1]])
    logits = hidden @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return Family(params, tokens, loss)


class BNNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=False, momentum=0.8)(x)
    return nn.Dense(3)(nn.relu(x))


def batchnorm():
  model = BNNet()
  variables = model.init(jax.random.key(0), jnp.zeros((1, 6)))
  batch = {
    "x": jax.random.normal(jax.random.key(1), (BATCH, 6)),
    "y": _labels(BATCH, 3, 2),
  }

  def loss(params, batch_stats, batch):
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats},
      batch["x"],
      mutable=["batch_stats"],
    )
    value = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return value, updates["batch_stats"]

  return Family(variables["params"], batch, loss, variables["batch_stats"])


def control_flow():
  params = {"w": jax.random.normal(jax.random.key(0), (6, 4)) / 3}
  x = jax.random.normal(jax.random.key(1), (BATCH, 6))
  # The odd rows are padding: on every route one micro-batch is all padding
  # and takes the cond's other side; the loss is still a mean over rows.
  x = x.at[1::2].set(0.0)
  batch = {"x": x, "kind": jnp.full(BATCH, 2)}

  def loss(params, batch):
    h = batch["x"] @ params["w"]
    padding = jnp.all(batch["x"] == 0, axis=1)
    per_row = jnp.where(padding, 0, jnp.tanh(h).sum(1) + jnp.sum(h**2, 1))
    value = jax.lax.cond(
      # 0·mean, not a constant 0: inside a type-checked shard_map both
      # branches must vary over the devices as the rows do.
      jnp.all(padding),
      lambda r: 0.0 * r.mean(),
      lambda r: r.mean(),
      per_row,
    )
    branch = jnp.max(batch["kind"])  # the same in every micro-batch
    scale = jax.lax.switch(branch, [lambda: 1.0, lambda: 2.0, lambda: 3.0])
    return value * scale

  return Family(params, batch, loss)


FAMILIES = {
  "mlp": mlp,
  "lax_cnn": lax_cnn,
  "linen_cnn": linen_cnn,
  "nnx_cnn": nnx_cnn,
  "lm": lm,
  "embedding_gather": embedding_gather,
  "batchnorm": batchnorm,
  "control_flow": control_flow,
}


@functools.cache
def family(name):
  return FAMILIES[name]()


def mesh_of(kind):
  return jax.make_mesh((DEVICES,), ("data",), axis_types=(kind,))


def fsdp_specs(params):
  """Shards each leaf's first dimension that the devices divide, if any."""

  def spec(x):
    for dim, size in enumerate(x.shape):
      if size % DEVICES == 0:
        return P(*([None] * dim), "data")
    return P()

  return jax.tree.map(spec, params)


class Route(NamedTuple):
  kind: Any  # the mesh's axis type, or None on one device
  whole: Any  # (grad_fn, options) -> the whole-batch step
  accumulated: Any  # (grad_fn, options, mesh) -> the accumulated step
  fsdp: bool = False


def _one_device(grad_fn, options, mesh):
  return jaccum.accumulate(grad_fn, K, **options)


def _data_parallel(grad_fn, options, mesh):
  return jaccum.data_parallel(grad_fn, K, mesh=mesh, **options)


def _fsdp(grad_fn, options, mesh, params):
  return jaccum.data_parallel(
    grad_fn, K, mesh=mesh, param_specs=fsdp_specs(params), **options
  )


def _shard_map(grad_fn, options, mesh):
  accumulated = jaccum.accumulate(grad_fn, K, axis_name="data", **options)
  batch_at = 2 if "state_argnum" in options else 1
  in_specs = tuple(P("data") if i == batch_at else P() for i in range(batch_at + 1))
  out_specs = (P(), P()) if "state_argnum" in options else P()
  return jax.shard_map(accumulated, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def _whole_in_shard_map(grad_fn, options, mesh):
  """The user's shard_map of the whole local batch, averaged over devices."""
  stateful = "state_argnum" in options

  def step(*args):
    out = grad_fn(*args)
    if stateful:
      out, state = out
      return jax.lax.pmean(out, "data"), jax.lax.pmean(state, "data")
    return jax.lax.pmean(out, "data")

  batch_at = 2 if stateful else 1
  in_specs = tuple(P("data") if i == batch_at else P() for i in range(batch_at + 1))
  out_specs = (P(), P()) if stateful else P()
  return jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


ROUTES = {
  "one_device": Route(None, None, _one_device),
  "data_parallel-auto": Route(AxisType.Auto, None, _data_parallel),
  "data_parallel-explicit": Route(AxisType.Explicit, None, _data_parallel),
  "explicit_jit": Route(AxisType.Explicit, None, _one_device),
  "shard_map-auto": Route(AxisType.Auto, _whole_in_shard_map, _shard_map),
  "shard_map-explicit": Route(AxisType.Explicit, _whole_in_shard_map, _shard_map),
  "fsdp-auto": Route(AxisType.Auto, None, _fsdp, fsdp=True),
  "fsdp-explicit": Route(AxisType.Explicit, None, _fsdp, fsdp=True),
}


def _sequential_reference(fam, devices):
  """BatchNorm's meaning: each device threads its K micro-batches in order.

  Gradients (and the loss) average over every micro-batch of every device,
  statistics over devices: what data_parallel and a pmap step compute.
  """
  grad_fn = jax.jit(jax.value_and_grad(fam.loss, has_aux=True))
  rows = BATCH // devices
  outs, states = [], []
  for d in range(devices):
    local = jax.tree.map(
      lambda x, d=d: np.asarray(x)[d * rows : (d + 1) * rows], fam.batch
    )
    state = fam.state
    for k in range(K):
      micro = jax.tree.map(lambda x, k=k: x[k::K], local)
      (value, state), grads = grad_fn(fam.params, state, micro)
      outs.append((value, grads))
    states.append(state)
  mean = lambda *xs: sum(xs) / len(xs)
  return jax.tree.map(mean, *outs), jax.tree.map(mean, *states)


def _place(fam, route, placement, mesh):
  """The params, state and batch, placed as the route and placement say."""
  params, batch, state = fam.params, fam.batch, fam.state
  if mesh is not None:
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    if placement == "host":
      params = jax.tree.map(np.asarray, params)
    else:
      specs = fsdp_specs(params) if route.fsdp else jax.tree.map(lambda _: P(), params)
      params = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
      )
      if state is not None:
        state = jax.device_put(state, NamedSharding(mesh, P()))
  return params, state, batch


def _steps(fam, route, placement, mesh, params):
  """The whole-batch step and the accumulated one, both jitted."""
  grad_fn = jax.value_and_grad(fam.loss, has_aux=fam.state is not None)
  options = {}
  if fam.state is not None:
    # ((value, new_state), grads) -> ((value, grads), new_state): state_argnum's form.
    plain = grad_fn
    grad_fn = lambda p, s, b: (lambda out: ((out[0][0], out[1]), out[0][1]))(
      plain(p, s, b)
    )
    options = {"state_argnum": 1, "batch_argnums": 2}
  if placement == "closure":
    grad_fn = functools.partial(lambda p, b: jax.value_and_grad(fam.loss)(p, b), params)
    grad_fn = (lambda f: lambda batch: f(batch))(grad_fn)  # a closure, not a partial
    options = {"batch_argnums": 0}
  whole = grad_fn if route.whole is None else route.whole(grad_fn, options, mesh)
  if route.fsdp:
    accumulated = route.accumulated(grad_fn, options, mesh, fam.params)
  else:
    accumulated = route.accumulated(grad_fn, options, mesh)
  return jax.jit(whole), jax.jit(accumulated)


# On one device params are where they are: one placement. Params reached by
# closure: on the routes whose call has no params argument to shard.
CLOSURE_ROUTES = ("data_parallel-auto", "data_parallel-explicit", "explicit_jit")
CASES = [
  (family_name, route_name, placement)
  for family_name in FAMILIES
  for route_name, route in ROUTES.items()
  for placement in (
    ["host"]
    if route.kind is None
    else ["mesh", "host"]
    + (
      ["closure"] if route_name in CLOSURE_ROUTES and family_name != "batchnorm" else []
    )
  )
]


@pytest.mark.parametrize(("family_name", "route_name", "placement"), CASES)
def test_what_runs_whole_batch_runs_accumulated(family_name, route_name, placement):
  route = ROUTES[route_name]
  fam = family(family_name)
  mesh = None if route.kind is None else mesh_of(route.kind)
  params, state, batch = _place(fam, route, placement, mesh)
  whole, accumulated = _steps(fam, route, placement, mesh, params)
  if placement == "closure":
    args = (batch,)
  else:
    args = (params, batch) if state is None else (params, state, batch)
  if fam.state is not None:
    expected = _sequential_reference(fam, 1 if mesh is None else DEVICES)
  else:
    expected = jax.jit(jax.value_and_grad(fam.loss))(fam.params, fam.batch)
  try:
    jax.block_until_ready(whole(*args))
  except Exception as refused:  # JAX refuses the whole batch on this route
    try:
      accumulated.lower(*args)
    except Exception as error:  # then jaccum may refuse it too, as JAX does
      # With JAX's own message (its start: shapes may differ further on).
      assert isinstance(error, type(refused)), (error, refused)
      assert str(error)[:60] == str(refused)[:60], (error, refused)
      return
    # Or run it, with the unsharded result.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    compiled = accumulated.lower(*args).compile()
  fell_back = [
    w for w in caught if "runs the loop as the whole batch" in str(w.message)
  ]
  # JAX's shard_map cannot close over arrays placed on an explicit mesh (nor
  # gather from an auto-mesh closure): jaccum traces grad_fn outside it and
  # runs it per device (issue 36, item 3; before, the loop ran as the whole
  # batch's step, with a warning). Nothing falls back.
  assert not fell_back, fell_back[0].message
  assert_trees_close(compiled(*args), expected, rtol=2e-5, atol=1e-6)
  if not fell_back:
    counts = jaccum.inspect._count_collectives(compiled.as_text())
    assert counts.inside_loops == 0, counts
    if mesh is not None and route_name != "explicit_jit":
      assert counts.all_reduce.outside_loops + counts.reduce_scatter.outside_loops


BF16_ROUTES = (
  "one_device",
  "data_parallel-auto",
  "data_parallel-explicit",
  "fsdp-explicit",
)


@pytest.mark.parametrize("route_name", BF16_ROUTES)
@pytest.mark.parametrize("family_name", ["mlp", "lax_cnn", "lm"])
def test_bfloat16_params_accumulate_in_float32_on_every_route(family_name, route_name):
  """bf16 params: bf16 gradients, as accurate as the whole batch's (f32 carry)."""
  route = ROUTES[route_name]
  fam = family(family_name)
  mesh = None if route.kind is None else mesh_of(route.kind)
  fam16 = fam._replace(
    params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), fam.params)
  )
  params, _, batch = _place(fam16, route, "mesh", mesh)
  whole, accumulated = _steps(fam16, route, "mesh", mesh, params)
  exact = jax.jit(jax.value_and_grad(fam.loss))(
    jax.tree.map(lambda x: x.astype(jnp.float32), fam16.params), fam.batch
  )
  got = accumulated(params, batch)
  assert jax.tree.map(lambda x: x.dtype, got[1]) == jax.tree.map(
    lambda x: x.dtype, fam16.params
  )
  relative_error = lambda tree: max(
    float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(exact), strict=True)
  )
  # bf16 keeps 8 bits; the whole batch's own error, where it runs, sets the scale.
  try:
    whole_error = relative_error(whole(params, batch))
  except Exception:  # e.g. JAX cannot shard the whole batch's FSDP contraction
    whole_error = 0.0
  assert relative_error(got) <= max(2 * whole_error, 1e-2), whole_error

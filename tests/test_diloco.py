"""`jaccum.DiLoCo`: local steps on replicas of a slow axis, averaged every H steps.

Checked against references written apart from the code: data-parallel SGD on
the same global batch (H = 1), a plain Python loop over replicas and steps in
float64 numpy with Adam and Nesterov written out by hand, the bytes the
compiled programs send over the slow axis against data parallel's, the
state's bytes, and a checkpoint that resumes mid-round.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaccum
import jaccum.inspect

AXIS = "replica"
ROWS = 4  # per replica per step
WIDTH, OUT = 3, 2


def make_mesh(replicas, *more):
  shape, names = (replicas, *(n for _, n in more)), (AXIS, *(a for a, _ in more))
  devices = jax.devices()[: int(np.prod(shape))]
  return jax.make_mesh(shape, names, devices=devices)


# --- The model: four leaves, so that 1, 2 and 4 fragments cut it evenly; its
# gradient is written out in numpy for the reference.


def init_params(dtype=np.float64):
  rng = np.random.default_rng(0)
  return {
    k: rng.normal(size=s).astype(dtype) * 0.5
    for k, s in (("a", (WIDTH, OUT)), ("b", (OUT,)), ("c", (WIDTH, OUT)), ("d", (OUT,)))
  }


def loss(params, x, y):
  pred = x @ params["a"] + params["b"] + (x * x) @ params["c"] + params["d"]
  return jnp.mean((pred - y) ** 2)


def numpy_grad(params, x, y):
  pred = x @ params["a"] + params["b"] + (x * x) @ params["c"] + params["d"]
  dpred = 2 * (pred - y) / pred.size
  return {
    "a": x.T @ dpred,
    "b": dpred.sum(0),
    "c": (x * x).T @ dpred,
    "d": dpred.sum(0),
  }


def batches(steps, replicas, dtype=np.float64, seed=1):
  """`[steps, replicas * ROWS, …]`: replica r's rows of step t are block r."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(steps, replicas * ROWS, WIDTH)).astype(dtype)
  y = rng.normal(size=(steps, replicas * ROWS, OUT)).astype(dtype)
  return x, y


# --- The reference: DiLoCo as a plain loop over steps and replicas, float64.


def adam(lr, b1=0.9, b2=0.999, eps=1e-8):
  def init(p):
    return {
      "m": {k: 0 * v for k, v in p.items()},
      "v": {k: 0 * v for k, v in p.items()},
      "t": 0,
    }

  def update(g, s):
    t = s["t"] + 1
    m = {k: b1 * s["m"][k] + (1 - b1) * g[k] for k in g}
    v = {k: b2 * s["v"][k] + (1 - b2) * g[k] ** 2 for k in g}
    u = {k: -lr * (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps) for k in g}
    return u, {"m": m, "v": v, "t": t}

  return init, update


def sgd(lr, momentum=0.0, nesterov=False):
  def init(p):
    return {k: 0 * v for k, v in p.items()}

  def update(g, trace):
    trace = {k: g[k] + momentum * trace[k] for k in g}
    direction = {k: g[k] + momentum * trace[k] for k in g} if nesterov else trace
    return {k: -lr * d for k, d in direction.items()}, trace

  return init, update


def reference(params, xs, ys, replicas, sync_every, fragments, delay, inner, outer):
  """Every replica's params after each step, and the shared params."""
  names = sorted(params)  # the leaves in jax.tree.leaves order
  groups = [names[f * len(names) // fragments : (f + 1) * len(names) // fragments]
            for f in range(fragments)]  # fmt: skip
  local = [dict(params) for _ in range(replicas)]
  inner_states = [inner[0](params) for _ in range(replicas)]
  shared = dict(params)
  outer_states = [outer[0]({k: params[k] for k in g}) for g in groups]
  waiting = {}  # fragment -> (step it lands, mean pseudo-gradient)
  period = sync_every // fragments
  history = []
  for t in range(1, len(xs) + 1):
    for r in range(replicas):
      rows = slice(r * ROWS, (r + 1) * ROWS)
      g = numpy_grad(local[r], xs[t - 1][rows], ys[t - 1][rows])
      u, inner_states[r] = inner[1](g, inner_states[r])
      local[r] = {k: local[r][k] + u[k] for k in names}
    for f, group in enumerate(groups):
      if t % sync_every == f * period:
        mean = {k: np.mean([shared[k] - local[r][k] for r in range(replicas)], 0)
                for k in group}  # fmt: skip
        waiting[f] = (t + delay, mean)
    for f, (when, mean) in list(waiting.items()):
      if when == t:
        u, outer_states[f] = outer[1](mean, outer_states[f])
        for k in groups[f]:
          shared[k] = shared[k] + u[k]
          for r in range(replicas):
            local[r][k] = shared[k]
        del waiting[f]
    history.append(([dict(p) for p in local], dict(shared)))
  return history


# --- jaccum, two ways: `update` in the user's shard_map (a `lax.switch` over
# the phases), and `train_step` (each phase its own program).


def per_replica(tree):
  return jax.tree.map(lambda x: x[0], tree)


def stacked(tree):
  return jax.tree.map(lambda x: x[None], tree)


def optax_way(diloco, mesh, params, xs, ys):
  """The user's own shard_map; yields every replica's params after each step."""
  replicas = mesh.shape[AXIS]

  def one_step(params, state, x, y):
    params, state = per_replica((params, state))
    grads = jax.grad(loss)(params, x, y)
    updates, state = diloco.update(grads, state, params)
    return stacked((optax.apply_updates(params, updates), state))

  step = jax.jit(
    jax.shard_map(one_step, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
  )
  rows = NamedSharding(mesh, P(AXIS))
  both = jax.tree.map(
    lambda x: jax.device_put(np.broadcast_to(x, (replicas, *x.shape)), rows),
    (params, diloco.init(params)),
  )
  params, state = both
  for x, y in zip(xs, ys, strict=True):
    params, state = step(
      params, state, jax.device_put(x, rows), jax.device_put(y, rows)
    )
    yield params, state


def mesh_way(diloco, mesh, params, xs, ys):
  step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh, batch_argnums=(1, 2))
  params, state = step.init(params)
  for x, y in zip(xs, ys, strict=True):
    params, state, _ = step(params, state, x, y)
    yield params, state


WAYS = {"optax": optax_way, "train_step": mesh_way}


# (fragments, delay) with H = 4: plain DiLoCo, a delay, fragments, both.
STREAMING = [(1, 0), (1, 2), (2, 0), (2, 1)]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("fragments, delay", STREAMING)
def test_two_rounds_match_a_float64_loop_over_replicas_and_steps(
  way, replicas, fragments, delay
):
  """Inner Adam, outer Nesterov: every replica's params after every step of
  two rounds (and the landing of the last sync), and the shared params."""
  sync_every = 4
  steps = 2 * sync_every + delay
  xs, ys = batches(steps, replicas)
  params = init_params()
  expected = reference(
    params, xs, ys, replicas, sync_every, fragments, delay,
    adam(0.05), sgd(0.7, momentum=0.9, nesterov=True),
  )  # fmt: skip
  with jax.enable_x64(True):
    diloco = jaccum.DiLoCo(
      optax.adam(0.05),
      sync_every,
      axis_name=AXIS,
      num_fragments=fragments,
      delay=delay,
    )
    got = list(WAYS[way](diloco, make_mesh(replicas), params, xs, ys))
  assert len(got) == len(expected)
  for t, (got_t, (local, shared)) in enumerate(zip(got, expected, strict=True)):
    params_t, state_t = got_t
    params_t, snapshot = jax.device_get((params_t, state_t.snapshot))
    for r in range(replicas):
      for k in params:
        np.testing.assert_allclose(
          params_t[k][r], local[r][k], rtol=1e-12, atol=1e-14,
          err_msg=f"step {t + 1}, replica {r}, leaf {k}",
        )  # fmt: skip
        np.testing.assert_allclose(snapshot[k][r], shared[k], rtol=1e-12, atol=1e-14)
  # Not a trivial agreement: the replicas moved apart, and the syncs moved them.
  assert any(not np.allclose(local[0]["a"], local[1]["a"]) for local, _ in expected)
  assert not np.allclose(expected[-1][1]["a"], params["a"])

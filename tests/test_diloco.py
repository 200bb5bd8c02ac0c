"""`jaccum.DiLoCo`: local steps on replicas of a slow axis, averaged every H steps.

Checked against references written apart from the code: data-parallel SGD on
the same global batch (H = 1), a plain Python loop over replicas and steps in
float64 numpy with Adam and Nesterov written out by hand, the bytes the
compiled programs send over the slow axis against data parallel's, the
state's bytes, and a checkpoint that resumes mid-round.
"""

import re

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


def make_mesh(replicas, data=None):
  """`replicas` devices along the slow axis, `data` more each along "data"."""
  shape, names = (replicas,), (AXIS,)
  if data:
    shape, names = (replicas, data), (AXIS, "data")
  return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


# --- The model: four leaves, so that 1, 2 and 4 fragments cut it evenly; its
# gradient is written out in numpy for the reference.


def init_params(dtype=np.float64):
  rng = np.random.default_rng(0)
  return {
    k: rng.normal(size=s).astype(dtype) * 0.5
    for k, s in (("a", (WIDTH, OUT)), ("b", (OUT,)), ("c", (WIDTH, OUT)), ("d", (OUT,)))
  }


def predict(params, x, sin):
  return (
    x @ params["a"]
    + params["b"]
    + (x * x) @ params["c"]
    + sin(x[:, :OUT]) * params["d"]
  )


def loss(params, x, y):
  return jnp.mean((predict(params, x, jnp.sin) - y) ** 2)


def numpy_grad(params, x, y):
  pred = predict(params, x, np.sin)
  dpred = 2 * (pred - y) / pred.size
  return {
    "a": x.T @ dpred,
    "b": dpred.sum(0),
    "c": (x * x).T @ dpred,
    "d": (dpred * np.sin(x[:, :OUT])).sum(0),
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


# --- H = 1 is data parallel.


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_one_step_rounds_with_outer_sgd_of_rate_one_are_data_parallel_sgd(
  way, momentum
):
  """H = 1, inner SGD, outer SGD of rate 1 without momentum: the mean of the
  replicas' SGD steps, i.e. SGD (with momentum: its trace is linear in the
  gradients) on the global batch's gradient, up to float32 rounding."""
  replicas, steps, lr = 4, 5, 0.1
  xs, ys = batches(steps, replicas, np.float32)
  params = init_params(np.float32)
  diloco = jaccum.DiLoCo(
    optax.sgd(lr, momentum=momentum or None),
    1,
    outer=optax.sgd(1.0),
    axis_name=AXIS,
  )
  got = list(WAYS[way](diloco, make_mesh(replicas), params, xs, ys))
  sgd_ = optax.sgd(lr, momentum=momentum or None)
  expected, state = params, sgd_.init(params)
  for t in range(steps):
    grads = jax.grad(loss)(expected, xs[t], ys[t])  # the whole global batch
    updates, state = sgd_.update(grads, state, expected)
    expected = optax.apply_updates(expected, updates)
    params_t = jax.device_get(got[t][0])
    for k in params:
      for r in range(replicas):
        np.testing.assert_allclose(
          params_t[k][r], expected[k], rtol=2e-6, atol=2e-7, err_msg=f"{t} {k} {r}"
        )
  assert not np.allclose(expected["a"], params["a"], atol=1e-2)


# --- Bytes over the slow axis, from the compiled programs.


def slow_bytes(counts):
  count = counts.by_axis.get(AXIS)
  assert set(counts.by_axis) <= {AXIS}, counts.by_axis
  return 0 if count is None else count.bytes_inside_loops + count.bytes_outside_loops


def bytes_per_phase(fragments, delay, sync_every=4, replicas=4, **options):
  """The bytes each call of a round sends over the slow axis, by its step
  count: the program each call runs, compiled and counted."""
  mesh = make_mesh(replicas)
  diloco = jaccum.DiLoCo(
    optax.sgd(0.1),
    sync_every,
    axis_name=AXIS,
    num_fragments=fragments,
    delay=delay,
    **options,
  )
  step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh, batch_argnums=(1, 2))
  params, state = step.init(init_params(np.float32))
  xs, ys = batches(1, replicas, np.float32)
  sent = []
  for count in range(sync_every, 2 * sync_every):  # the second round
    at = state._replace(count=jnp.full_like(state.count, count))
    sent.append(slow_bytes(jaccum.inspect.collectives(step, params, at, xs[0], ys[0])))
  # What train_step reports: the same, averaged over the round.
  assert step.bytes_per_step(params, state, xs[0], ys[0]) == (
    {AXIS: sum(sent) / sync_every} if sum(sent) else {}
  )
  return sent


def data_parallel_bytes(replicas=4):
  mesh = make_mesh(replicas)
  step = jaccum.data_parallel(
    jax.grad(loss), 1, mesh=mesh, axis=AXIS, batch_argnums=(1, 2)
  )
  xs, ys = batches(1, replicas, np.float32)
  return slow_bytes(
    jaccum.inspect.collectives(step, init_params(np.float32), xs[0], ys[0])
  )


PARAM_BYTES = 4 * (2 * WIDTH * OUT + 2 * OUT)  # float32


@pytest.mark.parametrize("sync_every", [1, 4])
def test_a_round_sends_what_one_data_parallel_step_sends(sync_every):
  """Per inner step, data parallel's bytes ÷ H: one sync a round, the
  params' bytes; every other step sends nothing over the slow axis."""
  dp = data_parallel_bytes()
  assert dp == PARAM_BYTES
  sent = bytes_per_phase(1, 0, sync_every)
  assert sent == [0] * (sync_every - 1) + [dp]  # the count ≡ 0 call syncs
  assert sum(sent) / sync_every == dp / sync_every


def test_each_fragment_sends_its_share_and_a_delay_moves_it_to_the_landing():
  """P = 2 (two fragments of 8 floats each): each sync 1/P of the bytes,
  at the steps ≡ 0 and ≡ 2 (mod 4); with a delay of 1 the landing step
  (one later) sends them, the step that takes the pseudo-gradient none."""
  half = PARAM_BYTES // 2
  # Calls of the second round, counts 4..7: call t = count + 1 = 5..8.
  assert bytes_per_phase(2, 0) == [0, half, 0, half]  # t = 6 (f = 1), 8 (f = 0)
  assert bytes_per_phase(2, 1) == [half, 0, half, 0]  # t = 5 (f = 0), 7 (f = 1)
  assert bytes_per_phase(1, 2) == [0, PARAM_BYTES, 0, 0]  # t = 8 - 4 + 2 = 6


def test_a_bf16_wire_sends_half_the_bytes():
  """What DiLoCo hands XLA (XLA:CPU widens bf16 all-reduces when it
  compiles; GPUs and TPUs send them as written): read from the lowered
  program of the sync step."""
  mesh = make_mesh(4)
  sent = {}
  for wire in (None, jnp.bfloat16):
    diloco = jaccum.DiLoCo(optax.sgd(0.1), 2, axis_name=AXIS, reduce_dtype=wire)
    step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh, batch_argnums=(1, 2))
    params, state = step.init(init_params(np.float32))
    state = state._replace(count=jnp.full_like(state.count, 1))  # t = 2: a sync
    xs, ys = batches(1, 4, np.float32)
    text = step.lower(params, state, xs[0], ys[0]).as_text(dialect="hlo")
    sent[wire] = jaccum.inspect._count_collectives(text).all_reduce.bytes_outside_loops
  assert sent[None] == PARAM_BYTES
  assert sent[jnp.bfloat16] * 2 == sent[None]


def entry_graph(hlo_text):
  """The compiled program's entry computation: `{name: (opcode, operands,
  line)}`."""
  graph = {}
  entry = hlo_text[hlo_text.index("\nENTRY") + 1 :]
  for line in entry.splitlines()[1:]:
    found = re.match(r"\s*(?:ROOT )?%(\S+) = .*? ([a-z][\w\-]*)\((.*?)\)", line)
    if found:
      name, opcode, operands = found.groups()
      graph[name] = (opcode, re.findall(r"%([\w.\-]+)", operands), line)
  return graph


def reads_the_batch(graph, name):
  """Whether instruction `name` depends on the batch (arguments 2 and 3)."""
  seen, stack = set(), [name]
  while stack:
    for operand in graph[stack.pop()][1]:
      if operand not in seen:
        seen.add(operand)
        stack.append(operand)
  batch = ('op_name="args[2]"', 'op_name="args[3]"')
  return any(graph[n][0] == "parameter" and any(b in graph[n][2] for b in batch)
             for n in seen)  # fmt: skip


@pytest.mark.parametrize("delay", [0, 1])
def test_with_a_delay_the_reduction_reads_nothing_the_step_computes(delay):
  """The landing step's all-reduce reads the pseudo-gradient from the state,
  not the step's batch or gradients, so XLA may run it while the step's
  forward and backward passes run; without a delay it waits for them."""
  mesh = make_mesh(4)
  diloco = jaccum.DiLoCo(optax.adam(0.1), 4, axis_name=AXIS, delay=delay)
  step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh, batch_argnums=(1, 2))
  params, state = step.init(init_params(np.float32))
  xs, ys = batches(1, 4, np.float32)
  at = state._replace(count=jnp.full_like(state.count, 3 + delay))  # t = 4 + delay
  graph = entry_graph(step.lower(params, at, xs[0], ys[0]).compile().as_text())
  all_reduces = [n for n, (opcode, *_) in graph.items() if opcode == "all-reduce"]
  assert all_reduces, "the step of a landing reduces"
  assert [reads_the_batch(graph, n) for n in all_reduces] == [not delay] * len(
    all_reduces
  )


# --- State: memory, replicas kept equal, checkpoints.


def extra_bytes_per_param(diloco, params):
  """The state's bytes besides the inner optimizer's and the count, a param."""
  state = diloco.init(params)
  extra = (state.snapshot, state.outer_state, state.in_flight)
  size = sum(np.size(x) for x in jax.tree.leaves(params))
  return sum(x.nbytes for x in jax.tree.leaves(extra)) / size


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_extra_memory_is_at_most_8_bytes_a_param(dtype):
  """The snapshot and the outer Nesterov momentum, float32; a delay keeps one
  fragment's pseudo-gradient more (4 bytes × its share of the params)."""
  params = jax.tree.map(lambda x: jnp.asarray(x, dtype), init_params(np.float32))
  plain = jaccum.DiLoCo(optax.adam(0.1), 4, axis_name=AXIS)
  assert extra_bytes_per_param(plain, params) == 8
  streaming = jaccum.DiLoCo(
    optax.adam(0.1), 4, axis_name=AXIS, num_fragments=2, delay=1
  )
  # Two fragments of 8 params each: slots of 8 float32 for 16 params.
  assert extra_bytes_per_param(streaming, params) == 8 + 4 * 8 / 16
  no_momentum = jaccum.DiLoCo(optax.adam(0.1), 4, outer=optax.sgd(0.7), axis_name=AXIS)
  assert extra_bytes_per_param(no_momentum, params) == 4


def test_after_a_sync_every_replica_holds_the_shared_params_bit_for_bit():
  mesh = make_mesh(4)
  diloco = jaccum.DiLoCo(optax.adam(0.1), 3, axis_name=AXIS)
  step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh, batch_argnums=(1, 2))
  params, state = step.init(init_params(np.float32))
  xs, ys = batches(6, 4, np.float32)
  for t in range(6):
    params, state, _ = step(params, state, xs[t], ys[t])
    rows = jax.device_get(params)
    synced = (t + 1) % 3 == 0
    for k, shared in jax.device_get(step.shared(state)).items():
      assert all(np.array_equal(row, shared) for row in rows[k]) == synced, (t, k)


def test_a_checkpoint_mid_round_resumes_bit_identically(tmp_path):
  """Saved with orbax while a fragment's outer update is in flight, restored
  into a new step (which reads the count from the state), it continues as if
  never stopped."""
  import orbax.checkpoint as ocp

  mesh = make_mesh(4)
  diloco = jaccum.DiLoCo(optax.adam(0.05), 4, axis_name=AXIS, num_fragments=2, delay=1)

  def new_step():
    return diloco.train_step(jax.value_and_grad(loss), mesh=mesh, batch_argnums=(1, 2))

  xs, ys = batches(11, 4, np.float32)
  step = new_step()
  params, state = step.init(init_params(np.float32))
  for t in range(6):  # t = 6 started fragment 1's reduction: it lands at t = 7
    params, state, _ = step(params, state, xs[t], ys[t])
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "checkpoint", {"params": params, "state": state})
  uninterrupted = (params, state)
  for t in range(6, 11):
    uninterrupted = step(*uninterrupted, xs[t], ys[t])[:2]

  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    {"params": params, "state": state},
  )
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "checkpoint", target)
  assert isinstance(restored["state"], jaccum.DiLoCoState)
  resumed, step = (restored["params"], restored["state"]), new_step()
  for t in range(6, 11):
    resumed = step(*resumed, xs[t], ys[t])[:2]
  for a, b in zip(
    jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(resumed[0]["a"]), np.asarray(params["a"]))


# --- The wire: reduce_dtype and reduce_fn.


def run_rounds(mesh, steps=8, **options):
  diloco = jaccum.DiLoCo(optax.adam(0.05), 4, axis_name=AXIS, **options)
  step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh, batch_argnums=(1, 2))
  params, state = step.init(init_params(np.float32))
  xs, ys = batches(steps, mesh.shape[AXIS], np.float32)
  for t in range(steps):
    params, state, _ = step(params, state, xs[t], ys[t])
  return jax.device_get(params), state


def test_reduce_fn_reduces_each_fragment_with_its_own_state():
  """A psum that counts its calls: the same params as jaccum's reduction,
  and each fragment's state counts that fragment's syncs."""
  mesh = make_mesh(4)

  def counting_psum(tree, axes, calls):
    return jax.lax.psum(tree, axes), calls + 1

  diloco = jaccum.DiLoCo(
    optax.adam(0.05), 4, axis_name=AXIS, num_fragments=2, reduce_fn=counting_psum
  )
  step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh, batch_argnums=(1, 2))
  params, state = step.init(init_params(np.float32))
  zeros = jnp.zeros_like(state.count)
  state = state._replace(reduce_state=(zeros, zeros))
  xs, ys = batches(8, 4, np.float32)
  for t in range(8):  # fragment 1 syncs at t = 2, 6; fragment 0 at t = 4, 8
    params, state, _ = step(params, state, xs[t], ys[t])
  calls = jax.device_get(state.reduce_state)
  np.testing.assert_array_equal(calls[0], [2] * 4)
  np.testing.assert_array_equal(calls[1], [2] * 4)
  expected, _ = run_rounds(mesh, num_fragments=2)
  for k, v in jax.device_get(params).items():
    np.testing.assert_array_equal(v, expected[k])


def test_a_bf16_wire_rounds_only_the_mean_pseudo_gradient():
  """bf16 rounds each replica's pseudo-gradient (8 bits) and the sum: the
  params stay within bf16's rounding of the pseudo-gradient of float32's."""
  mesh = make_mesh(4)
  exact, _ = run_rounds(mesh, steps=4)
  narrow, _ = run_rounds(mesh, steps=4, reduce_dtype=jnp.bfloat16)
  start = init_params(np.float32)
  for k in exact:
    moved = np.max(np.abs(exact[k] - start[k]))
    error = np.max(np.abs(narrow[k] - exact[k]))
    assert 0 < error <= 2**-6 * moved, k


# --- The inner step accumulates micro-batches over a fast axis.


def test_the_inner_step_can_accumulate_over_a_fast_data_axis():
  """Two replicas of four devices each, K = 2 micro-batches per device: each
  replica's gradient is its rows' mean, as in the float64 loop."""
  replicas, sync_every, steps = 2, 2, 4
  rows = 4 * 2 * 2  # devices × K × rows per micro-batch, per replica
  rng = np.random.default_rng(3)
  xs = rng.normal(size=(steps, replicas * rows, WIDTH))
  ys = rng.normal(size=(steps, replicas * rows, OUT))
  params = init_params()
  global ROWS
  saved, ROWS = ROWS, rows  # the reference's rows per replica
  try:
    expected = reference(
      params, xs, ys, replicas, sync_every, 1, 0,
      adam(0.05), sgd(0.7, momentum=0.9, nesterov=True),
    )  # fmt: skip
  finally:
    ROWS = saved
  with jax.enable_x64(True):
    mesh = make_mesh(replicas, 4)
    diloco = jaccum.DiLoCo(optax.adam(0.05), sync_every, axis_name=AXIS)
    step = diloco.train_step(
      jax.value_and_grad(loss), 2, mesh=mesh, axis="data", batch_argnums=(1, 2)
    )
    got, state = step.init(params)
    for t in range(steps):
      got, state, _ = step(got, state, xs[t], ys[t])
    counts = jaccum.inspect.collectives(step, got, state, xs[0], ys[0])
  got = jax.device_get(got)
  for r in range(replicas):
    for k in params:
      np.testing.assert_allclose(got[k][r], expected[-1][0][r][k], rtol=1e-12)
  assert counts.inside_loops == 0, counts  # nothing in the micro-batch loop


def test_train_step_under_jit_runs_the_phases_in_a_switch():
  """Under the user's jit the count is traced: the same numbers."""
  mesh = make_mesh(4)
  diloco = jaccum.DiLoCo(optax.adam(0.05), 4, axis_name=AXIS, num_fragments=2, delay=1)
  step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh, batch_argnums=(1, 2))
  traced = jax.jit(step)
  params, state = step.init(init_params(np.float32))
  both = [(params, state), (params, state)]
  xs, ys = batches(8, 4, np.float32)
  for t in range(8):
    both[0] = step(*both[0], xs[t], ys[t])[:2]
    both[1] = traced(*both[1], xs[t], ys[t])[:2]
  for a, b in zip(jax.tree.leaves(both[0]), jax.tree.leaves(both[1]), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


# --- Bad input: a clear error naming the argument, what was expected and got.

SGD = optax.sgd(0.1)


@pytest.mark.parametrize(
  "kwargs, error, message",
  [
    ({"sync_every": 0}, ValueError, r"sync_every must be an int >= 1, got 0\."),
    ({"sync_every": 2.0}, TypeError, r"sync_every must be an int >= 1, got 2\.0"),
    ({"num_fragments": 3}, ValueError, r"num_fragments=3 must divide sync_every=4"),
    ({"delay": 2, "num_fragments": 2}, ValueError, r"delay=2 must be below .* 2"),
    ({"delay": -1}, ValueError, r"delay must be an int >= 0, got -1\."),
    ({"inner": lambda g: g}, TypeError, r"inner must be an optax\.Gradient.*function"),
    ({"outer": "sgd"}, TypeError, r"outer must be an optax\.GradientTransformation"),
    ({"axis_name": 3}, TypeError, r"axis_name must name the slow mesh axis.*got 3"),
    ({"reduce_fn": "psum"}, TypeError, r"reduce_fn must be callable"),
    ({"reduce_dtype": "int8"}, (TypeError, ValueError), r"reduce_dtype"),
  ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, message):
  arguments = {"inner": SGD, "sync_every": 4, "axis_name": AXIS} | kwargs
  with pytest.raises(error, match=message):
    jaccum.DiLoCo(arguments.pop("inner"), arguments.pop("sync_every"), **arguments)


def test_fragments_that_do_not_divide_the_leaves_are_refused_at_init():
  diloco = jaccum.DiLoCo(SGD, 4, axis_name=AXIS, num_fragments=4)
  with pytest.raises(ValueError, match=r"num_fragments=4 must divide the number of "
                     r"param leaves, 3"):  # fmt: skip
    diloco.init({"a": jnp.zeros(2), "b": jnp.zeros(2), "c": jnp.zeros(2)})


def test_a_slow_axis_not_in_the_mesh_is_refused():
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  diloco = jaccum.DiLoCo(SGD, 4, axis_name=AXIS)
  step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh)
  with pytest.raises(ValueError, match=r"the mesh has the axes \('data',\), not "
                     r"\['replica'\]"):  # fmt: skip
    step.init(init_params(np.float32))
  with pytest.raises(ValueError, match=r"train_step needs a mesh"):
    diloco.train_step(jax.value_and_grad(loss)).init(init_params(np.float32))

  def inside(params, x, y):  # a shard_map over "data" only
    state = diloco.init(params)
    return diloco.update(jax.grad(loss)(params, x, y), state, params)[0]

  inside = jax.shard_map(inside, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                         out_specs=P("data"))  # fmt: skip
  xs, ys = batches(1, 4, np.float32)
  rows = NamedSharding(mesh, P("data"))
  xs, ys = jax.device_put(xs[0], rows), jax.device_put(ys[0], rows)
  with pytest.raises(ValueError, match=r"DiLoCo\(axis_name='replica'\) updates "
                     r"inside a shard_map over that axis, but the mesh here has the "
                     r"axes \('data',\)"):  # fmt: skip
    jax.jit(inside)(init_params(np.float32), xs, ys)


def test_update_needs_params_and_its_own_state():
  diloco = jaccum.DiLoCo(SGD, 4, axis_name=AXIS)
  mesh = make_mesh(4)
  params = init_params(np.float32)

  def call(state, with_params=True):
    def inside(params):
      grads = jax.tree.map(jnp.ones_like, params)
      return diloco.update(grads, state, params if with_params else None)[0]

    return jax.shard_map(inside, mesh=mesh, in_specs=P(), out_specs=P(),
                         check_vma=False)(params)  # fmt: skip

  with pytest.raises(ValueError, match=r"DiLoCo\.update needs params"):
    call(diloco.init(params), with_params=False)
  with pytest.raises(TypeError, match=r"state must be the jaccum\.DiLoCoState"):
    call(optax.sgd(0.1).init(params))
  other = jaccum.DiLoCo(SGD, 4, axis_name=AXIS, num_fragments=2)
  with pytest.raises(TypeError, match=r"state must come from a DiLoCo with "
                     r"num_fragments=1 and delay=0"):  # fmt: skip
    call(other.init(params))


def test_a_reduce_fn_must_keep_its_states_structure():
  mesh = make_mesh(4)
  diloco = jaccum.DiLoCo(
    SGD, 1, axis_name=AXIS, reduce_fn=lambda t, axes, s: (jax.lax.psum(t, axes), 1)
  )
  step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh, batch_argnums=(1, 2))
  params, state = step.init(init_params(np.float32))
  xs, ys = batches(1, 4, np.float32)
  with pytest.raises(TypeError, match=r"reduce_fn\(tree, axes, state\) must return "
                     r"\(sum, new_state\)"):  # fmt: skip
    step(params, state, xs[0], ys[0])


def test_diloco_copies_from_its_arguments():
  import copy

  diloco = jaccum.DiLoCo(SGD, 4, axis_name=AXIS, num_fragments=2, delay=1)
  for clone in (copy.copy(diloco), copy.deepcopy(diloco)):
    assert isinstance(clone, jaccum.DiLoCo) and clone is not diloco
    state = clone.init(init_params(np.float32))
    assert len(state.outer_state) == 2 and state.in_flight is not None

"""`BatchSchedule` and `BatchSizeController`: batch sizes that change in training.

The schedule is checked against a step-by-step simulation of its documented
rule (each step runs the K of the last entry at or before the offset where it
starts) and against Megatron's ramp-up formula; the controller against a
plain-Python transcription of its documented rule on synthetic noise scales.
"""

import itertools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaccum

# Schedules: a boundary between step boundaries, an entry a single step jumps
# over, repeated K, micro-batches of 1, and offsets past int32 (tokens).
SCHEDULES = [
  ({0: 4, 10_000: 8}, 32),
  ({0: 8, 100: 2, 200: 4}, 32),
  ({0: 1, 5: 1, 17: 3, 18: 2, 100: 5, 101: 1}, 7),
  ({0: 3, 1: 1, 2: 2}, 1),
  ({0: 2, 2**33 + 5: 4, 2**34: 1}, 2**20),
]


def simulate(schedule: dict[int, int], microbatch_size: int, num_steps: int):
  """The documented rule, one step at a time: `(K, offset)` of each step."""
  steps, offset = [], 0
  for _ in range(num_steps):
    k = schedule[max(o for o in schedule if o <= offset)]
    steps.append((k, offset))
    offset += k * microbatch_size
  return steps


def random_schedules(count: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  for _ in range(count):
    size = int(rng.integers(1, 6))
    offsets = [0, *sorted(rng.choice(np.arange(1, 400), size, replace=False))]
    schedule = {int(o): int(rng.integers(1, 9)) for o in offsets}
    yield schedule, int(rng.integers(1, 13))


@pytest.mark.parametrize(
  ("schedule", "microbatch_size"), SCHEDULES + list(random_schedules(30))
)
def test_offsets_and_k_equal_the_step_by_step_rule(schedule, microbatch_size):
  num_steps = 7000 if microbatch_size == 2**20 else 400
  expected = simulate(schedule, microbatch_size, num_steps)
  batch_schedule = jaccum.BatchSchedule(schedule, microbatch_size)
  got = [
    (batch_schedule.num_microbatches(s), batch_schedule.offset(s))
    for s in range(num_steps)
  ]
  assert got == expected  # Python ints: exact, past 2**31 too
  assert all(type(k) is int and type(o) is int for k, o in got)
  # Consecutive offsets differ by exactly one step's batch: nothing skipped
  # or read twice across a change.
  for (k, offset), (_, next_offset) in itertools.pairwise(got):
    assert next_offset - offset == k * microbatch_size
  # The changes table is where K changes, and nowhere else.
  changes = [
    (s, o, k) for s, (k, o) in enumerate(expected) if s == 0 or k != got[s - 1][0]
  ]
  assert batch_schedule.changes == tuple(changes)
  assert batch_schedule.max_num_microbatches == max(k for k, _ in expected)


@pytest.mark.parametrize(("schedule", "microbatch_size"), SCHEDULES[:4])
def test_arrays_under_jit_equal_the_python_ints(schedule, microbatch_size):
  batch_schedule = jaccum.BatchSchedule(schedule, microbatch_size)
  steps = np.arange(400)
  expected_k, expected_offset = np.array(simulate(schedule, microbatch_size, 400)).T
  k = jax.jit(batch_schedule.num_microbatches)(jnp.asarray(steps))
  assert k.dtype == jnp.int32 and np.array_equal(k, expected_k)
  offset = jax.jit(batch_schedule.offset)(jnp.asarray(steps))
  # float32, exact below 2**24
  assert offset.dtype == jnp.float32 and np.array_equal(offset, expected_offset)
  scalar = jax.jit(batch_schedule.num_microbatches)(jnp.int32(123))
  assert scalar.shape == () and int(scalar) == expected_k[123]


def test_array_offsets_past_2_to_the_24_are_float32_of_the_exact_ones():
  schedule = jaccum.BatchSchedule({0: 2, 2**33 + 5: 4, 2**34: 1}, 2**20)
  steps = [0, 4095, 4096, 4097, 6000, 6143, 6144, 7000]
  exact = np.array([schedule.offset(s) for s in steps], np.float64)
  got = np.asarray(schedule.offset(jnp.asarray(steps)), np.float64)
  np.testing.assert_allclose(got, exact, rtol=6e-8)


def megatron_batch_size(consumed, start, increment, rampup_samples, global_batch):
  """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update, ported."""
  num_increments = (global_batch - start) // increment
  per_increment = rampup_samples / num_increments
  if consumed > rampup_samples:
    return global_batch
  return start + int(consumed / per_increment) * increment


@pytest.mark.parametrize(
  ("start", "increment", "rampup_samples", "global_batch", "microbatch_size"),
  [(32, 32, 6000, 128, 32), (16, 16, 100_003, 1024, 16), (4, 8, 997, 100, 4)],
)
def test_ramp_is_megatrons_rampup(
  start, increment, rampup_samples, global_batch, microbatch_size
):
  m = microbatch_size
  ramp = jaccum.BatchSchedule.ramp(
    start // m,
    global_batch // m,
    increment=increment // m,
    over=rampup_samples,
    microbatch_size=m,
  )
  consumed = 0
  for step in range(20_000):
    assert ramp.offset(step) == consumed
    expected = megatron_batch_size(
      consumed, start, increment, rampup_samples, global_batch
    )
    assert ramp.num_microbatches(step) * m == expected, step
    consumed += expected
  assert ramp.num_microbatches(20_000) * m == global_batch


def test_multisteps_windows_follow_the_schedule_exactly():
  """With `every_k_schedule=schedule.num_microbatches`, window s averages exactly
  the examples from offset(s) to offset(s + 1)."""
  microbatch_size = 3
  schedule = jaccum.BatchSchedule({0: 2, 20: 5, 50: 1, 60: 3}, microbatch_size)
  examples = jax.random.normal(jax.random.key(0), (300, 2))
  opt = jaccum.MultiSteps(optax.sgd(1.0), every_k_schedule=schedule.num_microbatches)
  params = jnp.zeros(2)
  state = opt.init(params)
  update = jax.jit(opt.update)
  windows = []
  for start in range(0, 240, microbatch_size):
    micro_grad = examples[start : start + microbatch_size].mean(0)
    updates, state = update(micro_grad, state, params)
    if opt.has_updated(state):
      windows.append(-updates)
  assert len(windows) == int(state.gradient_step)
  for step, window in enumerate(windows):
    rows = examples[schedule.offset(step) : schedule.offset(step + 1)]
    assert len(rows) == schedule.num_microbatches(step) * microbatch_size
    np.testing.assert_allclose(window, rows.mean(0), rtol=1e-5, atol=1e-6)
  assert schedule.offset(len(windows)) <= 240 < schedule.offset(len(windows) + 1)


def test_by_step_keys_an_optax_schedule_by_examples():
  schedule = jaccum.BatchSchedule({0: 1, 1000: 4, 5000: 2}, 64)
  by_examples = optax.warmup_cosine_decay_schedule(0.0, 1.0, 2000, 20_000)
  learning_rate = jax.jit(schedule.by_step(by_examples))
  for step in (0, 5, 15, 16, 30, 40, 100):
    expected = by_examples(schedule.offset(step))
    np.testing.assert_allclose(learning_rate(jnp.int32(step)), expected, rtol=1e-6)
  # As an optimizer's learning rate: the count it passes is the step.
  opt = optax.sgd(schedule.by_step(by_examples))
  state = opt.init(jnp.zeros(()))
  for _ in range(16):
    _, state = opt.update(jnp.ones(()), state)
  updates, _ = opt.update(jnp.ones(()), state)
  np.testing.assert_allclose(-updates, by_examples(schedule.offset(16)), rtol=1e-6)


@pytest.mark.parametrize(
  ("schedule", "microbatch_size", "error", "match"),
  [
    ({}, 4, ValueError, "entry at offset 0"),
    ({5: 2}, 4, ValueError, "entry at offset 0"),
    ({0: 0}, 4, ValueError, r"schedule\[0\] must be an int >= 1, got 0"),
    ({0: 2.0}, 4, TypeError, r"schedule\[0\] must be an int"),
    ({0: True}, 4, TypeError, r"schedule\[0\] must be an int"),
    ({0: 2, -8: 1}, 4, ValueError, "offset -8"),
    ({0: 2, 1.5: 1}, 4, TypeError, "offset 1.5"),
    ([(0, 2), (0, 3)], 4, ValueError, "offset twice"),
    ([(0, 2, 3)], 4, ValueError, r"\(offset, K\) pairs"),
    (7, 4, TypeError, "schedule must be a mapping"),
    ({0: 2}, 0, ValueError, "microbatch_size must be an int >= 1, got 0"),
    ({0: 2}, 2.5, TypeError, "microbatch_size must be an int"),
  ],
)
def test_bad_schedules_are_named(schedule, microbatch_size, error, match):
  with pytest.raises(error, match=match):
    jaccum.BatchSchedule(schedule, microbatch_size)


@pytest.mark.parametrize(
  ("step", "error", "match"),
  [
    (-1, ValueError, "step must be >= 0, got -1"),
    (1.0, TypeError, "step must be an int or an integer array, got float"),
    (jnp.float32(1), TypeError, "got ArrayImpl"),
    (True, TypeError, "got the bool"),
  ],
)
def test_bad_steps_are_named(step, error, match):
  schedule = jaccum.BatchSchedule({0: 2}, 4)
  for method in (schedule.num_microbatches, schedule.offset):
    with pytest.raises(error, match=match):
      method(step)


@pytest.mark.parametrize(
  ("args", "match"),
  [
    ((4, 2, 1, 100), "stop must be an int >= 4, got 2"),
    ((1, 8, 3, 100), "increment=3 must divide stop - start = 7"),
    ((1, 8, 1, 0), "over must be an int >= 1, got 0"),
  ],
)
def test_bad_ramps_are_named(args, match):
  start, stop, increment, over = args
  with pytest.raises(ValueError, match=match):
    jaccum.BatchSchedule.ramp(
      start, stop, increment=increment, over=over, microbatch_size=1
    )


def test_a_ramp_from_k_to_k_is_constant():
  assert jaccum.BatchSchedule.ramp(
    3, 3, increment=1, over=10, microbatch_size=2
  ).changes == ((0, 0, 3),)


# The controller.


def smoothed(b_simple: float) -> jaccum.NoiseScaleEMAState:
  """An EMA state whose noise scale is `b_simple` (NaN: no step yet; inf: |G|² = 0)."""
  if np.isnan(b_simple):
    return jaccum.NoiseScaleEMAState(jnp.int32(0), jnp.float32(0), jnp.float32(0))
  if np.isinf(b_simple):
    return jaccum.NoiseScaleEMAState(jnp.int32(5), jnp.float32(0), jnp.float32(1))
  return jaccum.NoiseScaleEMAState(jnp.int32(5), jnp.float32(1), jnp.float32(b_simple))


def reference(controller: jaccum.BatchSizeController, k0: int, b_simples):
  """BatchSizeController's documented rule in Python: `(K, lr_scale)` per step."""
  c, k, ran, out = controller, k0, 0, []
  power = {None: 0, "linear": 1, "sqrt": 0.5}[c.lr_scaling]
  for b in b_simples:
    ran += 1
    up = min(math.ceil(Fraction(str(c.growth)) * k), c.max_num_microbatches)
    down = max(math.floor(Fraction(str(c.shrink)) * k), c.min_num_microbatches)
    new, b = k, b / c.headroom
    if ran >= c.cooldown:
      if b > k * c.microbatch_size:
        new = up
      elif b < down * c.microbatch_size:
        new = down
    if new != k:
      ran = 0
    k = new
    out.append((k, (k / k0) ** power))
  return out


def run(controller, k0, b_simples, *, jit=True):
  update = jax.jit(controller.update) if jit else controller.update
  state, out = controller.init(k0), []
  for b in b_simples:
    state = update(state, smoothed(b))
    out.append((int(state.num_microbatches), float(state.lr_scale)))
  return out, state


def assert_follows_reference(controller, k0, b_simples, *, jit=True):
  got, _ = run(controller, k0, b_simples, jit=jit)
  expected = reference(controller, k0, b_simples)
  assert [k for k, _ in got] == [k for k, _ in expected]
  np.testing.assert_allclose([s for _, s in got], [s for _, s in expected], rtol=1e-5)
  return [k for k, _ in got]


CONTROLLERS = [
  jaccum.BatchSizeController(16, 64),
  jaccum.BatchSizeController(16, 64, min_num_microbatches=2, lr_scaling="sqrt"),
  jaccum.BatchSizeController(10, 50, growth=1.5, shrink=0.75, lr_scaling="linear"),
  jaccum.BatchSizeController(3.5, 40, min_num_microbatches=3, growth=3, cooldown=4),
  jaccum.BatchSizeController(8, 32, shrink=1.0, cooldown=2, lr_scaling="sqrt"),
  jaccum.BatchSizeController(2, 64, headroom=4, lr_scaling="sqrt"),
  jaccum.BatchSizeController(5, 64, headroom=2.5, growth=1.5, shrink=0.6),
]


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("seed", [0, 1])
def test_controller_follows_its_documented_rule_on_random_noise_scales(
  controller, seed
):
  rng = np.random.default_rng(seed)
  # A random walk in log space over 1 .. 3000 examples, with gaps (NaN) and
  # hidden gradients (inf) sprinkled in.
  log_b = np.clip(np.cumsum(rng.normal(0, 0.35, 150)) + 4.5, 0, 8)
  b_simples = np.exp(log_b)
  b_simples[rng.choice(150, 8, replace=False)] = np.nan
  b_simples[rng.choice(150, 4, replace=False)] = np.inf
  k0 = controller.min_num_microbatches
  sizes = assert_follows_reference(controller, k0, b_simples)
  assert len(set(sizes)) > 2  # the walk made it change, both ways
  lo, hi = controller.min_num_microbatches, controller.max_num_microbatches
  assert all(lo <= k <= hi for k in sizes)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_grows_while_the_noise_scale_exceeds_the_batch(jit):
  controller = jaccum.BatchSizeController(8, 64)  # micro-batches of 8
  # b_simple 20 > batch 8: K 1 -> 2 (16) -> 4 (32 >= 20): holds at 4.
  sizes = assert_follows_reference(controller, 1, [20] * 5, jit=jit)
  assert sizes == [2, 4, 4, 4, 4]
  # Rising as training goes: each time it passes the batch, K doubles.
  sizes = assert_follows_reference(
    controller, 1, [5, 9, 9, 17, 30, 40, 70, 70], jit=jit
  )
  assert sizes == [1, 2, 2, 4, 4, 8, 16, 16]


def test_holds_between_the_smaller_and_the_current_batch():
  controller = jaccum.BatchSizeController(8, 64, shrink=0.5)
  _, state = run(controller, 1, [1000] * 3)  # K = 8, batch 64
  assert int(state.num_microbatches) == 8
  # down = 4: holds for 32 <= b <= 64, NaN (no estimate) holds too.
  for b in [32, 64, 40, np.nan, 33.3, 63.9]:
    state = controller.update(state, smoothed(b))
    assert int(state.num_microbatches) == 8
  assert int(state.steps_at_size) == 6
  state = controller.update(state, smoothed(31.9))
  assert int(state.num_microbatches) == 4 and int(state.steps_at_size) == 0


def test_shrinks_no_faster_than_its_rate():
  controller = jaccum.BatchSizeController(4, 64, shrink=0.5, cooldown=3)
  _, state = run(controller, 1, [10_000] * 20)
  assert int(state.num_microbatches) == 64
  sizes, _ = run(controller, 64, [0.5] * 24)  # far below any batch
  # Halving once per 3 steps at most, down to the bound.
  assert [k for k, _ in sizes] == [
    64,
    64,
    32,
    32,
    32,
    16,
    16,
    16,
    8,
    8,
    8,
    4,
    4,
    4,
    2,
    2,
    2,
    1,
    1,
    1,
    1,
    1,
    1,
    1,
  ]
  assert_follows_reference(controller, 64, [0.5] * 24)
  gentle = jaccum.BatchSizeController(4, 64, shrink=0.75)
  assert [k for k, _ in run(gentle, 64, [0.5] * 5)[0]] == [48, 36, 27, 20, 15]


def test_stays_within_its_bounds():
  controller = jaccum.BatchSizeController(
    1, 20, min_num_microbatches=3, growth=4, shrink=0.25
  )
  sizes = assert_follows_reference(controller, 3, [1e6, 1e6, 1e6, 0.1, 0.1, 0.1])
  assert sizes == [12, 20, 20, 5, 3, 3]
  assert [k for k, _ in run(controller, 20, [np.inf] * 2)[0]] == [20, 20]


@pytest.mark.parametrize(
  ("growth", "shrink"), [(1.2, 0.7), (1.1, 0.9), (1.25, 0.6), (1.7, 0.35)]
)
def test_k_changes_by_the_exact_factor_at_every_k(growth, shrink):
  """ceil(K·growth) and floor(K·shrink) as the fractions written (1.2 = 6/5), K < 200.

  In float32 growth 1.2 took 15 of these K one micro-batch too far (45 went
  to 55, not 54: 45·1.2f = 54.000002), and shrink 0.7 one too few (10 went
  to 6: 10·0.7f = 6.9999999); lr_scale followed.
  """
  controller = jaccum.BatchSizeController(
    1, 10_000, growth=growth, shrink=shrink, lr_scaling="linear"
  )
  ks = np.arange(1, 200)
  states = jaccum.BatchSizeControllerState(
    jnp.asarray(ks, jnp.int32), jnp.ones(ks.shape, jnp.float32), jnp.zeros_like(ks)
  )
  update = jax.jit(jax.vmap(controller.update, in_axes=(0, None)))
  for b_simple, expected in (
    (np.inf, [math.ceil(Fraction(str(growth)) * k) for k in ks]),
    (1e-3, [max(math.floor(Fraction(str(shrink)) * k), 1) for k in ks]),
  ):
    new = update(states, smoothed(b_simple))
    np.testing.assert_array_equal(new.num_microbatches, expected)
    np.testing.assert_allclose(new.lr_scale, np.asarray(expected) / ks, rtol=1e-6)


@pytest.mark.parametrize(
  ("lr_scaling", "scales"),
  [
    (None, [1, 1, 1, 1]),
    ("linear", [2, 4, 8, 4]),
    ("sqrt", [2**0.5, 2, 8**0.5, 2]),
  ],
)
def test_learning_rate_factor(lr_scaling, scales):
  """Linear for SGD, square root for Adam, relative to the K of init."""
  controller = jaccum.BatchSizeController(10, 64, lr_scaling=lr_scaling)
  got, _ = run(controller, 2, [25, 50, 100, 35])  # K 4, 8, 16, then 8
  assert [k for k, _ in got] == [4, 8, 16, 8]
  np.testing.assert_allclose([s for _, s in got], scales, rtol=1e-6)


def test_headroom_keeps_the_batch_that_far_below_the_noise_scale():
  controller = jaccum.BatchSizeController(8, 64, headroom=4)
  # b_simple 200: grow while 200 > 4 · 8 · K, so K 1 -> 2 -> 4 -> 8 (4 · 64 >= 200).
  assert [k for k, _ in run(controller, 1, [200] * 5)[0]] == [2, 4, 8, 8, 8]
  # Shrink when 4 · 8 · down > b_simple: at 100, down = 4 gives 128 > 100.
  assert [k for k, _ in run(controller, 8, [100] * 3)[0]] == [4, 4, 4]


def test_no_estimate_holds_and_a_hidden_gradient_grows():
  controller = jaccum.BatchSizeController(8, 64)
  assert [k for k, _ in run(controller, 2, [np.nan] * 3)[0]] == [2, 2, 2]
  assert [k for k, _ in run(controller, 2, [np.inf] * 3)[0]] == [4, 8, 16]


def test_a_real_noise_scale_settles_k_around_it():
  """Linear regression at fixed params, B_simple = 21 / 4 = 5.25 examples:
  with micro-batches of 2, K = 2 (4 examples) grows to 4 and holds there
  (4 · 2 = 8 >= 5.25 >= 2 · 2)."""

  def loss(w, x, y):
    return 0.5 * jnp.mean((x @ w - y) ** 2)

  ema = jaccum.NoiseScaleEMA(decay=0.99)
  controller = jaccum.BatchSizeController(2, 16)

  def step(ema_state, state, key, num_microbatches):
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (2 * num_microbatches, 4))
    y = x @ jnp.ones(4) + 0.5 * jax.random.normal(ky, (2 * num_microbatches,))
    accumulated = jaccum.accumulate(
      jax.grad(loss), num_microbatches, batch_argnums=(1, 2), return_stats=True
    )
    _, stats = accumulated(jnp.zeros(4), x, y)
    ema_state, _ = ema.update(ema_state, stats)
    return ema_state, controller.update(state, ema_state)

  step = jax.jit(step, static_argnums=3)
  ema_state, state, sizes = ema.init(), controller.init(2), []
  for key in jax.random.split(jax.random.key(0), 300):
    ema_state, state = step(ema_state, state, key, int(state.num_microbatches))
    sizes.append(int(state.num_microbatches))
  assert sizes[0] == 4 and sizes[20:] == [4] * 280, sizes


def test_controller_state_jits_without_retracing_and_checkpoints(tmp_path):
  import orbax.checkpoint as ocp

  controller = jaccum.BatchSizeController(16, 64, lr_scaling="sqrt", cooldown=2)
  traces = []

  @jax.jit
  def update(state, ema_state):
    traces.append(1)
    return controller.update(state, ema_state)

  state = controller.init(2)
  for b in [100, 100, 100]:
    state = update(state, smoothed(b))
  assert len(traces) == 1
  assert [x.dtype for x in state] == [jnp.int32, jnp.float32, jnp.int32]
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "controller", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(
      tmp_path / "controller", jax.eval_shape(controller.init)
    )
  assert isinstance(restored, jaccum.BatchSizeControllerState)
  assert jax.tree.all(jax.tree.map(np.array_equal, state, restored))
  # Restored mid-cooldown, it continues exactly as the original.
  after = [update(s, smoothed(1000)) for s in (state, restored)]
  assert jax.tree.all(jax.tree.map(np.array_equal, *after))
  assert len(traces) == 1
  # And through jax.tree flattening to NumPy and back (any checkpoint format).
  leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
  rebuilt = jax.tree.unflatten(jax.tree.structure(controller.init()), leaves)
  assert isinstance(rebuilt, jaccum.BatchSizeControllerState)
  assert int(update(rebuilt, smoothed(1000)).num_microbatches) == int(
    after[0].num_microbatches
  )


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    (dict(microbatch_size=0), ValueError, "microbatch_size must be > 0, got 0"),
    (dict(microbatch_size="8"), TypeError, "microbatch_size must be a number"),
    (
      dict(max_num_microbatches=0),
      ValueError,
      "max_num_microbatches must be an int >= 1",
    ),
    (
      dict(min_num_microbatches=4, max_num_microbatches=2),
      ValueError,
      "max_num_microbatches must be an int >= 4, got 2",
    ),
    (
      dict(min_num_microbatches=0),
      ValueError,
      "min_num_microbatches must be an int >= 1, got 0",
    ),
    (dict(growth=0.5), ValueError, "growth must be a factor >= 1"),
    (
      dict(shrink=0.3333, max_num_microbatches=2**30),
      ValueError,
      "shrink=0.3333 is too fine for exact int32 arithmetic",
    ),
    (dict(shrink=0), ValueError, r"shrink must be a factor in \(0, 1\]"),
    (dict(shrink=1.5), ValueError, r"shrink must be a factor in \(0, 1\]"),
    (dict(cooldown=0), ValueError, "cooldown must be an int >= 1, got 0"),
    (dict(headroom=0.5), ValueError, "headroom must be a factor >= 1"),
    (dict(headroom=None), TypeError, "headroom must be a number"),
    (dict(lr_scaling="cubic"), ValueError, "lr_scaling must be None, 'linear'"),
  ],
)
def test_bad_controller_arguments_are_named(kwargs, error, match):
  arguments = dict(microbatch_size=8, max_num_microbatches=16) | kwargs
  with pytest.raises(error, match=match):
    jaccum.BatchSizeController(**arguments)


def test_bad_controller_calls_are_named():
  controller = jaccum.BatchSizeController(8, 16, min_num_microbatches=2)
  with pytest.raises(ValueError, match="num_microbatches must be an int >= 2, got 1"):
    controller.init(1)
  with pytest.raises(
    ValueError, match="num_microbatches must be <= max_num_microbatches=16, got 17"
  ):
    controller.init(17)
  stats = jaccum.AccumulationStats(*[jnp.float32(1)] * 7)
  with pytest.raises(
    TypeError, match=r"ema_state must be the NoiseScaleEMAState.*got AccumulationStats"
  ):
    controller.update(controller.init(), stats)  # pyright: ignore[reportArgumentType]
  with pytest.raises(TypeError, match="state must be the BatchSizeControllerState"):
    controller.update((jnp.int32(2),), smoothed(1.0))  # pyright: ignore[reportArgumentType]

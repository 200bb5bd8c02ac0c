"""`fit_microbatches` / `fit_train_step`: K from a memory budget, at compile time.

The reference for every peak is the issue's formula applied to
`compiled.memory_analysis()` here, on steps these tests compile themselves;
the reference K is the smallest candidate whose reference peak fits. The
search itself is also checked on tables of made-up peaks, where it compiles
nothing.
"""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import optax
import pytest

import jaccum
import jaccum.inspect
from jaccum._planning import fit as _fit

SDS = jax.ShapeDtypeStruct
BATCH = 1024
DIVISORS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def mlp_loss(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["w1"])
  hidden = jnp.tanh(hidden @ params["w2"])
  return jnp.mean((hidden @ params["w3"] - batch["y"]) ** 2)


PARAMS = {
  "w1": SDS((32, 256), jnp.float32),
  "w2": SDS((256, 256), jnp.float32),
  "w3": SDS((256, 1), jnp.float32),
}
MLP_BATCH = {"x": SDS((BATCH, 32), jnp.float32), "y": SDS((BATCH, 1), jnp.float32)}


def nbytes(tree):
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def concrete(tree, seed=0):
  key = jax.random.key(seed)
  return jax.tree.map(lambda s: jax.random.normal(key, s.shape, s.dtype), tree)


def reference_peak(step, *args):
  """The issue's peak, straight from `memory_analysis()` of a compiled step."""
  analysis = step.lower(*args).compile().memory_analysis()
  total = (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    + analysis.temp_size_in_bytes
    - analysis.alias_size_in_bytes
  )
  return max(total, getattr(analysis, "peak_memory_in_bytes", 0) or 0)


def reference_peaks(grad_fn, args, candidates, **kwargs):
  return {
    k: reference_peak(jax.jit(jaccum.accumulate(grad_fn, k, **kwargs)), *args)
    for k in candidates
  }


def smallest_fitting(peaks, budget):
  return min(k for k, peak in peaks.items() if peak <= budget)


def is_falling(peaks_by_k):
  values = [peaks_by_k[k] for k in sorted(peaks_by_k)]
  return values == sorted(values, reverse=True)


@pytest.fixture(scope="module")
def mlp_peaks():
  peaks = reference_peaks(jax.grad(mlp_loss), (PARAMS, MLP_BATCH), DIVISORS)
  # The premise of the bisection tests: this MLP's memory falls with K.
  assert is_falling(peaks), peaks
  assert peaks[1] > 2 * peaks[1024], peaks
  return peaks


@pytest.fixture(scope="module")
def mlp_fits(mlp_peaks):
  """Fits at four budgets, with two independent counts of the K compiled.

  `compiled` counts calls of the compile function; `traced_rows` the
  micro-batch sizes the loss was traced at, one size per K compiled.
  """
  budgets = [
    mlp_peaks[1] + 1,  # K=1 fits
    (mlp_peaks[1] + mlp_peaks[2]) // 2,  # K=2
    (mlp_peaks[32] + mlp_peaks[64]) // 2,  # K=64
    mlp_peaks[1024],  # exactly the peak of K=1024, the last candidate
  ]
  runs = []
  memory = _fit._memory
  for budget in budgets:
    compiled, traced_rows = [], []

    def count(step, args, compiled=compiled):
      compiled.append(step)
      return memory(step, args)

    def loss(params, batch, traced_rows=traced_rows):
      traced_rows.append(batch["x"].shape[0])
      return mlp_loss(params, batch)

    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(_fit, "_memory", count)
      fit = jaccum.fit_microbatches(
        jax.grad(loss), PARAMS, MLP_BATCH, memory_budget=budget
      )
    runs.append((budget, fit, len(compiled), set(traced_rows)))
  return runs


def test_chosen_k_fits_and_the_next_smaller_candidate_does_not(mlp_peaks, mlp_fits):
  chosen = [fit.num_microbatches for _, fit, _, _ in mlp_fits]
  assert chosen == [1, 2, 64, 1024]
  for budget, fit, _, _ in mlp_fits:
    k = fit.num_microbatches
    assert k == smallest_fitting(mlp_peaks, budget)
    assert fit.peak_bytes == mlp_peaks[k] <= budget
    if k != 1:
      smaller = DIVISORS[DIVISORS.index(k) - 1]
      assert fit.tried[smaller] == mlp_peaks[smaller] > budget
    assert fit.tried == {k: mlp_peaks[k] for k in fit.tried}
    assert fit.memory_budget == budget


def test_compilations_at_most_log2_candidates_plus_two(mlp_fits):
  bound = math.ceil(math.log2(len(DIVISORS))) + 2
  for _, fit, compiled, traced_rows in mlp_fits:
    assert compiled == len(fit.tried)
    assert traced_rows == {BATCH // k for k in fit.tried}
    assert compiled <= bound, list(fit.tried)
  counts = [compiled for _, _, compiled, _ in mlp_fits]
  assert counts == [1, 5, 5, bound]  # K=1024 takes the longest bisection


def test_the_step_is_never_run():
  calls = []

  def loss(params, batch):
    jax.debug.callback(lambda: calls.append(1))
    return mlp_loss(params, batch)

  params, batch = concrete(PARAMS), concrete(MLP_BATCH)
  candidates = [1, 8, 64]
  peaks = reference_peaks(jax.grad(mlp_loss), (params, batch), candidates)
  budget = (peaks[1] + peaks[8]) // 2
  fit = jaccum.fit_microbatches(
    jax.grad(loss), params, batch, memory_budget=budget, candidates=candidates
  )

  optimizer = optax.sgd(0.1)

  def make_step(num_microbatches):
    grad_fn = jaccum.accumulate(jax.grad(loss), num_microbatches)

    def step(params, opt_state, batch):
      updates, opt_state = optimizer.update(grad_fn(params, batch), opt_state)
      return optax.apply_updates(params, updates), opt_state

    return jax.jit(step)

  opt_state = optimizer.init(params)
  step_fit = jaccum.fit_train_step(
    make_step, params, opt_state, batch, memory_budget=budget, candidates=candidates
  )
  jax.effects_barrier()
  assert list(fit.tried) == list(step_fit.tried) == [1, 64, 8]
  assert calls == []
  # The callback does fire when the chosen step runs: once per micro-batch.
  jax.block_until_ready(make_step(step_fit.num_microbatches)(params, opt_state, batch))
  jax.effects_barrier()
  assert len(calls) == step_fit.num_microbatches == 8


def spiky_loss(params, x):
  """Memory falls with K, except for a code path taken at 8 rows a micro-batch.

  Kernels chosen by shape (or padding to a tile) make such steps in practice.
  """
  hidden = jnp.tanh(x @ params["w1"])
  if x.shape[0] == 8:
    wide = jnp.sort(jnp.tile(hidden, (1, 64)), axis=1)
    hidden = hidden + wide[:, : hidden.shape[1]]
  return jnp.mean((hidden @ params["w2"]) ** 2)


SPIKY_PARAMS = {"w1": SDS((16, 64), jnp.float32), "w2": SDS((64, 1), jnp.float32)}
SPIKY_X = SDS((64, 16), jnp.float32)


def bisect(peaks, budget):
  """Plain bisection over sorted candidates, as if memory always fell with K."""
  candidates = sorted(peaks)
  low, high = 0, len(candidates) - 1
  while high - low > 1:
    middle = (low + high) // 2
    low, high = (low, middle) if peaks[candidates[middle]] <= budget else (middle, high)
  return candidates[high]


def test_memory_rising_with_k_falls_back_to_a_scan():
  candidates = [1, 2, 4, 8, 16, 32, 64]
  peaks = reference_peaks(jax.grad(spiky_loss), (SPIKY_PARAMS, SPIKY_X), candidates)
  assert peaks[8] > peaks[1] > peaks[2] > peaks[4] > peaks[16], peaks
  budget = (peaks[2] + peaks[4]) // 2
  assert bisect(peaks, budget) == 16  # Bisection alone would skip K=4.

  fit = jaccum.fit_microbatches(
    jax.grad(spiky_loss), SPIKY_PARAMS, SPIKY_X, memory_budget=budget
  )
  assert fit.num_microbatches == smallest_fitting(peaks, budget) == 4
  assert fit.peak_bytes == peaks[4]
  # Both ends, the spike that shows memory rising, then a scan from the bottom.
  assert list(fit.tried) == [1, 64, 8, 2, 4]
  assert fit.tried == {k: peaks[k] for k in fit.tried}


# The search alone, on made-up peaks: no compilation.


def fake_memory(peaks, compiled):
  """Stands in for XLA: a `MemoryStats` whose peak is `peaks[K]`."""

  def memory(step, args):
    compiled.append(step.num_microbatches)
    return jaccum.inspect.MemoryStats(
      temp_bytes=peaks[step.num_microbatches],
      argument_bytes=0,
      output_bytes=0,
      alias_bytes=0,
      generated_code_bytes=0,
      peak_bytes=None,
    )

  return memory


def fake_step(num_microbatches):
  step = lambda *args: pytest.fail("a step ran")
  step.num_microbatches = num_microbatches
  return step


def search(peaks, budget):
  """`fit_train_step` on fake steps: `(fit or None if it raised, K compiled)`."""
  compiled = []
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(_fit, "_memory", fake_memory(peaks, compiled))
    try:
      fit = jaccum.fit_train_step(
        fake_step, memory_budget=budget, candidates=list(peaks)
      )
    except ValueError as error:
      assert "no candidate K fits" in str(error)
      return None, compiled
  assert compiled == list(fit.tried)
  assert fit.tried == {k: peaks[k] for k in compiled}
  return fit, compiled


@st.composite
def peak_tables(draw, falling):
  """`(peaks, budget)`: up to 40 candidates with a peak each, and a budget."""
  ks = sorted(draw(st.sets(st.integers(1, 4096), min_size=1, max_size=40)))
  values = draw(st.lists(st.integers(1, 100), min_size=len(ks), max_size=len(ks)))
  if falling:
    values = sorted(values, reverse=True)
  return dict(zip(ks, values, strict=True)), draw(st.integers(1, 101))


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(peak_tables(falling=True))
def test_search_is_exact_in_log_compilations_where_memory_falls(table):
  peaks, budget = table
  fit, compiled = search(peaks, budget)
  fitting = [k for k, peak in peaks.items() if peak <= budget]
  if fit is None:  # said only once every candidate was compiled
    assert fitting == [] and sorted(compiled) == sorted(peaks)
  else:
    assert len(compiled) <= math.ceil(math.log2(len(peaks))) + 2
    assert fit.num_microbatches == min(fitting)
    assert fit.peak_bytes == peaks[min(fitting)]


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(peak_tables(falling=False))
def test_search_on_any_memory_profile(table):
  peaks, budget = table
  fit, compiled = search(peaks, budget)
  ks = sorted(peaks)
  fitting = [k for k in ks if peaks[k] <= budget]
  shown_rising = not is_falling({k: peaks[k] for k in compiled})
  if fit is None:  # never while some candidate fits
    assert fitting == []
    return
  chosen = fit.num_microbatches
  assert peaks[chosen] <= budget
  # The next smaller candidate was compiled and is over the budget.
  if chosen != ks[0]:
    assert peaks[ks[ks.index(chosen) - 1]] > budget
    assert ks[ks.index(chosen) - 1] in compiled
  # Having seen memory rise, it finds the smallest K that fits.
  if shown_rising:
    assert chosen == min(fitting)


# Data parallel: the budget is per device.


def wide_loss(params, batch):
  """Activations of [rows, 64, 64] per micro-batch: they dominate the params."""
  hidden = jnp.tanh(batch["x"][:, :, None] * params["w"])
  return jnp.mean((hidden.sum(-1) @ params["v"] - batch["y"]) ** 2)


WIDE_PARAMS = {"w": SDS((64, 64), jnp.float32), "v": SDS((64,), jnp.float32)}


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() == 8, "tests/conftest.py sets 8 CPU devices"
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("fsdp", [False, True])
def test_data_parallel_options_pass_through_and_the_budget_is_per_device(mesh, fsdp):
  devices, batch_size = 8, 128
  sharded = jax.NamedSharding(mesh, jax.P("data"))
  batch = {
    "x": SDS((batch_size, 64), jnp.float32, sharding=sharded),
    "y": SDS((batch_size,), jnp.float32, sharding=sharded),
  }
  param_specs = {"w": jax.P("data"), "v": jax.P()} if fsdp else None
  peaks = {
    k: reference_peak(
      jax.jit(
        jaccum.data_parallel(jax.grad(wide_loss), k, mesh=mesh, param_specs=param_specs)
      ),
      WIDE_PARAMS,
      batch,
    )
    for k in [1, 2, 4, 8, 16]  # the divisors of 128 / 8 rows per device
  }
  budget = (peaks[2] + peaks[4]) // 2
  fit = jaccum.fit_microbatches(
    jax.grad(wide_loss),
    WIDE_PARAMS,
    batch,
    memory_budget=budget,
    mesh=mesh,
    param_specs=param_specs,
  )
  assert fit.num_microbatches == smallest_fitting(peaks, budget) == 4
  assert fit.tried == {k: peaks[k] for k in fit.tried}
  assert list(fit.tried) == [1, 16, 4, 2]  # bisection over the 5 divisors
  # One device's arguments: its params (with FSDP, an eighth of `w`) and its
  # eighth of the batch.
  params_bytes = nbytes(WIDE_PARAMS) - (
    nbytes(WIDE_PARAMS["w"]) * 7 // 8 if fsdp else 0
  )
  for stats in fit.stats.values():
    assert stats.argument_bytes == params_bytes + nbytes(batch) // devices

  # One device with the whole batch needs more micro-batches for this budget.
  whole = {
    "x": SDS((batch_size, 64), jnp.float32),
    "y": SDS((batch_size,), jnp.float32),
  }
  single = jaccum.fit_microbatches(
    jax.grad(wide_loss), WIDE_PARAMS, whole, memory_budget=budget, candidates=[4, 32]
  )
  assert single.num_microbatches == 32 and single.tried[4] > budget


def test_per_device_candidates_must_divide_the_per_device_batch(mesh):
  batch = {"x": SDS((64, 32), jnp.float32), "y": SDS((64, 1), jnp.float32)}
  with pytest.raises(ValueError, match=r"per-device batch size 8 \(64 rows over 8"):
    jaccum.fit_microbatches(
      jax.grad(mlp_loss),
      PARAMS,
      batch,
      memory_budget=2**30,
      candidates=[16],
      mesh=mesh,
    )


# Whole train steps.


def test_train_step_counts_optimizer_state_and_donated_buffers():
  optimizer = optax.adam(1e-3)
  opt_state = jax.eval_shape(optimizer.init, PARAMS)

  def make_step(num_microbatches, donate=True):
    grad_fn = jaccum.accumulate(jax.grad(mlp_loss), num_microbatches)

    def step(params, opt_state, batch):
      updates, opt_state = optimizer.update(grad_fn(params, batch), opt_state)
      return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())

  args = (PARAMS, opt_state, MLP_BATCH)
  candidates = [1, 16, 256]
  peaks = {k: reference_peak(make_step(k), *args) for k in candidates}
  budget = (peaks[1] + peaks[16]) // 2
  fit = jaccum.fit_train_step(
    make_step, *args, memory_budget=budget, batch_size=BATCH, candidates=candidates
  )
  assert fit.num_microbatches == smallest_fitting(peaks, budget) == 16
  assert fit.tried == peaks
  # Params, Adam's state and the batch are arguments; the outputs reuse the
  # donated params and Adam's state.
  chosen = fit.stats[16]
  assert chosen.argument_bytes == nbytes(args)
  assert chosen.alias_bytes == nbytes((PARAMS, opt_state))
  assert peaks[16] < reference_peak(make_step(16, donate=False), *args)


def test_accumulate_options_pass_through_and_concrete_args_match_abstract():
  def loss(batch, params):
    return mlp_loss(params, batch)

  options = {"batch_argnums": 0, "split": "contiguous"}
  candidates = [1, 8, 64]
  abstract = (MLP_BATCH, PARAMS)
  peaks = reference_peaks(jax.grad(loss, 1), abstract, candidates, **options)
  budget = (peaks[1] + peaks[8]) // 2
  fits = [
    jaccum.fit_microbatches(
      jax.grad(loss, 1), *args, memory_budget=budget, candidates=candidates, **options
    )
    for args in [abstract, concrete(abstract)]
  ]
  assert fits[0].tried == fits[1].tried == peaks
  assert fits[0].num_microbatches == fits[1].num_microbatches == 8


def test_fraction_of_the_reported_device_memory(mlp_peaks, monkeypatch):
  limit = 4 * mlp_peaks[64]

  class Device:
    platform = "fake"

    def memory_stats(self):
      return {"bytes_limit": limit, "bytes_in_use": 0}

  monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [Device()])
  fit = jaccum.fit_microbatches(
    jax.grad(mlp_loss), PARAMS, MLP_BATCH, memory_budget=0.25, candidates=[32, 64]
  )
  assert fit.memory_budget == limit // 4 == mlp_peaks[64]
  assert fit.num_microbatches == 64


def test_the_report_is_a_table_of_every_k_tried(mlp_fits):
  budget, fit, _, _ = mlp_fits[2]
  title, header, *rows = str(fit).splitlines()
  share = fit.peak_bytes / budget
  assert title == (
    f"memory budget {budget / 2**20:.2f} MiB per device: K=64, peak "
    f"{fit.peak_bytes / 2**20:.2f} MiB ({share:.1%} of the budget)"
  )
  assert header.split() == [
    "K",
    "order",
    "arguments",
    "outputs",
    "temporaries",
    "aliased",
    "peak",
  ]
  cells = [row.split() for row in rows]
  assert [int(row[0]) for row in cells] == sorted(fit.tried)
  order = list(fit.tried)
  assert [int(row[1]) for row in cells] == [
    order.index(int(row[0])) + 1 for row in cells
  ]
  assert {int(row[0]): row[-1] for row in cells} == {
    k: "chosen" if k == 64 else "fits" if peak <= budget else "over"
    for k, peak in fit.tried.items()
  }
  units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
  for row in cells:
    shown = float(row[-3]) * units[row[-2]]
    assert abs(shown - fit.tried[int(row[0])]) <= 0.005 * units[row[-2]], row


# Errors.


def fit_mlp(**kwargs):
  kwargs.setdefault("memory_budget", 2**30)
  return jaccum.fit_microbatches(jax.grad(mlp_loss), PARAMS, MLP_BATCH, **kwargs)


@pytest.mark.parametrize("budget", [0, -1, -0.5, 0.0, float("nan")])
def test_memory_budget_must_be_positive(budget):
  with pytest.raises(ValueError, match=r"memory_budget must be positive"):
    fit_mlp(memory_budget=budget)


@pytest.mark.parametrize("budget", [True, "1GB", None])
def test_memory_budget_must_be_a_number(budget):
  with pytest.raises(TypeError, match=r"memory_budget must be bytes \(an int\)"):
    fit_mlp(memory_budget=budget)


def test_a_float_budget_above_one_says_to_pass_bytes():
  with pytest.raises(
    ValueError, match=r"must be in \(0, 1\]; pass bytes as an int, e.g. memory_budget"
  ):
    fit_mlp(memory_budget=2e9)


def test_a_fraction_on_a_backend_without_memory_stats_says_to_pass_bytes():
  assert jax.local_devices()[0].memory_stats() is None  # XLA:CPU reports none
  with pytest.raises(
    ValueError, match=r"the cpu backend does not report its memory.*pass the budget"
  ):
    fit_mlp(memory_budget=0.5)


@pytest.mark.parametrize(
  ("candidates", "error", "message"),
  [
    ([3, 4, 6], ValueError, r"candidates \[3, 6\] do not divide the batch size 1024"),
    ([0, 2], ValueError, r"candidates must be positive, got \[0\]"),
    ([-4], ValueError, r"candidates must be positive, got \[-4\]"),
    ([2.0], TypeError, r"candidates must be ints, got \[2.0\]"),
    ([True], TypeError, r"candidates must be ints"),
    ([], ValueError, r"candidates is empty"),
    (8, TypeError, r"candidates must be a sequence of positive ints"),
  ],
)
def test_bad_candidates(candidates, error, message, monkeypatch):
  monkeypatch.setattr(_fit, "_memory", lambda *a: pytest.fail("compiled"))
  with pytest.raises(error, match=message):
    fit_mlp(candidates=candidates)


def test_no_fit_names_the_smallest_peak_and_the_temporaries(mlp_peaks):
  budget = mlp_peaks[1024] // 2  # below every peak; activations dominate at K=2
  with pytest.raises(ValueError) as error:
    fit_mlp(memory_budget=budget, candidates=[1, 2])
  message = str(error.value)
  assert f"no candidate K fits memory_budget={budget}" in message
  assert f"the smallest peak is {mlp_peaks[2] / 2**20:.2f} MiB at K=2" in message
  assert "The temporaries (activations) dominate" in message


def test_no_fit_names_the_arguments_when_they_dominate():
  params = {"w": SDS((4096, 512), jnp.float32)}  # 8 MiB of params and grads
  x = SDS((16, 4096), jnp.float32)  # 256 KiB of batch, small activations
  loss = lambda params, x: jnp.mean(jnp.tanh(x @ params["w"]))
  with pytest.raises(ValueError) as error:
    jaccum.fit_microbatches(
      jax.grad(loss), params, x, memory_budget=2**20, candidates=[1, 16]
    )
  message = str(error.value)
  assert "at K=16: arguments 8.25 MiB, outputs 8.00 MiB" in message
  assert "The arguments and outputs (params, batch, gradients," in message


def test_fit_train_step_needs_the_batch_size_or_candidates(monkeypatch):
  monkeypatch.setattr(_fit, "_memory", lambda *a: pytest.fail("compiled"))
  with pytest.raises(TypeError, match=r"needs batch_size= .* or candidates="):
    jaccum.fit_train_step(fake_step, PARAMS, memory_budget=2**20)
  with pytest.raises(ValueError, match=r"batch_size must be a positive int, got 0"):
    jaccum.fit_train_step(fake_step, PARAMS, memory_budget=2**20, batch_size=0)
  with pytest.raises(TypeError, match=r"batch_size must be a positive int, got 8.0"):
    jaccum.fit_train_step(fake_step, PARAMS, memory_budget=2**20, batch_size=8.0)
  with pytest.raises(ValueError, match=r"candidates \[3\] do not divide batch_size=8"):
    jaccum.fit_train_step(
      fake_step, PARAMS, memory_budget=2**20, batch_size=8, candidates=[3]
    )
  with pytest.raises(TypeError, match=r"make_step\(1\) must return a step function"):
    jaccum.fit_train_step(lambda k: None, PARAMS, memory_budget=2**20, batch_size=1)
  with pytest.raises(TypeError, match=r"make_step must be callable"):
    jaccum.fit_train_step(None, PARAMS, memory_budget=2**20, batch_size=1)


def test_bad_options_fail_before_compiling(monkeypatch):
  monkeypatch.setattr(_fit, "_memory", lambda *a: pytest.fail("compiled"))
  with pytest.raises(ValueError, match=r"reduce"):
    fit_mlp(reduce="median")
  with pytest.raises(ValueError, match=r"batch_argnums=5 points past the 2"):
    fit_mlp(batch_argnums=5)
  with pytest.raises(ValueError, match=r"needs a mesh"):
    fit_mlp(axis="data")
  with pytest.raises(TypeError, match=r"takes `axis`, not `axis_name`"):
    fit_mlp(mesh=None, axis_name="data")


def test_plain_accumulate_on_an_explicitly_sharded_batch_counts_rows_per_device():
  """accumulate loops per device on such a batch: K divides 64 / 8 = 8 rows."""
  explicit = jax.make_mesh((8,), ("data",))
  sharded = jax.NamedSharding(explicit, jax.P("data"))
  batch = {
    "x": SDS((64, 32), jnp.float32, sharding=sharded),
    "y": SDS((64, 1), jnp.float32, sharding=sharded),
  }
  fit = jaccum.fit_microbatches(jax.grad(mlp_loss), PARAMS, batch, memory_budget=2**40)
  assert fit.num_microbatches == 1
  with pytest.raises(ValueError, match=r"per-device batch size 8 \(64 rows over 8"):
    jaccum.fit_microbatches(
      jax.grad(mlp_loss), PARAMS, batch, memory_budget=2**30, candidates=[16]
    )


def test_a_middle_k_that_fits_is_found_when_both_ends_are_over_the_budget():
  """Memory can dip in the middle: "no candidate fits" is checked before it is said.

  Before, with K=1 and K=64 over the budget and K=8 within it, the search
  raised "no candidate K fits" without compiling K=8.
  """
  peaks = {1: 100, 2: 90, 4: 60, 8: 40, 16: 70, 32: 80, 64: 95}
  fit, compiled = search(peaks, 50)
  assert 8 in compiled and fit is not None and fit.num_microbatches == 8
  assert fit.peak_bytes == 40


def test_return_stats_skips_k1_on_one_device():
  """K = 1 has one batch size: fit the smallest K >= 2 (it crashed compiling K=1)."""
  loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
  w, x = SDS((16, 32), jnp.float32), SDS((64, 16), jnp.float32)
  fit = jaccum.fit_microbatches(
    jax.grad(loss), w, x, memory_budget=2**30, return_stats=True
  )
  assert fit.num_microbatches == 2 and 1 not in fit.tried
  with pytest.raises(
    ValueError, match=r"return_stats=True needs K >= 2.*only candidate"
  ):
    jaccum.fit_microbatches(
      jax.grad(loss),
      w,
      SDS((1, 16), jnp.float32),
      memory_budget=2**30,
      return_stats=True,
    )


def test_a_batch_of_zero_rows_is_named():
  """A zero-row batch: a ValueError saying so (it was an IndexError)."""
  loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
  with pytest.raises(ValueError, match=r"the batch \(args\[1\]\) has 0 rows"):
    jaccum.fit_microbatches(
      jax.grad(loss),
      SDS((16, 32), jnp.float32),
      SDS((0, 16), jnp.float32),
      memory_budget=2**30,
    )

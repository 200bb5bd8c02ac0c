"""Tests for `jaccum.inspect`: collectives inside and outside loops, memory figures."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaccum import inspect

NUM_DEVICES = 8
ZERO = inspect.Count(0, 0)


def counts(report):
  """The counts alone, inside and outside loops, of a Count or CollectiveCounts."""
  if isinstance(report, inspect.Count):
    return (report.inside_loops, report.outside_loops)
  return [counts(count) for count in report]


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() == NUM_DEVICES, "tests/conftest.py sets 8 CPU devices"
  return jax.make_mesh(
    (NUM_DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )


def per_device(mesh, fn):
  """`fn` on each device's columns of a `[rows, 8 * cols]` array."""
  return jax.shard_map(
    fn, mesh=mesh, in_specs=jax.P(None, "data"), out_specs=jax.P(None, "data")
  )


def scan_sum(body, xs):
  """`lax.scan` over the rows of `xs`, summing `body(row)` into the carry."""
  total, _ = jax.lax.scan(lambda c, x: (c + body(x), None), jnp.zeros_like(xs[0]), xs)
  return total


XS = jnp.ones((4, NUM_DEVICES * 8))


def test_psum_inside_scan_and_after_it(mesh):
  step = per_device(
    mesh,
    lambda xs: jax.lax.psum(scan_sum(lambda x: jax.lax.psum(x, "data"), xs), "data")[
      None
    ],
  )
  report = inspect.collectives(step, XS)
  assert counts(report) == [(1, 1), (0, 0), (0, 0), (0, 0), (0, 0)]
  assert (report.inside_loops, report.outside_loops) == (1, 1)


def test_loop_with_a_wide_carry(mesh):
  """Six or more carried arrays print `/*index=5*/` in the body's signature."""

  def step(xs):
    def body(carry, x):
      return tuple(c + jax.lax.psum(x * i, "data") for i, c in enumerate(carry)), None

    carry, _ = jax.lax.scan(body, (jnp.zeros_like(xs[0]),) * 7, xs)
    return jax.lax.pmax(sum(carry), "data")[None]

  report = inspect.collectives(per_device(mesh, step), XS)
  # XLA may combine the seven psums of one iteration into fewer all-reduces.
  assert report.all_reduce.inside_loops >= 1
  assert report.all_reduce.outside_loops == 1


def test_no_collectives_reports_zeros():
  report = inspect.collectives(lambda xs: scan_sum(jnp.sin, xs) @ xs.T, XS)
  assert counts(report) == [(0, 0)] * 5
  assert (report.inside_loops, report.outside_loops) == (0, 0)


def test_gather_scatter_permute_all_to_all_outside_loops(mesh):
  ring = [(i, (i + 1) % NUM_DEVICES) for i in range(NUM_DEVICES)]

  def step(xs):
    gathered = jax.lax.all_gather(xs, "data", axis=1, tiled=True)  # [4, 64]
    scattered = jax.lax.psum_scatter(gathered, "data", scatter_dimension=1, tiled=True)
    shifted = jax.lax.ppermute(xs, "data", ring)
    swapped = jax.lax.all_to_all(xs, "data", split_axis=1, concat_axis=1, tiled=True)
    return scattered + shifted + swapped

  report = inspect.collectives(per_device(mesh, step), XS)
  assert counts(report.all_gather) == (0, 1)
  assert counts(report.reduce_scatter) == (0, 1)
  assert counts(report.collective_permute) == (0, 1)
  assert counts(report.all_to_all) == (0, 1)
  assert report.inside_loops == 0


def test_gather_and_scatter_inside_loop_are_counted_inside(mesh):
  def body(x):
    gathered = jax.lax.all_gather(x, "data", tiled=True)  # [64]
    return jax.lax.psum_scatter(jnp.sin(gathered), "data", tiled=True)

  report = inspect.collectives(
    per_device(mesh, lambda xs: scan_sum(body, xs)[None]), XS
  )
  assert counts(report.all_gather) == (1, 0)
  assert counts(report.reduce_scatter) == (1, 0)
  assert report.outside_loops == 0


def test_collectives_in_computations_called_from_a_loop_body(mesh):
  """A psum in a `cond` branch inside a nested scan still runs per iteration."""

  def body(x):
    branch = jax.lax.cond(
      x[0] > 0, lambda v: jax.lax.psum(v, "data") + v, lambda v: v * 2.0, x
    )
    return scan_sum(lambda y: jax.lax.pmax(y, "data"), jnp.stack([branch, x]))

  report = inspect.collectives(
    per_device(mesh, lambda xs: scan_sum(body, xs)[None]), XS
  )
  assert counts(report.all_reduce) == (2, 0)


def test_jitted_function_with_static_and_keyword_arguments(mesh):
  @functools.partial(jax.jit, static_argnums=1)
  def step(xs, num_psums, *, scale):
    def local(xs):
      for _ in range(num_psums):
        xs = jax.lax.psum(xs, "data")
      return xs * scale

    return per_device(mesh, local)(xs)

  assert counts(inspect.collectives(step, XS, 3, scale=2.0).all_reduce) == (0, 3)


# GPU-style optimised HLO: async pairs, an `async-start` wrapper, an instruction
# printed over two lines, and metadata that mentions collectives in text.
ASYNC_HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b), metadata={op_name="not an all-reduce(x) here"}
}

%wrapped_reduce_scatter (p: f32[8]) -> f32[1] {
  %p = f32[8]{0} parameter(0)
  ROOT %rs = f32[1]{0} reduce-scatter(f32[8]{0} %p), replica_groups={{0,1,2,3,4,5,6,7}},
      dimensions={0}, to_apply=%add
}

%body (state: (s32[], f32[8])) -> (s32[], f32[8]) {
  %state = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[8]{0} get-tuple-element(%state), index=1
  %ars = f32[8]{0} all-reduce-start(%x), replica_groups={}, to_apply=%add
  %ard = f32[8]{0} all-reduce-done(%ars)
  %rss = ((f32[8]{0}), f32[1]{0}) async-start(%ard), calls=%wrapped_reduce_scatter
  %rsu = ((f32[8]{0}), f32[1]{0}) async-update(%rss), calls=%wrapped_reduce_scatter
  %rsd = f32[1]{0} async-done(%rsu), calls=%wrapped_reduce_scatter
  %ags = (f32[1]{0}, f32[8]{0}) all-gather-start(%rsd), dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  ROOT %out = (s32[], f32[8]{0}) tuple(%i, %agd)
}

%cond (state: (s32[], f32[8])) -> pred[] {
  %state = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0), metadata={op_name="collective-permute-start(%x)"}
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %x)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %y = f32[8]{0} get-tuple-element(%loop), index=1
  %cps = (f32[8]{0}, f32[8]{0}) collective-permute-start(%y),
      source_target_pairs={{0,1}}
  %cpd = f32[8]{0} collective-permute-done(%cps)
  ROOT %ar = f32[8]{0} all-reduce(%cpd), replica_groups={}, to_apply=%add
}
"""


def test_async_pairs_count_once():
  report = inspect._count_collectives(ASYNC_HLO)
  assert counts(report) == [(1, 1), (1, 0), (1, 0), (0, 0), (0, 1)]
  # The loop has no known trip count: its bytes per step are unknown.
  assert report.all_reduce.bytes_inside_loops is None
  assert report.all_reduce.bytes_outside_loops == 32  # f32[8]
  assert report.collective_permute.bytes_outside_loops == 32
  assert report.bytes_per_step is None


def test_collectives_str_is_a_table():
  report = inspect.CollectiveCounts(
    inspect.Count(3, 1), ZERO, inspect.Count(0, 2), ZERO, ZERO
  )
  lines = str(report).splitlines()
  assert lines[0].split() == [
    "collective", "inside", "loops", "outside", "loops", "bytes", "in", "loops",
    "bytes", "outside",
  ]  # fmt: skip
  assert [line.split()[:3] for line in lines[1:]] == [
    ["all-reduce", "3", "1"],
    ["reduce-scatter", "0", "0"],
    ["all-gather", "0", "2"],
    ["all-to-all", "0", "0"],
    ["collective-permute", "0", "0"],
  ]


def test_memory_matches_memory_analysis():
  def fn(w, x):
    return jnp.tanh(x @ w).sum(0) + jnp.sin(w).sum(0)

  w, x = jnp.ones((32, 16)), jnp.ones((128, 32), jnp.float32)
  stats = inspect.memory(fn, w, x)
  analysis = jax.jit(fn).lower(w, x).compile().memory_analysis()
  assert stats == inspect.MemoryStats(
    temp_bytes=analysis.temp_size_in_bytes,
    argument_bytes=analysis.argument_size_in_bytes,
    output_bytes=analysis.output_size_in_bytes,
    alias_bytes=analysis.alias_size_in_bytes,
    generated_code_bytes=analysis.generated_code_size_in_bytes,
    peak_bytes=analysis.peak_memory_in_bytes,
  )
  # Independent of XLA: the argument and output buffers are these arrays.
  assert stats.argument_bytes == w.nbytes + x.nbytes
  assert stats.output_bytes == 16 * 4


def test_memory_sees_donation_and_shape_structs():
  fn = jax.jit(lambda x: x * 2, donate_argnums=0)
  x = jax.ShapeDtypeStruct((1024,), np.float32)
  stats = inspect.memory(fn, x)
  assert (stats.argument_bytes, stats.output_bytes, stats.alias_bytes) == (4096,) * 3
  lines = str(stats).splitlines()
  assert [line.split()[0] for line in lines] == [
    "temp",
    "argument",
    "output",
    "alias",
    "generated",
    "peak",
  ]
  assert lines[1].split()[-2:] == ["4,096", "B"]

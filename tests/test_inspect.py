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


# Collectives by mesh axis: the device groups XLA prints, read back to axes.

LAYOUT_4x2 = inspect._layout(jax.sharding.AbstractMesh((4, 2), ("data", "model")))


@pytest.mark.parametrize(
  ("text", "groups"),
  [
    ("x, replica_groups={{0,1,2,3},{4,5,6,7}}, d", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups={}, to_apply=%add", [list(range(8))]),
    ("x, replica_groups=[2,4]<=[8], d", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("x, replica_groups=[4,2]<=[2,4]T(1,0), d", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("source_target_pairs={{0,2},{2,4},{6,0}}, m", [[0, 2], [2, 4], [6, 0]]),
    # Mesh axes: XLA's mesh, (4, 1, 2) holding 0, 4, 1, 5, ...; groups along axis_0.
    (
      "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0))"
      " {'axis_0'}, dimensions={0}",
      [[0, 1, 2, 3], [4, 5, 6, 7]],
    ),
    (
      "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0))"
      " {'axis_2'}, dimensions={0}",
      [[0, 4], [1, 5], [2, 6], [3, 7]],
    ),
    # Unquoted names, ids in order (not printed), two axes grouped.
    ("replica_groups=mesh[a=2,b=2,c=2] {a,c}, x", [[0, 1, 4, 5], [2, 3, 6, 7]]),
    # Listed ids; groups of one device where no axis is braced.
    ("replica_groups=mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'b'}", [[3, 2], [1, 0]]),
    ("replica_groups=mesh['a'=4] {}, x", [[0], [1], [2], [3]]),
    # Sub-axes, major first: a=8 as [2, 4] (the first 2) or [2, 2, 2] (the middle).
    ("replica_groups=mesh['a'=8] {'a':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['a'=8] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("replica_groups=maximal_mesh[device_id=0] {}", None),
  ],
)
def test_device_groups_reads_each_form_xla_prints(text, groups):
  assert inspect._device_groups(text, 8) == groups


@pytest.mark.parametrize(
  ("groups", "key"),
  [
    ("{{0,2,4,6},{1,3,5,7}}", "data"),
    ("{{0,1},{2,3},{4,5},{6,7}}", "model"),
    ("{{0,1,2,3,4,5,6,7}}", ("data", "model")),
    ("{}", ("data", "model")),
    ("{{0,4}}", "data"),  # part of the axis: still over it
    ("{{0,3}}", ("data", "model")),
    ("{{0},{1},{2},{3},{4},{5},{6},{7}}", ()),
    ("{{0,9}}", None),  # a device the mesh does not have
  ],
)
def test_axes_of_groups_on_a_data_4_model_2_mesh(groups, key):
  """Position i sits at (i // 2, i % 2): "data" varies across pairs, "model" within."""
  assert inspect._axes_spanned(f"replica_groups={groups}", LAYOUT_4x2) == key
  if key not in (None, ()):
    pairs = f"source_target_pairs={groups}"
    assert inspect._axes_spanned(pairs, LAYOUT_4x2) == key


def shard_map_psums(mesh):
  """On each device's 8 columns: a psum over "data" in a 4-step scan, then
  one over "model" and one over both."""

  def step(xs):
    total = scan_sum(lambda x: jax.lax.psum(x, "data"), xs)
    return (jax.lax.psum(total, "model") + jax.lax.psum(2 * total, ("data", "model")))[
      None
    ]

  columns = jax.P(None, ("data", "model"))
  return jax.shard_map(step, mesh=mesh, in_specs=columns, out_specs=columns)


AUTO_4x2 = dict(axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("devices", ["in order", "transposed"])
def test_by_axis_psums_on_a_data_4_model_2_mesh(devices):
  """Hand-counted from the HLO: three all-reduces of f32[8], with groups
  {{0,2,4,6},{1,3,5,7}} (in the loop), {{0,1},...,{6,7}} and {{0,...,7}}.

  The ids are positions in the mesh's devices, not device ids: with the
  devices transposed (position 1 holds device 4), the HLO and the axes are
  the same.
  """
  if devices == "in order":
    mesh = jax.make_mesh((4, 2), ("data", "model"), **AUTO_4x2)
  else:
    grid = np.array(jax.devices()).reshape(2, 4).T
    mesh = jax.sharding.Mesh(grid, ("data", "model"), **AUTO_4x2)
  report = inspect.collectives(shard_map_psums(mesh), XS)
  assert report.by_axis == {
    "data": inspect.Count(1, 0, 4 * 32, 0),
    "model": inspect.Count(0, 1, 0, 32),
    ("data", "model"): inspect.Count(0, 1, 0, 32),
  }
  assert list(report.by_axis) == ["data", "model", ("data", "model")]
  assert str(report).splitlines()[-4:] == [
    "over mesh axes",
    "data                             1              0            128 B            0 B",
    "model                            0              1              0 B           32 B",
    "data, model                      0              1              0 B           32 B",
  ]


def tensor_parallel_mlp(mesh):
  """Megatron-style: w1 split by columns, w2 by rows over "model"; rows over "data"."""

  def put(x, *spec):
    return jax.device_put(x, jax.NamedSharding(mesh, jax.P(*spec)))

  params = {
    "w1": put(jnp.ones((16, 64)) / 16, None, "model"),
    "w2": put(jnp.ones((64, 8)) / 64, "model", None),
  }

  def loss(params, x):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"]) ** 2)

  return jax.grad(loss), params, put(jnp.ones((64, 16)), "data")


def test_by_axis_tells_the_models_collectives_from_the_data_axis():
  """Hand-counted from the HLO, K = 4 over 16 rows per device: the row-parallel
  matmul's all-reduce of f32[4,8] (4 rows) runs in every micro-step over
  "model" under both; plain `accumulate` on this auto mesh adds an
  all-reduce over "data" of both gradients (f32[16,32] and f32[32,8]) in
  every micro-step, which `data_parallel` runs once, after the loop.
  """
  import jaccum

  mesh = jax.make_mesh((4, 2), ("data", "model"), **AUTO_4x2)
  grad_fn, params, x = tensor_parallel_mlp(mesh)
  grads = 4 * (16 * 32 + 32 * 8)
  plain = jax.jit(jaccum.accumulate(grad_fn, 4))
  parallel = jax.jit(jaccum.data_parallel(grad_fn, 4, mesh=mesh))
  assert inspect.collectives(plain, params, x).by_axis == {
    "data": inspect.Count(1, 0, 4 * grads, 0),
    "model": inspect.Count(1, 0, 4 * 4 * 8 * 4, 0),
  }
  assert inspect.collectives(parallel, params, x).by_axis == {
    "data": inspect.Count(0, 1, 0, grads),
    "model": inspect.Count(1, 0, 4 * 4 * 8 * 4, 0),
  }
  # What a warning about data-axis collectives in the loop would name.
  text = plain.lower(params, x).compile().as_text()
  assert inspect._inside_loops_by_axis(text, mesh) == {"data": 1, "model": 1}
  assert inspect._inside_loops_by_axis(text, mesh, ["data"]) == {"data": 1}
  text = parallel.lower(params, x).compile().as_text()
  assert inspect._inside_loops_by_axis(text, mesh, ["data"]) == {}


def test_by_axis_on_a_data_fsdp_tensor_mesh():
  """(data=2, fsdp=2, tensor=2): position i sits at (i // 4, i // 2 % 2, i % 2).

  Hand-counted: an all-gather of f32[16] over "fsdp" ({{0,2},{1,3},...}) in
  a 4-step scan; psums of f32[8] after it over "fsdp", ("data", "fsdp")
  ({{0,2,4,6},{1,3,5,7}}), "tensor" and ("data", "tensor") ({{0,1,4,5},...}).
  """
  auto = (jax.sharding.AxisType.Auto,) * 3
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=auto)

  def step(xs):
    gather = lambda x: jax.lax.all_gather(x, "fsdp", tiled=True)[: x.shape[0]]
    total = scan_sum(gather, xs)
    sums = [
      jax.lax.psum(i * total, axes)
      for i, axes in enumerate(
        ["fsdp", ("data", "fsdp"), "tensor", ("data", "tensor")], start=1
      )
    ]
    return sum(sums)[None]

  columns = jax.P(None, ("data", "fsdp", "tensor"))
  step = jax.shard_map(
    step, mesh=mesh, in_specs=columns, out_specs=columns, check_vma=False
  )
  assert inspect.collectives(step, XS).by_axis == {
    "fsdp": inspect.Count(1, 1, 4 * 64, 32),
    "tensor": inspect.Count(0, 1, 0, 32),
    ("data", "fsdp"): inspect.Count(0, 1, 0, 32),
    ("data", "tensor"): inspect.Count(0, 1, 0, 32),
  }


def test_by_axis_of_a_tensor_parallel_grad_on_an_explicit_3d_mesh():
  """The mesh from `jax.set_mesh`. Hand-counted: the row-parallel matmul's
  all-reduce of f32[8,8] over "tensor" ({{0,1},...}), and one of both
  gradients (f32[32,16], f32[8,32]) over the batch's axes ("data", "fsdp"),
  printed as an iota, [2,4]<=[4,2]T(1,0)."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  batch = jax.P(("data", "fsdp"))

  def put(x, *spec):
    return jax.device_put(x, jax.NamedSharding(mesh, jax.P(*spec)))

  params = {
    "w1": put(jnp.ones((16, 64)) / 16, None, "tensor"),
    "w2": put(jnp.ones((64, 8)) / 64, "tensor", None),
  }

  def loss(params, x):
    hidden = jnp.tanh(x @ params["w1"])
    return jnp.mean(jnp.matmul(hidden, params["w2"], out_sharding=batch) ** 2)

  with jax.set_mesh(mesh):
    report = inspect.collectives(
      jax.grad(loss), params, put(jnp.ones((32, 16)), *batch)
    )
  assert report.by_axis == {
    "tensor": inspect.Count(0, 1, 0, 8 * 8 * 4),
    ("data", "fsdp"): inspect.Count(0, 1, 0, (32 * 16 + 8 * 32) * 4),
  }


def test_by_axis_is_empty_without_a_mesh_and_kept_by_replace():
  report = inspect.collectives(lambda xs: scan_sum(jnp.sin, xs), XS)
  assert report.by_axis == {}
  assert "over mesh axes" not in str(report)
  counts = inspect._count_collectives(ASYNC_HLO, LAYOUT_4x2)
  assert counts.by_axis == {
    ("data", "model"): inspect.Count(3, 1, None, 32),  # replica_groups={}
    "model": inspect.Count(0, 1, 0, 32),  # source_target_pairs={{0,1}}
  }
  replaced = counts._replace(all_to_all=inspect.Count(0, 1))
  assert replaced.by_axis == counts.by_axis and replaced.all_to_all.outside_loops == 1
  assert "by_axis={'model': Count(inside_loops=0, outside_loops=1," in repr(counts)
  assert len(counts) == 5 and list(counts._fields)[-1] == "collective_permute"

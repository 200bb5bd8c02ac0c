"""Reports on a compiled step: its collectives, inside loops or not, and its memory.

Run them on your own train step to check what XLA will execute: no collective
inside the accumulation loop (one reduction per step, not one per micro-batch),
and how many bytes of temporaries the step needs.
"""

from __future__ import annotations

import itertools
import math
import re
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["CollectiveCounts", "Count", "MemoryStats", "collectives", "memory"]

_KINDS = (
  "all-reduce",
  "reduce-scatter",
  "all-gather",
  "all-to-all",
  "collective-permute",
)
# Attributes through which an instruction runs other computations.
_CALLS = re.compile(
  r"\b(to_apply|calls|body|condition|true_computation|false_computation|"
  r"branch_computations|called_computations|select|scatter)=(\{[^{}]*\}|%?[\w.\-]+)"
)
# A computation opens at a line `[ENTRY ]%name (params) -> type {`; its
# instructions are indented. Tuple types may hold `/*index=5*/` comments.
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s({]+).*\{\s*$")
# Its name and ` = ` (an attribute continued on the next line, `dimensions={0}`,
# has no spaces around its `=`).
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s+=\s")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# An array type in HLO text: `f32[16,8]{1,0}`, `bf16[]`, `pred[4]`.
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")
# The device groups of a collective, in the forms XLA prints (see _device_groups).
_LISTED = re.compile(
  r"(replica_groups|source_target_pairs)=\{((?:\{[\d,\s]*\},?\s*)*)\}"
)
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(
  r"replica_groups=mesh\[([^\]]*)\]"
  r"(?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?\s*\{([^}]*)\}"
)
# A mesh's axis `'name'=4` (or `name=4`); a grouped axis `'name'` or a sub-axis
# `'name':(2)4` (size 4 of the axis, after the 2 that come before it, major first).
_MESH_AXIS = re.compile(r"'?([^'=,\s]+)'?=(\d+)")
_GROUPED_AXIS = re.compile(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?")

# A by_axis key: one axis name, the names of several in mesh order, () for
# groups of one device, None for groups in a form this module cannot read.
AxisKey = str | tuple[str, ...] | None


class Count(NamedTuple):
  """How often one kind of collective appears in the compiled program.

  Attributes:
    inside_loops: in a while loop's body or condition, or in a computation
      they call: it runs once per iteration.
    outside_loops: everywhere else.
    bytes_inside_loops: the bytes those inside loops move in one step, each
      counted once per iteration; None where a loop's trip count is unknown.
    bytes_outside_loops: the bytes those outside loops move in one step.

  Bytes are per device: the array each instruction reduces (all-reduce,
  reduce-scatter: its operand), gathers (all-gather: its result) or sends
  (all-to-all, collective-permute: its operand). A ring all-reduce of S
  bytes sends about 2S(D-1)/D of them and receives as many; a reduce-scatter
  or an all-gather about S(D-1)/D.

  Examples:
    `data_parallel` runs no collective inside its loop and one all-reduce
    after it:

    >>> import jax, jax.numpy as jnp, jaccum, jaccum.inspect
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> step = jax.jit(jaccum.data_parallel(jax.grad(loss), 4, mesh=mesh))
    >>> x = jnp.ones((8 * jax.device_count(), 2))
    >>> count = jaccum.inspect.collectives(step, jnp.ones(2), x).all_reduce
    >>> count
    Count(inside_loops=0, outside_loops=1, bytes_inside_loops=0, bytes_outside_loops=8)
    >>> count.inside_loops, count.bytes_outside_loops  # two float32 gradients
    (0, 8)
  """

  inside_loops: int
  outside_loops: int
  bytes_inside_loops: int | None = 0
  bytes_outside_loops: int = 0


class _Kinds(NamedTuple):
  """The counts by kind: the tuple that `CollectiveCounts` is."""

  all_reduce: Count
  reduce_scatter: Count
  all_gather: Count
  all_to_all: Count
  collective_permute: Count


class CollectiveCounts(_Kinds):
  """Collectives in a compiled program, by kind, inside loops and outside.

  Counts are of instructions in the optimised HLO: a loop that XLA unrolled
  shows its collectives repeated outside loops. It is a tuple of five `Count`
  values, one per kind (`all_reduce`, `reduce_scatter`, `all_gather`,
  `all_to_all`, `collective_permute`); `print` it for a table.

  Attributes:
    by_axis: the same collectives by the mesh axes their device groups span:
      `{axis: Count}`, the key one axis name (`"data"`), or the names of
      several in mesh order (`("data", "model")`) for a collective whose groups
      span all of them. Devices of one group differ in those axes' coordinates
      and agree in every other's. A psum over `"data"` counts under `"data"`
      only, not also under `("data", "model")`; to ask what runs over `"data"`
      at all, sum the keys that hold it. `()` is for groups of one device,
      `None` for groups XLA printed in a form jaccum cannot read. Empty when
      no mesh is known (see `collectives`).

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum, jaccum.inspect
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> step = jax.jit(jaccum.data_parallel(jax.grad(loss), 4, mesh=mesh))
    >>> x = jnp.ones((8 * jax.device_count(), 2))
    >>> counts = jaccum.inspect.collectives(step, jnp.ones(2), x)
    >>> counts.all_reduce.outside_loops, counts.all_gather.outside_loops
    (1, 0)
    >>> counts.inside_loops, counts.outside_loops  # all kinds together
    (0, 1)
    >>> counts.bytes_per_step
    8
    >>> counts.by_axis["data"].outside_loops
    1
    >>> print(counts)
    collective          inside loops  outside loops   bytes in loops  bytes outside
    all-reduce                     0              1              0 B            8 B
    reduce-scatter                 0              0              0 B            0 B
    all-gather                     0              0              0 B            0 B
    all-to-all                     0              0              0 B            0 B
    collective-permute             0              0              0 B            0 B
    over mesh axes
    data                           0              1              0 B            8 B
  """

  by_axis: Mapping[AxisKey, Count]

  def __new__(
    cls,
    all_reduce: Count,
    reduce_scatter: Count,
    all_gather: Count,
    all_to_all: Count,
    collective_permute: Count,
    by_axis: Mapping[AxisKey, Count] | None = None,
  ) -> CollectiveCounts:
    self = super().__new__(
      cls, all_reduce, reduce_scatter, all_gather, all_to_all, collective_permute
    )
    # Not a tuple field: code that iterates over the kinds (zip with
    # `_fields`, sums over `self`) keeps seeing five `Count`s.
    self.by_axis = types.MappingProxyType(dict(by_axis or {}))
    return self

  def _replace(self, **kwargs: Any) -> CollectiveCounts:
    by_axis = kwargs.pop("by_axis", self.by_axis)
    return CollectiveCounts(*super()._replace(**kwargs), by_axis=by_axis)

  def __repr__(self) -> str:
    return f"{super().__repr__()[:-1]}, by_axis={dict(self.by_axis)!r})"

  @property
  def inside_loops(self) -> int:
    """All collectives inside loops: 0 for one reduction per step."""
    return sum(count.inside_loops for count in self)

  @property
  def outside_loops(self) -> int:
    """All collectives outside loops."""
    return sum(count.outside_loops for count in self)

  @property
  def bytes_per_step(self) -> int | None:
    """The bytes all collectives move in one step, per device (see `Count`)."""
    inside = [count.bytes_inside_loops for count in self]
    if any(b is None for b in inside):
      return None
    return sum(b or 0 for b in inside) + sum(c.bytes_outside_loops for c in self)

  def __str__(self) -> str:
    rows = [
      ("collective", "inside loops", "outside loops", "bytes in loops", "bytes outside")
    ]
    rows += [_row(kind, n) for kind, n in zip(_KINDS, self, strict=True)]
    if self.by_axis:
      rows.append(("over mesh axes", "", "", "", ""))
      rows += [_row(_axis_label(key), n) for key, n in self.by_axis.items()]
    return "\n".join(
      f"{a:<20}{b:>14}{c:>15}{d:>17}{e:>15}".rstrip() for a, b, c, d, e in rows
    )


def _row(label: str, count: Count) -> tuple[str, str, str, str, str]:
  return (
    label,
    str(count.inside_loops),
    str(count.outside_loops),
    _format_bytes(count.bytes_inside_loops),
    _format_bytes(count.bytes_outside_loops),
  )


def _axis_label(key: AxisKey) -> str:
  if key is None:
    return "(unread groups)"
  if isinstance(key, str):
    return key
  return ", ".join(key) if key else "(one device)"


def _format_bytes(size: int | None) -> str:
  if size is None:
    return "unknown"
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if size >= scale:
      return f"{size / scale:.1f} {unit}"
  return f"{size} B"


class MemoryStats(NamedTuple):
  """XLA's memory figures for a compiled program, in bytes per device.

  Attributes:
    temp_bytes: temporaries: activations, loop carries, copies.
    argument_bytes: the inputs.
    output_bytes: the outputs.
    alias_bytes: outputs that reuse donated input buffers.
    generated_code_bytes: the compiled code.
    peak_bytes: the backend's own peak figure, or None where it gives none
      (on CPU it leaves temporaries out).

  Examples:
    >>> import jax.numpy as jnp, jaccum.inspect
    >>> stats = jaccum.inspect.memory(lambda x: jnp.sin(x) * 2, jnp.ones(256))
    >>> stats.argument_bytes, stats.output_bytes  # 256 float32 in, 256 out
    (1024, 1024)
    >>> print(stats)
    temp            ... B
    argument                 1,024 B
    output                   1,024 B
    alias                        0 B
    generated code  ...
    peak            ...
  """

  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  generated_code_bytes: int
  peak_bytes: int | None

  def __str__(self) -> str:
    return "\n".join(
      f"{name.removesuffix('_bytes').replace('_', ' '):<16}"
      + ("n/a" if value is None else f"{value:>14,} B")
      for name, value in zip(self._fields, self, strict=True)
    )


class _Instruction(NamedTuple):
  """One instruction of optimised HLO text.

  `runs` is how often it runs in one step: 1 outside loops, the product of
  the enclosing loops' trip counts inside them, None where one is unknown.
  `text` is what follows `name =`, with quoted metadata emptied.
  """

  inside_loop: bool
  runs: int | None
  opcode: str
  result_type: str
  operand_types: list[str]
  text: str


def _array_bytes(type_text: str, largest: bool = False) -> int:
  """Bytes of the arrays in an HLO type (a tuple's summed, or its largest)."""
  sizes = []
  for dtype, dims in _ARRAY.findall(type_text):
    digits = re.match(r"[a-z]+(\d+)", dtype)  # f32, bf16, c64, s8, f8e4m3fn
    bits = int(digits.group(1)) if digits else 8  # pred: a byte
    elements = 1
    for d in filter(None, dims.split(",")):
      elements *= int(d)
    sizes.append((elements * bits + 7) // 8)
  return max(sizes, default=0) if largest else sum(sizes)


def _instructions(hlo_text: str) -> list[_Instruction]:
  """Each instruction of optimised HLO text, where it runs and how often."""
  lines: list[tuple[str, str]] = []  # (computation, instruction text)
  computation, entry = None, None
  for line in hlo_text.splitlines():
    header = None if line[:1].isspace() else _HEADER.match(line)
    if header and not line.startswith("HloModule"):
      computation = header.group(1)
      if line.startswith("ENTRY"):
        entry = computation
    elif line.startswith("}"):
      computation = None
    elif computation and _INSTRUCTION.match(line):
      lines.append((computation, line))
    elif computation and lines and line.strip():  # printed over lines
      lines[-1] = (computation, lines[-1][1] + " " + line.strip())

  names = {computation for computation, _ in lines}
  # caller -> [(callee, times per run of the caller: a loop's trip count, or
  # None where unknown; 1 for any other call)]
  calls: dict[str, list[tuple[str, int | None, bool]]] = {n: [] for n in names}
  types: dict[str, str] = {}
  parsed = []
  for computation, line in lines:
    name, rest = line.split("=", 1)
    trip = _TRIP_COUNT.search(rest)
    # Metadata and backend configs are quoted and may hold any text.
    rest = _QUOTED.sub('""', rest)
    match = _OPCODE.search(" " + rest)
    opcode = match.group(1) if match else ""
    result_type = rest[: match.start()] if match else ""
    types[name.replace("ROOT", "").strip().lstrip("%")] = result_type
    operands = []
    if match:  # `%name` in optimised HLO, `name` before optimisation
      inner = rest[match.end() - 1 :].split(")", 1)[0]
      operands = re.findall(r"%?([\w.\-]+)", inner)
    for attribute, value in _CALLS.findall(rest):
      for callee in set(re.findall(r"%?([\w.\-]+)", value)) & names:
        loop = opcode == "while" and attribute in ("body", "condition")
        times = (int(trip.group(1)) if trip else None) if loop else 1
        calls[computation].append((callee, times, loop))
    parsed.append((computation, opcode, result_type, operands, rest))

  # Callers before callees (the call graph has no cycles), from the entry.
  order: list[str] = []
  seen: set[str] = set()

  def visit(name: str) -> None:
    if name not in seen:
      seen.add(name)
      for callee, _, _ in calls[name]:
        visit(callee)
      order.append(name)

  for name in sorted(names):
    visit(name)
  runs: dict[str, int | None] = dict.fromkeys(names, 0)
  if entry is not None:
    runs[entry] = 1
  in_loops: set[str] = set()
  for caller in reversed(order):
    for callee, times, loop in calls[caller]:
      mine, theirs = runs[caller], runs[callee]
      if mine is None or times is None or theirs is None:
        runs[callee] = None
      else:
        runs[callee] = theirs + mine * times
      if loop or caller in in_loops:
        in_loops.add(callee)
  return [
    _Instruction(
      computation in in_loops,
      runs[computation],
      opcode,
      result_type,
      [types.get(o, "") for o in operands],
      text,
    )
    for computation, opcode, result_type, operands, text in parsed
  ]


def _iota(reshape: str, perm: str | None) -> np.ndarray:
  """XLA's iota device list `[4,2]T(1,0)`: 0..n-1 laid out as [4, 2], transposed."""
  dims = [int(d) for d in reshape.split(",")]
  order = None if perm is None else [int(d) for d in perm.split(",")]
  return np.arange(math.prod(dims)).reshape(dims).transpose(order).ravel()


def _device_groups(text: str, num_devices: int) -> list[list[int]] | None:
  """The device groups of one collective instruction, as XLA prints them.

  Listed, `replica_groups={{0,1},{2,3}}` (`{}`: one group of every device), or
  for a collective-permute `source_target_pairs={{0,1},{1,2}}` (each pair a
  group); iota, `replica_groups=[2,4]<=[4,2]T(1,0)` (0..7 laid out as [4, 2],
  transposed, read as 2 groups of 4); or mesh axes,
  `replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}` (the
  devices laid out on XLA's mesh, one group along the braced axes, or parts
  `'a':(1)2` of them, for each position on the others). None printed: every
  device. None for another form.
  The ids are positions in the program's device assignment.
  """
  if listed := _LISTED.search(text):
    groups = re.findall(r"\{([\d,\s]*)\}", listed.group(2))
    if not groups:
      return [list(range(num_devices))]
    return [[int(d) for d in g.split(",") if d.strip()] for g in groups]
  if iota := _IOTA.search(text):
    shape = [int(d) for d in iota.group(1).split(",")]
    return _iota(iota.group(2), iota.group(3)).reshape(shape).tolist()
  if not (mesh := _MESH.search(text)):
    # No groups printed: one group of every device, as XLA reads it.
    absent = "replica_groups=" not in text and "source_target_pairs=" not in text
    return [list(range(num_devices))] if absent else None
  sizes = [(name, int(n)) for name, n in _MESH_AXIS.findall(mesh.group(1))]
  ids_text = mesh.group(2)
  if ids_text is None:  # printed only where it is not 0..n-1 in order
    ids = np.arange(math.prod(n for _, n in sizes))
  elif iota := re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", ids_text):
    ids = _iota(iota.group(1), iota.group(2))
  else:
    ids = np.array([int(d) for d in ids_text.split(",")])
  refs = _GROUPED_AXIS.findall(mesh.group(3))
  # Each mesh axis cut where a grouped (sub-)axis starts or ends, major first.
  dims, grouped = [], []
  for name, size in sizes:
    mine = [(int(pre or 1), int(n or size)) for ref, pre, n in refs if ref == name]
    cuts = sorted({1, size} | {c for pre, n in mine for c in (pre, pre * n)})
    for low, high in itertools.pairwise(cuts):
      dims.append(high // low)
      grouped.append(any(pre == low for pre, _ in mine))
  order = [i for i, g in enumerate(grouped) if not g] + [
    i for i, g in enumerate(grouped) if g
  ]
  group_size = math.prod(d for d, g in zip(dims, grouped, strict=True) if g)
  return ids.reshape(dims).transpose(order).reshape(-1, group_size).tolist()


class _MeshLayout(NamedTuple):
  """Where each device of a program sits on a mesh.

  `coords[i]` is the mesh coordinate of the device that the program's
  collectives call i (its position in the program's device assignment).
  """

  names: tuple[str, ...]
  coords: np.ndarray


def _layout(mesh: Any, device_assignment: Any = None) -> _MeshLayout | None:
  """`mesh`'s layout for a program that runs on `device_assignment`.

  Without a device assignment the program's ids are positions in the mesh's
  devices, row-major (as in any program jit compiles for arrays on `mesh`).
  None if the assignment holds a device the mesh does not.
  """
  shape = tuple(mesh.axis_sizes)
  if device_assignment is None or not hasattr(mesh, "devices"):
    coords = np.stack(np.unravel_index(np.arange(math.prod(shape)), shape), -1)
    return _MeshLayout(tuple(mesh.axis_names), coords)
  where = {device: index for index, device in np.ndenumerate(mesh.devices)}
  if len(device_assignment) != mesh.size or not set(device_assignment) <= set(where):
    return None
  coords = np.array([where[d] for d in device_assignment]).reshape(-1, len(shape))
  return _MeshLayout(tuple(mesh.axis_names), coords)


def _axes_spanned(text: str, layout: _MeshLayout) -> AxisKey:
  """The mesh axes along which the devices of a collective's groups differ."""
  groups = _device_groups(text, len(layout.coords))
  if groups is None or any(d >= len(layout.coords) for g in groups for d in g):
    return None
  varies = np.zeros(len(layout.names), bool)
  for group in groups:
    coords = layout.coords[group]
    varies |= (coords != coords[:1]).any(axis=0)
  names = tuple(n for n, v in zip(layout.names, varies, strict=True) if v)
  return names[0] if len(names) == 1 else names


def _count_collectives(
  hlo_text: str, layout: _MeshLayout | None = None
) -> CollectiveCounts:
  """Counts the collectives in optimised HLO text, `compiled.as_text()`.

  With a mesh layout, also by the mesh axes each one spans.
  """
  counts: dict[Any, list[Any]] = {kind: [0, 0, 0, 0] for kind in _KINDS}
  by_axis: dict[Any, list[Any]] = {}
  for instruction in _instructions(hlo_text):
    # An async pair counts once, at its `-start`; an `async-start` wrapper
    # holds the plain op in the computation it calls.
    kind = instruction.opcode.removesuffix("-start").removeprefix("ragged-")
    if kind not in _KINDS:
      continue
    if kind == "all-gather":  # what it gathers: its result (a -start's largest)
      size = _array_bytes(instruction.result_type, largest=True)
    else:
      size = sum(_array_bytes(t) for t in instruction.operand_types)
    tallies = [counts[kind]]
    if layout is not None:
      key = _axes_spanned(instruction.text, layout)
      tallies.append(by_axis.setdefault(key, [0, 0, 0, 0]))
    where = 0 if instruction.inside_loop else 1
    for tally in tallies:
      tally[where] += 1
      total, runs = tally[2 + where], instruction.runs
      tally[2 + where] = None if total is None or runs is None else total + size * runs
  names = () if layout is None else layout.names

  def mesh_order(key: AxisKey) -> tuple[bool, bool, int, list[int]]:
    axes = _axes_of(key)
    return (key is None, key == (), len(axes), [names.index(a) for a in axes])

  return CollectiveCounts(
    *(Count(*counts[kind]) for kind in _KINDS),
    by_axis={key: Count(*by_axis[key]) for key in sorted(by_axis, key=mesh_order)},
  )


def _inside_loops_by_axis(
  hlo_text: str, mesh: Any, axes: Iterable[str] = ()
) -> dict[AxisKey, int]:
  """How many collectives of a compiled program run inside loops, by mesh axes.

  For a warning that names them: `{key: count}` as in `CollectiveCounts.by_axis`,
  only the keys with a collective inside a loop, and with `axes` (the data
  axes) only the keys that span one of them. The program's device ids are
  taken as positions in `mesh.devices` (a `Mesh` or `AbstractMesh`), as in any
  program jit compiles for arrays placed on `mesh`.

  Args:
    hlo_text: optimised HLO, `jitted.lower(*args).compile().as_text()`.
    mesh: the mesh the program runs on.
    axes: mesh axis names; none: every key.

  Returns:
    E.g. `{"data": 2, ("data", "model"): 1}`: two collectives over the data
    axis alone, one over both, each run once per iteration.
  """
  wanted = set(axes)
  counts = _count_collectives(hlo_text, _layout(mesh)).by_axis
  return {
    key: count.inside_loops
    for key, count in counts.items()
    if count.inside_loops and (not wanted or key is None or wanted & set(_axes_of(key)))
  }


def _axes_of(key: AxisKey) -> tuple[str, ...]:
  """The axis names in a by_axis key."""
  return () if key is None else (key,) if isinstance(key, str) else key


def _compile(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  return jitted.lower(*args, **kwargs).compile()


def collectives(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CollectiveCounts:
  """Compiles `fn` for the arguments and counts its collectives, in loops or not.

  The counts are also by mesh axis (`CollectiveCounts.by_axis`), on the mesh
  the program runs on: the one set with `jax.set_mesh` around the call, else
  that of the first `NamedSharding` among the compiled program's inputs, then
  its outputs (arrays placed with `jax.device_put`, a `shard_map`'s results,
  `jit(in_shardings=...)`). With none, `by_axis` is empty.

  Args:
    fn: a function, jitted or not; jit it yourself to mark static arguments.
    *args: the arguments, as arrays or `jax.ShapeDtypeStruct` objects.
    **kwargs: keyword arguments, likewise.

  Returns:
    A `CollectiveCounts`; `print` it for a table.

  Examples:
    A `psum` inside a scan runs in every iteration, the one after it once:

    >>> import jax, jax.numpy as jnp, jaccum.inspect
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> def step(xs):
    ...   body = lambda carry, x: (carry + jax.lax.psum(x, "data"), None)
    ...   total, _ = jax.lax.scan(body, jnp.zeros(xs.shape[1:]), xs)
    ...   return jax.lax.psum(total, "data")
    >>> step = jax.shard_map(step, mesh=mesh, in_specs=jax.P(None, "data"),
    ...                      out_specs=jax.P("data"))
    >>> xs = jnp.ones((4, 16 * jax.device_count()))  # 16 float32 per device
    >>> print(jaccum.inspect.collectives(step, xs))
    collective          inside loops  outside loops   bytes in loops  bytes outside
    all-reduce                     1              1            256 B           64 B
    reduce-scatter                 0              0              0 B            0 B
    all-gather                     0              0              0 B            0 B
    all-to-all                     0              0              0 B            0 B
    collective-permute             0              0              0 B            0 B
    over mesh axes
    data                           1              1            256 B           64 B

    The psum in the scan runs 4 times a step: 4 × 64 bytes.
  """
  compiled = _compile(fn, args, kwargs)
  return _count_collectives(compiled.as_text(), _program_layout(compiled))


def _program_layout(compiled: Any) -> _MeshLayout | None:
  """The layout of the mesh a compiled program runs on, as `collectives` finds it."""
  shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
  # Every sharding of one program holds its device assignment, in its order.
  assignment = next(
    (s._device_assignment for s in shardings if hasattr(s, "_device_assignment")),
    None,
  )
  # The abstract mesh only where no concrete one is set: with one, the abstract
  # mesh is its shape, and would pass where its devices did not.
  meshes = [jax.sharding.get_mesh()]
  if not meshes[0].axis_names:
    meshes = [jax.sharding.get_abstract_mesh()]
  meshes += [s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)]
  for mesh in meshes:
    if mesh.axis_names and (layout := _layout(mesh, assignment)) is not None:
      return layout
  return None


def memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryStats:
  """Compiles `fn` for the arguments and returns XLA's memory figures for it.

  Args:
    fn: a function, jitted or not; jit it yourself to mark static arguments.
    *args: the arguments, as arrays or `jax.ShapeDtypeStruct` objects.
    **kwargs: keyword arguments, likewise.

  Returns:
    A `MemoryStats` from `compiled.memory_analysis()`; `print` it for a table.

  Raises:
    RuntimeError: the backend reports no memory analysis.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum.inspect
    >>> stats = jaccum.inspect.memory(lambda x: jnp.sin(x) * 2, jnp.ones(256))
    >>> stats.argument_bytes, stats.output_bytes
    (1024, 1024)
  """
  return _memory_of(_compile(fn, args, kwargs))


def _memory_of(compiled: Any) -> MemoryStats:
  """XLA's memory figures for a program compiled already."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    raise RuntimeError(f"the {jax.default_backend()} backend reports no memory.")
  return MemoryStats(
    temp_bytes=analysis.temp_size_in_bytes,
    argument_bytes=analysis.argument_size_in_bytes,
    output_bytes=analysis.output_size_in_bytes,
    alias_bytes=analysis.alias_size_in_bytes,
    generated_code_bytes=analysis.generated_code_size_in_bytes,
    peak_bytes=getattr(analysis, "peak_memory_in_bytes", None),
  )

"""Reports on a compiled step: its collectives, inside loops or not, and its memory.

Run them on your own train step to check what XLA will execute: no collective
inside the accumulation loop (one reduction per step, not one per micro-batch),
and how many bytes of temporaries the step needs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

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
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s*=")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# An array type in HLO text: `f32[16,8]{1,0}`, `bf16[]`, `pred[4]`.
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")


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


class CollectiveCounts(NamedTuple):
  """Collectives in a compiled program, by kind, inside loops and outside.

  Counts are of instructions in the optimised HLO: a loop that XLA unrolled
  shows its collectives repeated outside loops. Fields are `Count` values, one per
  kind; `print` it for a table.

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
    >>> print(counts)
    collective          inside loops  outside loops   bytes in loops  bytes outside
    all-reduce                     0              1              0 B            8 B
    reduce-scatter                 0              0              0 B            0 B
    all-gather                     0              0              0 B            0 B
    all-to-all                     0              0              0 B            0 B
    collective-permute             0              0              0 B            0 B
  """

  all_reduce: Count
  reduce_scatter: Count
  all_gather: Count
  all_to_all: Count
  collective_permute: Count

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
    rows += [
      (
        kind,
        str(n.inside_loops),
        str(n.outside_loops),
        _format_bytes(n.bytes_inside_loops),
        _format_bytes(n.bytes_outside_loops),
      )
      for kind, n in zip(_KINDS, self, strict=True)
    ]
    return "\n".join(f"{a:<20}{b:>14}{c:>15}{d:>17}{e:>15}" for a, b, c, d, e in rows)


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


def _count_collectives(hlo_text: str) -> CollectiveCounts:
  """Counts the collectives in optimised HLO text, `compiled.as_text()`."""
  counts: dict[str, list[Any]] = {kind: [0, 0, 0, 0] for kind in _KINDS}
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
    where = 0 if instruction.inside_loop else 1
    counts[kind][where] += 1
    total, runs = counts[kind][2 + where], instruction.runs
    counts[kind][2 + where] = (
      None if total is None or runs is None else total + size * runs
    )
  return CollectiveCounts(*(Count(*counts[kind]) for kind in _KINDS))


def _compile(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  return jitted.lower(*args, **kwargs).compile()


def collectives(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CollectiveCounts:
  """Compiles `fn` for the arguments and counts its collectives, in loops or not.

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

    The psum in the scan runs 4 times a step: 4 × 64 bytes.
  """
  return _count_collectives(_compile(fn, args, kwargs).as_text())


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

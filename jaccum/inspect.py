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


class Count(NamedTuple):
  """How often one kind of collective appears in the compiled program.

  Attributes:
    inside_loops: in a while loop's body or condition, or in a computation
      they call: it runs once per iteration.
    outside_loops: everywhere else.

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
    Count(inside_loops=0, outside_loops=1)
    >>> count.inside_loops
    0
  """

  inside_loops: int
  outside_loops: int


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
    >>> counts.all_reduce, counts.all_gather
    (Count(inside_loops=0, outside_loops=1), Count(inside_loops=0, outside_loops=0))
    >>> counts.inside_loops, counts.outside_loops  # all kinds together
    (0, 1)
    >>> print(counts)
    collective          inside loops  outside loops
    all-reduce                     0              1
    reduce-scatter                 0              0
    all-gather                     0              0
    all-to-all                     0              0
    collective-permute             0              0
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

  def __str__(self) -> str:
    rows = [("collective", "inside loops", "outside loops")]
    rows += [
      (kind, str(n.inside_loops), str(n.outside_loops))
      for kind, n in zip(_KINDS, self, strict=True)
    ]
    return "\n".join(f"{a:<20}{b:>14}{c:>15}" for a, b, c in rows)


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


def _instructions(hlo_text: str) -> list[tuple[bool, str, str]]:
  """`(inside_loop, opcode, text)` for each instruction of optimised HLO text.

  `inside_loop`: in a while loop's body or condition, or in a computation they
  call. `text` is what follows `name =`, with quoted metadata emptied.
  """
  lines: list[tuple[str, str]] = []  # (computation, instruction text)
  computation = None
  for line in hlo_text.splitlines():
    header = None if line[:1].isspace() else _HEADER.match(line)
    if header and not line.startswith("HloModule"):
      computation = header.group(1)
    elif line.startswith("}"):
      computation = None
    elif computation and _INSTRUCTION.match(line):
      lines.append((computation, line))
    elif computation and lines and line.strip():  # printed over lines
      lines[-1] = (computation, lines[-1][1] + " " + line.strip())

  names = {computation for computation, _ in lines}
  calls: dict[str, set[str]] = {name: set() for name in names}
  loop_roots, parsed = set(), []
  for computation, line in lines:
    # Metadata and backend configs are quoted and may hold any text.
    line = _QUOTED.sub('""', line.split("=", 1)[1])
    match = _OPCODE.search(" " + line)
    opcode = match.group(1) if match else ""
    for attribute, value in _CALLS.findall(line):
      callees = set(re.findall(r"%?([\w.\-]+)", value)) & names
      calls[computation] |= callees
      if opcode == "while" and attribute in ("body", "condition"):
        loop_roots |= callees
    parsed.append((computation, opcode, line))

  in_loops, stack = set(), list(loop_roots)
  while stack:
    if (name := stack.pop()) not in in_loops:
      in_loops.add(name)
      stack.extend(calls[name])
  return [
    (computation in in_loops, opcode, line) for computation, opcode, line in parsed
  ]


def _count_collectives(hlo_text: str) -> CollectiveCounts:
  """Counts the collectives in optimised HLO text, `compiled.as_text()`."""
  counts = {kind: [0, 0] for kind in _KINDS}
  for inside_loop, opcode, _ in _instructions(hlo_text):
    # An async pair counts once, at its `-start`; an `async-start` wrapper
    # holds the plain op in the computation it calls.
    kind = opcode.removesuffix("-start").removeprefix("ragged-")
    if kind in _KINDS:
      counts[kind][not inside_loop] += 1
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
    >>> print(jaccum.inspect.collectives(step, jnp.ones((4, 128))))
    collective          inside loops  outside loops
    all-reduce                     1              1
    reduce-scatter                 0              0
    all-gather                     0              0
    all-to-all                     0              0
    collective-permute             0              0
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
  analysis = _compile(fn, args, kwargs).memory_analysis()
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

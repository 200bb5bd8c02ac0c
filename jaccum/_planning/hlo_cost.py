"""Matmul FLOPs of a compiled program, read from its HLO, loops counted by their trips.

XLA's `cost_analysis()` counts a loop's body once, however often it runs, and
a conditional as its costliest branch. To compare schedules whose loops run
different numbers of ticks (the pipeline's), this reads the optimised HLO and
counts each `dot`'s multiply-adds, 2·M·N·K, with a loop's body multiplied by
its known trip count; a conditional counts as its costliest branch, as XLA's
analysis does: on every tick the work of the device that works the most.
Matmuls are what the models here spend their FLOPs on; elementwise
arithmetic and convolutions are not counted.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from jaccum.inspect import _ARRAY, _HEADER, _QUOTED, _TRIP_COUNT

_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_CALLEE = re.compile(
  r"\b(body|calls|to_apply|true_computation|false_computation|branch_computations)"
  r"=(\{[^{}]*\}|%?[\w.\-]+)"
)
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


class Loop(NamedTuple):
  """A while loop of the program.

  Attributes:
    trip_count: its known trip count, or None.
    branches: for each conditional in its body, nested ones included (in
      program order, each before those inside it), the matmul FLOPs of each
      branch, in branch order.
  """

  trip_count: int | None
  branches: list[list[float]]


class _Instruction(NamedTuple):
  name: str
  opcode: str
  result_type: str
  operands: list[str]
  text: str  # after `name =`, quoted metadata emptied
  trip_count: int | None
  callees: dict[str, list[str]]  # attribute -> computations


def matmul_flops(hlo_text: str) -> float:
  """The program's matmul FLOPs per run, loops counted by their trip counts.

  A loop whose trip count is unknown counts once.
  """
  program = _Program(hlo_text)
  return program.cost(program.entry)


def loops(hlo_text: str) -> list[Loop]:
  """The program's while loops, with the matmul FLOPs of their conditionals'
  branches."""
  program = _Program(hlo_text)
  found = []
  for instructions in program.computations.values():
    for instruction in instructions:
      if instruction.opcode != "while":
        continue
      body = instruction.callees["body"][0]
      found.append(Loop(instruction.trip_count, program.conditionals(body)))
  return found


class _Program:
  """The computations of HLO text, and their matmul FLOPs, memoised."""

  def __init__(self, hlo_text: str) -> None:
    self.computations: dict[str, list[_Instruction]] = {}
    self.entry = ""
    current = None
    for line in hlo_text.splitlines():
      header = None if line[:1].isspace() else _HEADER.match(line)
      if header and not line.startswith("HloModule"):
        current = header.group(1)
        self.computations[current] = []
        self.entry = current if line.startswith("ENTRY") else self.entry
      elif line.startswith("}"):
        current = None
      elif current is not None and (match := _INSTRUCTION.match(line)):
        self.computations[current].append(_instruction(*match.groups()))
    self._costs: dict[str, float] = {}

  def cost(self, name: str) -> float:
    if name not in self._costs:
      instructions = self.computations.get(name, [])
      types = {i.name: i.result_type for i in instructions}
      self._costs[name] = sum(self._instruction_cost(i, types) for i in instructions)
    return self._costs[name]

  def conditionals(self, name: str) -> list[list[float]]:
    """Each conditional `name` runs, nested ones included: its branches' FLOPs."""
    found = []
    for instruction in self.computations.get(name, []):
      branches = _branches(instruction) if instruction.opcode == "conditional" else []
      if branches:
        found.append([self.cost(b) for b in branches])
      for callee in branches or instruction.callees.get("calls", []):
        found += self.conditionals(callee)
    return found

  def _instruction_cost(self, instruction: _Instruction, types: dict) -> float:
    if instruction.opcode == "dot":
      return _dot_flops(instruction, types)
    if instruction.opcode == "while":
      body = self.cost(instruction.callees["body"][0])
      return body * (instruction.trip_count or 1)
    if instruction.opcode == "conditional":
      return max(self.cost(b) for b in _branches(instruction))
    return sum(self.cost(c) for c in instruction.callees.get("calls", []))


def _branches(instruction: _Instruction) -> list[str]:
  callees = instruction.callees
  if "branch_computations" in callees:
    return callees["branch_computations"]
  return callees.get("false_computation", []) + callees.get("true_computation", [])


def _instruction(name: str, rest: str) -> _Instruction:
  trip = _TRIP_COUNT.search(rest)
  rest = _QUOTED.sub('""', rest)
  match = _OPCODE.search(" " + rest)
  operands = []
  if match:
    inner = rest[match.end() - 1 :].split(")", 1)[0]
    operands = re.findall(r"%([\w.\-]+)", inner) or re.findall(r"([\w.\-]+)", inner)
  callees = {
    attribute: re.findall(r"%?([\w.\-]+)", value)
    for attribute, value in _CALLEE.findall(rest)
  }
  return _Instruction(
    name,
    match.group(1) if match else "",
    rest[: match.start()] if match else "",
    operands,
    rest,
    int(trip.group(1)) if trip else None,
    callees,
  )


def _dot_flops(dot: _Instruction, types: dict[str, str]) -> float:
  """2 × the result's elements × the contracted size."""
  size = lambda type_text: [
    int(d) for d in _ARRAY.findall(type_text)[0][1].split(",") if d
  ]
  elements = 1
  for d in size(dot.result_type):
    elements *= d
  lhs = size(types[dot.operands[0]])
  match = _CONTRACTING.search(dot.text)
  contracted = 1
  for axis in [int(a) for a in match.group(1).split(",") if a] if match else []:
    contracted *= lhs[axis]
  return 2.0 * elements * contracted

"""A stage's backward as two programs: B, to the stage's input, and W, to its weights.

The zero-bubble schedules run a stage's backward in two parts: B computes the
cotangent of the stage's input, which the previous stage waits for; W, later,
the gradients of its weights, which nothing waits for. `split` cuts the
traced backward program (`jax.vjp`'s, from its residuals and the output's
cotangent) in two along its data flow: B holds every equation the input's
cotangent needs, W the rest. W takes, besides residuals, the values B
computed that it uses (the cotangents of the layers' outputs, from which
`dW = xᵀ·dy`), so that nothing is computed twice: B + W cost what the whole
backward costs.

Nested calls (`jax.jit` inside the stage) are inlined first, so that a jitted
block's backward splits too. A `lax.scan` over layers, whose transpose yields
the carried cotangent and the layers' gradients in one loop, becomes two
loops: B's, which also stacks what W's body needs of each iteration, and W's
(its body split the same way, nested scans included). Other primitives that
compute both parts at once (a `while`, a `cond`) stay whole in B: exact, with
less left for W.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend.core import (
  ClosedJaxpr,
  DebugInfo,
  Jaxpr,
  JaxprEqn,
  Literal,
  Var,
  jaxpr_as_fun,
)

# Call primitives whose body is inlined before splitting.
_CALLS = frozenset({"closed_call", "core_call", "jit", "pjit"})


class Split(NamedTuple):
  """A program cut into B and W.

  Attributes:
    b: `(inputs[b_inputs]...) -> (B's outputs..., carried...)`.
    w: `(inputs[w_inputs]..., carried...) -> (W's outputs...)`.
    b_inputs: the positions of the program's inputs B reads, in order.
    w_inputs: those W reads itself, in order.
    num_carried: how many values B hands to W.
  """

  b: ClosedJaxpr
  w: ClosedJaxpr
  b_inputs: tuple[int, ...]
  w_inputs: tuple[int, ...]
  num_carried: int


def split(
  closed: ClosedJaxpr,
  b_outputs: Sequence[bool],
  through_b: Collection[int] = (),
  free: Collection[int] = (),
) -> Split:
  """Cuts `closed` into B, the equations the outputs `b_outputs` marks need,
  and W, the other equations the other outputs need.

  W reads inputs itself, except those at positions `through_b` (the output's
  cotangent, which waits only until B): B hands it those, with the values of
  its own it uses. W computes again what B computed by elementwise
  arithmetic or data movement from values W has (or inputs at positions
  `free`, which cost nothing to keep), rather than being handed it.
  """
  closed = _rewritten(closed, b_outputs)
  jaxpr = closed.jaxpr
  b_out = [v for v, is_b in zip(jaxpr.outvars, b_outputs, strict=True) if is_b]
  w_out = [v for v, is_b in zip(jaxpr.outvars, b_outputs, strict=True) if not is_b]
  b_eqns, _ = _needed(jaxpr.eqns, b_out)
  in_b = {id(e) for e in b_eqns}
  w_eqns, _ = _needed([e for e in jaxpr.eqns if id(e) not in in_b], w_out)
  given = {v for i, v in enumerate(jaxpr.invars) if i in through_b}
  b_defined = {v for e in b_eqns for v in e.outvars} | given
  free_vars = {v for i, v in enumerate(jaxpr.invars) if i in free and v not in given}
  w_eqns = _recomputed(jaxpr, b_eqns, w_eqns, w_out, b_defined, free_vars)
  w_reads = _reads(w_eqns, w_out)
  carried = [v for v in _ordered(w_reads, jaxpr) if v in b_defined]
  b_reads = _reads(b_eqns, b_out + carried)
  b_inputs = tuple(i for i, v in enumerate(jaxpr.invars) if v in b_reads)
  w_inputs = tuple(
    i for i, v in enumerate(jaxpr.invars) if v in w_reads and v not in given
  )
  invars = lambda positions: [jaxpr.invars[i] for i in positions]
  b = _program(closed, invars(b_inputs), b_out + carried, b_eqns)
  w = _program(closed, invars(w_inputs) + carried, w_out, w_eqns)
  return Split(b, w, b_inputs, w_inputs, len(carried))


# Primitives W computes again rather than keeping their result from B to W:
# elementwise arithmetic and data movement, cheap beside the matmuls.
_CHEAP = frozenset(
  {
    "abs",
    "add",
    "add_any",
    "broadcast_in_dim",
    "convert_element_type",
    "copy",
    "div",
    "expand_dims",
    "max",
    "min",
    "mul",
    "neg",
    "reshape",
    "select_n",
    "sign",
    "squeeze",
    "sub",
    "transpose",
  }
)


def _recomputed(
  jaxpr: Jaxpr,
  b_eqns: list[JaxprEqn],
  w_eqns: list[JaxprEqn],
  w_out: list[Any],
  b_defined: set[Var],
  free: set[Var],
) -> list[JaxprEqn]:
  """`w_eqns` and the cheap equations of B whose results W would be handed,
  where W has every value they read (`free` inputs, the program's constants,
  what W reads anyway): each one moved hands W one value fewer, and no more.
  """
  defined_by = {v: e for e in b_eqns if e.primitive.name in _CHEAP for v in e.outvars}
  free = free | set(jaxpr.constvars)
  moved: list[JaxprEqn] = []
  while True:
    reads = _reads(moved + w_eqns, w_out)
    has = reads | free
    movable = [
      defined_by[v]
      for v in _ordered(reads & b_defined, jaxpr)
      if v in defined_by
      and len(defined_by[v].outvars) == 1
      and not defined_by[v].effects
      and all(x in has for x in defined_by[v].invars if isinstance(x, Var))
    ]
    if not movable:
      break
    moved.append(movable[0])
  if not moved:
    return w_eqns
  order = {id(e): i for i, e in enumerate(jaxpr.eqns)}
  return sorted(moved + w_eqns, key=lambda e: order[id(e)])


def _needed(
  eqns: Sequence[JaxprEqn], outputs: Sequence[Any]
) -> tuple[list[JaxprEqn], set[Var]]:
  """The equations `outputs` depend on (and effectful ones), in program order,
  and every variable they read."""
  live = {v for v in outputs if isinstance(v, Var)}
  kept = []
  for eqn in reversed(eqns):
    if any(v in live for v in eqn.outvars) or eqn.effects:
      kept.append(eqn)
      live.update(v for v in eqn.invars if isinstance(v, Var))
  return kept[::-1], live


def _reads(eqns: Sequence[JaxprEqn], outputs: Sequence[Any]) -> set[Var]:
  """The variables `eqns` and `outputs` read that `eqns` do not define."""
  defined = {v for e in eqns for v in e.outvars}
  read = {v for e in eqns for v in e.invars if isinstance(v, Var)}
  read |= {v for v in outputs if isinstance(v, Var)}
  return read - defined


def _ordered(variables: set[Var], jaxpr: Jaxpr) -> list[Var]:
  """`variables` in the order the program binds them: a fixed order."""
  order = [*jaxpr.constvars, *jaxpr.invars]
  order += [v for e in jaxpr.eqns for v in e.outvars]
  return [v for v in order if v in variables]


def _program(
  closed: ClosedJaxpr,
  invars: list[Var],
  outvars: list[Any],
  eqns: list[JaxprEqn],
) -> ClosedJaxpr:
  """A program of some of `closed`'s equations, with the constants they read."""
  jaxpr = closed.jaxpr
  used = _reads(eqns, outvars)
  constvars = [v for v in jaxpr.constvars if v in used]
  consts = [c for v, c in zip(jaxpr.constvars, closed.consts, strict=True) if v in used]
  effects = frozenset().union(*(e.effects for e in eqns))
  names = tuple(f"in[{i}]" for i in range(len(invars)))
  paths = tuple(f"out[{i}]" for i in range(len(outvars)))
  info = DebugInfo("jaccum B/W split", "a stage's backward", names, paths)
  program = Jaxpr(constvars, invars, outvars, eqns, effects, info)
  return ClosedJaxpr(program, consts)


# --- before splitting: calls inlined, scans over layers in two ----------------------


def _rewritten(closed: ClosedJaxpr, b_outputs: Sequence[bool]) -> ClosedJaxpr:
  """`closed` with its calls' bodies in line and each scan whose outputs B
  and W share as two scans, B's and W's (`_split_scan`)."""
  closed = _inlined(closed)
  jaxpr = closed.jaxpr
  b_out = [v for v, is_b in zip(jaxpr.outvars, b_outputs, strict=True) if is_b]
  _, b_live = _needed(jaxpr.eqns, b_out)
  shared_scans = {
    id(e): [v in b_live for v in e.outvars]
    for e in jaxpr.eqns
    if e.primitive.name == "scan" and len({v in b_live for v in e.outvars}) == 2
  }
  if not shared_scans:
    return closed

  def scan_rule(eqn: JaxprEqn, values: list[Any]) -> list[Any] | None:
    mask = shared_scans.get(id(eqn))
    return None if mask is None else _split_scan(eqn, values, mask)

  return _retraced(closed, scan_rule)


def _split_scan(eqn: JaxprEqn, values: list[Any], b_outputs: list[bool]) -> list[Any]:
  """Runs a scan as B's scan, then W's, and returns the scan's outputs.

  B's carries are those whose outputs B needs, and every carry they depend
  on. B's scan stacks, per iteration, what W's body needs of B's (its values,
  B's carries as they came in); W's scan reads those, the scan's constants
  and inputs, and runs W's carries.
  """
  params = eqn.params
  body: ClosedJaxpr = params["jaxpr"]
  num_consts, num_carry = params["num_consts"], params["num_carry"]
  carry_at = range(num_consts, num_consts + num_carry)
  b_carries = {j for j in range(num_carry) if b_outputs[j]}
  while True:  # B's carries: those B's outputs read, until none is added
    body_b = [j in b_carries for j in range(num_carry)] + b_outputs[num_carry:]
    through = [num_consts + j for j in sorted(b_carries)]
    parts = split(body, body_b, through)
    reads = {i - num_consts for i in parts.b_inputs if i in carry_at}
    if reads <= b_carries:
      break
    b_carries |= reads
  consts, init, xs = (
    values[:num_consts],
    values[num_consts : num_consts + num_carry],
    values[num_consts + num_carry :],
  )
  order = sorted(b_carries)
  others = [j for j in range(num_carry) if j not in b_carries]
  scan = lambda body, carry, inputs: jax.lax.scan(
    body,
    carry,
    inputs,
    length=params["length"],
    reverse=params["reverse"],
    unroll=params["unroll"],
  )

  def b_body(carry, x):
    inputs = dict(enumerate([*consts, *init, *x]))
    inputs.update({num_consts + j: c for j, c in zip(order, carry, strict=True)})
    outs = jaxpr_as_fun(parts.b)(*[inputs[i] for i in parts.b_inputs])
    num_b = len(order) + sum(b_outputs[num_carry:])
    return outs[: len(order)], (outs[len(order) : num_b], outs[num_b:])

  b_final, (b_ys, stacked) = scan(b_body, [init[j] for j in order], xs)

  def w_body(carry, x):
    x, carried = x
    inputs = dict(enumerate([*consts, *init, *x]))
    inputs.update({num_consts + j: c for j, c in zip(others, carry, strict=True)})
    outs = jaxpr_as_fun(parts.w)(*[inputs[i] for i in parts.w_inputs], *carried)
    return outs[: len(others)], outs[len(others) :]

  w_final, w_ys = scan(w_body, [init[j] for j in others], (xs, stacked))
  carries = dict(zip(order, b_final, strict=True)) | dict(
    zip(others, w_final, strict=True)
  )
  b_iter, w_iter = iter(b_ys), iter(w_ys)
  ys = [next(b_iter if is_b else w_iter) for is_b in b_outputs[num_carry:]]
  return [carries[j] for j in range(num_carry)] + ys


def _inlined(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` with the bodies of its calls (`jax.jit` inside) put in their place."""
  if not any(e.primitive.name in _CALLS for e in closed.jaxpr.eqns):
    return closed
  return _retraced(closed, lambda eqn, values: None)


def _retraced(closed: ClosedJaxpr, rule: Any) -> ClosedJaxpr:
  """`closed` traced again, calls in line, `rule(eqn, values)` replacing the
  equations it returns outputs for."""
  avals = [
    jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars
  ]
  return jax.make_jaxpr(lambda *args: _evaluate(closed, args, rule))(*avals)


def _evaluate(closed: ClosedJaxpr, args: Sequence[Any], rule: Any) -> list[Any]:
  """Runs `closed` on `args`, evaluating calls' bodies in line."""
  env: dict[Var, Any] = {}
  read = lambda v: v.val if isinstance(v, Literal) else env[v]
  jaxpr = closed.jaxpr
  env.update(zip(jaxpr.constvars, closed.consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    values = [read(v) for v in eqn.invars]
    body = eqn.params.get("jaxpr")
    outs = rule(eqn, values)
    if outs is not None:
      pass
    elif eqn.primitive.name in _CALLS and isinstance(body, ClosedJaxpr):
      outs = _evaluate(body, values, lambda eqn, values: None)
    else:
      params = eqn.primitive.get_bind_params(eqn.params)
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*values, **params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]

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
block's backward splits too. A primitive that computes both parts at once (a
`lax.scan` over layers, whose transpose yields the carry's cotangent and the
layers' gradients together) stays whole in B: exact, with less left for W.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, JaxprEqn, Literal, Var

# Call primitives whose body is inlined before splitting.
_CALLS = frozenset({"closed_call", "core_call", "jit", "pjit"})


class Split(NamedTuple):
  """A backward program cut into B and W.

  Attributes:
    b: `(residuals[b_residuals]..., cotangents...) -> (b outputs...,
      carried...)`.
    w: `(residuals[w_residuals]..., carried...) -> (w outputs...)`.
    b_residuals: the positions of the residuals B reads.
    w_residuals: the positions of the residuals W reads.
    num_carried: how many values B hands to W.
  """

  b: ClosedJaxpr
  w: ClosedJaxpr
  b_residuals: tuple[int, ...]
  w_residuals: tuple[int, ...]
  num_carried: int


def split(closed: ClosedJaxpr, num_residuals: int, b_outputs: Sequence[bool]) -> Split:
  """Cuts `closed`, `(residuals..., cotangents...) -> outputs`, into B and W.

  `b_outputs[i]` says whether output i is B's (the input's cotangent) or W's
  (a weight's gradient). B is every equation B's outputs depend on; W is
  every other equation W's outputs depend on, fed with the residuals it
  reads and the values of B (or cotangents) it uses.
  """
  closed = _inlined(closed)
  jaxpr = closed.jaxpr
  b_out = [v for v, is_b in zip(jaxpr.outvars, b_outputs, strict=True) if is_b]
  w_out = [v for v, is_b in zip(jaxpr.outvars, b_outputs, strict=True) if not is_b]
  b_eqns = _needed(jaxpr.eqns, b_out, keep_effects=True)
  in_b = {id(e) for e in b_eqns}
  w_eqns = _needed([e for e in jaxpr.eqns if id(e) not in in_b], w_out)
  residuals, cotangents = jaxpr.invars[:num_residuals], jaxpr.invars[num_residuals:]
  b_defined = {v for e in b_eqns for v in e.outvars} | set(cotangents)
  w_reads = _reads(w_eqns, w_out)
  carried = [v for v in _ordered(w_reads, jaxpr) if v in b_defined]
  b_reads = _reads(b_eqns, b_out)
  b_residuals = tuple(i for i, v in enumerate(residuals) if v in b_reads)
  w_residuals = tuple(i for i, v in enumerate(residuals) if v in w_reads)
  b = _program(
    closed,
    [residuals[i] for i in b_residuals] + list(cotangents),
    b_out + carried,
    b_eqns,
  )
  w = _program(closed, [residuals[i] for i in w_residuals] + carried, w_out, w_eqns)
  return Split(b, w, b_residuals, w_residuals, len(carried))


def _needed(
  eqns: Sequence[JaxprEqn], outputs: Sequence[Any], keep_effects: bool = False
) -> list[JaxprEqn]:
  """The equations `outputs` depend on (and effectful ones), in program order."""
  live = {v for v in outputs if isinstance(v, Var)}
  kept = []
  for eqn in reversed(eqns):
    if any(v in live for v in eqn.outvars) or (keep_effects and eqn.effects):
      kept.append(eqn)
      live.update(v for v in eqn.invars if isinstance(v, Var))
  return kept[::-1]


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


def _inlined(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` with the bodies of its calls (`jax.jit` inside) put in their place."""
  if not any(e.primitive.name in _CALLS for e in closed.jaxpr.eqns):
    return closed
  avals = [
    jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars
  ]
  return jax.make_jaxpr(lambda *args: _evaluate(closed, args))(*avals)


def _evaluate(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
  """Runs `closed` on `args`, evaluating calls' bodies in line."""
  env: dict[Var, Any] = {}
  read = lambda v: v.val if isinstance(v, Literal) else env[v]
  jaxpr = closed.jaxpr
  env.update(zip(jaxpr.constvars, closed.consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    values = [read(v) for v in eqn.invars]
    body = eqn.params.get("jaxpr")
    if eqn.primitive.name in _CALLS and isinstance(body, ClosedJaxpr):
      outs = _evaluate(body, values)
    else:
      params = eqn.primitive.get_bind_params(eqn.params)
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*values, **params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]

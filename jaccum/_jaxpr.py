"""Rewriting a traced micro-step, equation by equation, nested programs included.

jaccum traces the user's micro-step once (`jax.make_jaxpr`) and evaluates
that program in its loop, so it can adjust what the program does where the
loop needs it: put convolutions into XLA:CPU's fast layout (`_conv_layout`),
drop the data axes from sharding constraints that run on one device's rows
(`strip_constraints`), write divisions the way every compile path rounds
them alike (`divisions_as_reciprocals`, for `deterministic=True`). Programs
nest (jit, remat, custom_jvp/vjp, cond, scan, while, shard_map, ...): they
hold their bodies as `Jaxpr` or `ClosedJaxpr` params, alone or in a tuple
(cond's branches). A rewrite keeps every equation's
input and output types, so the equations holding nested programs stay valid.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

P = jax.sharding.PartitionSpec

# eqn -> the equations that replace it, or None to keep it (and rewrite the
# programs nested in its params).
EqnRewrite = Callable[[JaxprEqn], list[JaxprEqn] | None]


class _Rewriter:
  """Applies an `EqnRewrite` to a program and every program nested in it.

  A program that several equations share is rewritten once and stays shared;
  one with nothing to rewrite comes back as the same object.
  """

  def __init__(self, rewrite: EqnRewrite):
    self._rewrite = rewrite
    # id(program) -> (program, rewritten); holding the program keeps its id.
    self._done: dict[int, tuple[Any, Any]] = {}

  def program(self, program: Jaxpr | ClosedJaxpr) -> Any:
    if id(program) not in self._done:
      if isinstance(program, ClosedJaxpr):
        jaxpr = self.program(program.jaxpr)
        new = program if jaxpr is program.jaxpr else program.replace(jaxpr=jaxpr)
      else:
        new = self._jaxpr(program)
      self._done[id(program)] = (program, new)
    return self._done[id(program)][1]

  def _jaxpr(self, jaxpr: Jaxpr) -> Jaxpr:
    eqns: list[JaxprEqn] = []
    for eqn in jaxpr.eqns:
      replaced = self._rewrite(eqn)
      if replaced is not None:
        eqns.extend(replaced)
        continue
      params = {name: self._param(value) for name, value in eqn.params.items()}
      changed = any(params[name] is not value for name, value in eqn.params.items())
      eqns.append(eqn.replace(params=params) if changed else eqn)
    unchanged = len(eqns) == len(jaxpr.eqns) and all(
      new is old for new, old in zip(eqns, jaxpr.eqns, strict=True)
    )
    return jaxpr if unchanged else jaxpr.replace(eqns=eqns)

  def _param(self, value: Any) -> Any:
    if isinstance(value, Jaxpr | ClosedJaxpr):
      return self.program(value)
    if isinstance(value, tuple) and any(
      isinstance(v, Jaxpr | ClosedJaxpr) for v in value
    ):
      new = tuple(self._param(v) for v in value)
      return value if all(a is b for a, b in zip(new, value, strict=True)) else new
    return value


def rewrite_eqns(closed: ClosedJaxpr, rewrite: EqnRewrite) -> ClosedJaxpr:
  """`closed` with `rewrite` applied to every equation, nested programs included."""
  return _Rewriter(rewrite).program(closed)


def spec_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes one `PartitionSpec` entry names: None, a name or a tuple."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def without_axes(spec: P, axes: Sequence[str]) -> P:
  """`spec` with `axes` removed: the layout of a value gathered over them."""
  kept = [tuple(a for a in spec_axes(e) if a not in axes) or None for e in spec]
  return P(*(e[0] if e and len(e) == 1 else e for e in kept))


def strip_constraints(closed: ClosedJaxpr, axes: Sequence[str]) -> ClosedJaxpr:
  """Sharding constraints of `closed` with the data `axes` taken out of them.

  The per-device loop runs each device's rows on that device: an
  activation's batch dimension is already where `with_sharding_constraint(h,
  P("data", ...))` asks it to be, and XLA refuses a constraint that names an
  axis the loop runs manually over. What the constraint says about the other
  axes (a "model" axis) stays.
  """

  def strip(eqn: JaxprEqn) -> list[JaxprEqn] | None:
    if eqn.primitive.name != "sharding_constraint":
      return None
    sharding = eqn.params["sharding"]
    spec = getattr(sharding, "spec", None)
    if spec is None or not {a for e in spec for a in spec_axes(e)} & set(axes):
      return None
    new = sharding.update(spec=without_axes(spec, axes))
    return [eqn.replace(params={**eqn.params, "sharding": new})]

  return rewrite_eqns(closed, strip)


def _as_reciprocal(eqn: JaxprEqn) -> list[JaxprEqn] | None:
  """`x / y` as `x · (1 / y)`, traced on the operands' types and wired to `eqn`'s."""
  x, y = eqn.invars
  dtype = getattr(y.aval, "dtype", None)
  if isinstance(y, Literal) or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    return None
  return in_place_of(eqn, jax.make_jaxpr(lambda x, y: x * (1 / y))(x.aval, y.aval))


def in_place_of(eqn: JaxprEqn, closed: ClosedJaxpr) -> list[JaxprEqn] | None:
  """`closed`'s equations wired to `eqn`'s own input and output variables.

  `closed` is traced on the types of `eqn`'s inputs and computes its one
  output; None where it has constants or its output's type is not exactly
  `eqn`'s (the caller then keeps `eqn`).
  """
  (out,) = closed.jaxpr.outvars
  if closed.consts or not isinstance(out, Var) or out.aval != eqn.outvars[0].aval:
    return None
  rename: dict[Any, Any] = dict(zip(closed.jaxpr.invars, eqn.invars, strict=True))
  rename[out] = eqn.outvars[0]
  return [
    new.replace(
      invars=[rename.get(v, v) if isinstance(v, Var) else v for v in new.invars],
      outvars=[rename.get(v, v) for v in new.outvars],
      source_info=eqn.source_info,
      ctx=eqn.ctx,
    )
    for new in closed.jaxpr.eqns
  ]


def divisions_as_reciprocals(closed: ClosedJaxpr) -> ClosedJaxpr:
  """Every floating division by a traced value, `x / y`, written `x · (1 / y)`.

  XLA's simplifier turns `x / broadcast(s)` into `x · broadcast(1 / s)` (two
  roundings, not one) only where nothing else uses that broadcast. On
  several devices the compiler shares identical broadcasts first (its SPMD
  clean-up runs CSE), on one device it does not: a softmax's backward pass
  then divides on one path and multiplies on the other, and the same
  micro-batch's gradient differs in its last bits (measured on CPU, XLA of
  jax 0.10.2). Written as a reciprocal here, every path computes the same.
  A division by a constant (`x / 3.0`) stays as it is.
  """
  return rewrite_eqns(
    closed, lambda eqn: _as_reciprocal(eqn) if eqn.primitive.name == "div" else None
  )

"""Rewrites of the traced micro-step, equation by equation, nested programs included.

jaccum traces the user's micro-step once (`jax.make_jaxpr`) and evaluates
that program in its loop, so it can adjust what the program does where the
loop needs it: drop the data axes from sharding constraints that run on one
device's rows (`strip_constraints`), write divisions the way every compile
path rounds them alike (`divisions_as_reciprocals`, for
`deterministic=True`), and put convolutions into XLA:CPU's fast layout
(`canonicalize_convolutions`, below). Programs nest (jit, remat,
custom_jvp/vjp, cond, scan, while, shard_map, ...): they hold their bodies as
`Jaxpr` or `ClosedJaxpr` params, alone or in a tuple (cond's branches). A
rewrite keeps every equation's input and output types, so the equations
holding nested programs stay valid.

Convolutions. XLA:CPU runs a convolution on its fast kernels only when its
dimension numbers are canonical: input batch-first and feature-last (`b01f`,
"NHWC"), kernel spatial dimensions first, then input and output features
(`01io`, "HWIO"),
output `b01f`; likewise `b0f_0io->b0f` in 1-D and `b012f_012io->b012f` in 3-D.
Its `ConvCanonicalization` pass rewrites every other convolution into
transpose -> canonical convolution -> transpose, but it visits only the entry
computation. Convolutions inside a while loop's body, such as the body of the
`lax.scan` that accumulates micro-batches, keep their layout and run on a
generic loop nest, many times slower. A backward pass always makes such
convolutions, even for an NHWC model: its kernel gradient is
`f01b_i01o->01bf` and its input gradient `b01f_01oi->b01f`. On the Flax
tutorial's CNN that made the loop 4-7x slower than the whole batch on a
2-core CPU, and a ResNet block's loop 20x slower than the same work unrolled.

`canonicalize_convolutions` does that pass's work on the traced micro-step, so
the loop body reaches XLA canonical. It also turns a convolution that groups
the batch (`batch_group_count > 1`: kernel gradients of grouped and depthwise
convolutions) into the equivalent one that groups features: XLA:CPU expands
the former into a non-canonical convolution, after its pass has run.

It rewrites only where that is faster. For a few kinds, XLA's generic loop
nest beats its canonical path: depthwise convolutions (a 3x3 depthwise
input gradient 12x in 2-D), grouped ones with a dilated input, and 3-D ones
grouped or dilated (a strided 3-D convolution's input gradient 12x). Those
stay as traced; `_rewrite_wins` is the rule, measured kind by kind.

To check a compiled step, read the `dim_labels` of its convolutions in
`jax.jit(step).lower(*args).compile().as_text()`: those in the `while` body
should read `b01f_01io->b01f` (or the 1-D/3-D form), but for the kinds the
rule keeps as traced. XLA leaves one kind
non-canonical in the entry computation too, so it is no loss here: a
convolution whose operands it swapped, marked `rhs_reversal`, which no fast
kernel takes anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
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


def programs(jaxpr: jex.Jaxpr) -> Iterator[jex.Jaxpr]:
  yield jaxpr
  for sub in jex.subjaxprs(jaxpr):
    yield from programs(sub)


def sums_over(jaxpr: jex.Jaxpr, axes: Sequence[str]) -> bool:
  """Whether `jaxpr` (or a program nested in it) sums over any of `axes`."""
  return any(
    eqn.primitive.name in ("psum", "psum_invariant")
    and set(eqn.params.get("axes", ())) & set(axes)
    for sub in programs(jaxpr)
    for eqn in sub.eqns
  )


COLLECTIVES = {
  "psum": "axes",
  "psum_invariant": "axes",
  "pmax": "axes",
  "pmin": "axes",
  "pbroadcast": "axes",
  "all_gather": "axis_name",
  "all_gather_invariant": "axis_name",
  "reduce_scatter": "axis_name",
  "ppermute": "axis_name",
  "all_to_all": "axis_name",
  "ragged_all_to_all": "axis_name",
}


def collective_axes(jaxpr: jex.Jaxpr) -> set[str]:
  """The mesh axes that collectives in `jaxpr` (nested programs too) run over."""
  found: set[str] = set()
  for sub in programs(jaxpr):
    for eqn in sub.eqns:
      param = COLLECTIVES.get(eqn.primitive.name)
      names = eqn.params.get(param, ()) if param else ()
      found.update((names,) if isinstance(names, str) else names)
  return found


def spec_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes one `PartitionSpec` entry names: None, a name or a tuple.

  `P.UNCONSTRAINED` (what `vmap` gives a constraint's mapped axis) names none.
  """
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry) if isinstance(entry, tuple | list) else ()


def without_axes(spec: P, axes: Sequence[str]) -> P:
  """`spec` with `axes` removed: the layout of a value gathered over them."""
  kept = [
    e
    if e is P.UNCONSTRAINED
    else tuple(a for a in spec_axes(e) if a not in axes) or None
    for e in spec
  ]
  return P(*(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in kept))


def strip_constraints(closed: ClosedJaxpr, axes: Sequence[str]) -> ClosedJaxpr:
  """Sharding constraints of `closed` with the data `axes` taken out of them.

  The per-device loop runs each device's rows on that device: an
  activation's batch dimension is already where `with_sharding_constraint(h,
  P("data", ...))` asks it to be, and XLA refuses a constraint that names an
  axis the loop runs manually over. What the constraint says about the other
  axes (a "model" axis) stays. An axis left unconstrained (`vmap` leaves its
  mapped axis so) becomes unsharded where the mesh has no other axes: XLA
  lowers `P.UNCONSTRAINED` only where some axis is not manual.
  """

  def strip(eqn: JaxprEqn) -> list[JaxprEqn] | None:
    if eqn.primitive.name != "sharding_constraint":
      return None
    sharding = eqn.params["sharding"]
    spec = getattr(sharding, "spec", None)
    if spec is None or not {a for e in spec for a in spec_axes(e)} & set(axes):
      return None
    params = dict(eqn.params)
    spec = without_axes(spec, axes)
    if set(getattr(sharding.mesh, "axis_names", ())) <= set(axes):
      spec = P(*(None if e is P.UNCONSTRAINED else e for e in spec))
      if "unconstrained_dims" in params:
        params["unconstrained_dims"] = frozenset()
    params["sharding"] = sharding.update(spec=spec)
    return [eqn.replace(params=params)]

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


_Orders = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _layout_orders(dimension_numbers: Any) -> _Orders:
  """The axis orders that put the input, kernel and output in canonical layout.

  A `ConvDimensionNumbers` spec names the axes of (batch, feature, spatial...)
  for the input and output, (out-feature, in-feature, spatial...) for the
  kernel. The convolution is canonical when all three orders are identities.
  """
  lhs, rhs, out = (tuple(spec) for spec in dimension_numbers)
  return (
    (lhs[0], *lhs[2:], lhs[1]),
    (*rhs[2:], rhs[1], rhs[0]),
    (out[0], *out[2:], out[1]),
  )


def _canonical_dimension_numbers(ndim: int) -> jax.lax.ConvDimensionNumbers:
  """`b01f_01io->b01f` for operands of `ndim` dimensions."""
  spatial = tuple(range(1, ndim - 1))
  return jax.lax.ConvDimensionNumbers(
    (0, ndim - 1, *spatial),
    (ndim - 1, ndim - 2, *range(ndim - 2)),
    (0, ndim - 1, *spatial),
  )


def _is_identity(order: Sequence[int]) -> bool:
  return tuple(order) == tuple(range(len(order)))


def _transpose(x: jax.Array, order: Sequence[int]) -> jax.Array:
  return x if _is_identity(order) else jax.lax.transpose(x, tuple(order))


def _is_unsharded(x: Any) -> bool:
  return all(entry is None for entry in x.aval.sharding.spec)


def _is_canonical(eqn: JaxprEqn) -> bool:
  """Whether XLA:CPU takes this convolution as it is: canonical, no batch groups."""
  orders = _layout_orders(eqn.params["dimension_numbers"])
  return all(map(_is_identity, orders)) and eqn.params["batch_group_count"] == 1


def _rewrite_wins(eqn: JaxprEqn) -> bool:
  """Whether XLA:CPU runs this convolution faster rewritten than as traced.

  Measured kind by kind in a loop body, 1-D to 3-D, channels last and first
  (`python -m benchmarks.conv_kinds`; the table is
  `benchmarks/results/conv_kinds.md`). Rewritten, most kinds run 2-50x
  faster, but XLA's generic loop nest wins on convolutions grouped by
  features that are depthwise (one input or one output feature per group:
  depthwise forwards and input gradients, 3-96x) or whose input is dilated
  (grouped strided convolutions' input gradients, grouped transposed
  convolutions: 1.1-3.5x), and on 3-D convolutions grouped by features
  (5-47x) or dilated: strided convolutions' input gradients, transposed and
  dilated forwards and input gradients (1.6-12x), grouped kernel gradients
  (1.2-20x); the ungrouped kernel gradients are a tie (0.7-1.4x). Batch
  groups (kernel gradients of grouped convolutions) are no reason to keep
  one: regrouped, they win. Of the 180 kinds, the rule picks the slower form
  for 8, by at most 2.0x: channels-first kinds, where the faster form
  differs from channels last, and the ties.
  """
  params = eqn.params
  groups = params["feature_group_count"]
  dilated_input = any(d > 1 for d in params["lhs_dilation"])
  if len(params["window_strides"]) == 3:
    return groups == 1 and not dilated_input and max(params["rhs_dilation"]) == 1
  if groups == 1:
    return True
  _, (out_axis, in_axis, *_), _ = params["dimension_numbers"]
  kernel: Any = eqn.invars[1].aval
  depthwise = kernel.shape[in_axis] == 1 or kernel.shape[out_axis] == groups
  return not (depthwise or dilated_input)


def _needs_rewrite(eqn: JaxprEqn) -> bool:
  if eqn.primitive is not jax.lax.conv_general_dilated_p or _is_canonical(eqn):
    return False
  # Regrouping an input sharded over explicit mesh axes would need a reshard.
  orders = _layout_orders(eqn.params["dimension_numbers"])
  if all(map(_is_identity, orders)) and not _is_unsharded(eqn.invars[0]):
    return False
  return _rewrite_wins(eqn)


def _canonical_conv(lhs, rhs, *, dimension_numbers, out_sharding, **params):
  """`conv_general_dilated_p` with these params, computed in canonical layout."""
  lhs_order, rhs_order, out_order = _layout_orders(dimension_numbers)
  lhs, rhs = _transpose(lhs, lhs_order), _transpose(rhs, rhs_order)
  groups = params["batch_group_count"]
  if groups > 1 and _is_unsharded(lhs):
    # Batch group g (input rows g*B/G ... (g+1)*B/G - 1) becomes feature
    # group g: the same sums, as a grouped convolution XLA:CPU runs natively.
    batch, *spatial, features = lhs.shape
    lhs = lhs.reshape(groups, batch // groups, *spatial, features)
    lhs = jax.lax.transpose(lhs, (*range(1, lhs.ndim - 1), 0, lhs.ndim - 1))
    lhs = lhs.reshape(batch // groups, *spatial, groups * features)
    params = {**params, "batch_group_count": 1, "feature_group_count": groups}
  if out_sharding is not None:
    spec = (*out_sharding.spec, *(None,) * (len(out_order) - len(out_sharding.spec)))
    out_sharding = out_sharding.update(
      spec=out_sharding.spec.update(partitions=[spec[i] for i in out_order])
    )
  out = jax.lax.conv_general_dilated_p.bind(
    lhs,
    rhs,
    dimension_numbers=_canonical_dimension_numbers(lhs.ndim),
    out_sharding=out_sharding,
    **params,
  )
  return _transpose(out, tuple(np.argsort(out_order)))


def _rewrite_conv(eqn: JaxprEqn) -> list[JaxprEqn]:
  """Equations that compute `eqn`'s convolution in canonical layout.

  They are traced on the operands' types (so shardings and device-varying
  axes come out right), then wired to `eqn`'s own input and output variables.
  Were the output type not exactly `eqn`'s, `eqn` would be kept as it is.
  """
  closed = jax.make_jaxpr(functools.partial(_canonical_conv, **eqn.params))(
    *(v.aval for v in eqn.invars)
  )
  return in_place_of(eqn, closed) or [eqn]


def canonicalize_convolutions(closed: ClosedJaxpr) -> ClosedJaxpr:
  """Returns `closed` with its convolutions in XLA:CPU's canonical layout.

  Each `conv_general_dilated` whose dimension numbers are not
  `b01f_01io->b01f` (or the 1-D/3-D form) becomes transpose -> canonical
  convolution -> transpose, with the same strides, padding, dilations,
  groups, precision and preferred element type; one that groups the batch
  becomes one that groups features. The kinds XLA:CPU runs faster as traced
  stay as they are (see the module's docstring). Nested programs are
  rewritten too.
  Inputs, outputs and values stay the same; a program with nothing to
  rewrite comes back as it is.

  Args:
    closed: a traced program, e.g. `jax.make_jaxpr(grad_fn)(*args)`.

  Returns:
    The rewritten program, e.g. for `jax.core.eval_jaxpr`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> def conv(x, w):  # NCHW input, OIHW kernel
    ...   return jax.lax.conv(x, w, (1, 1), "SAME")
    >>> x, w = jnp.ones((2, 3, 8, 8)), jnp.ones((4, 3, 3, 3))
    >>> closed = canonicalize_convolutions(jax.make_jaxpr(conv)(x, w))
    >>> [eqn.primitive.name for eqn in closed.eqns]
    ['transpose', 'transpose', 'conv_general_dilated', 'transpose']
    >>> out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x, w)[0]
    >>> bool(jnp.allclose(out, conv(x, w)))
    True
  """
  return rewrite_eqns(
    closed, lambda eqn: _rewrite_conv(eqn) if _needs_rewrite(eqn) else None
  )

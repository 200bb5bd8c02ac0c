"""Per-example gradient norms from the batched backward pass, and the clipped sum.

The loss of one example is traced once (`jax.make_jaxpr`) and read
equation by equation (`jit` bodies inlined), each value classed as a
function of the params alone, of the example (an activation), or of
neither. An equation that takes both is a *use* of the params. A params
leaf whose only way to the loss is one `dot_general`, convolution or
embedding gather, reached through transposes, reshapes, casts and slices
(each keeps the norm of a gradient), is *ghost*: each example's gradient
of that leaf is a product of the use's input activation `a_i` and its
output cotangent `g_i`, so its squared norm comes from them (`Gram`:
`Σ_{t,s} (a_it·a_is)(g_it·g_is)` over positions t, s, Li et al. 2021; or
`Outer`: the product `a_iᵀ g_i` itself, whichever costs fewer operations,
as mixed ghost clipping does, Bu et al. 2022). Every other leaf is
*per-example*: its gradient for each example comes out of the same
backward pass.

One pass then gives everything (`clipped_sum`): the program is run for
each example (`vmap`) with a zero *tap* added to each ghost use's output,
and differentiated with respect to the taps and the per-example leaves
only: the taps' cotangents are the `g_i`, the activations are recorded on
the way. With the norms, `c_i = min(1, C/‖∇ℓ_i‖)`; the ghost leaves'
clipped sum is the gradient of `Σ_i ⟨use(a_i, W), c_i g_i⟩` with respect
to W (book-keeping, Bu et al. 2023: the weight gradient a plain backward
pass computes, with each example's cotangent scaled), the others' `Σ_i
c_i G_i`. No example's whole gradient is formed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

Path = tuple[int, ...]

# Equations on a param that keep the norm of its gradient: their transpose
# only moves, pads or casts the cotangent.
_KEEP_NORM = frozenset(
  {
    "convert_element_type",
    "copy",
    "copy_p",
    "expand_dims",
    "reshape",
    "rev",
    "sharding_constraint",
    "slice",
    "squeeze",
    "transpose",
  }
)
_HIGHEST = jax.lax.Precision.HIGHEST


class _Const(NamedTuple):
  """A value that depends on neither the params nor the example."""


class _Act(NamedTuple):
  """A value that depends on the example (an activation)."""


class _Param(NamedTuple):
  """A value that depends on the params alone.

  Attributes:
    leaves: the params leaves it depends on.
    chain: the norm-keeping equations from its one leaf to it, or None.
  """

  leaves: frozenset[int]
  chain: tuple[JaxprEqn, ...] | None


CONST, ACT = _Const(), _Act()


def _aval(var: Any) -> Any:
  """A variable's type (shaped: `shape`, `dtype`)."""
  return var.aval


class Use(NamedTuple):
  """A ghost use: the one way of a params leaf to the loss.

  Attributes:
    path: where the equation sits (indices through inlined `jit` bodies).
    eqn: the equation (`dot_general`, `conv_general_dilated` or `gather`).
    leaf: the params leaf.
    chain: the norm-keeping equations from the leaf to the operand.
    operand: the param operand's position among the equation's inputs.
    how: `"gram"` (the ghost norm) or `"outer"` (each example's product).
  """

  path: Path
  eqn: JaxprEqn
  leaf: int
  chain: tuple[JaxprEqn, ...]
  operand: int
  how: str

  @property
  def kind(self) -> str:
    return {"conv_general_dilated": "conv"}.get(
      self.eqn.primitive.name, self.eqn.primitive.name
    )

  @property
  def activation(self) -> int:
    """The position of the activation among the equation's inputs."""
    return 1 - self.operand


class Analysis(NamedTuple):
  """How each params leaf's per-example norm is made.

  Attributes:
    uses: the ghost uses, by path (one per ghost leaf).
    per_example: the leaves whose per-example gradients are formed.
    unused: the leaves that do not reach the loss (zero gradients).
  """

  uses: dict[Path, Use]
  per_example: tuple[int, ...]
  unused: tuple[int, ...]

  def describe(self, names: Sequence[str]) -> dict[str, str]:
    """`{leaf name: "ghost dot_general (gram)" | "per-example" | "unused"}`."""
    out = {names[i]: "per-example" for i in self.per_example}
    out |= {names[i]: "unused" for i in self.unused}
    for use in self.uses.values():
      out[names[use.leaf]] = f"ghost {use.kind} ({use.how})"
    return dict(sorted(out.items()))


def _dot_dims(eqn: JaxprEqn, operand: int) -> tuple[list[int], list[int], list[int]]:
  """The activation's (batch, free, contracting) axes in a `dot_general` use."""
  (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
  contract, batch = (lhs_c, lhs_b) if operand == 1 else (rhs_c, rhs_b)
  ndim = len(_aval(eqn.invars[1 - operand]).shape)
  free = [d for d in range(ndim) if d not in contract and d not in batch]
  return list(batch), free, list(contract)


def _sizes(shape: Sequence[int], axes: Sequence[int]) -> int:
  return math.prod(shape[d] for d in axes)


def _dot_how(eqn: JaxprEqn, operand: int) -> str:
  batch, free, contract = _dot_dims(eqn, operand)
  shape = _aval(eqn.invars[1 - operand]).shape
  positions, features = _sizes(shape, free), _sizes(shape, contract)
  outputs = math.prod(_aval(eqn.outvars[0]).shape) // max(
    _sizes(shape, batch) * positions, 1
  )
  return _how(positions * (features + outputs), features * outputs)


def _how(activations: int, product: int) -> str:
  """Each example's product kept (`"outer"`) where it is no larger than twice
  the activations and cotangents the backward pass holds for the use anyway,
  else the ghost norm (`"gram"`).

  Kept, the product is the weight gradient's own work, and the clipped sum
  is its weighted sum: no operation beyond the plain step's. The Gram
  matrices cost `T²(c + f)` per example more, but hold only `T²`: the
  choice for a use whose product `c·f` outgrows `T(c + f)` (wide layers
  over few positions: `T = 1` for an MLP).
  """
  return "outer" if product <= 2 * activations else "gram"


def _conv_how(eqn: JaxprEqn) -> str:
  _, rhs_spec, out_spec = eqn.params["dimension_numbers"]
  kernel = _aval(eqn.invars[1]).shape
  out = _aval(eqn.outvars[0]).shape
  positions = math.prod(out) // out[out_spec[1]]
  features = math.prod(kernel) // kernel[rhs_spec[0]]
  outputs = kernel[rhs_spec[0]]
  return _how(positions * (features + outputs), features * outputs)


def _is_embedding(eqn: JaxprEqn) -> bool:
  """A gather of whole rows of a `[V, d]` table: `table[ids]`, `jnp.take`."""
  dn, table = eqn.params["dimension_numbers"], _aval(eqn.invars[0])
  ids = _aval(eqn.invars[1])
  return (
    len(table.shape) == 2
    and tuple(dn.collapsed_slice_dims) == (0,)
    and tuple(dn.start_index_map) == (0,)
    and not dn.operand_batching_dims
    and len(dn.offset_dims) == 1
    and tuple(eqn.params["slice_sizes"]) == (1, table.shape[1])
    and ids.shape[-1:] == (1,)
  )


def _gather_how(eqn: JaxprEqn) -> str:
  rows, width = _aval(eqn.invars[0]).shape
  positions = math.prod(_aval(eqn.invars[1]).shape[:-1])
  return _how(positions * (1 + width), rows * width)


def _ghost_use(eqn: JaxprEqn, ins: Sequence[Any]) -> tuple[int, str] | None:
  """`(operand, how)` where `eqn` is a use the norms can read, else None."""
  name = eqn.primitive.name
  if len(ins) != 2 or not any(isinstance(c, _Param) for c in ins):
    return None
  operand = 0 if isinstance(ins[0], _Param) else 1
  param, other = ins[operand], ins[1 - operand]
  if param.chain is None or len(param.leaves) != 1 or other is not ACT:
    return None
  floating = jnp.issubdtype(_aval(eqn.invars[1 - operand]).dtype, jnp.floating)
  if name == "dot_general" and floating:
    return operand, _dot_how(eqn, operand)
  ungrouped = name == "conv_general_dilated" and (
    eqn.params["feature_group_count"] == eqn.params["batch_group_count"] == 1
  )
  if ungrouped and operand == 1 and floating:
    return operand, _conv_how(eqn)
  if name == "gather" and operand == 0 and _is_embedding(eqn):
    return operand, _gather_how(eqn)
  return None


class _Reader:
  """Classes every value of a program and records how each leaf is used."""

  def __init__(self) -> None:
    # leaf -> ("chain" | "use" | "other") for each equation that takes it.
    self.records: dict[int, list[str]] = defaultdict(list)
    self.uses: dict[Path, Use] = {}

  def program(self, jaxpr: Jaxpr, ins: Sequence[Any], consts: int, at: Path) -> list:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, [CONST] * consts, strict=True))
    env.update(zip(jaxpr.invars, ins, strict=True))
    read = lambda v: CONST if isinstance(v, Literal) else env[v]
    for k, eqn in enumerate(jaxpr.eqns):
      outs = self._eqn(eqn, [read(v) for v in eqn.invars], (*at, k))
      env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]

  def other(self, classes: Sequence[Any]) -> None:
    for c in classes:
      if isinstance(c, _Param):
        for leaf in c.leaves:
          self.records[leaf].append("other")

  def _eqn(self, eqn: JaxprEqn, ins: list[Any], path: Path) -> list[Any]:
    n = len(eqn.outvars)
    if eqn.primitive.name in ("jit", "pjit"):
      inner = eqn.params["jaxpr"]
      return self.program(inner.jaxpr, ins, len(inner.consts), path)
    params = [c for c in ins if isinstance(c, _Param)]
    if not params:
      return [ACT if ACT in ins else CONST] * n
    if ACT not in ins:
      return self._on_params(eqn, ins, params)
    found = _ghost_use(eqn, ins)
    if found is None:
      self.other(ins)
      return [ACT] * n
    operand, how = found
    param = ins[operand]
    assert param.chain is not None
    (leaf,) = param.leaves
    self.records[leaf].append("use")
    self.uses[path] = Use(path, eqn, leaf, param.chain, operand, how)
    return [ACT] * n

  def _on_params(self, eqn: JaxprEqn, ins: list[Any], params: list[_Param]) -> list:
    """An equation on params alone: a norm-keeping step of a chain, or not."""
    (first, *_) = params
    lone = len(params) == 1 and all(
      isinstance(v, Literal) or c is first for v, c in zip(eqn.invars, ins, strict=True)
    )
    if (
      lone
      and first.chain is not None
      and len(eqn.outvars) == 1
      and eqn.primitive.name in _KEEP_NORM
    ):
      (leaf,) = first.leaves
      self.records[leaf].append("chain")
      return [_Param(first.leaves, (*first.chain, eqn))]
    self.other(params)
    leaves = frozenset().union(*(p.leaves for p in params))
    return [_Param(leaves, None)] * len(eqn.outvars)


def analyse(closed: ClosedJaxpr, num_leaves: int) -> Analysis:
  """Which leaves are ghost (and their uses), per-example, or unused.

  `closed` is the loss of one example, its first `num_leaves` inputs the
  params leaves, the rest the example's.
  """
  reader = _Reader()
  num_inputs = len(closed.jaxpr.invars)
  ins = [_Param(frozenset({i}), ()) for i in range(num_leaves)]
  ins += [ACT] * (num_inputs - num_leaves)
  reader.other(reader.program(closed.jaxpr, ins, len(closed.consts), ()))
  uses, per_example, unused = {}, [], []
  by_leaf = {use.leaf: use for use in reader.uses.values()}
  for leaf in range(num_leaves):
    records = reader.records.get(leaf, [])
    use = by_leaf.get(leaf)
    ghost = (
      use is not None
      and records.count("use") == 1
      and "other" not in records
      and records.count("chain") == len(use.chain)
    )
    if ghost:
      assert use is not None
      uses[use.path] = use
    elif records:
      per_example.append(leaf)
    else:
      unused.append(leaf)
  return Analysis(uses, tuple(per_example), tuple(unused))


def _bind(eqn: JaxprEqn, values: Sequence[Any]) -> list[Any]:
  params = eqn.primitive.get_bind_params(eqn.params)
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*values, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


class _Runner:
  """Evaluates the program with a tap on each ghost use's output.

  `acts` holds, after a run, each ghost use's activation input.
  """

  def __init__(self, uses: dict[Path, Use], taps: dict[Path, Any]):
    self.uses, self.taps = uses, taps
    self.acts: dict[Path, Any] = {}

  def program(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], at: Path):
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    for k, eqn in enumerate(jaxpr.eqns):
      path, values = (*at, k), [read(v) for v in eqn.invars]
      name = eqn.primitive.name
      if name in ("jit", "pjit"):
        inner = eqn.params["jaxpr"]
        outs = self.program(inner.jaxpr, inner.consts, values, path)
      elif name == "sharding_constraint":
        # A value, not a layout: the examples' rows are where vmap puts them.
        outs = values
      else:
        outs = _bind(eqn, values)
        if path in self.uses:
          self.acts[path] = values[self.uses[path].activation]
          outs = [outs[0] + self.taps[path]]
      env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _literal(var: Any) -> Any:
  return var.val


def _chain(chain: Sequence[JaxprEqn], value: Any, casts: bool = True) -> Any:
  """The operand made from its leaf (`casts=False`: the layout alone)."""
  for eqn in chain:
    name = eqn.primitive.name
    if name == "sharding_constraint" or (name == "convert_element_type" and not casts):
      continue
    (value,) = _bind(eqn, [value, *(_literal(v) for v in eqn.invars[1:])])
  return value


def _gram(a: jax.Array, g: jax.Array) -> jax.Array:
  """`‖Σ_t a_t g_tᵀ‖²` summed over b, for `a: [b, t, c]`, `g: [b, t, f]`."""
  aa = jnp.einsum("btc,bsc->bts", a, a, precision=_HIGHEST)
  gg = jnp.einsum("btf,bsf->bts", g, g, precision=_HIGHEST)
  return jnp.sum(aa * gg)


def _dot_gram(use: Use, a: jax.Array, g: jax.Array) -> jax.Array:
  """One example's squared gradient norm of a `dot_general` use's operand."""
  batch, free, contract = _dot_dims(use.eqn, use.operand)
  nb, nt = _sizes(a.shape, batch), _sizes(a.shape, free)
  a = jnp.transpose(a, (*batch, *free, *contract)).reshape(nb, nt, -1)
  # The output is (batch, lhs free, rhs free): the activation's free axes
  # come first where it is the lhs, last where it is the rhs.
  nbatch, nfree = len(batch), len(free)
  if use.operand == 0:
    moved = (*range(g.ndim - nfree, g.ndim), *range(nbatch, g.ndim - nfree))
    g = jnp.transpose(g, (*range(nbatch), *moved))
  return _gram(a, g.reshape(nb, nt, -1))


def _conv_gram(use: Use, a: jax.Array, g: jax.Array) -> jax.Array:
  """One example's squared kernel-gradient norm, from its input's patches."""
  params = use.eqn.params
  _, rhs_spec, out_spec = params["dimension_numbers"]
  kernel = _aval(use.eqn.invars[1]).shape
  patches = jax.lax.conv_general_dilated_patches(
    a,
    [kernel[d] for d in rhs_spec[2:]],
    params["window_strides"],
    params["padding"],
    params["lhs_dilation"],
    params["rhs_dilation"],
    params["dimension_numbers"],
    precision=_HIGHEST,
  )
  order = (out_spec[0], *out_spec[2:], out_spec[1])
  patches = jnp.transpose(patches, order).reshape(1, -1, patches.shape[out_spec[1]])
  g = jnp.transpose(g, order).reshape(1, -1, g.shape[out_spec[1]])
  return _gram(patches, g)


def _gather_gram(use: Use, ids: jax.Array, g: jax.Array) -> jax.Array:
  """One example's squared gradient norm of an embedding table it gathers from."""
  rows = _aval(use.eqn.invars[0]).shape[0]
  (offset,) = use.eqn.params["dimension_numbers"].offset_dims
  ids = ids.reshape(-1)
  g = jnp.moveaxis(g, offset, -1).reshape(ids.shape[0], -1)
  if use.eqn.params["mode"] == jax.lax.GatherScatterMode.FILL_OR_DROP:
    # Rows out of range gather the fill value and take no gradient.
    g = jnp.where(((ids >= 0) & (ids < rows))[:, None], g, 0)
  else:
    ids = jnp.clip(ids, 0, rows - 1)
  same = ids[:, None] == ids[None, :]
  return jnp.sum(jnp.where(same, g @ g.T, 0))


_GRAM = {"dot_general": _dot_gram, "conv": _conv_gram, "gather": _gather_gram}


def _gram_sq(use: Use, a: jax.Array, g: jax.Array, dtype: Any) -> jax.Array:
  if jnp.issubdtype(a.dtype, jnp.floating):
    a = a.astype(dtype)
  return _GRAM[use.kind](use, a, g.astype(dtype))


def _operand_grad(use: Use, a: jax.Array, g: jax.Array, w: jax.Array) -> jax.Array:
  """One example's gradient of the use's operand: the equation's own transpose."""

  def output(w):
    return _bind(use.eqn, [a, w] if use.operand == 1 else [w, a])[0]

  return jax.vjp(output, w)[1](g)[0]


def _varying_zeros(aval: Any) -> jax.Array:
  """Zeros of `aval`'s type, device-varying where it is (inside a `shard_map`).

  An invariant tap on a varying value would make its cotangent invariant:
  a psum in every micro-step's backward pass.
  """
  zeros = jnp.zeros(aval.shape, aval.dtype)
  varying = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
  manual = set(jax.sharding.get_abstract_mesh().manual_axes)
  axes = tuple(a for a in varying if a in manual)
  return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


def _keep(mask: jax.Array, x: jax.Array) -> jax.Array:
  """`mask` shaped to select `x`'s rows."""
  return mask.reshape(mask.shape + (1,) * (x.ndim - 1))


def weighted_rows(c: jax.Array, rows: jax.Array, mask: jax.Array, dtype: Any):
  """`Σ_i c_i rows_i`, padding rows (NaN or not) left out."""
  rows = jnp.where(_keep(mask, rows), rows, 0).astype(dtype)
  return jnp.tensordot(c.astype(dtype), rows, axes=1)


class Backward(NamedTuple):
  """One micro-batch's batched backward pass, read for per-example norms.

  Attributes:
    analysis: which leaves are ghost, per-example or unused.
    leaves: the params leaves.
    treedef: the params' structure.
    losses: each example's loss, `[rows]`.
    acts: each ghost use's activations, `[rows, ...]`.
    cotangents: each ghost use's output cotangents, `[rows, ...]`.
    per_example: the per-example leaves' gradients, `[rows, ...]` each.
    products: each `"outer"` use's per-example operand gradients.
  """

  analysis: Analysis
  leaves: list[Any]
  treedef: Any
  losses: jax.Array
  acts: dict[Path, Any]
  cotangents: dict[Path, Any]
  per_example: list[Any]
  products: dict[Path, Any]

  def squared_norms(self, dtype: Any) -> jax.Array:
    """Each example's squared gradient norm over every leaf, in `dtype`."""
    rows = self.losses.shape[0]
    total = jnp.zeros(rows, dtype)
    for g in [*self.per_example, *self.products.values()]:
      total += jnp.sum(jnp.square(g.astype(dtype)).reshape(rows, -1), axis=1)
    for path, use in self.analysis.uses.items():
      if use.how == "gram":
        squared = jax.vmap(lambda a, g, use=use: _gram_sq(use, a, g, dtype))
        total += squared(self.acts[path], self.cotangents[path])
    return total

  def clipped_sum(self, c: jax.Array, mask: jax.Array, dtypes: Sequence[Any]) -> Any:
    """`Σ_i c_i ∇ℓ_i` over the rows, each leaf in its `dtypes` entry."""
    out = [jnp.zeros(x.shape, d) for x, d in zip(self.leaves, dtypes, strict=True)]
    for i, g in zip(self.analysis.per_example, self.per_example, strict=True):
      out[i] = weighted_rows(c, g, mask, dtypes[i])
    for path, products in self.products.items():
      use = self.analysis.uses[path]
      summed = weighted_rows(c, products, mask, dtypes[use.leaf])
      layout = lambda v, use=use: _chain(use.chain, v, casts=False)
      leaf = self.leaves[use.leaf].astype(dtypes[use.leaf])
      out[use.leaf] = jax.vjp(layout, leaf)[1](summed)[0]
    gram = {u.leaf for u in self.analysis.uses.values() if u.how == "gram"}
    if gram:
      values = {i: self.leaves[i].astype(dtypes[i]) for i in sorted(gram)}
      grads = jax.grad(self._reweighted)(values, c, mask)
      out = [grads.get(i, o) for i, o in enumerate(out)]
    return jax.tree.unflatten(self.treedef, out)

  def _reweighted(self, values: dict[int, Any], c: jax.Array, mask: jax.Array) -> Any:
    """`Σ_i ⟨use(a_i, W), c_i g_i⟩` over the gram uses: its gradient is theirs."""
    total = 0.0
    for path, use in self.analysis.uses.items():
      if use.how != "gram":
        continue
      w = _chain(use.chain, values[use.leaf].astype(self.leaves[use.leaf].dtype))
      a, g = self.acts[path], self.cotangents[path]
      if jnp.issubdtype(a.dtype, jnp.floating):
        a = jnp.where(_keep(mask, a), a, 0)  # a padding row's NaN times 0 is NaN
      scaled = jnp.where(_keep(mask, g), _keep(c, g) * g, 0).astype(g.dtype)

      def output(a_i, use=use, w=w):
        return _bind(use.eqn, [a_i, w] if use.operand == 1 else [w, a_i])[0]

      total += jnp.sum(jax.vmap(output)(a) * jax.lax.stop_gradient(scaled))
    return total


def trace(
  loss: Any, params: Any, examples: Any, keys: Any
) -> tuple[ClosedJaxpr, Analysis]:
  """The loss of one example, traced, and how its leaves' norms are made.

  Traced where `vmap` runs it, so that one example's types are those the
  loop will see: without the row axis's sharding (an explicit mesh),
  varying over the devices where the rows do (inside `shard_map`).
  """
  leaves, treedef = jax.tree.flatten(params)
  found: list[ClosedJaxpr] = []

  def flat(leaves, example, key):
    return loss(jax.tree.unflatten(treedef, leaves), example, key)

  def trace_one(example, key):
    found.append(jax.make_jaxpr(flat)(leaves, example, key))
    return 0

  jax.eval_shape(jax.vmap(trace_one, (0, None if keys is None else 0)), examples, keys)
  (closed,) = found
  return closed, analyse(closed, len(leaves))


def backward(loss: Any, params: Any, examples: Any, keys: Any) -> Backward:
  """The micro-batch's per-example losses and the pieces of their norms.

  One `vmap` over the examples of one backward pass, taken with respect to
  the ghost uses' taps and the per-example leaves only.
  """
  leaves, treedef = jax.tree.flatten(params)
  closed, analysis = trace(loss, params, examples, keys)
  uses = analysis.uses

  def one(example, key):
    def run(taps, chosen):
      values = list(leaves)
      for i, v in zip(analysis.per_example, chosen, strict=True):
        values[i] = v
      runner = _Runner(uses, taps)
      args = [*values, *jax.tree.leaves((example, key))]
      (out,) = runner.program(closed.jaxpr, closed.consts, args, ())
      return out, runner.acts

    taps = {
      path: _varying_zeros(_aval(use.eqn.outvars[0])) for path, use in uses.items()
    }
    chosen = [leaves[i] for i in analysis.per_example]
    out, pullback, acts = jax.vjp(run, taps, chosen, has_aux=True)
    tap_grads, leaf_grads = pullback(jnp.ones_like(out))
    return out, acts, tap_grads, leaf_grads

  key_axis = None if keys is None else 0
  losses, acts, cotangents, per_example = jax.vmap(one, (0, key_axis))(examples, keys)
  products = {}
  for path, use in uses.items():
    if use.how == "outer":
      w = _chain(use.chain, leaves[use.leaf])
      grad = lambda a, g, use=use, w=w: _operand_grad(use, a, g, w)
      products[path] = jax.vmap(grad)(acts.pop(path), cotangents.pop(path))
  return Backward(
    analysis, leaves, treedef, losses, acts, cotangents, per_example, products
  )

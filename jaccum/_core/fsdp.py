"""FSDP inside the loop: params gathered where used, gradients scattered where made.

`data_parallel`'s sharded FSDP modes run the traced micro-step (a jaxpr,
gradients included) on each device with some of its inputs given as shards
and some of its outputs wanted as shards. `evaluate` walks the program as
`jax.core.eval_jaxpr` does, with two changes:

- an input given as a shard is all-gathered right before each equation that
  uses it, so the forward and the backward pass each gather what they need
  when they need it and nothing keeps the whole params alive in between;
  where a `lax.scan` slices it (stacked layers with a leading layer axis), the
  scan gets the shard and gathers one slice per iteration: one layer at a time;
- an output wanted as a shard (a parameter's gradient) is scaled by the
  micro-batch's weight and reduce-scattered right after the equation that
  makes it; where a `lax.scan` stacks it, one slice per iteration.

Nothing about the model changes: the user's function was traced once, on
whole params, and computes what it computed. `jit` calls inside it are
evaluated inline so that their scans are reached too; other nested programs
(`cond`, `remat`, custom derivatives, ...) count as one use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, Literal, Var

from jaccum._core import wire as _wire
from jaccum._core.rewrites import spec_axes


def psum_scatter(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
  """`lax.psum_scatter(x, axes)` along `dim`, tiled, whatever `x`'s type shards.

  On an explicit mesh an FSDP × tensor parallel gradient (`P("data",
  "model")` on `jax.make_mesh`'s default mesh) reaches the scatter typed as
  sharded over `"model"`, and JAX's reduce-scatter over the manual data
  axes asserts on such an operand. A `shard_map` over the explicit axes
  makes them manual too: each tensor-parallel shard is scattered on its own,
  which is the same sum.
  """

  def scatter(v):
    return _wire.reduced(
      lambda v: jax.lax.psum_scatter(v, axes, scatter_dimension=dim, tiled=True), v
    )

  spec = tuple(getattr(jax.typeof(x).sharding, "spec", ()))
  explicit = {
    a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))
  }
  if not explicit or (dim < len(spec) and spec[dim] is not None):
    return scatter(x)
  spec = jax.P(*spec)
  return jax.shard_map(scatter, in_specs=spec, out_specs=spec, axis_names=explicit)(x)


class Sharded(NamedTuple):
  """An array split along `dim` over the mesh `axes`, each device holding a slice.

  `dtype`, for a gradient scattered in the loop: what it is summed into
  (the accumulator's dtype, float32 for bf16 gradients unless
  `accum_dtype=None` asks for bf16); None keeps its own. `wire`: the dtype
  it crosses the wire in (`reduce_dtype`), cast back after; None sends it
  as it is.
  """

  dim: int
  axes: tuple[str, ...]
  dtype: Any = None
  wire: Any = None

  def gather(self, shard: jax.Array) -> jax.Array:
    """The whole array, gathered along its leading axis and moved back.

    XLA:CPU gathers and scatters along the major axis of a layout: gathered
    along another, the whole array arrives in a transposed layout and is
    copied back, two whole copies of it at once. Moved to the front, only
    the shard is copied, and the dots that use the whole read it as it is.
    """
    if self.dim == 0:
      return jax.lax.all_gather(shard, self.axes, axis=0, tiled=True)
    leading = jnp.moveaxis(shard, self.dim, 0)
    whole = jax.lax.all_gather(leading, self.axes, axis=0, tiled=True)
    return jnp.moveaxis(whole, 0, self.dim)

  def scatter(self, whole: jax.Array) -> jax.Array:
    """The sum over `axes` of `whole`, each device keeping its slice (scattered
    along the leading axis, for the reason of `gather`)."""
    narrow = self.wire is not None and jnp.issubdtype(whole.dtype, jnp.floating)
    sent = whole.astype(self.wire) if narrow else whole
    if self.dim == 0:
      return psum_scatter(sent, self.axes, 0).astype(whole.dtype)
    shard = psum_scatter(jnp.moveaxis(sent, self.dim, 0), self.axes, 0)
    return jnp.moveaxis(shard, 0, self.dim).astype(whole.dtype)

  def sliced(self) -> Sharded | None:
    """How a slice of the leading axis is split (None: the leading axis is)."""
    return self._replace(dim=self.dim - 1) if self.dim > 0 else None


class Plan(NamedTuple):
  """What FSDP's sharded modes change in the per-device loop.

  Attributes:
    params: per leaf of the params (argument 0): how it arrives split over
      devices, or None for whole. `"shard_all"` sets it for the sharded
      leaves; the loop gathers them where they are used.
    grads: per gradient leaf of the output, in order: how each micro-step
      reduce-scatters it into a sharded accumulator, or None.
  """

  params: list[Sharded | None]
  grads: list[Sharded | None]


def whole_shape(shard_shape: tuple[int, ...], how: Sharded) -> tuple[int, ...]:
  size = jax.lax.axis_size(how.axes)
  return tuple(d * size if i == how.dim else d for i, d in enumerate(shard_shape))


def whole_params(params: Any, hows: Sequence[Sharded | None]) -> Any:
  """The params as the micro-step sees them: shards given whole shapes."""
  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(
    treedef,
    [
      x
      if how is None
      else jax.ShapeDtypeStruct(whole_shape(np.shape(x), how), jnp.result_type(x))
      for x, how in zip(leaves, [*hows, *[None] * len(leaves)], strict=False)
    ],
  )


def _sq_norm(x: jax.Array) -> jax.Array:
  compute = jnp.promote_types(x.dtype, jnp.float32)
  return jnp.sum(jnp.square(jnp.abs(x.astype(compute)))).astype(jnp.float32)


def tied(shard: jax.Array, tie: jax.Array) -> jax.Array:
  """`shard`, made to depend on one element of `tie` (what its use also reads).

  Each use of a param then gathers a different array, so XLA can neither
  hoist the gather out of the loop (a loop-invariant gather keeps the param
  whole through every iteration), nor merge the gathers of its uses (which
  would keep it whole from the forward pass to the backward), nor run one
  before it is needed. An `optimization_barrier` does not survive XLA:CPU's
  passes; `x + 0·f` is not folded for floats (0·inf is NaN), and costs one
  add per element of a shard. `f` is whether that element is NaN, 0 or 1:
  a NaN in the batch (a padding row) must not reach the params every
  device gathers.
  """
  if not jnp.issubdtype(shard.dtype, jnp.inexact) or tie.size == 0:
    return shard
  element = _first_element(tie)
  flag = jnp.isnan(element) if jnp.issubdtype(element.dtype, jnp.inexact) else element
  return shard + flag.astype(shard.dtype) * 0


def _first_element(x: jax.Array) -> jax.Array:
  """`x`'s first element on each device, as a scalar, with no communication.

  Not a reshape: on an explicit mesh it would need a sharding. Nor, where a
  dimension is split over explicit axes (a tensor-parallel activation), an
  index: JAX's types cannot slice one element out of it. There each device
  reads its own first element under a `shard_map` over those axes: the
  elements differ between devices, but only their dependence is used.
  """
  index = (0,) * x.ndim
  spec = tuple(getattr(jax.typeof(x).sharding, "spec", None) or ())
  axes = {a for entry in spec for a in spec_axes(entry)}
  if not axes:
    return x[index]
  return jax.shard_map(
    lambda local: local[index],
    in_specs=jax.P(*spec),
    out_specs=jax.P(),
    axis_names=axes,
    check_vma=False,
  )(x)


_INLINED = ("pjit", "jit", "closed_call", "core_call")


def evaluate(
  jaxpr: Jaxpr,
  consts: Sequence[Any],
  args: Sequence[Any],
  inputs: Sequence[Sharded | None],
  outputs: Sequence[Sharded | None],
  weight: Any = None,
  tie: Any = None,
) -> tuple[list[Any], list[jax.Array]]:
  """Evaluates `jaxpr` with sharded inputs and outputs, gathering and scattering.

  Args:
    jaxpr: the program; its inputs and outputs are whole arrays.
    consts: values of its constvars.
    args: values of its invars: where `inputs[i]` is set, `args[i]` is this
      device's shard of the input.
    inputs: how each input is split, or None for one given whole.
    outputs: how each output is to be split, or None to return it whole.
    weight: this device's weight of the micro-batch (a scalar), which
      multiplies each scattered output before it is summed over devices
      (weights differ between devices, so it cannot be applied after); a
      weight of 0 contributes zeros, even where the output is NaN. None for
      none.
    tie: what a gather is `tied` to where its equation reads nothing else
      (the micro-batch's index), or None. Each shard is tied where it is
      gathered, never whole beforehand: a tie makes a new array, and the
      whole of a stack that a scan slices would be one more stack per
      device (P/D) for as long as the scan runs.

  Returns:
    `(outs, sq_norms)`: the outputs (shards where `outputs` asks) and, for
    each scattered output in order, the float32 squared norm of its whole
    value on this device, before weighting (for the gradient noise scale).
  """
  env: dict[Var, Any] = {}
  shards: dict[Var, tuple[Any, Sharded]] = {}
  wanted: dict[Var, Sharded] = {}
  for var, how in zip(jaxpr.outvars, outputs, strict=True):
    if how is not None and isinstance(var, Var):
      wanted[var] = how
  scattered: dict[Var, tuple[Any, jax.Array]] = {}

  def read(v: Any, use: Any = None) -> Any:
    if isinstance(v, Literal):
      return v.val
    if v in shards:  # a use: gather it here, for this equation alone
      shard, how = shards[v]
      use = tie if use is None else use
      if use is not None:
        shard = tied(shard, use)
      return how.gather(shard)
    return env[v]

  def scatter(whole: Any, how: Sharded) -> tuple[Any, jax.Array]:
    norm = _sq_norm(whole)
    if how.dtype is not None:
      whole = whole.astype(how.dtype)
    if weight is not None:
      compute = jnp.promote_types(whole.dtype, jnp.float32)
      w = jnp.asarray(weight).astype(compute)
      # `where`: a micro-batch of weight 0 (padding) contributes nothing, NaN too.
      whole = jnp.where(w != 0, whole.astype(compute) * w, 0)
      whole = whole.astype(how.dtype or whole.dtype)
    return how.scatter(whole), norm

  for var, value in zip(jaxpr.constvars, consts, strict=True):
    env[var] = value
  for var, value, how in zip(jaxpr.invars, args, inputs, strict=True):
    if how is None:
      env[var] = value
    else:
      shards[var] = (value, how)

  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    touches = any(v in shards for v in eqn.invars if isinstance(v, Var)) or any(
      v in wanted for v in eqn.outvars
    )
    if touches and name in ("scan", *_INLINED):
      # Evaluated here, so that their slices are gathered and scattered one at a
      # time.
      run = _scan if name == "scan" else _inline
      outs, made = run(eqn, read, shards, wanted, weight, tie)
      scattered.update(made)
    else:
      params = eqn.primitive.get_bind_params(eqn.params)
      others = [env[v] for v in eqn.invars if isinstance(v, Var) and v in env]
      use = next((o for o in others if isinstance(o, jax.Array)), None)
      with eqn.ctx.manager:
        result = eqn.primitive.bind(*(read(v, use) for v in eqn.invars), **params)
      outs = result if eqn.primitive.multiple_results else [result]
    for var, value in zip(eqn.outvars, outs, strict=True):
      if value is None:
        continue  # made as a shard, held in `scattered`
      env[var] = value
      if var in wanted and var not in scattered:
        # A gradient, made whole: scatter it now, while it is fresh.
        scattered[var] = scatter(value, wanted[var])

  results, norms = [], []
  for var, how in zip(jaxpr.outvars, outputs, strict=True):
    if how is None:
      results.append(read(var))
      continue
    if isinstance(var, Var) and var in scattered:
      value, norm = scattered[var]
    else:  # an input or a constant returned as it is
      value, norm = scatter(read(var), how)
    results.append(value)
    norms.append(norm)
  return results, norms


def _split(eqn: Any, shards: dict[Var, tuple[Any, Sharded]], read: Any, sliced: Any):
  """The operands of a nested program: shards where `sliced(i)` says, else values."""
  inputs: list[Sharded | None] = []
  operands = []
  for i, v in enumerate(eqn.invars):
    how = shards[v][1] if isinstance(v, Var) and v in shards else None
    inner = sliced(i, how) if how is not None else None
    inputs.append(inner)
    operands.append(shards[v][0] if inner is not None else read(v))
  return inputs, operands


def _inline(eqn, read, shards, wanted, weight, tie):
  """A `jit` call evaluated in place, its inputs and outputs as sharded as ours."""
  closed = eqn.params["jaxpr"]
  inputs, operands = _split(eqn, shards, read, lambda i, how: how)
  outputs = [wanted.get(v) for v in eqn.outvars]
  outs, norms = evaluate(
    closed.jaxpr, closed.consts, operands, inputs, outputs, weight, tie
  )
  norm_iter = iter(norms)
  made = {
    v: (value, next(norm_iter))
    for v, value, how in zip(eqn.outvars, outs, outputs, strict=True)
    if how is not None
  }
  return [
    None if v in made else o for v, o in zip(eqn.outvars, outs, strict=True)
  ], made


def _scan(eqn, read, shards, wanted, weight, tie):
  """A `lax.scan` whose slices are gathered and scattered one at a time.

  A sharded input it slices (an `xs` operand) goes in as the shard stack and
  each iteration gathers its slice; a wanted output it stacks (a `ys`
  operand) comes out as the stack of scattered slices. A sharded constant or
  carry, or a stack split along its leading axis, is gathered (or scattered)
  whole, as for any other equation.
  """
  params = eqn.params
  body = params["jaxpr"]
  num_consts, num_carry = params["num_consts"], params["num_carry"]
  first_xs = num_consts + num_carry
  inputs, operands = _split(
    eqn, shards, read, lambda i, how: how.sliced() if i >= first_xs else None
  )
  consts, carry, xs = (
    operands[:num_consts],
    operands[num_consts:first_xs],
    operands[first_xs:],
  )
  ys_vars = eqn.outvars[num_carry:]
  outputs = [None] * num_carry + [
    how.sliced() if (how := wanted.get(v)) is not None else None for v in ys_vars
  ]
  num_norms = sum(how is not None for how in outputs)

  def step(state, x):
    carry, norm_sums = state
    outs, norms = evaluate(
      body.jaxpr, body.consts, [*consts, *carry, *x], inputs, outputs, weight, tie
    )
    sums = [a + b for a, b in zip(norm_sums, norms, strict=True)]
    return (outs[:num_carry], sums), outs[num_carry:]

  zeros = [jnp.zeros((), jnp.float32) for _ in range(num_norms)]
  (carry, norm_sums), ys = jax.lax.scan(
    step,
    (carry, zeros),
    xs,
    length=params["length"],
    reverse=params["reverse"],
    unroll=params["unroll"],
  )
  norm_iter = iter(norm_sums)
  made = {
    v: (value, next(norm_iter))
    for v, value, how in zip(ys_vars, ys, outputs[num_carry:], strict=True)
    if how is not None
  }
  outs = list(carry) + [
    None if v in made else y for v, y in zip(ys_vars, ys, strict=True)
  ]
  return outs, made

"""ZB-H1: one loop of ticks running F, B or W, as the schedule's table says.

The stage's backward is cut in two (`backward`): B, to the stage's input,
sends the cotangent on at once; W, to its weights, runs where the device
would otherwise idle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from jaccum._pipeline import backward, common
from jaccum._pipeline.tables import (
  KINDS,
  zero_bubble_tables,
)


class _WeightSplit:
  """The stage's backward as B and W (`backward.split`), and where
  what each reads waits.

  B reads some residuals and the output's cotangent, and hands W the values
  W reads of it (`carried`: the cotangents of the layers' outputs); W reads
  those and residuals of its own. Per micro-batch, the residuals W reads wait
  from F to W (ring `fw`), those only B reads from F to B (`fb`), and what B
  hands W from B to W (`bw`). With remat, `fb` holds the stage's input and
  state, from which B recomputes the residuals, and B hands W the residuals
  it reads with `carried`. Residuals of the parameters alone are `shared`.
  """

  def __init__(self, residuals: common.Residuals) -> None:
    self.residuals, self.remat = residuals, residuals.layout.remat
    first_input = residuals.first_input
    like = lambda tree: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(jnp.shape(a), common.dtype(a)), tree
    )
    counts: list[int] = []

    def program(leaves, cotangent):
      fn = jax.tree.unflatten(residuals.treedef, leaves)
      grads = [common.floats(g) for g in fn(common.with_float0(cotangent, first_input))]
      counts[:] = [len(g) for g in grads]
      return [g for group in grads for g in group]

    closed = jax.make_jaxpr(program)(
      like(residuals.all_like), like(common.floats(first_input))
    )
    self.num_param_grads, num_const_grads, self.num_input_grads = counts
    is_b = [False] * (self.num_param_grads + num_const_grads)
    # The cotangent waits until B: W gets what it reads of it through B.
    self.num_residuals = num = len(residuals.all_like)
    self.split = backward.split(
      closed,
      is_b + [True] * self.num_input_grads,
      through_b=range(num, len(closed.jaxpr.invars)),
    )
    per_microbatch = residuals.per_microbatch
    w_reads = set(self.split.w_inputs)
    self.w_kept = [i for i in self.split.w_inputs if per_microbatch[i]]
    self.b_kept = [
      i
      for i in self.split.b_inputs
      if i < num and per_microbatch[i] and i not in w_reads
    ]
    self.shared_at = [i for i, d in enumerate(per_microbatch) if not d]
    carried_like = [
      jax.ShapeDtypeStruct(a.shape, a.dtype)
      for a in self.split.b.out_avals[self.num_input_grads :]
    ]
    kept = lambda at: [residuals.all_like[i] for i in at]
    if self.remat:
      self.like = (
        (first_input, residuals.kept_like[1]),
        [],
        (kept(self.w_kept), carried_like),
      )
    else:
      self.like = (kept(self.b_kept), kept(self.w_kept), carried_like)

  def forward(self, params: Any, x: Any, key: Any, state: Any) -> Any:
    """F: `(y, new state, what waits for B, what waits for W)`."""
    if self.remat:
      y, new_state, kept = self.residuals.forward(params, x, key, state)
      return y, new_state, kept, []
    y, new_state, leaves = self.residuals.leaves(params, x, key, state)
    at = lambda indices: [leaves[i] for i in indices]
    return y, new_state, at(self.b_kept), at(self.w_kept)

  def input_backward(
    self, params: Any, fb: Any, fw: Any, shared: Any, key: Any, cotangent: Any
  ) -> tuple[list[Any], Any]:
    """B: `(the input's cotangent, what waits for W)`."""
    if self.remat:
      x, state = fb
      leaves = self.residuals.leaves(params, x, key, state)[2]
      fw = [leaves[i] for i in self.w_kept]
      by_index = dict(enumerate(leaves))
    else:
      by_index = self._by_index(fw, shared) | dict(zip(self.b_kept, fb, strict=True))
    by_index |= dict(enumerate(cotangent, start=self.num_residuals))
    reads = [by_index[i] for i in self.split.b_inputs]
    out = jaxpr_as_fun(self.split.b)(*reads)
    input_grads, carried = out[: self.num_input_grads], out[self.num_input_grads :]
    return input_grads, ((fw, carried) if self.remat else carried)

  def shared(self, params: Any) -> list[Any]:
    """The residuals of the parameters alone: kept from before the loop, or
    with remat recomputed (they take no arithmetic: weights, transposes)."""
    if not self.remat:
      return common.take_chunk(self.residuals.shared, 0, 1)
    leaves = self.residuals.leaves(params, *self.residuals.example[1:])[2]
    return [leaves[i] for i in self.shared_at]

  def weight_backward(
    self, fw: Any, bw: Any, shared: Any
  ) -> tuple[list[Any], list[Any]]:
    """W: `(the parameters' gradients, the constants')`."""
    kept, carried = bw if self.remat else (fw, bw)
    by_index = self._by_index(kept, shared)
    reads = [by_index[i] for i in self.split.w_inputs]
    grads = jaxpr_as_fun(self.split.w)(*reads, *carried)
    return grads[: self.num_param_grads], grads[self.num_param_grads :]

  def _by_index(self, w_kept: list[Any], shared: list[Any]) -> dict[int, Any]:
    by_index = dict(zip(self.w_kept, w_kept, strict=True))
    return by_index | dict(zip(self.shared_at, shared, strict=True))


class _Rings(NamedTuple):
  """What waits on a device in the ZB-H1 loop, micro-batch k in slot k % size.

  `x` and `cotangent` are inboxes: what the neighbours sent, until the F or
  B that uses it; on the last stage the loss's cotangent waits in
  `cotangent` from F to B. `fb`, `fw`, `bw`: as `_WeightSplit` says.
  """

  x: Any
  cotangent: Any
  fb: Any
  fw: Any
  bw: Any


class _TickOut(NamedTuple):
  """What a ZB-H1 tick's F, B, W or idle branch returns."""

  y: Any  # sent to the next stage
  input_grads: Any  # sent to the previous stage
  state: Any
  fb: Any
  fw: Any
  bw: Any
  head: Any  # `common.head_branches`' result
  sums: Any


def loop(
  layout: common.Layout,
  stage: common.Traced,
  head: common.Traced,
  param_dtypes: Any,
  args: common.Args,
) -> tuple[jax.Array, Any, tuple[list[Any], ...]]:
  """The ZB-H1 loop on one device; it returns what `one_f_one_b.loop` does.

  In each tick a device runs one of F, B and W, as the schedule's table says
  (`zero_bubble_tables`): F keeps what B and W need, the last stage's F also
  the loss and its cotangent; B computes the input's cotangent, sent on at
  once, and hands W what it needs; W adds the weights' gradients to the
  sums. What waits between them, and what arrives before the tick that uses
  it, waits in rings (`_Rings`).
  """
  residuals = common.Residuals(layout, stage, param_dtypes, args)
  split = _WeightSplit(residuals)
  tables = zero_bubble_tables(layout.schedule)
  first_input = residuals.first_input

  def ring(like, size):
    return jax.tree.map(lambda a: jnp.zeros((size, *a.shape), a.dtype), like)

  rings = _Rings(
    *(
      ring(like, tables.sizes[name])
      for name, like in zip(
        _Rings._fields,
        (first_input, common.floats(first_input), *split.like),
        strict=True,
      )
    )
  )
  arrived = (first_input, common.zeros(common.floats(first_input)))
  carry = (arrived, rings, args.state, common.zero_accumulators(layout, head, args))
  tick = _tick(layout, split, head, args, tables)
  steps = jnp.arange(len(tables.table))
  (_, _, state, acc), _ = jax.lax.scan(tick, carry, steps)
  return acc.loss.astype(head.out_dtype), state, common.gradients(acc)


def _branches(
  layout: common.Layout, split: _WeightSplit, head: common.Traced, args: common.Args
) -> Callable[..., _TickOut]:
  """What a device runs in a tick: idle, F, B or W, by `work` (0, then the
  indices of `KINDS` + 1).

  It takes `(work, params, x, key, state, rings, k, head_consts, targets,
  sums)`: the stage's parameters, micro-batch k's input (for F) and key, the
  stage's state, the rings (read here, written by the loop), k's targets and
  the gradients' sums; and returns a `_TickOut`.
  """
  head_grads, idle_head = common.head_branches(layout, head)
  last = jax.lax.axis_index(layout.axis) == layout.ticks.num_stages - 1
  first_input = split.residuals.first_input
  like = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(jnp.shape(a), common.dtype(a)),
    (first_input, common.floats(first_input), *split.like),
  )

  # What a branch does not compute it returns as zeros: XLA would copy what
  # passed through it unchanged.
  def out(**computed):
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
    names = ("y", "input_grads", "fb", "fw", "bw")
    fields = dict(zip(names, map(zeros, like), strict=True))
    return _TickOut(**(fields | computed))

  def slot(ring, k):
    leaves = jax.tree.leaves(ring)
    return common.take(ring, k % leaves[0].shape[0]) if leaves else ring

  def idle(params, x, key, state, rings, k, head_consts, targets, sums):
    return out(state=state, head=idle_head(head_consts, x, targets), sums=sums)

  def forward(params, x, key, state, rings, k, head_consts, targets, sums):
    y, new_state, fb, fw = split.forward(params, x, key, state)
    loss = jax.lax.cond(last, head_grads, idle_head, head_consts, y, targets)
    return out(y=y, state=new_state, fb=fb, fw=fw, head=loss, sums=sums)

  def input_backward(params, x, key, state, rings, k, head_consts, targets, sums):
    fb, fw, ct = slot(rings.fb, k), slot(rings.fw, k), slot(rings.cotangent, k)
    shared = [] if split.remat else split.shared(params)
    input_grads, bw = split.input_backward(params, fb, fw, shared, key, ct)
    head_out = idle_head(head_consts, x, targets)
    return out(input_grads=input_grads, state=state, bw=bw, head=head_out, sums=sums)

  def weight_backward(params, x, key, state, rings, k, head_consts, targets, sums):
    fw, bw = slot(rings.fw, k), slot(rings.bw, k)
    grads = split.weight_backward(fw, bw, split.shared(params))
    head_out = idle_head(head_consts, x, targets)
    return out(state=state, head=head_out, sums=common.add_grads(sums, 0, *grads, 1))

  # W adds to the sums in place in a two-way `cond` whose other branch passes
  # them through: XLA keeps them in one buffer, where a four-way `switch`
  # would copy them. XLA's cost analysis counts either as one branch.
  def not_weight(work, *operands):
    return jax.lax.switch(work, [idle, forward, input_backward], *operands)

  def run(work, *operands):
    is_w = work == len(KINDS)
    return jax.lax.cond(
      is_w, lambda w, *o: weight_backward(*o), not_weight, work, *operands
    )

  return run


def _tick(
  layout: common.Layout,
  split: _WeightSplit,
  head: common.Traced,
  args: common.Args,
  tables: Any,
) -> Callable[..., Any]:
  """The body of the ZB-H1 loop: store what arrived, run the tick's work,
  keep what it computed, send."""
  residuals = split.residuals
  S, K = layout.ticks.num_stages, layout.ticks.num_microbatches
  device = jax.lax.axis_index(layout.axis)
  table = jnp.asarray(tables.table)
  sizes = _Rings(*(tables.sizes[name] for name in _Rings._fields))
  run = _branches(layout, split, head, args)
  targets = common.split(args.targets, K)
  num_kinds = len(KINDS) + 1

  def arrival(t, source, kind):
    """The micro-batch whose `kind`'s output `source` sent last tick, or -1."""
    code = table[jnp.maximum(t - 1, 0), jnp.clip(source, 0, S - 1)]
    sent = (t > 0) & (source >= 0) & (source < S) & (code % num_kinds == kind)
    return jnp.where(sent, code // num_kinds, -1)

  def tick(carry, t):
    (x_arrived, ct_arrived), rings, state, acc = carry
    code = table[t, device]
    work, k = code % num_kinds, code // num_kinds
    k_x, k_ct = arrival(t, device - 1, 1), arrival(t, device + 1, 2)
    rings = rings._replace(
      x=common.put(rings.x, k_x % sizes.x, x_arrived, k_x >= 0),
      cotangent=common.put(
        rings.cotangent, k_ct % sizes.cotangent, ct_arrived, k_ct >= 0
      ),
    )
    x = common.select(
      device == 0, common.take(residuals.xs, k), common.take(rings.x, k % sizes.x)
    )
    old_state = common.stop(common.take_chunk(state, 0, 1))
    out = run(
      work,
      common.take_chunk(args.params, 0, 1),
      x,
      layout.key(residuals.key, k, 0),
      old_state,
      rings,
      k,
      args.head_consts,
      common.take(targets, k),
      (acc.params, acc.stage_consts),
    )
    is_f, is_b = work == 1, work == 2
    end = is_f & (device == S - 1)
    value, y_grads, head_const_grads, target_grads = out.head
    rings = rings._replace(
      cotangent=common.put(rings.cotangent, k % sizes.cotangent, y_grads, end),
      fb=common.put(rings.fb, k % sizes.fb, out.fb, is_f),
      fw=common.put(rings.fw, k % sizes.fw, out.fw, is_f),
      bw=common.put(rings.bw, k % sizes.bw, out.bw, is_b),
    )
    new_state = common.select(is_f, common.stop(out.state), old_state)
    acc = common.Accumulators(
      loss=acc.loss + value,
      params=out.sums[0],
      stage_consts=out.sums[1],
      head_consts=jax.tree.map(jnp.add, acc.head_consts, head_const_grads),
      x=common.put(acc.x, k, out.input_grads, is_b & (device == 0)),
      targets=common.put(acc.targets, k, target_grads, end),
    )
    sends = (common.shift(out.y, layout, +1), common.shift(out.input_grads, layout, -1))
    return (sends, rings, common.put_chunk(state, 0, new_state, 1), acc), None

  return tick

"""ZB-H1 and ZB-V: one loop of ticks running F, B or W, as the schedule's table says.

The stage's backward is cut in two (`backward`): B, to the stage's input,
sends the cotangent on at once; W, to its weights, runs where the device
would otherwise idle. ZB-V runs two chunks per device, placed in a V; the
loop is the same, read from its table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from jaccum._pipeline import backward, common
from jaccum._pipeline.tables import COLUMNS, KINDS, zero_bubble_tables


class _WeightSplit:
  """The stage's backward as B and W (`backward.split`), and where
  what each reads waits.

  B reads some residuals and the output's cotangent, and hands W the values
  W reads of it (`carried`: the cotangents of the layers' outputs); W reads
  those and residuals of its own. Per micro-batch, the residuals W reads wait
  from F to W (ring `fw`), those only B reads from F to B (`fb`), and what B
  hands W from B to W (`bw`). With remat, `fw` holds the stage's input and
  state from F to W, from which B and W each recompute the residuals they
  read (W's recomputation is one more forward, run in ticks whose other
  devices run a B, itself a forward and a backward: it costs no time), and
  B hands W only `carried`. Residuals of the parameters alone are `shared`.
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
    per_microbatch = residuals.per_microbatch
    # Residuals of the parameters alone are kept once, not per micro-batch:
    # W reads them at no cost.
    self.split = backward.split(
      closed,
      is_b + [True] * self.num_input_grads,
      through_b=range(num, len(closed.jaxpr.invars)),
      free=[i for i, depends in enumerate(per_microbatch) if not depends],
    )
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
      self.like = ([], (first_input, residuals.kept_like[1]), carried_like)
    else:
      self.like = (kept(self.b_kept), kept(self.w_kept), carried_like)

  def forward(self, params: Any, x: Any, key: Any, state: Any) -> Any:
    """F: `(y, new state, what waits for B, what waits for W)`."""
    if self.remat:
      y, new_state, kept = self.residuals.forward(params, x, key, state)
      return y, new_state, [], kept
    y, new_state, leaves = self.residuals.leaves(params, x, key, state)
    at = lambda indices: [leaves[i] for i in indices]
    return y, new_state, at(self.b_kept), at(self.w_kept)

  def input_backward(
    self, params: Any, fb: Any, fw: Any, shared: Any, key: Any, cotangent: Any
  ) -> tuple[list[Any], Any]:
    """B: `(the input's cotangent, what waits for W)`."""
    if self.remat:
      by_index = dict(enumerate(self._recomputed(params, fw, key)))
    else:
      by_index = self._by_index(fw, shared) | dict(zip(self.b_kept, fb, strict=True))
    by_index |= dict(enumerate(cotangent, start=self.num_residuals))
    reads = [by_index[i] for i in self.split.b_inputs]
    out = jaxpr_as_fun(self.split.b)(*reads)
    input_grads, carried = out[: self.num_input_grads], out[self.num_input_grads :]
    return input_grads, carried

  def shared(self, chunk: Any) -> list[Any]:
    """The residuals of chunk `chunk`'s parameters alone, kept from before
    the loop (without remat)."""
    num_chunks = self.residuals.layout.ticks.num_chunks
    return common.take_chunk(self.residuals.shared, chunk, num_chunks)

  def weight_backward(
    self, params: Any, fw: Any, bw: Any, key: Any, chunk: Any
  ) -> tuple[list[Any], list[Any]]:
    """W: `(the parameters' gradients, the constants')`. With remat it
    recomputes the residuals it reads from the stage's input and state."""
    if self.remat:
      by_index = dict(enumerate(self._recomputed(params, fw, key)))
    else:
      by_index = self._by_index(fw, self.shared(chunk))
    reads = [by_index[i] for i in self.split.w_inputs]
    grads = jaxpr_as_fun(self.split.w)(*reads, *bw)
    return grads[: self.num_param_grads], grads[self.num_param_grads :]

  def _recomputed(self, params: Any, kept: Any, key: Any) -> list[Any]:
    """The residuals, recomputed from what F kept with remat: the stage's
    input and state."""
    x, state = kept
    return self.residuals.leaves(params, x, key, state)[2]

  def _by_index(self, w_kept: list[Any], shared: list[Any]) -> dict[int, Any]:
    by_index = dict(zip(self.w_kept, w_kept, strict=True))
    return by_index | dict(zip(self.shared_at, shared, strict=True))


class _Carry(NamedTuple):
  """What the zero-bubble loop carries from tick to tick besides the messages.

  `inbox`: what the neighbours (or the device itself) sent, until the F or B
  that reads it, like the stage's input (a cotangent in its floating
  leaves). `fb`, `fw`, `bw`: what waits for B and W, as `_WeightSplit`
  says. Each a ring of slots, as the table assigns them (`ZeroBubbleTables`).
  `state`: the device's chunks' state; `acc`: the sums.
  """

  inbox: Any
  fb: Any
  fw: Any
  bw: Any
  state: Any
  acc: common.Accumulators


def loop(
  layout: common.Layout,
  stage: common.Traced,
  head: common.Traced,
  param_dtypes: Any,
  args: common.Args,
) -> tuple[jax.Array, Any, tuple[list[Any], ...]]:
  """The ZB-H1 or ZB-V loop on one device; it returns what `one_f_one_b.loop`
  does.

  In each tick a device stores the messages its neighbours and itself sent
  in the last tick, then runs one of F, B and W, as the schedule's table
  says (`zero_bubble_tables`), and sends what it computed to both
  neighbours: F keeps what B and W need, the last stage's F also the loss's
  cotangent; B computes the input's cotangent and keeps what W needs; W adds
  the weights' gradients to the sums. What F and B keep goes into the
  rings after the branch (`_tick`), where XLA updates them in place.
  """
  residuals = common.Residuals(layout, stage, param_dtypes, args)
  split = _WeightSplit(residuals)
  tables = zero_bubble_tables(layout.schedule)
  first_input = residuals.first_input

  def ring(like, size):
    return jax.tree.map(lambda a: jnp.zeros((size, *jnp.shape(a)), a.dtype), like)

  sizes = tables.sizes
  carry = _Carry(
    ring(first_input, sizes["inbox"]),
    *(
      ring(like, sizes[name])
      for name, like in zip(("fb", "fw", "bw"), split.like, strict=True)
    ),
    state=args.state,
    acc=common.zero_accumulators(layout, head, args),
  )
  messages = (common.zeros_like(first_input),) * 3
  tick = _tick(layout, split, head, args, tables.table)
  steps = jnp.arange(len(tables.table))
  (_, carry), _ = jax.lax.scan(tick, (messages, carry), steps)
  acc = carry.acc
  return acc.loss.astype(head.out_dtype), carry.state, common.gradients(acc)


def _as_message(floats: list[Any], like: Any) -> Any:
  """`like`'s tree with `floats` at its floating leaves: a cotangent sent as
  an activation is (its integer leaves are never read)."""
  values = iter(floats)
  return jax.tree.map(
    lambda a: next(values) if common.is_float(common.dtype(a)) else a, like
  )


class _TickOut(NamedTuple):
  """What a zero-bubble tick's F, B, W or idle branch returns."""

  message: Any  # F's output (the last stage's: the loss's cotangent), B's
  # input cotangent; zeros from W and idle.
  fb: Any  # what F keeps for B and W, and what B keeps for W
  fw: Any
  bw: Any
  state: Any  # F's new state of the chunk
  head: Any  # the loss, and the head constants' and targets' gradients
  sums: Any  # the gradients' sums, W's added


def _branches(
  layout: common.Layout, split: _WeightSplit, head: common.Traced, args: common.Args
) -> Callable[..., _TickOut]:
  """What a device runs in a tick, by the table's row: idle, F, B or W.

  `run(row, carry)` returns a `_TickOut`; what a branch does not compute it
  returns as zeros. Only W updates something in place, the sums: the rest
  is written after the branch (`_tick`).
  """
  ticks = layout.ticks
  V = ticks.num_chunks
  device = jax.lax.axis_index(layout.axis)
  head_grads, idle_head = common.head_branches(layout, head)
  residuals = split.residuals
  targets = common.split(args.targets, ticks.num_microbatches)
  col = {name: i for i, name in enumerate(COLUMNS)}
  first_input = residuals.first_input
  like = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(jnp.shape(a), common.dtype(a)),
    (first_input, *split.like),
  )

  def out(carry, head_out, **computed):
    names = ("message", "fb", "fw", "bw")
    fields = dict(zip(names, map(common.zeros_like, like), strict=True))
    fields |= {"state": common.take_chunk(carry.state, 0, V), "head": head_out}
    return _TickOut(
      **(fields | {"sums": (carry.acc.params, carry.acc.stage_consts)} | computed)
    )

  def unpack(row, carry):
    k, chunk = row[col["microbatch"]], row[col["chunk"]]
    params = common.take_chunk(args.params, chunk, V)
    value, _, *grads = idle_head(args.head_consts, first_input, common.take(targets, k))
    idle_out = (value, *grads)
    return k, chunk, params, layout.key(residuals.key, k, chunk), idle_out

  def idle(row, carry):
    return out(carry, unpack(row, carry)[-1])

  def forward(row, carry):
    k, chunk, params, key, _ = unpack(row, carry)
    x = common.select(
      ticks.is_first(device, chunk),
      common.take(residuals.xs, k),
      common.take(carry.inbox, row[col["x"]]),
    )
    state = common.stop(common.take_chunk(carry.state, chunk, V))
    y, new_state, fb, fw = split.forward(params, x, key, state)
    last = ticks.is_last(device, chunk)
    value, y_grads, *grads = jax.lax.cond(
      last, head_grads, idle_head, args.head_consts, y, common.take(targets, k)
    )
    # The last stage sends the loss's cotangent, to itself.
    message = common.select(last, _as_message(y_grads, y), y)
    head_out = (value, *grads)
    return out(carry, head_out, message=message, fb=fb, fw=fw, state=new_state)

  def input_backward(row, carry):
    _, chunk, params, key, idle_out = unpack(row, carry)
    fb = common.take(carry.fb, row[col["fb"]])
    fw = common.take(carry.fw, row[col["fw"]])
    cotangent = common.floats(common.take(carry.inbox, row[col["cotangent"]]))
    shared = [] if split.remat else split.shared(chunk)
    input_grads, bw = split.input_backward(params, fb, fw, shared, key, cotangent)
    message = _as_message(input_grads, common.zeros_like(first_input))
    return out(carry, idle_out, message=message, bw=bw)

  def weight_backward(row, carry):
    _, chunk, params, key, idle_out = unpack(row, carry)
    fw = common.take(carry.fw, row[col["fw"]])
    bw = common.take(carry.bw, row[col["bw"]])
    grads = split.weight_backward(params, fw, bw, key, chunk)
    sums = common.add_grads(
      (carry.acc.params, carry.acc.stage_consts), chunk, *grads, V
    )
    return out(carry, idle_out, sums=sums)

  # W adds to the sums in place in a two-way `cond` whose other branch passes
  # them through: XLA keeps them in one buffer, where a four-way `switch`
  # would copy them. XLA's cost analysis counts either as one branch.
  def not_weight(row, carry):
    work = row[col["work"]]
    return jax.lax.switch(work, [idle, forward, input_backward], row, carry)

  def run(row, carry):
    is_w = row[col["work"]] == 1 + KINDS.index("W")
    return jax.lax.cond(is_w, weight_backward, not_weight, row, carry)

  return run


def _tick(
  layout: common.Layout,
  split: _WeightSplit,
  head: common.Traced,
  args: common.Args,
  table: Any,
) -> Callable[..., Any]:
  """The body of the zero-bubble loop: store what arrived, run the tick's
  pass, keep what it computed, send."""
  ticks = layout.ticks
  V = ticks.num_chunks
  device = jax.lax.axis_index(layout.axis)
  table = jnp.asarray(table)
  run = _branches(layout, split, head, args)
  col = {name: i for i, name in enumerate(COLUMNS)}
  sources = ("from_previous", "from_next", "from_self")
  put = lambda ring, slot, value: jax.tree.map(
    lambda r, v: jax.lax.dynamic_update_index_in_dim(r, v, slot, 0), ring, value
  )
  keep = lambda *rings: rings

  def tick(carry, t):
    messages, carry = carry
    row = table[t, device]
    # Every message is stored, unconditionally: one that no pass here reads
    # goes to a slot free in this tick.
    inbox = carry.inbox
    for source, message in zip(sources, messages, strict=True):
      inbox = put(inbox, row[col[source]], message)
    carry = carry._replace(inbox=inbox)
    out = run(row, carry)
    work, k, chunk = row[col["work"]], row[col["microbatch"]], row[col["chunk"]]
    is_f, is_b = work == 1 + KINDS.index("F"), work == 1 + KINDS.index("B")
    # Written in place in two-way `cond`s that pass them through otherwise:
    # a `where` would copy the slot, a branch writing them would copy the
    # rings (XLA copies a buffer that one branch updates and another passes
    # through while updating another).
    fb, fw = jax.lax.cond(
      is_f,
      lambda fb, fw: (put(fb, row[col["fb"]], out.fb), put(fw, row[col["fw"]], out.fw)),
      keep,
      carry.fb,
      carry.fw,
    )
    first = is_b & ticks.is_first(device, chunk)
    grads = common.floats(out.message)
    acc_x, bw = jax.lax.cond(
      is_b,
      lambda x, bw: (common.put(x, k, grads, first), put(bw, row[col["bw"]], out.bw)),
      keep,
      carry.acc.x,
      carry.bw,
    )
    value, head_const_grads, target_grads = out.head
    acc = carry.acc._replace(
      loss=carry.acc.loss + value,
      params=out.sums[0],
      stage_consts=out.sums[1],
      head_consts=jax.tree.map(jnp.add, carry.acc.head_consts, head_const_grads),
      x=acc_x,
      targets=common.put(
        carry.acc.targets, k, target_grads, is_f & ticks.is_last(device, chunk)
      ),
    )
    old_state = common.take_chunk(carry.state, chunk, V)
    new_state = common.select(is_f, common.stop(out.state), old_state)
    state = common.put_chunk(carry.state, chunk, new_state, V)
    carry = _Carry(inbox, fb, fw, bw, state, acc)
    sends = (
      common.shift(out.message, layout, +1),
      common.shift(out.message, layout, -1),
      out.message,
    )
    return (sends, carry), None

  return tick

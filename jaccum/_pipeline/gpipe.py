"""GPipe: every forward, then `jax.grad` of the forward loop runs every backward.

The forward loop runs the ticks of the schedule; each device runs its
stage on the micro-batch that has reached it, and the last stage's outputs
are gathered (or, with `loss_fn`, the last stage's losses summed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaccum._pipeline import common


def gpipe(
  layout: common.Layout,
  stage: common.Traced,
  head: common.Traced | None,
  param_dtypes: Any,
  args: common.Args,
) -> tuple[Any, Any]:
  """A device's forward loop (and head); `jax.grad` makes the backward loop.

  Returns the output (replicated over the stages) or the device's share of
  the summed loss, and the device's state. Closed-over values are used in
  `accum_dtype` too, so that their gradients accumulate in it.
  """
  num_microbatches = layout.ticks.num_microbatches
  widen = layout.widen
  stage_consts, head_consts = widen(args.stage_consts), widen(args.head_consts)

  def run(params, x, key, state):
    consts = common.cast(stage_consts, [c.dtype for c in args.stage_consts])
    return stage(consts, common.cast(params, param_dtypes), x, key, state)

  xs = common.split(args.x, num_microbatches)
  key = layout.wrap_key(args.key)
  outputs, state = _forward_loop(layout, run, args.params, xs, key, args.state)
  if head is None:
    return common.unsplit(common.from_last_stage(layout, outputs)), state
  traced = head

  def loss(y, t):
    return traced(common.cast(head_consts, [c.dtype for c in args.head_consts]), y, t)

  targets = common.split(args.targets, num_microbatches)
  return common.total_loss(layout, traced.out_dtype, loss, outputs, targets), state


def _forward_loop(
  layout: common.Layout,
  run: Callable[..., Any],
  params: Any,
  xs: Any,
  key: Any,
  state: Any,
) -> tuple[Any, Any]:
  """All forward ticks; returns the last stage's outputs `[K, ...]` and the state.

  The outputs are filled in on the device holding the last stage, and are
  zeros elsewhere.
  """
  ticks = layout.ticks
  S, V, K = ticks.num_stages, ticks.num_chunks, ticks.num_microbatches
  device = jax.lax.axis_index(layout.axis)

  # With V > 1 a tick's parameters are a chunk chosen by the tick: autodiff
  # would keep it, and every slice or transpose the stage takes of it, for
  # the backward once per tick. Kept instead is only what took arithmetic
  # to compute; the backward slices the chunk again from the stack of all
  # chunks, which the loop does not change and autodiff keeps once.
  def run_chunk(params, chunk, x, key, state):
    return run(common.take_chunk(params, chunk, V), x, key, state)

  if layout.remat:
    run_chunk = jax.checkpoint(run_chunk)
  elif V > 1:
    run_chunk = jax.checkpoint(run_chunk, policy=common.save_arithmetic)

  def tick(carry, t):
    received, outputs, state = carry
    microbatch, chunk, active = ticks.forward(t, device)
    microbatch = jnp.clip(microbatch, 0, K - 1)
    # ZB-V's chunk 1 takes what the next device (or, at the turn, this
    # one) sent; the rest what the previous one sent.
    inputs = (
      received[0]
      if len(received) == 1
      else common.select(chunk == 0, received[0], received[1])
    )
    inputs = common.select(
      ticks.is_first(device, chunk), common.take(xs, microbatch), inputs
    )
    # A device runs `stage_fn` in its idle ticks too, and what it computes
    # there goes nowhere (its cotangent is zero). Skipping it with
    # `lax.cond` would make autodiff keep the cond's operands, the
    # parameters included, once per tick. Idle ticks see real data, never
    # placeholders (the first micro-batch's input before a device's first
    # micro-batch arrives, activations of the last one after its last), so
    # `stage_fn` is not asked for values and derivatives at points like 0,
    # where it may have none.
    old_state = common.take_chunk(state, chunk, V)
    step_key = layout.key(key, microbatch, chunk)
    y, new_state = run_chunk(params, chunk, inputs, step_key, common.stop(old_state))
    last = active & ticks.is_last(device, chunk)
    outputs = common.put(outputs, microbatch, y, last)
    new_state = common.select(active, common.stop(new_state), old_state)
    state = common.put_chunk(state, chunk, new_state, V)
    sent = (common.shift(y, layout, +1),)
    if ticks.v_shape:
      sent += (common.select(device == S - 1, y, common.shift(y, layout, -1)),)
    return (sent, outputs, state), None

  outputs = jax.tree.map(jnp.zeros_like, xs)
  first = common.take(xs, jnp.int32(0))
  carry = ((first,) * (2 if ticks.v_shape else 1), outputs, state)
  steps = jnp.arange(ticks.num_forward_ticks)
  (_, outputs, state), _ = jax.lax.scan(tick, carry, steps)
  return outputs, state


# Primitives that only move or retype data: recomputing them costs no arithmetic.

"""1F1B: one loop of ticks in which each device runs one forward and one backward.

The last stage computes each micro-batch's loss right after its forward, so
that micro-batch's backward starts while later ones still go forward; a
device keeps the residuals of a bounded number of micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaccum._pipeline import common


def loop(
  layout: common.Layout,
  stage: common.Traced,
  head: common.Traced,
  param_dtypes: Any,
  args: common.Args,
) -> tuple[jax.Array, Any, tuple[list[Any], ...]]:
  """The 1F1B loop on one device: its share of the loss, its state, and its
  share of the gradients of `common.Args`' first five fields (their floating leaves).

  In each tick a device runs the forward of one micro-batch through one of
  its chunks and the backward of another (`_Ticks`). The device holding the
  last stage runs `loss_fn` and its gradient right after that stage's
  forward, and the backward in the same tick; any other stage runs a
  micro-batch's backward 2(L − 1 − l) ticks after its forward, from what the
  forward kept in a ring of slots (`common.Residuals`).
  """
  ticks = layout.ticks
  residuals = common.Residuals(layout, stage, param_dtypes, args)
  sizes = ticks.ring_sizes()
  ring = jax.tree.map(
    lambda a: jnp.zeros((sum(sizes), *a.shape), a.dtype), residuals.kept_like
  )
  first_input = residuals.first_input
  carry = (
    first_input,
    common.zeros(common.floats(first_input)),
    ring,
    args.state,
    common.zero_accumulators(layout, head, args),
  )
  tick = _tick(layout, residuals, head, args, sizes)
  steps = jnp.arange(ticks.num_1f1b_ticks)
  (*_, state, acc), _ = jax.lax.scan(tick, carry, steps)
  return acc.loss.astype(head.out_dtype), state, common.gradients(acc)


def _backward(residuals: common.Residuals) -> tuple[Callable[..., Any], ...]:
  """A micro-batch's backward through a chunk, and the same in an idle tick.

  Cotangents travel as lists of their floating leaves; integer leaves of the
  activations (token ids passed along) have float0 cotangents. The gradients
  are added to the sums inside the branch: an idle tick leaves them as they
  are, and no gradient-sized result leaves the `cond`.
  """
  V = residuals.layout.ticks.num_chunks

  def backward(params, kept, shared, key, cotangent, chunk, sums):
    fn = residuals.backward_fn(params, kept, shared, key)
    param_grads, const_grads, input_grads = fn(
      common.with_float0(cotangent, residuals.first_input)
    )
    grads = common.floats(param_grads), common.floats(const_grads)
    return common.add_grads(sums, chunk, *grads, V), common.floats(input_grads)

  def idle_backward(params, kept, shared, key, cotangent, chunk, sums):
    return sums, [jnp.zeros_like(a) for a in cotangent]

  return backward, idle_backward


def _tick(
  layout: common.Layout,
  residuals: common.Residuals,
  head: common.Traced,
  args: common.Args,
  sizes: tuple[int, ...],
) -> Callable[..., Any]:
  """The body of the 1F1B loop: one tick's forward, loss and backward."""
  ticks = layout.ticks
  S, V, K = ticks.num_stages, ticks.num_chunks, ticks.num_microbatches
  device = jax.lax.axis_index(layout.axis)
  params, xs, key = args.params, residuals.xs, residuals.key
  targets = common.split(args.targets, K)
  head_grads, idle_head = common.head_branches(layout, head)
  backward, idle_backward = _backward(residuals)
  # With remat the backward recomputes every residual, these too.
  shared = [] if layout.remat else residuals.shared

  def idle_forward(params, x, key, state):
    return x, state, jax.tree.map(jnp.zeros_like, residuals.kept_like)

  offsets = jnp.array(np.cumsum((0, *sizes[:-1])), jnp.int32)
  modulus = jnp.array(sizes, jnp.int32)
  slot = lambda microbatch, chunk: offsets[chunk] + microbatch % modulus[chunk]

  def tick(carry, t):
    received, cotangent_received, ring, state, acc = carry
    # Forward of micro-batch kf through chunk vf; what the backward needs
    # goes into the ring (an idle forward writes zeros where a micro-batch
    # after the last would go).
    kf, vf, forward_on = ticks.forward(t, device)
    ring_slot = slot(kf, vf)
    kf = jnp.clip(kf, 0, K - 1)
    inputs = common.select((device == 0) & (vf == 0), common.take(xs, kf), received)
    old_state = common.stop(common.take_chunk(state, vf, V))
    y, new_state, kept = jax.lax.cond(
      forward_on,
      residuals.forward,
      idle_forward,
      common.take_chunk(params, vf, V),
      inputs,
      layout.key(key, kf, vf),
      old_state,
    )
    state = common.put_chunk(state, vf, common.stop(new_state), V)
    ring = jax.tree.map(
      lambda r, a: jax.lax.dynamic_update_index_in_dim(r, a, ring_slot, 0), ring, kept
    )
    # On the last stage, the loss and its gradient right after the forward.
    end = forward_on & (device == S - 1) & (vf == V - 1)
    value, y_grads, head_const_grads, target_grads = jax.lax.cond(
      end, head_grads, idle_head, args.head_consts, y, common.take(targets, kf)
    )
    # Backward of micro-batch kb through chunk vb, from its ring slot (on
    # the last stage, the one this tick's forward just wrote).
    kb, vb, backward_on = ticks.backward(t, device)
    same_tick = (device == S - 1) & (vb == V - 1)
    kept_b = common.take(ring, slot(kb, vb))
    kb = jnp.clip(kb, 0, K - 1)
    shared_b = common.take_chunk(shared, vb, V)
    sums, input_grads = jax.lax.cond(
      backward_on,
      backward,
      idle_backward,
      common.take_chunk(params, vb, V),
      kept_b,
      shared_b,
      layout.key(key, kb, vb),
      common.select(same_tick, y_grads, cotangent_received),
      vb,
      (acc.params, acc.stage_consts),
    )
    first = backward_on & (device == 0) & (vb == 0)
    acc = common.Accumulators(
      loss=acc.loss + value,
      params=sums[0],
      stage_consts=sums[1],
      head_consts=jax.tree.map(jnp.add, acc.head_consts, head_const_grads),
      x=common.put(acc.x, kb, input_grads, first),
      targets=common.put(acc.targets, kf, target_grads, end),
    )
    sends = (common.shift(y, layout, +1), common.shift(input_grads, layout, -1))
    return (*sends, ring, state, acc), None

  return tick

"""The ways to take one optimizer step at an effective batch of N rows, K micro-batches.

Every method runs the same thing: gradients of a per-example-mean loss over
the whole batch of N rows (given once, on the device), then one Adam update,
with params and optimizer state donated as training loops do. They differ in
how the N rows become K micro-batches:

* **whole**: no accumulation, the whole batch in one `jit` (flat in K).
* **jaccum**: `jaccum.accumulate(value_and_grad(loss), K)` inside the step.
* **jaccum+stats**: the same with `return_stats=True` (the gradient noise
  scale, returned by the step); from K=2.
* **optax.microbatch**: `optax.microbatching.microbatch(..., MEAN)` inside it.
* **python loop**: what users coming from PyTorch write: a jitted micro-step
  (`value_and_grad` of loss / K), a Python loop over K contiguous slices of the
  batch that adds each micro-step's gradients into an accumulator
  (`jax.tree.map(jnp.add, ...)`, eager), then a jitted Adam update. Every
  micro-step and every add is a dispatch from Python.
* **optax.MultiSteps** / **jaccum.MultiSteps**: K calls of one jitted train
  step (gradients of one micro-batch, the wrapper's `update`, apply), each
  fed a slice of the batch; the inner Adam update lands on the K-th call.
* **nnx**: `nnx.value_and_grad` on the whole batch, and **jaccum.nnx**:
  `jaccum.nnx.value_and_grad(loss, K)`, both on the `nnx.Module` (merged
  from its state inside `jax.jit`; the same dispatch as the others).

A method is built by a factory `make(model, num_microbatches, tx)` registered
in `METHODS` (None where it does not apply, e.g. the noise scale at K=1);
another part of the suite adds its own with `register`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax import microbatching

import jaccum
import jaccum.nnx
from benchmarks import _measure
from benchmarks.models import Model

State = tuple[Any, Any]  # (params, optimizer state)


class Method(NamedTuple):
  """One way to take an optimizer step.

  Attributes:
    init: `init() -> state`, fresh params (a copy: they get donated) and
      optimizer state.
    step: `step(state, batch) -> state`, one optimizer step over the batch.
    programs: `programs(state, batch) -> [(jitted, args), ...]`, the compiled
      programs a step runs, with arguments, for XLA's memory figures.
    held: `held(state, batch) -> bytes` a step holds outside those programs
      while it runs: an accumulator, a micro-batch sliced out of the batch,
      the gradient accumulator kept in an optimizer state.
  """

  init: Callable[[], State]
  step: Callable[[State, Any], State]
  programs: Callable[[State, Any], list[tuple[Any, tuple[Any, ...]]]]
  held: Callable[[State, Any], int]


Factory = Callable[[Model, int, optax.GradientTransformation], Method | None]
METHODS: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
  """Adds a method factory to `METHODS` under `name`."""

  def add(factory: Factory) -> Factory:
    METHODS[name] = factory
    return factory

  return add


def fresh_params(model: Model) -> Any:
  return jax.tree.map(jnp.copy, model.params)


def microbatch(batch: Any, index: int, num_microbatches: int) -> Any:
  """Rows `index * N/K … (index + 1) * N/K - 1`, sliced eagerly as users do."""
  size = jax.tree.leaves(batch)[0].shape[0] // num_microbatches
  return jax.tree.map(lambda x: x[index * size : (index + 1) * size], batch)


def one_program(
  model: Model, grad_fn: Callable[[Any, Any], Any], tx: optax.GradientTransformation
) -> Method:
  """A method whose step is one jitted program around `grad_fn(params, batch)`.

  `grad_fn` returns `(aux, grads)`; `aux` (the loss, the noise scale) is an
  output of the step so that nothing computing it is dropped.
  """

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    aux, grads = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, aux

  def init():
    params = fresh_params(model)
    return params, tx.init(params)

  return Method(
    init=init,
    step=lambda state, batch: train_step(*state, batch)[:2],
    programs=lambda state, batch: [(train_step, (*state, batch))],
    held=lambda state, batch: 0,
  )


@register("whole")
def whole(model, num_microbatches, tx):
  return one_program(model, jax.value_and_grad(model.loss), tx)


@register("jaccum")
def accumulate(model, num_microbatches, tx):
  grad_fn = jaccum.accumulate(jax.value_and_grad(model.loss), num_microbatches)
  return one_program(model, grad_fn, tx)


@register("jaccum+stats")
def accumulate_with_stats(model, num_microbatches, tx):
  if num_microbatches < 2:
    return None  # the noise scale needs two batch sizes
  accumulated = jaccum.accumulate(
    jax.value_and_grad(model.loss), num_microbatches, return_stats=True
  )

  def grad_fn(params, batch):
    (loss, grads), stats = accumulated(params, batch)
    return (loss, stats.noise_scale), grads

  return one_program(model, grad_fn, tx)


@register("optax.microbatch")
def optax_microbatch(model, num_microbatches, tx):
  batch_size = jax.tree.leaves(model.batch)[0].shape[0]
  grad_fn = microbatching.microbatch(
    jax.value_and_grad(model.loss),
    argnums=1,
    microbatch_size=batch_size // num_microbatches,
    accumulator=microbatching.AccumulationType.MEAN,
  )
  return one_program(model, grad_fn, tx)


@register("python loop")
def python_loop(model, num_microbatches, tx):
  scaled_loss = lambda params, batch: model.loss(params, batch) / num_microbatches
  grad_step = jax.jit(jax.value_and_grad(scaled_loss))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def apply(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def init():
    params = fresh_params(model)
    return params, tx.init(params)

  def step(state, batch):
    params, opt_state = state
    loss, grads = grad_step(params, microbatch(batch, 0, num_microbatches))
    for index in range(1, num_microbatches):
      micro_loss, micro_grads = grad_step(
        params, microbatch(batch, index, num_microbatches)
      )
      loss = loss + micro_loss
      grads = jax.tree.map(jnp.add, grads, micro_grads)
    return apply(params, opt_state, grads)

  def programs(state, batch):
    params, opt_state = state
    micro = microbatch(batch, 0, num_microbatches)
    grads = jax.eval_shape(grad_step, params, micro)[1]
    return [(grad_step, (params, micro)), (apply, (params, opt_state, grads))]

  def held(state, batch):
    # The accumulator and the micro-batch slice, beside a micro-step's
    # own outputs (counted in its program).
    grads = jax.eval_shape(jax.grad(model.loss), state[0], batch)
    return _measure.nbytes(grads) + _measure.nbytes(batch) // num_microbatches

  return Method(init, step, programs, held)


def multi_steps(model, num_microbatches, tx, wrapper):
  opt = wrapper(tx, num_microbatches)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def call(params, opt_state, micro):
    loss, grads = jax.value_and_grad(model.loss)(params, micro)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def init():
    params = fresh_params(model)
    return params, opt.init(params)

  def step(state, batch):
    for index in range(num_microbatches):
      state = call(*state, microbatch(batch, index, num_microbatches))[:2]
    return state

  def programs(state, batch):
    return [(call, (*state, microbatch(batch, 0, num_microbatches)))]

  def held(state, batch):
    # What the wrapper's state keeps beyond the inner optimizer's (the
    # accumulator), and the micro-batch slice.
    params, opt_state = state
    extra = _measure.nbytes(opt_state) - _measure.nbytes(tx.init(params))
    return extra + _measure.nbytes(batch) // num_microbatches

  return Method(init, step, programs, held)


@register("optax.MultiSteps")
def optax_multi_steps(model, num_microbatches, tx):
  return multi_steps(model, num_microbatches, tx, optax.MultiSteps)


@register("jaccum.MultiSteps")
def jaccum_multi_steps(model, num_microbatches, tx):
  return multi_steps(model, num_microbatches, tx, jaccum.MultiSteps)


def nnx_method(model, tx, value_and_grad):
  def grad_fn(params, batch):
    module = nnx.merge(model.graphdef, params)
    loss, grads = value_and_grad(model.module_loss)(module, batch)
    # The same pytree as the params (nnx.State of arrays), for optax.
    return loss, jax.tree.map(jnp.asarray, grads)

  return one_program(model, grad_fn, tx)


@register("nnx")
def nnx_whole(model, num_microbatches, tx):
  return nnx_method(model, tx, nnx.value_and_grad)


@register("jaccum.nnx")
def jaccum_nnx(model, num_microbatches, tx):
  value_and_grad = functools.partial(
    jaccum.nnx.value_and_grad, num_microbatches=num_microbatches
  )
  return nnx_method(model, tx, value_and_grad)


def adam_mu(opt_state: Any) -> Any:
  """Adam's first moment in any of the methods' optimizer states.

  After one step from a fresh state it is (1 - b1) times the gradient the
  step applied: comparing it compares the methods' gradients exactly, where
  the params after one Adam step only show their signs.
  """
  return optax.tree_utils.tree_get(opt_state, "mu")

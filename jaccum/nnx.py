"""Flax NNX integration: accumulated `nnx.value_and_grad` and `nnx.grad`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaccum._accumulate import accumulate

__all__ = ["grad", "value_and_grad"]


def _split_loss(out: Any, has_aux: bool) -> tuple[Any, Any]:
  """Returns `(loss, aux)` from `loss_fn`'s output, or raises saying what is wrong."""
  if has_aux and (not isinstance(out, tuple | list) or len(out) != 2):
    raise TypeError(
      "with has_aux=True, loss_fn must return (loss, aux), got "
      f"{type(out).__name__} {jax.tree.structure(out)}."
    )
  if not has_aux and isinstance(out, tuple | list):
    raise TypeError(
      f"loss_fn returned a {type(out).__name__} of {len(out)}, not a scalar loss; "
      "if it returns (loss, aux), pass has_aux=True."
    )
  loss, aux = out if has_aux else (out, None)
  shape, dtype = getattr(loss, "shape", None), getattr(loss, "dtype", None)
  if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    got = type(loss).__name__ if shape is None else f"shape {shape} {dtype}"
    raise TypeError(
      f"loss_fn must return a floating scalar loss of shape (), got {got} on a "
      "micro-batch; reduce it, e.g. `.mean()`."
    )
  return loss, aux


def _transform(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  has_aux: bool,
  return_value: bool,
  wrt: Any,
  accumulate_kwargs: dict[str, Any],
) -> Callable[..., Any]:
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}.")
  options = dict(accumulate_kwargs)
  if "state_argnum" in options:
    raise TypeError(
      "state_argnum is not an option of jaccum.nnx: the model's non-parameter "
      "state (BatchNorm statistics, nnx.Rngs counts) is threaded already."
    )
  for name in ("batch_argnums", "rng_argnum"):
    nums = options.get(name)
    if nums == 0 or (isinstance(nums, Sequence) and 0 in nums):
      raise ValueError(f"{name}={nums!r} must not include 0, the model's position.")
  if (weight_fn := options.get("weight_fn")) is not None:
    if not callable(weight_fn):
      raise TypeError(f"weight_fn must be callable or None, got {weight_fn!r}.")
    # The user's weight_fn sees the micro-batch, not the model's state.
    options["weight_fn"] = lambda rest, *args: weight_fn(*args)
  # Check num_microbatches and the options now rather than at the first call.
  accumulate(loss_fn, num_microbatches, state_argnum=0, **options)

  def accumulated(model: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    if not isinstance(model, nnx.Module):
      raise TypeError(
        "the first argument must be the nnx.Module to differentiate, "
        f"loss_fn(model, *batch), got {type(model).__name__}."
      )
    for i, arg in enumerate(args, start=1):
      if nnx.graph.is_graph_node(arg):
        raise TypeError(
          f"argument {i} is an {type(arg).__name__}; jaccum.nnx threads the state "
          "of the model only. Keep nnx.Rngs in the model (e.g. "
          "nnx.Dropout(rate, rngs=rngs)) or pass a key with rng_argnum."
        )
    if not args:
      raise ValueError("called with the model only; pass the batch after it.")
    graphdef, params, rest = nnx.split(model, wrt, ...)
    if not jax.tree.leaves(params):
      raise ValueError(f"the model holds no variables matching wrt={wrt!r}.")

    # The model's state sits where the model was, so argument numbers (and
    # jaccum's error messages) count as in the user's call; params are closed
    # over, passed whole to every micro-batch.
    def step(rest, *args, **kwargs):
      def loss_of_params(params):
        # Fresh variables (copy=True) belong to this trace, so BatchNorm and
        # nnx.Rngs may update them.
        module = nnx.merge(graphdef, params, rest, copy=True)
        loss, aux = _split_loss(loss_fn(module, *args, **kwargs), has_aux)
        _, _, new_rest = nnx.split(module, wrt, ...)
        if jax.tree.structure(new_rest) != jax.tree.structure(rest):
          raise TypeError(
            "loss_fn must not add or remove model variables (e.g. with sow): "
            "their state is carried from micro-batch to micro-batch; before "
            f"{jax.tree.structure(rest)}, after {jax.tree.structure(new_rest)}."
          )
        return loss, (aux, new_rest)

      grad_fn = jax.value_and_grad(loss_of_params, has_aux=True)
      (loss, (aux, new_rest)), grads = grad_fn(params)
      # nnx's output structure, so a `reduce` tree reads the same.
      if return_value:
        out = ((loss, aux), grads) if has_aux else (loss, grads)
      else:
        out = (grads, aux) if has_aux else grads
      return out, new_rest

    # By default every positional argument after the model but the key is a batch.
    rng_argnum = options.get("rng_argnum")
    key_at = None if rng_argnum is None else rng_argnum % (len(args) + 1)
    batch = tuple(i for i in range(1, len(args) + 1) if i != key_at)
    run = accumulate(
      step, num_microbatches, **{"batch_argnums": batch, **options}, state_argnum=0
    )
    out, new_rest = run(rest, *args, **kwargs)
    nnx.update(model, new_rest)
    return out

  return accumulated


def value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  has_aux: bool = False,
  wrt: Any = nnx.Param,
  **accumulate_kwargs: Any,
) -> Callable[..., Any]:
  """Accumulated `nnx.value_and_grad`: `f(model, *batch)` over K micro-batches.

  Splits the model into the variables in `wrt` and the rest, runs `loss_fn`
  on each micro-batch with `jaccum.accumulate`, and returns what
  `nnx.value_and_grad(loss_fn, has_aux=has_aux)(model, *batch)` returns:
  `(loss, grads)` or `((loss, aux), grads)`, with `grads` an `nnx.State` of
  the `wrt` variables that `nnx.Optimizer.update(model, grads)` takes. The
  rest of the model's state is threaded through the micro-batches in order
  and written back into the model: BatchNorm statistics end as after K
  sequential forward passes, and `nnx.Rngs` counts advance, so each
  micro-batch draws fresh dropout masks. `loss_fn` must not add variables
  (`sow`), and `nnx.Rngs` belong in the model, not in the arguments. Works
  with or without `nnx.jit`.

  Args:
    loss_fn: `loss_fn(model, *batch, **kwargs) -> loss` (or `(loss, aux)`),
      with `loss` a float scalar, e.g. a mean over the examples.
    num_microbatches: the number of micro-batches K; it divides the batch.
    has_aux: whether `loss_fn` returns `(loss, aux)`; `aux` is reduced like
      the loss (`"mean"` unless `reduce` says otherwise).
    wrt: an nnx filter of the variables to differentiate, as in
      `nnx.Optimizer(model, tx, wrt=...)`.
    **accumulate_kwargs: passed to `jaccum.accumulate`. Argument numbers
      count as in the call `f(model, *batch)`, the model being 0:
      `batch_argnums` defaults to every positional argument after the model
      but `rng_argnum`, a key argument that each micro-batch gets its own
      fold of; keyword arguments go whole to every micro-batch.
      `weight_fn(*micro_batch)` receives the positional arguments after the
      model, cut to one micro-batch, and returns its weight, e.g. its number
      of real tokens for a per-token-mean loss. `reduce` is a string or a
      prefix of the output structure above.

  Returns:
    A function `f(model, *batch, **kwargs)` returning `(value, grads)`.

  Raises:
    TypeError: the first argument is not an `nnx.Module`, `loss_fn` returns
      something other than a float scalar (or `(loss, aux)` with `has_aux`),
      or an option is not one of `jaccum.accumulate`'s.
    ValueError: the batch does not split into K micro-batches, or nothing in
      the model matches `wrt`.

  Examples:
    >>> import jax.numpy as jnp, optax, jaccum.nnx
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> def loss_fn(model, x, y):
    ...   return jnp.mean((model(x)[:, 0] - y) ** 2)
    >>> x, y = jnp.arange(24.0).reshape(8, 3) / 10, jnp.arange(8.0)
    >>> loss, grads = jaccum.nnx.value_and_grad(loss_fn, 4)(model, x, y)
    >>> whole_loss, whole_grads = nnx.value_and_grad(loss_fn)(model, x, y)
    >>> bool(jnp.allclose(grads["kernel"][...], whole_grads["kernel"][...]))
    True
    >>> @nnx.jit
    ... def train_step(model, optimizer, x, y):
    ...   loss, grads = jaccum.nnx.value_and_grad(loss_fn, 4)(model, x, y)
    ...   optimizer.update(model, grads)
    ...   return loss
    >>> losses = [float(train_step(model, optimizer, x, y)) for _ in range(3)]
    >>> losses[2] < losses[0]
    True
  """
  return _transform(loss_fn, num_microbatches, has_aux, True, wrt, accumulate_kwargs)


def grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  has_aux: bool = False,
  wrt: Any = nnx.Param,
  **accumulate_kwargs: Any,
) -> Callable[..., Any]:
  """Accumulated `nnx.grad`: like `value_and_grad`, returning `grads` only.

  Returns `grads`, or `(grads, aux)` with `has_aux`, as `nnx.grad` does; the
  arguments, state threading and errors are those of `value_and_grad`.

  Examples:
    >>> import jax.numpy as jnp, jaccum.nnx
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
    >>> x = jnp.arange(12.0).reshape(6, 2)
    >>> grads = jaccum.nnx.grad(loss_fn, 3)(model, x)
    >>> bool(jnp.allclose(grads["bias"][...], nnx.grad(loss_fn)(model, x)["bias"][...]))
    True
  """
  return _transform(loss_fn, num_microbatches, has_aux, False, wrt, accumulate_kwargs)

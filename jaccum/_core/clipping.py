"""Per-example clipping inside the micro-step: one micro-batch's clipped sum.

`dp_value_and_grad`'s micro-step runs the user's per-example loss on one
micro-batch and returns what the ordinary loop sums (`reduce="sum"`): the
sum of the real examples' losses, their number, the sum of their gradients
each clipped to the norm C, `Σ_i c_i ∇ℓ_i` with `c_i = min(1, C/‖∇ℓ_i‖)`, and
the per-example norms (`"concat"`). The noise is no business of the loop: it
is drawn once, after the reduction over devices.

Two ways to the same numbers. `"vmap"`, the reference, materialises every
example's gradient (`vmap` of `jax.grad` of the loss on one example), clips
and sums them. `"auto"` reads the per-example program and gets each
example's norm from the activations and output cotangents of the batched
backward pass, per parameter use, and the clipped sum from one reweighted
pass (`ghost`); parameters it cannot treat so get their per-example
gradients from the same backward pass, alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaccum._core import ghost


class Layout(NamedTuple):
  """Where the pieces of one call sit in the micro-step's arguments.

  The micro-step is called as `step(params, *args, mask)`: the user's
  positional arguments, then the example mask, cut like the batch.

  Attributes:
    batch: the positions of the batch arguments (the params at 0).
    key: the position of a PRNG key that each example gets a fold of.
  """

  batch: tuple[int, ...]
  key: int | None


class Clipping(NamedTuple):
  """The micro-step's fixed pieces.

  Attributes:
    loss_fn: `loss_fn(params, *args, **kwargs) -> [rows]`, one loss per example.
    clip_norm: C.
    norms: `"auto"` (ghost norms where the program allows) or `"vmap"`.
    return_norms: also return each example's gradient norm.
    accum_dtype: floating sums narrower than this are made in it (None: the
      params' own dtype).
  """

  loss_fn: Callable[..., Any]
  clip_norm: float
  norms: str
  return_norms: bool
  accum_dtype: Any


def sum_dtype(dtype: Any, accum_dtype: Any) -> np.dtype:
  """The dtype a floating leaf of `dtype` is summed in."""
  dtype = np.dtype(dtype)
  if accum_dtype is None or np.dtype(accum_dtype).itemsize <= dtype.itemsize:
    return dtype
  return np.dtype(accum_dtype)


def check_params(params: Any) -> None:
  """Refuses a params leaf that is not floating: every leaf is differentiated."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
        f"params{jax.tree_util.keystr(path)} is {getattr(leaf, 'dtype', type(leaf))}"
        ": dp_value_and_grad differentiates every leaf of the params (argument "
        "0), and their clipped sum needs floating leaves. Pass integer or "
        "constant values as another argument."
      )


def check_losses(losses: Any) -> jax.Array:
  """The one example's loss, from `loss_fn`'s output on a batch of one row."""
  shape, dtype = getattr(losses, "shape", None), getattr(losses, "dtype", None)
  if shape != (1,) or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    got = type(losses).__name__ if shape is None else f"shape {shape} {dtype}"
    hint = " (a scalar: a mean or sum over the batch?)" if shape == () else ""
    raise TypeError(
      f"loss_fn must return one floating loss per example, shape [rows]; on "
      f"a batch of 1 row it returned {got}{hint}. Return one loss per example "
      f"(e.g. without `.mean()`): the examples are clipped one by one."
    )
  return losses[0]


def one_example(
  loss_fn: Callable[..., Any],
  layout: Layout,
  args: Sequence[Any],
  kwargs: dict[str, Any],
) -> Callable[..., jax.Array]:
  """`loss(params, example, key)`: the loss of one example.

  `example` holds the batch arguments' rows of that example (without a row
  axis); they reach `loss_fn` as a batch of one row. The other arguments are
  those of the call; `key` replaces the key argument, if any.
  """

  def loss(params, example, key):
    full = list(args)
    full[0] = params
    for position, rows in zip(layout.batch, example, strict=True):
      full[position] = jax.tree.map(lambda x: x[None], rows)
    if layout.key is not None:
      full[layout.key] = key
    return check_losses(loss_fn(*full, **kwargs))

  return loss


def example_keys(args: Sequence[Any], layout: Layout, rows: int) -> Any:
  """One key per example, `fold_in(key, row)`, or None without a key."""
  if layout.key is None:
    return None
  key = args[layout.key]
  return jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(rows))


def factors(sq_norms: jax.Array, mask: jax.Array, clip_norm: float) -> jax.Array:
  """`c_i = min(1, C / ‖g_i‖)` for real examples, 0 for padding."""
  norms = jnp.sqrt(sq_norms)
  safe = jnp.where(norms > clip_norm, norms, clip_norm)
  return jnp.where(
    mask & (norms > clip_norm), clip_norm / safe, mask.astype(safe.dtype)
  )


def squared_norms(per_example: Any, dtype: Any) -> jax.Array:
  """Each row's squared norm over every leaf of `per_example`, in `dtype`."""
  leaves = jax.tree.leaves(per_example)
  total = jnp.zeros(leaves[0].shape[0], dtype)
  for g in leaves:
    total += jnp.sum(jnp.square(g.astype(dtype)).reshape(g.shape[0], -1), axis=1)
  return total


def _vmap_path(
  clipping: Clipping, loss, params: Any, examples: Any, keys: Any, mask: jax.Array
) -> tuple[jax.Array, Any, jax.Array]:
  """The reference: every example's gradient, clipped and summed."""
  grad_one = jax.value_and_grad(loss)
  key_axis = None if keys is None else 0
  losses, grads = jax.vmap(grad_one, (None, 0, key_axis))(params, examples, keys)
  dtype = norm_dtype(params)
  sq = squared_norms(grads, dtype)
  c = factors(sq, mask, clipping.clip_norm)
  summed = jax.tree.map(
    lambda g, p: ghost.weighted_rows(
      c, g, mask, sum_dtype(p.dtype, clipping.accum_dtype)
    ),
    grads,
    params,
  )
  return losses, summed, sq


def _ghost_path(
  clipping: Clipping, loss, params: Any, examples: Any, keys: Any, mask: jax.Array
) -> tuple[jax.Array, Any, jax.Array]:
  """Norms from the batched backward pass (`ghost`), the clipped sum reweighted."""
  run = ghost.backward(loss, params, examples, keys)
  sq = run.squared_norms(norm_dtype(params))
  c = factors(sq, mask, clipping.clip_norm)
  dtypes = [sum_dtype(p.dtype, clipping.accum_dtype) for p in jax.tree.leaves(params)]
  return run.losses, run.clipped_sum(c, mask, dtypes), sq


def norm_dtype(params: Any) -> np.dtype:
  """Norms are computed in float32, or wider where the params are."""
  widest = max((np.dtype(p.dtype).itemsize for p in jax.tree.leaves(params)), default=4)
  return np.dtype(np.float64) if widest >= 8 else np.dtype(np.float32)


def micro_step(clipping: Clipping, layout: Layout) -> Callable[..., Any]:
  """`step(params, *args, mask, **kwargs)`: one micro-batch's sums.

  Returns `(loss_sum, count, clipped_sum)`, and the per-example norms with
  `return_norms` (zero on padding rows), for the loop to sum (the norms to
  concatenate).
  """

  def step(params, *args_and_mask, **kwargs):
    *args, mask = args_and_mask
    args = [params, *args]
    mask = mask.astype(bool)
    rows = mask.shape[0]
    examples = tuple(args[i] for i in layout.batch)
    keys = example_keys(args, layout, rows)
    loss = one_example(clipping.loss_fn, layout, args, kwargs)
    if clipping.norms == "vmap":
      losses, summed, sq = _vmap_path(clipping, loss, params, examples, keys, mask)
    else:
      losses, summed, sq = _ghost_path(clipping, loss, params, examples, keys, mask)
    loss_dtype = jnp.promote_types(losses.dtype, jnp.float32)
    loss_sum = jnp.sum(jnp.where(mask, losses, 0).astype(loss_dtype))
    count = jnp.sum(mask.astype(loss_dtype))
    out = (loss_sum, count, summed)
    if clipping.return_norms:
      out = (*out, jnp.where(mask, jnp.sqrt(sq), 0))
    return out

  return step

"""Which outputs of `grad_fn` are gradients: told by `grad_leaves`, or found.

FSDP scatters the gradients, `return_stats` measures them, `reduce_fn`
reduces them: each needs to know which output leaves they are. By default
they are the part of the output shaped like the params (the first
non-batch argument), and jaccum never guesses between two such parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaccum import _reduce
from jaccum._config import Config, Positions

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def params_of(config: Config, at: Positions, args: Sequence[Any]) -> Any:
  """What the gradients are taken of, by default: the first non-batch argument."""
  skip = {*at.batch, at.rng, at.state}
  rest = [*config.bound_args, *(a for i, a in enumerate(args) if i not in skip)]
  return rest[0] if rest else None


def gradient_mask(
  out_shape: Any,
  params: Any,
  grad_leaves: Any,
  leaves: Any,
  needed_by: str | None = None,
) -> Any:
  """A tree of bools like `out_shape`, True on the gradient leaves.

  With `grad_leaves` (a bool prefix of the output) it says so. Otherwise the
  gradient is the whole output (`jax.grad`), or the one of its two elements
  (`value_and_grad`: the second; `grad(has_aux=True)`: the first) that has
  the structure and shapes of `params` and is averaged or summed in the plan
  `leaves` (a per-parameter maximum shaped like the params is not a
  gradient). When both elements could be (an aux shaped like the params, the
  loss beside the gradient of a scalar param), it never guesses: with
  `needed_by` (what needs the gradients, e.g. "return_stats=True") that is
  an error asking for `grad_leaves`, else no leaf is marked; likewise when
  nothing is found.
  """
  if grad_leaves is not None:
    try:
      mask = jax.tree.broadcast(grad_leaves, out_shape)
    except ValueError as e:
      raise ValueError(
        f"grad_leaves={grad_leaves!r} must be a bool or a pytree prefix of "
        f"grad_fn's output, whose structure is {jax.tree.structure(out_shape)}. "
        f"({e})"
      ) from None
    if needed_by and not any(jax.tree.leaves(mask)):
      raise ValueError(
        f"grad_leaves={grad_leaves!r} marks no output leaf as a gradient, but "
        f"{needed_by} needs the gradients: mark them True, e.g. "
        "grad_leaves=(False, True) for value_and_grad's (loss, grads)."
      )
    return mask
  modes = jax.tree.map(lambda leaf: leaf.mode, leaves, is_leaf=_reduce.is_plan)
  mask = jax.tree.map(lambda _: False, out_shape)
  layouts = []
  if params is not None:
    # The gradients have the params' structure (jax.grad), or that structure
    # with None wherever the params hold no floating array (Equinox's
    # filter_grad: its models hold functions and modules as leaves).
    differentiable = jax.tree.map(
      lambda p: (
        p
        if isinstance(p, (*ARRAY_TYPES, jax.ShapeDtypeStruct))
        and jnp.issubdtype(p.dtype, jnp.inexact)
        else None
      ),
      params,
    )
    layouts = [
      (jax.tree.structure(tree), [np.shape(p) for p in jax.tree.leaves(tree)])
      for tree in (params, differentiable)
      if all(
        isinstance(p, (*ARRAY_TYPES, jax.ShapeDtypeStruct, int, float))
        for p in jax.tree.leaves(tree)
      )
    ]

  def is_gradient(node, node_modes):
    leaves, treedef = jax.tree.flatten(node)
    return (treedef, [leaf.shape for leaf in leaves]) in layouts and all(
      m in ("mean", "sum", "float0") for m in jax.tree.leaves(node_modes)
    )

  if is_gradient(out_shape, modes):
    return jax.tree.map(lambda _: True, out_shape)
  hits = []
  if isinstance(out_shape, tuple | list) and len(out_shape) == 2:
    hits = [i for i in (0, 1) if is_gradient(out_shape[i], modes[i])]
  if len(hits) == 1:
    parts = [
      jax.tree.map(lambda _, hit=j == hits[0]: hit, part)
      for j, part in enumerate(out_shape)
    ]
    return type(out_shape)(parts)
  if needed_by is None:
    return mask
  where = (
    "both the first and the second element of grad_fn's output have"
    if hits
    else "none of grad_fn's output, its first or its second element has"
  )
  raise ValueError(
    f"{needed_by} needs to know which outputs are gradients, and {where} the "
    f"structure and shapes of the params (the first non-batch argument, "
    f"{jax.tree.structure(params)}), so jaccum will not guess. Mark them with "
    "grad_leaves, a bool or a pytree prefix of the output: e.g. "
    "grad_leaves=(True, False) for jax.grad(loss, has_aux=True)'s (grads, aux), "
    "grad_leaves=(False, True) for value_and_grad's (loss, grads)."
  )

"""Reducing collectives in a form every XLA backend compiles.

XLA:CPU runs each bfloat16 all-reduce and reduce-scatter in float32 (its
`AllReducePromotion` pass widens them; GPUs and TPUs reduce bfloat16 as it
is). In a `shard_map` manual over only some of the mesh's axes (the data axes
of a mesh that also has a `"model"` axis, even one of size 1), JAX writes a
sharding annotation into the reduction's body, and that pass, copying the
body into float32, aborts the process: "Invalid binary instruction opcode
copy", exit 134, no exception. The smallest program that aborts:

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
                      in_specs=P("data"), out_specs=P(), axis_names={"data"})
    jax.jit(f)(jnp.ones((8, 4), jnp.bfloat16))

`reduced` gives XLA:CPU such a reduction as that pass would have made it:
the bfloat16 operands widened to float32 (exact), reduced, the result
rounded back to bfloat16. The numbers are those XLA:CPU computes for a
bfloat16 reduction, and the wire is the float32 one it sends for it. The form
is chosen when the program is lowered (`lax.platform_dependent`): GPUs and
TPUs get the bfloat16 reduction as written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# What XLA:CPU's AllReducePromotion widens.
_PROMOTED = jnp.dtype(jnp.bfloat16)


def _partly_manual() -> bool:
  """Whether the context is a `shard_map` manual over some mesh axes, not all."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(mesh.manual_axes)
  return bool(manual) and manual != set(mesh.axis_names)


def reduced(collective: Callable[[Any], Any], tree: Any) -> Any:
  """`collective(tree)`, in a form XLA:CPU compiles (see the module's docstring).

  Args:
    collective: a reduction over mesh axes (`psum`, `pmax`, `psum_scatter`,
      ...) of a pytree, returning a pytree of the same structure.
    tree: its operands.

  Returns:
    What `collective(tree)` returns, in the operands' dtypes.
  """
  leaves, treedef = jax.tree.flatten(tree)
  promoted = [jnp.result_type(x) == _PROMOTED for x in leaves]
  if not any(promoted) or not _partly_manual():
    return collective(tree)

  def as_written(*leaves):
    return jax.tree.leaves(collective(jax.tree.unflatten(treedef, list(leaves))))

  def widened(*leaves):
    wide = [
      x.astype(jnp.float32) if p else x for x, p in zip(leaves, promoted, strict=True)
    ]
    out = as_written(*wide)
    return [r.astype(x.dtype) for r, x in zip(out, leaves, strict=True)]

  out = jax.lax.platform_dependent(*leaves, cpu=widened, default=as_written)
  return jax.tree.unflatten(treedef, list(out))

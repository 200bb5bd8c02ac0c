"""DiLoCo's fragments: the param leaves cut into P groups that sync in turn.

Fragment f is leaves f·L/P .. (f+1)·L/P - 1 in `jax.tree.leaves` order. While
a fragment's outer update is in flight (`delay` > 0) its pseudo-gradient
waits in slots that every fragment shares, one fragment's size in all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def wide(dtype: Any) -> np.dtype:
  """The snapshot's dtype for a param's: float32 at least."""
  return jnp.promote_types(dtype, jnp.float32)


class Fragments:
  """The param leaves cut into P groups of consecutive leaves, and the slots
  that hold one group's pseudo-gradient while its update is in flight."""

  def __init__(self, params: Any, num_fragments: int):
    leaves, self.treedef = jax.tree.flatten(params)
    count = len(leaves)
    if count == 0 or count % num_fragments:
      raise ValueError(
        f"num_fragments={num_fragments} must divide the number of param "
        f"leaves, {count}: each fragment is a group of {count}/{num_fragments} "
        "consecutive leaves (in jax.tree.leaves order). Pick a num_fragments "
        "that divides it, or group the params into that many leaves."
      )
    self.size = count // num_fragments
    self.num_fragments = num_fragments
    self.specs = [jax.ShapeDtypeStruct(jnp.shape(x), wide(x.dtype)) for x in leaves]

  def members(self, f: int) -> range:
    return range(f * self.size, (f + 1) * self.size)

  def tree(self, leaves: Sequence[Any], f: int) -> Any:
    """Fragment f's leaves in the params' structure, the others None."""
    picked = [None] * len(self.specs)
    for i, x in zip(self.members(f), leaves, strict=True):
      picked[i] = x
    return jax.tree.unflatten(self.treedef, picked)

  def leaves(self, tree: Any, f: int) -> list[Any]:
    """The leaves of fragment f in `tree` (as `tree` builds it)."""
    return [x for x in self.treedef.flatten_up_to(tree) if x is not None]

  def _slot_specs(self) -> list[tuple[tuple[int, ...], Any]]:
    """Slot j holds leaf j of whichever fragment is in flight: in that leaf's
    shape where every fragment's leaf j shares it, else flat and padded."""
    slots = []
    for j in range(self.size):
      specs = [self.specs[f * self.size + j] for f in range(self.num_fragments)]
      dtype = jnp.result_type(*(s.dtype for s in specs))
      if all(s.shape == specs[0].shape for s in specs):
        slots.append((specs[0].shape, dtype))
      else:
        slots.append(((max(int(np.prod(s.shape)) for s in specs),), dtype))
    return slots

  def empty_slots(self, snapshot: list[Any]) -> list[jax.Array]:
    """Zeroed slots; a slot shaped like its first fragment's leaf takes its
    sharding (`zeros_like`)."""
    out = []
    for (shape, dtype), like in zip(self._slot_specs(), snapshot, strict=False):
      if jnp.shape(like) == shape:
        out.append(jnp.zeros_like(like, dtype))
      else:
        out.append(jnp.zeros(shape, dtype))
    return out

  def pack(self, f: int, delta: list[Any], slots: list[Any]) -> list[Any]:
    out = []
    for x, slot in zip(delta, slots, strict=True):
      if x.shape != slot.shape:
        x = jnp.pad(x.reshape(-1), (0, slot.size - x.size))
      out.append(x.astype(slot.dtype))
    return out

  def unpack(self, f: int, slots: list[Any]) -> list[Any]:
    out = []
    for i, slot in zip(self.members(f), slots, strict=True):
      spec = self.specs[i]
      if slot.shape != spec.shape:
        slot = slot[: int(np.prod(spec.shape))].reshape(spec.shape)
      out.append(slot.astype(spec.dtype))
    return out

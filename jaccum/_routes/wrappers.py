"""What the Flax wrappers (`jaccum.nnx`, `jaccum.linen`) share.

Both take `accumulate`'s options as keywords, fix some of them (the call's
positions are theirs), and warn when an aux output with one row per example
is averaged over micro-batches.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings
from typing import Any

import jax
import jax.numpy as jnp


def user_stacklevel() -> int:
  """The `stacklevel`, for a warning in the caller, that points at the user's line.

  A warning raised while jaccum traces the user's function sits below
  jaccum's, JAX's and Flax's frames (and the standard library's, which JAX
  calls through); how many depends on the route. The user's line is the
  first frame outside them.
  """
  modules = [sys.modules.get(name) for name in ("jaccum", "jax", "jaxlib", "flax")]
  library = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in modules
    if m is not None and m.__file__
  )
  stdlib = sysconfig.get_paths()["stdlib"]

  def ours(filename: str) -> bool:
    in_stdlib = filename.startswith(stdlib) and "site-packages" not in filename
    return filename.startswith(library) or in_stdlib or filename.startswith("<")

  frame, level = sys._getframe(1), 1
  while frame.f_back is not None and ours(frame.f_code.co_filename):
    frame, level = frame.f_back, level + 1
  return level


def warn_averaged_rows(aux: Any, modes: Any, rows: int, fix: str) -> None:
  """Warns for each aux leaf with one row per example that is averaged.

  Averaging per-example rows over micro-batches mixes different examples; it
  is almost never meant. `fix` is the `reduce` tree that keeps them.
  """
  for (path, leaf), mode in zip(
    jax.tree_util.tree_flatten_with_path(aux)[0], jax.tree.leaves(modes), strict=True
  ):
    if mode == "mean" and rows > 1 and jnp.shape(leaf)[:1] == (rows,):
      warnings.warn(
        f"aux{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, one row per "
        f"example of the micro-batch of {rows}, and is averaged over micro-batches "
        f'(reduce="mean"), which mixes different examples\' rows. To keep one row '
        f'per example in the batch\'s order, give it "concat": {fix}.',
        stacklevel=user_stacklevel(),
      )

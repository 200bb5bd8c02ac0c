"""Shared test helpers: one way to compare trees."""

import jax
import numpy as np


def _leaf_errors(actual, expected):
  """Yields (path, largest |a - e|, largest |e|) per leaf, in float64."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected), (
    jax.tree.structure(actual),
    jax.tree.structure(expected),
  )
  flat_actual = jax.tree_util.tree_flatten_with_path(actual)[0]
  for (path, a), e in zip(flat_actual, jax.tree.leaves(expected), strict=True):
    where = jax.tree_util.keystr(path)
    assert np.shape(a) == np.shape(e), (where, np.shape(a), np.shape(e))
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    yield where, np.abs(a - e).max(initial=0.0), np.abs(e).max(initial=0.0)


def max_rel_error(actual, expected) -> float:
  """Largest leafwise |a - e| / max|e| over a tree."""
  return max(
    error / max(scale, np.finfo(np.float64).tiny)
    for _, error, scale in _leaf_errors(actual, expected)
  )


def assert_trees_close(actual, expected, rtol: float, atol: float = 0.0) -> None:
  """Asserts same structure, shapes and dtypes, and |a - e| ≤ atol + rtol·scale.

  The scale of a leaf is its largest magnitude, so a near-zero entry of a large
  gradient does not dominate. `atol` is for leaves that are zero in exact
  arithmetic (e.g. the bias before a BatchNorm), where only rounding remains.
  """
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert np.asarray(a).dtype == np.asarray(e).dtype, (a.dtype, e.dtype)
  for where, error, scale in _leaf_errors(actual, expected):
    assert error <= atol + rtol * scale, (
      f"{where}: |error| {error:.3g} > {atol:.3g} + {rtol:.3g} * {scale:.3g}"
    )

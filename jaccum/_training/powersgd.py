"""PowerSGD: a low-rank reduction of the gradients, with error feedback.

Vogels, Karimireddy and Jaggi (2019), "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization" (arXiv:1905.13192). Each gradient
matrix M (a leaf viewed as `[prod(shape[:-1]), shape[-1]]`) is sent as two
thin factors instead: one step of power iteration against the last step's
Q gives `P = (Σ_d M_d) Q` and `Q' = (Σ_d M_d)ᵀ P̂` (P̂ orthonormalised), and
`P̂ Q'ᵀ` is the rank-r estimate of the sum. What it leaves out stays on each
device (error feedback) and is added to the next step's gradient, so nothing
is lost, only delayed. Vectors and small matrices, where the factors would
not be smaller, are summed as they are.

It is a `reduce_fn` for `jaccum.data_parallel` (or `accumulate(axis_name=)`):
it sees each device's share of the accumulated gradients and returns their
(estimated) sum.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaccum._core import wire as _wire


class PowerSGDState(NamedTuple):
  """`PowerSGD`'s state: per gradient leaf, one row per device.

  Attributes:
    q: the power iteration's right factor `[columns, rank]`, the same on
      every device, warm-started from the last step; None for a leaf summed
      whole.
    error: what this device's estimate left out, added to its next gradient
      (error feedback), shaped like the leaf; None for a leaf summed whole.

  Examples:
    A 64 x 48 matrix is compressed at rank 2 (2 x 112 numbers sent, not
    3,072); a vector is summed whole:

    >>> import jax.numpy as jnp, jaccum
    >>> state = jaccum.PowerSGD(rank=2).init(
    ...   {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}, num_devices=8)
    >>> state.q["w"].shape, state.error["w"].shape, state.q["b"]
    ((8, 48, 2), (8, 64, 48), None)
  """

  q: Any
  error: Any


@dataclasses.dataclass(frozen=True)
class PowerSGD:
  """A rank-r reduction of the gradients with error feedback, as a `reduce_fn`.

  For an `n × m` gradient it sends `r (n + m)` numbers instead of `n m`:
  `jaccum.inspect.collectives` shows the bytes. `init` makes the state to
  pass as `reduce_state=` on the first call; every call returns the next.

  Attributes:
    rank: the rank r of each matrix's estimate.
    min_compression: compress a matrix only if its factors are this many
      times smaller than it; others are summed whole.
    seed: for the first Q.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> w = jnp.ones((32, 16)) / 32
    >>> x = jax.random.normal(jax.random.key(0), (8 * jax.device_count(), 32))
    >>> powersgd = jaccum.PowerSGD(rank=2)
    >>> step = jax.jit(jaccum.data_parallel(
    ...   jax.grad(loss), 2, mesh=mesh, reduce_fn=powersgd))
    >>> state = powersgd.init(w, jax.device_count())
    >>> grads, state = step(w, x, reduce_state=state)
    >>> grads.shape, state.q.shape  # one row of q per device
    ((32, 16), (..., 16, 2))
  """

  rank: int = 4
  min_compression: float = 2.0
  seed: int = 0

  def __post_init__(self) -> None:
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"rank must be a positive int, got {self.rank!r}.")
    if not self.min_compression >= 1:
      raise ValueError(f"min_compression must be >= 1, got {self.min_compression!r}.")

  def _compressed(self, shape: tuple[int, ...]) -> bool:
    if len(shape) < 2:
      return False
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return self.rank * (rows + cols) * self.min_compression <= rows * cols

  def init(self, grads_like: Any, num_devices: int) -> PowerSGDState:
    """The state before the first step, for `num_devices` devices.

    Args:
      grads_like: a tree shaped like the gradients (the params), arrays or
        `jax.ShapeDtypeStruct` values.
      num_devices: the devices of the reduction's axes: each leaf gets a
        leading axis of that many rows.
    """
    leaves, treedef = jax.tree.flatten(grads_like)
    keys = jax.random.split(jax.random.key(self.seed), max(len(leaves), 1))
    qs, errors = [], []
    for leaf, key in zip(leaves, keys, strict=False):
      shape = tuple(jnp.shape(leaf))
      if not self._compressed(shape):
        qs.append(None)
        errors.append(None)
        continue
      q = jax.random.normal(key, (shape[-1], self.rank), jnp.float32)
      qs.append(jnp.broadcast_to(q, (num_devices, *q.shape)))
      errors.append(jnp.zeros((num_devices, *shape), jnp.float32))
    return PowerSGDState(
      jax.tree.unflatten(treedef, qs), jax.tree.unflatten(treedef, errors)
    )

  def __call__(
    self, grads: Any, axes: tuple[str, ...], state: PowerSGDState
  ) -> tuple[Any, PowerSGDState]:
    """The (estimated) sum over `axes` of each device's share `grads`."""
    if not isinstance(state, PowerSGDState):
      raise TypeError(
        "PowerSGD needs its state: pass reduce_state=powersgd.init(params, "
        "num_devices) on the first call, and the state each call returns on "
        f"the next; got {type(state).__name__}."
      )
    leaves, treedef = jax.tree.flatten(grads)
    qs = treedef.flatten_up_to(state.q)
    errors = treedef.flatten_up_to(state.error)
    num_devices = jax.lax.axis_size(axes)
    out, new_qs, new_errors = [], [], []
    for grad, q, error in zip(leaves, qs, errors, strict=True):
      if q is None:
        out.append(_wire.reduced(lambda g: jax.lax.psum(g, axes), grad))
        new_qs.append(None)
        new_errors.append(None)
        continue
      shape = grad.shape
      m = grad.astype(jnp.float32).reshape(-1, shape[-1]) + error.reshape(-1, shape[-1])
      p = jax.lax.psum(m @ q, axes)
      p, _ = jnp.linalg.qr(p)  # orthonormal columns, the same on every device
      q = jax.lax.psum(m.T @ p, axes)
      estimate = p @ q.T  # of the sum over devices
      # Each device keeps its share of what the estimate left out.
      new_errors.append((m - estimate / num_devices).reshape(shape))
      new_qs.append(q)
      out.append(estimate.reshape(shape).astype(grad.dtype))
    return jax.tree.unflatten(treedef, out), PowerSGDState(
      jax.tree.unflatten(treedef, new_qs), jax.tree.unflatten(treedef, new_errors)
    )

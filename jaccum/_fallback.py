"""The whole batch's route: for a `grad_fn` that cannot run on each device's rows.

`data_parallel` runs `grad_fn` per device under `shard_map`, and where it
cannot be traced there, traced outside and run per device retyped
(`_retype`). What fails both ways (an `out_sharding` or reshard naming the
data axes on fewer rows per device than they have devices, a function JAX
cannot run inside `shard_map` at all) runs here, as the whole batch's step
runs, on the sharded batch, with a warning that names the cause and the fix.

It cuts the same micro-batches, in the same order: micro-batch k here is
micro-batch k of every device together, device after device (with the
strided split, the global strided micro-batch k is exactly that; with the
contiguous one, the rows are put in that order first, and concatenated
outputs back in theirs). So sums, maxima, concatenations, per-example means
and `weight_fn` means whose weight adds up over rows come out the same, up
to rounding. What depends on each device's micro-batches alone cannot be
the same here, and is refused by name: `deterministic=True`'s bits, the
noise scale's small batch (`return_stats`), per-device state, a count per
device, `reduce_fn`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaccum import _loop, _placement, _reduce, _step
from jaccum._config import Config, Positions

P = jax.sharding.PartitionSpec

# option -> why the whole batch's step cannot give what the per-device loop does
_PER_DEVICE = {
  "deterministic=True": (
    "its bits are those of devices × K micro-batches of each device's rows, "
    "and the whole batch's step sums K micro-batches of all devices' rows"
  ),
  "return_stats=True": (
    "the noise scale's small batch is a micro-batch of one device's rows, and "
    "the whole batch's step has micro-batches of all devices' rows"
  ),
  "state_argnum": (
    "each device threads its state through its own rows, and the whole "
    "batch's step threads one state through all devices' rows"
  ),
  "num_real_microbatches": "it counts micro-batches per device",
  "reduce_fn": "it reduces each device's accumulator",
}


def _first_line(error: BaseException) -> str:
  return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


def failures(error: Exception) -> str:
  """How `grad_fn` failed per device: inside the loop, then traced outside it.

  `_retype.lift` raises the error inside the loop from the one outside it.
  """
  outside = error.__cause__
  if isinstance(outside, Exception) and outside is not error:
    return f"{_first_line(error)}; traced outside the loop: {_first_line(outside)}"
  return _first_line(error)


def cause_and_fix(error: Exception, axes: tuple[str, ...]) -> str:
  """What usually makes `grad_fn` fail per device, and what to write instead."""
  message = f"{error} {error.__cause__ or ''}"
  if "with_sharding_constraint can only refer to Auto axes" in message:
    return (
      f"The cause is a with_sharding_constraint given a bare PartitionSpec "
      f"that names {axes}: inside the per-device loop JAX resolves it against "
      f"the mesh in context, where those axes are manual. Write it as "
      f"NamedSharding(mesh, P(...)) (jaccum drops the data axes from it: each "
      f"device holds its rows already), or leave {axes} out of the spec, and "
      f"the loop runs per device."
    )
  if any(
    words in message
    for words in (
      "cannot contain axis names that are of type Auto or Manual",
      "does not evenly divide the dimension size",
    )
  ):
    return (
      f"The cause is an out_sharding= (or reshard) that names {axes}: inside "
      f"the per-device loop those axes are manual, and jaccum drops them only "
      f"where each device's micro-batch splits over them. Pick K so that each "
      f"device's micro-batch holds a multiple of the devices of {axes} in "
      f"rows, or leave {axes} out of the spec (or use an auto mesh with "
      f"sharding constraints), and the loop runs per device."
    )
  return (
    "The usual cause is an array that grad_fn closes over (on an explicit "
    "mesh, any array placed on the mesh): pass it as an argument or keyword "
    "instead, and the loop runs per device."
  )


def _refuse_per_device_options(
  config: Config, at: Positions, num_real: Any, error: Exception, axes: tuple[str, ...]
) -> None:
  """Options whose result only the per-device loop gives, refused by name."""
  given = {
    "deterministic=True": config.deterministic,
    "return_stats=True": config.return_stats,
    "state_argnum": at.state is not None,
    "num_real_microbatches": num_real is not None,
    "reduce_fn": config.reduce_fn is not None,
  }
  named = [name for name, on in given.items() if on]
  if not named:
    return
  raise ValueError(
    f"{' and '.join(named)} need{'s' if len(named) == 1 else ''} the per-device "
    f"loop, which cannot run grad_fn here ({failures(error)}): "
    + "; ".join(f"{name}: {_PER_DEVICE[name]}" for name in named)
    + f". Without {'them' if len(named) > 1 else 'it'} the step would run as the "
    f"whole batch's does. {cause_and_fix(error, axes)}"
  ) from error


def _device_order(x: jax.Array, num_devices: int, num_microbatches: int) -> jax.Array:
  """Rows reordered so that strided micro-batch k is each device's contiguous k.

  `[D, K, R]` read as `[D, R, K]`: each device reorders its own rows, so
  nothing moves between devices. `_batch_order` is its inverse.
  """
  return _transposed(x, num_devices, (num_microbatches, -1))


def _batch_order(x: jax.Array, num_devices: int, num_microbatches: int) -> jax.Array:
  return _transposed(x, num_devices, (-1, num_microbatches))


def _transposed(x: jax.Array, num_devices: int, inner: tuple[int, int]) -> jax.Array:
  shape = (num_devices, *inner, *x.shape[1:])
  spec = _placement.spec_of(x)
  if spec is None:
    blocks = jnp.swapaxes(x.reshape(shape), 1, 2)
    return blocks.reshape(x.shape)
  mesh = jax.typeof(x).sharding.mesh
  rest = tuple(spec)[1:]
  blocks = jnp.reshape(
    x, shape, out_sharding=jax.NamedSharding(mesh, P(spec[0], None, None, *rest))
  )
  blocks = jnp.swapaxes(blocks, 1, 2)
  return jnp.reshape(blocks, x.shape, out_sharding=jax.NamedSharding(mesh, spec))


def run(
  config: Config,
  at: Positions,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  *,
  mesh: Any,
  axes: tuple[str, ...],
  explicit: bool,
  num_real: Any,
  error: Exception,
) -> Any:
  """The loop over the sharded batch, as the whole batch's step would run.

  The micro-step is the whole-batch step on every device's micro-batch k
  together, sharded by the batch's types: whatever the whole batch runs,
  this runs, but XLA communicates inside the loop wherever the whole batch's
  step communicates. If this fails too, the whole batch would fail the same
  way, and its error is raised.
  """
  _refuse_per_device_options(config, at, num_real, error, axes)
  num_devices = math.prod(mesh.shape[a] for a in axes)
  contiguous = config.split == "contiguous" and num_devices > 1
  args = list(args)
  for i in at.batch:
    args[i] = jax.tree.map(
      lambda x: (
        _lay_out(x, mesh, axes, explicit, contiguous, num_devices, config)
        if isinstance(x, _step.ARRAY_TYPES)
        else x
      ),
      args[i],
    )
  if contiguous:
    config = config._replace(split="strided")
  try:
    out = _loop.run(config, at, args, kwargs)
  except Exception as whole_batch_error:
    raise whole_batch_error from error
  if contiguous:  # "concat" rows back in the batch's order
    modes = jax.tree.broadcast(config.reduce, out)
    out = jax.tree.map(
      lambda mode, x: (
        _batch_order(x, num_devices, config.num_microbatches) if mode == "concat" else x
      ),
      modes,
      out,
    )
  _warn(error, axes)
  return out


def _lay_out(
  x: Any,
  mesh: Any,
  axes: tuple[str, ...],
  explicit: bool,
  contiguous: bool,
  num_devices: int,
  config: Config,
) -> jax.Array:
  """A batch leaf split over `axes`, in the per-device micro-batches' order."""
  rest = (_placement.spec_of(x) or P())[1:] if explicit else ()
  x = _placement.place(x, mesh, P(axes, *rest), explicit)
  return _device_order(x, num_devices, config.num_microbatches) if contiguous else x


def _warn(error: Exception, axes: tuple[str, ...]) -> None:
  warnings.warn(
    f"jaccum could not run grad_fn on each device's rows under shard_map "
    f"({failures(error)}), so it runs the loop as the "
    f"whole batch's step runs, sharded over {axes}. Its micro-batch k is every "
    f"device's micro-batch k together, in the same order: sums, maxima, "
    f"concatenations, per-example means and weight_fn means whose weight adds "
    f"up over rows (token counts) are the same, up to rounding. What is not: a "
    f"mean of a value that is not a mean over examples (a mean over tokens "
    f"without weight_fn) averages K micro-batches of all devices' rows, not "
    f"devices × K of each device's, and a key (rng_argnum) is folded with the "
    f"micro-batch only, not the device. XLA may communicate over {axes} inside "
    f"the loop (count it with jaccum.inspect.collectives(step, *args).by_axis). "
    f"{cause_and_fix(error, axes)}",
    stacklevel=_reduce.user_stacklevel(),
  )

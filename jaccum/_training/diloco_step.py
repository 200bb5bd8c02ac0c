"""`DiLoCo.train_step`: DiLoCo on a mesh, each phase of a round its own program.

The step wraps the user's value-and-grad function in a `shard_map` manual
over the slow axis (and the fast data axes, if any), runs `DiLoCo`'s update
on each replica and applies it. Called with a concrete state, it reads the
step count on the host (from the state it returned last, without waiting for
the device) and runs the program of that step's phase: an inner step holds no
collective over the slow axis, a sync exactly its fragment's reduction, so a
compiled program shows what its step sends and a landing's reduction has
nothing in the step feeding it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from jaccum import inspect as _inspect
from jaccum._routes.accumulate import accumulate
from jaccum._routes.placement import place

P = jax.sharding.PartitionSpec
AxisType = jax.sharding.AxisType


def _axes(value: Any, name: str) -> tuple[str, ...]:
  if value is None:
    return ()
  axes = (value,) if isinstance(value, str) else value
  if not isinstance(axes, tuple | list) or not all(isinstance(a, str) for a in axes):
    raise TypeError(
      f"{name} must be a mesh axis name or a tuple of them, got {value!r}."
    )
  return tuple(axes)


def _batch_positions(accumulate_kwargs: dict[str, Any]) -> tuple[int, ...]:
  at = accumulate_kwargs.get("batch_argnums", 1)
  at = (at,) if isinstance(at, int) else tuple(at)
  if not at or any(operator.index(i) < 1 for i in at):
    raise ValueError(
      f"batch_argnums={at} must name arguments after the params (position 0): "
      "the step splits them over the replicas."
    )
  return at


class TrainStep:
  """DiLoCo on a mesh; see `DiLoCo.train_step`."""

  def __init__(
    self,
    core: Any,
    value_and_grad_fn: Callable[..., Any],
    num_microbatches: int,
    mesh: Any,
    axis: Any,
    accumulate_kwargs: dict[str, Any],
  ):
    if not callable(value_and_grad_fn):
      raise TypeError(
        "value_and_grad_fn must be callable, fn(params, *args) -> (value, grads), "
        f"e.g. jax.value_and_grad(loss); got {type(value_and_grad_fn).__name__}."
      )
    self._core = core
    self._slow = core.o.axes
    self._fast = _axes(axis, "axis")
    if set(self._fast) & set(self._slow):
      raise ValueError(
        f"axis={self._fast} must not hold DiLoCo's axis_name {self._slow}: the "
        "replicas lie along axis_name, the fast data axes inside each replica."
      )
    self._batch_at = _batch_positions(accumulate_kwargs)
    self._mesh_given = mesh
    others = set(accumulate_kwargs) - {"batch_argnums"}
    if num_microbatches == 1 and not self._fast and not others:
      self._fn = value_and_grad_fn
    else:
      self._fn = accumulate(
        value_and_grad_fn,
        num_microbatches,
        axis_name=self._fast or None,
        **accumulate_kwargs,
      )
    self._programs: dict[Any, Any] = {}
    self._known: tuple[Any, int] | None = None  # (a count array, its value)

  def _mesh(self) -> jax.sharding.Mesh:
    mesh = self._mesh_given
    if mesh is None:
      mesh = jax.sharding.get_mesh()
    if not isinstance(mesh, jax.sharding.Mesh) or not mesh.axis_names:
      raise ValueError(
        "DiLoCo.train_step needs a mesh: pass mesh=jax.make_mesh(...) holding "
        f"the axis {self._slow[0]!r}, or set one with jax.set_mesh; got {mesh!r}."
      )
    missing = [a for a in self._slow + self._fast if a not in mesh.axis_names]
    if missing:
      raise ValueError(
        f"the mesh has the axes {mesh.axis_names}, not {missing}: DiLoCo's "
        "axis_name (the replicas' slow axis) and train_step's axis (fast data "
        "axes) must be axes of the mesh. Make the mesh with them, e.g. "
        f"jax.make_mesh((replicas, ...), ({self._slow[0]!r}, ...))."
      )
    return mesh

  def num_replicas(self) -> int:
    """The replicas: the size of DiLoCo's axis_name on the mesh."""
    mesh = self._mesh()
    return int(np.prod([mesh.shape[a] for a in self._slow]))

  def init(self, params: Any) -> tuple[Any, Any]:
    """`(params, state)`, one copy per replica, placed over `axis_name`."""
    mesh, replicas = self._mesh(), self.num_replicas()
    rows = jax.sharding.NamedSharding(mesh, P(self._slow))

    def stacked(params):
      both = (params, self._core.init(params))
      return jax.tree.map(
        lambda x: jax.numpy.broadcast_to(x, (replicas, *x.shape)), both
      )

    return jax.jit(stacked, out_shardings=rows)(params)

  def shared(self, state: Any) -> Any:
    """The shared params (`state.snapshot`), one copy, replicated."""
    # Every replica holds the same snapshot (the same reduction and outer
    # step, bit for bit), so each device's row is the copy: no collective.
    if "shared" not in self._programs:
      first = jax.shard_map(
        lambda tree: jax.tree.map(lambda x: x[0], tree),
        mesh=self._mesh(),
        in_specs=P(self._slow),
        out_specs=P(),
        axis_names=set(self._slow),
        check_vma=False,
      )
      self._programs["shared"] = jax.jit(first)
    return self._programs["shared"](state.snapshot)

  def _phase(self, state: Any) -> tuple[Any, int | None]:
    """The step's program (`Core.program`) where the count is known on the
    host, else None (read from the traced count); and the call's number."""
    count = state.count
    if isinstance(count, Tracer):
      return None, None
    if self._known is not None and self._known[0] is count:
      done = self._known[1]
    else:  # a state from elsewhere (a checkpoint): one read of the device
      done = int(np.asarray(count).reshape(-1)[0])
    return self._core.program(done + 1), done + 1

  def _program(self, phase: int | str | None, num_args: int) -> Callable[..., Any]:
    key = (phase, num_args)
    if key not in self._programs:
      self._programs[key] = self._build(phase, num_args)
    return self._programs[key]

  def _build(self, phase: int | str | None, num_args: int) -> Callable[..., Any]:
    mesh, core, fn = self._mesh(), self._core, self._fn
    split = P((*self._slow, *self._fast))
    arg_specs = [split if i + 1 in self._batch_at else P() for i in range(num_args)]

    def body(params, state, *args):
      params, state = jax.tree.map(lambda x: x[0], (params, state))
      value, grads = fn(params, *args)
      _, params, state = core.advance(grads, state, params, phase, {})
      return jax.tree.map(lambda x: x[None], (params, state, value))

    in_specs = (P(self._slow), P(self._slow), *arg_specs)
    mapped = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=in_specs,
      out_specs=P(self._slow),
      axis_names=set(self._slow + self._fast),
    )
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    explicit = all(types[a] == AxisType.Explicit for a in self._slow + self._fast)

    def placed(*args):
      # Arguments from anywhere (unplaced, or sharded otherwise) laid out as
      # the shard_map reads them, inside the program.
      args = [
        jax.tree.map(lambda x, spec=spec: place(x, mesh, spec, explicit), a)
        for a, spec in zip(args, in_specs, strict=True)
      ]
      return mapped(*args)

    return jax.jit(placed)

  def lower(self, params: Any, state: Any, *args: Any) -> Any:
    """The program `self(params, state, *args)` runs, lowered (`jax.stages`)."""
    phase, _ = self._phase(state)
    return self._program(phase, len(args)).lower(params, state, *args)

  def bytes_per_step(self, params: Any, state: Any, *args: Any) -> dict[Any, float]:
    """The bytes a step sends over each mesh axis, averaged over a round.

    Each call of a round (the second: every fragment's reduction and
    landing as they recur) runs its phase's program; each distinct program
    is compiled once and its collectives counted (`jaccum.inspect`), per
    device and by mesh axes as `CollectiveCounts.by_axis` keys them.

    Returns:
      `{axis key: bytes}`, the round's bytes ÷ H (data parallel's figure
      over the slow axis, ÷ H), the keys in the mesh's order.
    """
    sync_every = self._core.o.sync_every
    calls: dict[Any, int] = {}
    for step in range(sync_every + 1, 2 * sync_every + 1):
      phase = self._core.program(step)
      calls[phase] = calls.get(phase, 0) + 1
    total: dict[Any, float] = {}
    for phase, times in calls.items():
      program = self._program(phase, len(args))
      counts = _inspect.collectives(program, params, state, *args)
      for key, count in counts.by_axis.items():
        sent = (count.bytes_inside_loops or 0) + count.bytes_outside_loops
        total[key] = total.get(key, 0.0) + times * sent / sync_every
    names = self._mesh().axis_names

    def mesh_order(key: Any) -> tuple[int, list[int]]:
      axes = () if key is None else (key,) if isinstance(key, str) else key
      return len(axes), [names.index(a) for a in axes]

    return {key: total[key] for key in sorted(total, key=mesh_order)}

  def __call__(self, params: Any, state: Any, *args: Any) -> tuple[Any, Any, Any]:
    """One step on every replica: `(params, state, value)`."""
    phase, step = self._phase(state)
    params, state, value = self._program(phase, len(args))(params, state, *args)
    if step is not None:
      self._known = (state.count, step)
    return params, state, value

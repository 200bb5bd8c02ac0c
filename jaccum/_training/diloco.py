"""`DiLoCo`: local steps on each replica, one averaged outer step every H steps.

Douillard et al. (2023), "DiLoCo: Distributed Low-Communication Training of
Language Models" (arXiv:2311.08105), and its streaming form, Douillard et al.
(2025), "Streaming DiLoCo with overlapping communication" (arXiv:2501.18512).
Each replica of a slow mesh axis trains on its own data with the inner
optimizer; every `sync_every` steps the replicas average their pseudo-
gradients θ_start − θ_local (one reduction over the slow axis) and an outer
optimizer steps the shared params from θ_start, which every replica then
continues from. With fragments, each group of param leaves syncs at its own
offset in the round (1/P of the bytes per sync), and with a delay its outer
update lands τ steps after its pseudo-gradient was taken, so that the
reduction can run while those steps compute. `diloco_step` offers it on a
mesh without writing `shard_map`.
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaccum._core import accumulators
from jaccum._core import wire as _wire
from jaccum._core.step import cast_varying, varying_axes
from jaccum._routes import rules
from jaccum._training.diloco_fragments import Fragments, wide

ReduceFn = Callable[[Any, tuple[str, ...], Any], tuple[Any, Any]]

# `Core.advance`'s phase for the steps that send nothing over the slow axis.
QUIET = "quiet"


class DiLoCoState(NamedTuple):
  """State of `DiLoCo`, one per replica.

  Attributes:
    count: int32, the inner steps taken (calls to `update`).
    inner_state: the inner optimizer's state, this replica's own.
    snapshot: the shared params, in the params' structure, in float32 at
      least: each leaf as its fragment's last sync left it (θ_start, the
      point the next pseudo-gradient is taken from). The same on every
      replica.
    outer_state: the outer optimizer's state, one per fragment (each made by
      `outer.init` of the snapshot with the other fragments' leaves None).
      The same on every replica.
    in_flight: with `delay > 0`: the pseudo-gradient of the fragment whose
      outer update is waiting to be applied (one fragment's leaves, in slots
      shared by the fragments); None with `delay=0`.
    reduce_state: `reduce_fn`'s state, one per fragment: what it returned at
      that fragment's last sync, None until then. Put a starting state here
      (`state._replace(reduce_state=...)`) for a `reduce_fn` that needs one.

  Examples:
    Two float32 leaves of 3 params each, Nesterov outer momentum: the
    snapshot and the momentum are 8 bytes per param.

    >>> import jax, jax.numpy as jnp, optax, jaccum
    >>> diloco = jaccum.DiLoCo(optax.sgd(0.1), sync_every=4, axis_name="replica")
    >>> state = diloco.init({"a": jnp.zeros(3), "b": jnp.zeros(3)})
    >>> int(state.count), jax.tree.map(jnp.shape, state.snapshot)
    (0, {'a': (3,), 'b': (3,)})
    >>> sum(x.nbytes for x in jax.tree.leaves((state.snapshot, state.outer_state)))
    48
  """

  count: jax.Array
  inner_state: Any
  snapshot: Any
  outer_state: tuple[Any, ...]
  in_flight: Any
  reduce_state: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Options:
  """`DiLoCo`'s keywords, checked once (see `options`)."""

  inner: optax.GradientTransformationExtraArgs
  outer: optax.GradientTransformationExtraArgs
  sync_every: int
  axes: tuple[str, ...]
  num_fragments: int
  delay: int
  reduce_dtype: Any
  reduce_fn: ReduceFn | None

  @property
  def period(self) -> int:
    """Steps between two fragments' syncs, H / P."""
    return self.sync_every // self.num_fragments


def _check_optimizer(opt: Any, name: str) -> optax.GradientTransformationExtraArgs:
  if not (
    callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None))
  ):
    raise TypeError(
      f"{name} must be an optax.GradientTransformation (an (init, update) pair, "
      f"e.g. optax.adamw(1e-3)), got {type(opt).__name__}: wrap your optimizer "
      "with optax.GradientTransformation(init, update)."
    )
  return optax.with_extra_args_support(opt)


def _check_count(value: Any, name: str, least: int) -> int:
  if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
    raise TypeError(
      f"{name} must be an int >= {least}, got {value!r:.60} of type "
      f"{type(value).__name__}."
    )
  if value < least:
    raise ValueError(f"{name} must be an int >= {least}, got {value}.")
  return operator.index(value)


def _check_axes(axis_name: Any) -> tuple[str, ...]:
  axes = (axis_name,) if isinstance(axis_name, str) else axis_name
  if (
    not isinstance(axes, tuple | list)
    or not axes
    or not all(isinstance(a, str) for a in axes)
  ):
    raise TypeError(
      "axis_name must name the slow mesh axis the replicas lie along, a str "
      f"(e.g. 'replica') or a tuple of str, got {axis_name!r}."
    )
  return tuple(axes)


def options(
  inner: Any,
  sync_every: Any,
  outer: Any,
  axis_name: Any,
  num_fragments: Any,
  delay: Any,
  reduce_dtype: Any,
  reduce_fn: Any,
) -> Options:
  """`DiLoCo`'s keywords, each checked once, as a frozen record."""
  sync_every = _check_count(sync_every, "sync_every", 1)
  num_fragments = _check_count(num_fragments, "num_fragments", 1)
  if sync_every % num_fragments:
    raise ValueError(
      f"{num_fragments=} must divide {sync_every=}: fragment f syncs at the "
      "steps ≡ f·sync_every/num_fragments (mod sync_every). Pick a "
      "num_fragments that divides sync_every."
    )
  delay = _check_count(delay, "delay", 0)
  period = sync_every // num_fragments
  if delay >= period:
    raise ValueError(
      f"{delay=} must be below sync_every/num_fragments = {period}: a "
      "fragment's outer update must land before the next fragment's "
      "reduction starts (one in flight at a time). Use a smaller delay or "
      "fewer fragments."
    )
  if reduce_fn is not None and not callable(reduce_fn):
    raise TypeError(
      "reduce_fn must be callable, reduce_fn(tree, axes, state) -> (sum, state), "
      f"or None, got {type(reduce_fn).__name__}."
    )
  record = Options(
    inner=_check_optimizer(inner, "inner"),
    outer=_check_optimizer(
      optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer,
      "outer",
    ),
    sync_every=sync_every,
    axes=_check_axes(axis_name),
    num_fragments=num_fragments,
    delay=delay,
    reduce_dtype=accumulators.check_accum_dtype(reduce_dtype, "reduce_dtype"),
    reduce_fn=typing.cast(ReduceFn | None, reduce_fn),
  )
  rules.check("diloco", record)
  return record


def phase_of(step: Any, o: Options) -> Any:
  """What call number `step` (1, 2, …) does: 0 an inner step only; 1 + f
  fragment f's sync (`delay=0`) or the start of its reduction; 1 + P + f the
  landing of fragment f's outer update. An int for an int, else traced."""
  xp = np if isinstance(step, int | np.integer) else jnp
  at = step % o.sync_every
  phase = xp.where(at % o.period == 0, 1 + at // o.period, 0)
  if o.delay:
    started = step - o.delay
    at = started % o.sync_every
    lands = (started >= 1) & (at % o.period == 0)
    phase = xp.where(lands, 1 + o.num_fragments + at // o.period, phase)
  return int(phase) if xp is np else phase.astype(jnp.int32)


class _Carry(NamedTuple):
  """What a phase reads and writes besides the inner step (flat leaf lists)."""

  snapshot: list[Any]
  outer_state: tuple[Any, ...]
  in_flight: list[Any] | None
  reduce_state: tuple[Any, ...]


def _structure(tree: Any) -> str:
  text = str(jax.tree.structure(tree))
  return text if len(text) <= 200 else text[:200] + "…"


def _apply(p: Any, u: Any) -> jax.Array:
  """`optax.apply_updates` on one leaf."""
  return jnp.asarray(p + u).astype(jnp.result_type(p))


class Core:
  """What `DiLoCo` does; `DiLoCo` is the optax-facing `(init, update)` and
  `diloco_step` runs it on a mesh with each phase compiled on its own."""

  def __init__(self, o: Options):
    self.o = o

  def phase(self, step: Any) -> Any:
    """What call number `step` does (`phase_of`)."""
    return phase_of(step, self.o)

  def program(self, step: int) -> int | str:
    """The program call number `step` runs on its own: its phase if it
    reduces over the slow axis, else `QUIET`, one program for every phase
    that does not (an inner step only; with a delay, a reduction's start)."""
    phase = self.phase(step)
    if phase == 0 or (self.o.delay and phase <= self.o.num_fragments):
      return QUIET if self.o.delay else 0
    return phase

  def init(self, params: optax.Params) -> DiLoCoState:
    """The state before the first step: the snapshot is `params`."""
    o = self.o
    fragments = Fragments(params, o.num_fragments)
    leaves = fragments.treedef.flatten_up_to(params)
    # A copy, never the params' own buffer: both may be donated.
    snapshot = [jnp.array(x, wide(jnp.result_type(x)), copy=True) for x in leaves]
    outer_state = tuple(
      o.outer.init(fragments.tree([snapshot[i] for i in fragments.members(f)], f))
      for f in range(o.num_fragments)
    )
    in_flight = fragments.empty_slots(snapshot) if o.delay else None
    state = DiLoCoState(
      count=jnp.zeros([], jnp.int32),
      inner_state=o.inner.init(params),
      snapshot=jax.tree.unflatten(fragments.treedef, snapshot),
      outer_state=outer_state,
      in_flight=in_flight,
      reduce_state=(None,) * o.num_fragments,
    )
    # Inside the replicas' shard_map, typed as varying from the start, as
    # `update` returns it, so that a loop can carry it.
    count = state.count
    return cast_varying(state, o.axes)._replace(count=count)

  def _check_scope(self) -> int:
    """The replicas' count, or an error if `axis_name` is not bound here."""
    try:
      return jax.lax.axis_size(self.o.axes)
    except NameError:
      mesh = jax.sharding.get_abstract_mesh()
      where = (
        f"the mesh here has the axes {mesh.axis_names} (manual: "
        f"{tuple(mesh.manual_axes)})"
        if mesh.axis_names
        else "no mesh axis is bound here"
      )
      name = self.o.axes[0] if len(self.o.axes) == 1 else self.o.axes
      raise ValueError(
        f"DiLoCo(axis_name={name!r}) "
        f"updates inside a shard_map over that axis, but {where}. Call update "
        "inside jax.shard_map(..., axis_names={...}) over the replicas' axis, or "
        "use DiLoCo.train_step(..., mesh=mesh), which does."
      ) from None

  def _check_state(self, state: Any, params: Any) -> None:
    if not isinstance(state, DiLoCoState):
      raise TypeError(
        "state must be the jaccum.DiLoCoState made by this DiLoCo's init, got "
        f"{type(state).__module__}.{type(state).__qualname__}."
      )
    if params is None:
      raise ValueError(
        "DiLoCo.update needs params (this replica's current params): its "
        "pseudo-gradient is θ_start - θ_local. Call update(grads, state, params)."
      )
    if jax.tree.structure(state.snapshot) != jax.tree.structure(params):
      raise ValueError(
        "params must have the structure of the params given to init, "
        f"{_structure(state.snapshot)}, got {_structure(params)}."
      )
    if (state.in_flight is None) != (self.o.delay == 0) or len(
      state.outer_state
    ) != self.o.num_fragments:
      raise TypeError(
        f"state must come from a DiLoCo with num_fragments={self.o.num_fragments} "
        f"and delay={self.o.delay} (its outer_state and in_flight differ)."
      )

  def advance(
    self,
    grads: optax.Updates,
    state: DiLoCoState,
    params: optax.Params | None,
    phase: int | str | None,
    extra_args: dict[str, Any],
  ) -> tuple[Any, Any, DiLoCoState]:
    """One inner step and whatever the step's phase does (`phase_of`; None:
    read from the count, traced; `QUIET`: the same among the phases that
    send nothing). Returns `(updates, new_params, state)`:
    the updates `update` returns, and the params they lead to, exactly the
    shared params for a fragment that lands (`optax.apply_updates` of the
    updates rounds there: `p + (new - p)`)."""
    o = self.o
    num_replicas = self._check_scope()
    self._check_state(state, params)
    fragments = Fragments(params, o.num_fragments)
    updates, inner_state = o.inner.update(
      grads, state.inner_state, params, **extra_args
    )
    flat = fragments.treedef.flatten_up_to
    u, p = flat(updates), flat(params)
    carry = _Carry(
      flat(state.snapshot), state.outer_state, state.in_flight, state.reduce_state
    )
    step = _Phases(o, fragments, num_replicas)
    branches = step.branches()
    vary = frozenset(o.axes).union(
      *(varying_axes(x) for x in jax.tree.leaves((u, p, carry)))
    )

    def typed(branch: Callable[..., Any]) -> Callable[..., Any]:
      # Every branch's outputs vary alike, whichever of them a psum made
      # invariant: a switch wants one type, a loop its carry's.
      return lambda *args: cast_varying(branch(*args), vary)

    if isinstance(phase, int):
      out = typed(branches[phase])(u, p, carry)
    else:
      index = phase_of(state.count + 1, o)
      if phase == QUIET:  # the phases that send nothing: 0 and the starts
        branches = branches[: 1 + o.num_fragments]
        index = jnp.minimum(index, o.num_fragments)
      out = jax.lax.switch(index, [typed(b) for b in branches], u, p, carry)
    new_updates, new_params, carry = out
    unflat = lambda leaves: jax.tree.unflatten(fragments.treedef, leaves)
    new_state = DiLoCoState(
      count=jnp.asarray(optax.safe_increment(state.count)),
      inner_state=cast_varying(inner_state, vary),
      snapshot=unflat(carry.snapshot),
      outer_state=carry.outer_state,
      in_flight=carry.in_flight,
      reduce_state=carry.reduce_state,
    )
    return unflat(new_updates), unflat(new_params), new_state


class _Phases:
  """The branches of one step, each a function of `(u, p, carry)`: the inner
  updates, the params and the carry, as flat leaf lists."""

  def __init__(self, o: Options, fragments: Fragments, num_replicas: int):
    self.o, self.fragments, self.num_replicas = o, fragments, num_replicas

  def branches(self) -> list[Callable[..., Any]]:
    o, num = self.o, self.o.num_fragments
    if not o.delay:
      syncs = [lambda u, p, c, f=f: self._land(f, self._delta(f, u, p, c), u, p, c)
               for f in range(num)]  # fmt: skip
      return [self._ordinary, *syncs]
    starts = [lambda u, p, c, f=f: self._start(f, u, p, c) for f in range(num)]
    lands = [
      lambda u, p, c, f=f: self._land(f, self.fragments.unpack(f, c.in_flight), u, p, c)
      for f in range(num)
    ]
    return [self._ordinary, *starts, *lands]

  def _ordinary(self, u: list[Any], p: list[Any], c: _Carry) -> Any:
    return u, [_apply(x, d) for x, d in zip(p, u, strict=True)], c

  def _delta(self, f: int, u: list[Any], p: list[Any], c: _Carry) -> list[Any]:
    """Fragment f's pseudo-gradient after this step: θ_start - θ_local."""
    return [
      c.snapshot[i]
      - (p[i].astype(c.snapshot[i].dtype) + u[i].astype(c.snapshot[i].dtype))
      for i in self.fragments.members(f)
    ]

  def _start(self, f: int, u: list[Any], p: list[Any], c: _Carry) -> Any:
    assert c.in_flight is not None
    in_flight = self.fragments.pack(f, self._delta(f, u, p, c), c.in_flight)
    return u, self._ordinary(u, p, c)[1], c._replace(in_flight=in_flight)

  def _mean(self, f: int, delta: list[Any], reduce_state: Any) -> tuple[list[Any], Any]:
    """The replicas' mean of fragment f's pseudo-gradients: one reduction."""
    o, tree = self.o, self.fragments.tree(delta, f)
    if o.reduce_fn is not None:
      total, new_state = o.reduce_fn(tree, o.axes, reduce_state)
      if jax.tree.structure(total) != jax.tree.structure(tree) or jax.tree.structure(
        new_state
      ) != jax.tree.structure(reduce_state):
        raise TypeError(
          "reduce_fn(tree, axes, state) must return (sum, new_state): the sum "
          f"with the tree's structure {_structure(tree)} and new_state with "
          f"state's {_structure(reduce_state)}; got {_structure(total)} and "
          f"{_structure(new_state)}."
        )
      summed = self.fragments.leaves(total, f)
    else:
      wire = o.reduce_dtype
      narrow = [x.astype(wire) if wire is not None else x for x in delta]
      summed = _wire.reduced(lambda xs: jax.lax.psum(xs, o.axes), narrow)
      new_state = reduce_state
    mean = [
      (s.astype(d.dtype) / self.num_replicas).astype(d.dtype)
      for s, d in zip(summed, delta, strict=True)
    ]
    return mean, new_state

  def _land(
    self, f: int, delta: list[Any], u: list[Any], p: list[Any], c: _Carry
  ) -> Any:
    """The outer step of fragment f from the mean pseudo-gradient; its leaves
    go to the new shared params, the others take the inner step."""
    fragments, members = self.fragments, self.fragments.members(f)
    mean, reduce_f = self._mean(f, delta, c.reduce_state[f])
    start = [c.snapshot[i] for i in members]
    outer_updates, outer_f = self.o.outer.update(
      fragments.tree(mean, f), c.outer_state[f], fragments.tree(start, f)
    )
    new = [
      s + d.astype(s.dtype)
      for s, d in zip(start, fragments.leaves(outer_updates, f), strict=True)
    ]
    snapshot, updates, params = list(c.snapshot), list(u), self._ordinary(u, p, c)[1]
    for i, x in zip(members, new, strict=True):
      snapshot[i] = x
      updates[i] = (x - p[i].astype(x.dtype)).astype(jnp.result_type(u[i]))
      params[i] = x.astype(jnp.result_type(p[i]))
    outer_state = tuple(outer_f if g == f else s for g, s in enumerate(c.outer_state))
    reduce_state = tuple(
      reduce_f if g == f else s for g, s in enumerate(c.reduce_state)
    )
    return (
      updates,
      params,
      c._replace(snapshot=snapshot, outer_state=outer_state, reduce_state=reduce_state),
    )


@jax.tree_util.register_static  # a configuration, not data: no leaves
class DiLoCo(optax.GradientTransformationExtraArgs):
  """DiLoCo: replicas train apart and average their progress every H steps.

  Inside a `shard_map` over the slow mesh axis `axis_name` (pods, data
  centres: a link too slow for an all-reduce every step), each replica holds
  its own params and inner optimizer state and trains on its own data. Every
  `sync_every` = H steps the replicas average their pseudo-gradients, one
  reduction over the slow axis, and an outer optimizer steps the shared
  params, which every replica continues from. What a call computes, for the
  replica's params `p`::

    def update(grads, state, p):
      u = inner.update(grads, inner_state, p)           # every call
      t = count = count + 1
      for each fragment f (param leaves f·L/P .. (f+1)·L/P - 1):
        if t ≡ f·H/P (mod H):                           # its sync
          delta_f = snapshot_f - (p_f + u_f)            # θ_start - θ_local
          if delay == 0: land(f, delta_f)
          else: in_flight = delta_f                     # lands at t + delay
        if delay and t - delay ≥ 1 and t - delay ≡ f·H/P (mod H):
          land(f, in_flight)
      return u, with each landed fragment's u_f replaced by new_f - p_f

    def land(f, delta):
      mean = psum(delta, axis_name) / replicas          # the one reduction
      new_f = snapshot_f + outer.update(mean, outer_state_f, snapshot_f)
      snapshot_f = new_f                                # the shared params

  With one fragment and no delay this is DiLoCo (Douillard et al. 2023):
  the pseudo-gradients are reduced once every H steps, so the slow axis
  carries the params' bytes once a round, a data-parallel step's ÷ H. With
  `num_fragments` = P (Streaming DiLoCo, Douillard et al. 2025) fragment f
  syncs at the steps ≡ f·H/P (mod H): each sync carries 1/P of the bytes,
  spread over the round. With `delay` = τ ≥ 1 a fragment's outer update
  lands τ steps after its pseudo-gradient was taken, and the reduction runs
  in the step where it lands, on a pseudo-gradient from the state: nothing
  that step computes feeds it, so a scheduler that overlaps communication
  with compute can hide it behind the step's forward and backward passes
  (`train_step` compiles that step on its own; `update` under `jit` holds
  each phase in a `lax.switch`, whose branches XLA does not overlap). The
  inner steps a replica takes while a fragment is in flight are replaced by
  the shared params when it lands (Streaming DiLoCo's mixing α = 0).

  The inner optimizer's state is never reset; the outer optimizer keeps one
  state per fragment. On a sync step `update` returns the updates that take
  the replica to the new shared params: `optax.apply_updates` computes
  `p + (new - p)`, which rounds to within an ulp of `p` of them (exact where
  they are within a factor 2 of `p`); the shared params themselves are kept
  exact in `state.snapshot`, which the next pseudo-gradient is taken from,
  so that rounding does not build up. `train_step` sets them exactly.
  Every replica must be at the same step (they are, from `init`).

  Memory per replica besides the inner optimizer's state: the snapshot and
  the outer optimizer's state, 8 bytes a param for float32 params and the
  default Nesterov outer step (its momentum); with `delay` ≥ 1, one
  fragment's pseudo-gradient more (4/P bytes a param).

  Args:
    inner: the optimizer each replica runs every step, an optax
      `GradientTransformation` (the paper's: AdamW); `update`'s extra
      keyword arguments reach it.
    sync_every: H, the inner steps per round, an int ≥ 1.
    outer: the outer optimizer, stepping the shared params with the mean
      pseudo-gradient as its gradient; None: Nesterov SGD, learning rate 0.7,
      momentum 0.9 (the paper's). `optax.sgd(1.0)` gives the average of the
      replicas' params.
    axis_name: the slow mesh axis the replicas lie along (or a tuple of axes),
      bound by the `shard_map` that `update` runs in.
    num_fragments: P, the groups of consecutive param leaves (in
      `jax.tree.leaves` order) that sync in turn; P must divide H and the
      number of leaves.
    delay: τ, the steps between a fragment's pseudo-gradient and its landing,
      0 ≤ τ < H/P.
    reduce_dtype: the dtype the pseudo-gradients cross the slow axis in (e.g.
      `jnp.bfloat16`: half the bytes of float32), summed back into float32.
      XLA:CPU sums bf16 in float32 (GPUs and TPUs send bf16).
    reduce_fn: replaces the reduction: `reduce_fn(tree, axes, state) ->
      (sum, new_state)`, as `accumulate`'s, called at each sync with the
      fragment's pseudo-gradients (the params' structure, the other
      fragments' leaves None) and returning their sum over `axes` (or an
      estimate: compression); `state` is the fragment's entry of
      `DiLoCoState.reduce_state`. Not with `reduce_dtype`.

  Raises:
    TypeError, ValueError: for a bad argument, naming it, what was expected
      and what was received; `init` if P does not divide the number of param
      leaves; `update` if `axis_name` is not bound where it runs.

  Examples:
    One replica per device, two inner steps a round, outer SGD of rate 1
    (the mean of the replicas' params). Replica r's gradient is r, so after
    a round of two inner SGD steps of rate 0.1 its params moved by -0.2·r,
    and the round ends at their mean on every replica:

    >>> import jax, jax.numpy as jnp, optax, jaccum
    >>> n = jax.device_count()
    >>> mesh = jax.make_mesh((n,), ("replica",))
    >>> diloco = jaccum.DiLoCo(optax.sgd(0.1), sync_every=2,
    ...                        outer=optax.sgd(1.0), axis_name="replica")
    >>> def train(w):
    ...   state = diloco.init(w)
    ...   for _ in range(2):
    ...     grads = jax.lax.axis_index("replica") * jnp.ones_like(w)
    ...     updates, state = diloco.update(grads, state, w)
    ...     w = optax.apply_updates(w, updates)
    ...   return w[None]
    >>> train = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=jax.P(),
    ...                               out_specs=jax.P("replica")))
    >>> w = train(jnp.zeros(2))
    >>> w.shape == (n, 2), bool(jnp.allclose(w, -0.2 * (n - 1) / 2))
    (True, True)

    On a mesh without writing the `shard_map`: `train_step`.

  References:
    Douillard et al., "DiLoCo: Distributed Low-Communication Training of
    Language Models", arXiv:2311.08105 (2023). Douillard et al., "Streaming
    DiLoCo with overlapping communication: Towards a Distributed Free
    Lunch", arXiv:2501.18512 (2025).

  Methods:
    init(params): the `DiLoCoState` before the first step: the snapshot is a
      float32 (at least) copy of `params`, the outer state `outer.init` of
      each fragment's leaves.
    update(grads, state, params, **extra_args): one inner step, and the
      step's syncs; returns `(updates, new_state)` (above). `params` are
      required. Under `jit` every phase of a round is a branch of one
      `lax.switch`.
  """

  _core: Core
  _arguments: tuple[tuple[Any, ...], dict[str, Any]]

  def __new__(
    cls,
    inner: optax.GradientTransformation,
    sync_every: int,
    *,
    outer: optax.GradientTransformation | None = None,
    axis_name: str | tuple[str, ...],
    num_fragments: int = 1,
    delay: int = 0,
    reduce_dtype: Any = None,
    reduce_fn: ReduceFn | None = None,
  ) -> DiLoCo:
    o = options(
      inner, sync_every, outer, axis_name, num_fragments, delay, reduce_dtype, reduce_fn
    )
    core = Core(o)

    def update(
      updates: optax.Updates,
      state: DiLoCoState,
      params: optax.Params | None = None,
      **extra_args: Any,
    ) -> tuple[optax.Updates, DiLoCoState]:
      new_updates, _, new_state = core.advance(updates, state, params, None, extra_args)
      return new_updates, new_state

    # The ignore: `update` narrows optax's `OptState` to DiLoCoState.
    self = super().__new__(cls, core.init, update)  # pyright: ignore[reportArgumentType]
    self._core = core
    self._arguments = (
      (inner, sync_every),
      dict(
        outer=outer,
        axis_name=axis_name,
        num_fragments=num_fragments,
        delay=delay,
        reduce_dtype=reduce_dtype,
        reduce_fn=reduce_fn,
      ),
    )
    return self

  def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # copy and pickle rebuild from the constructor's arguments, not (init, update).
    return self._arguments

  def train_step(
    self,
    value_and_grad_fn: Callable[..., Any],
    num_microbatches: int = 1,
    *,
    mesh: jax.sharding.Mesh | None = None,
    axis: str | tuple[str, ...] | None = None,
    **accumulate_kwargs: Any,
  ) -> Any:
    """DiLoCo on a mesh, without writing the `shard_map`.

    The returned step runs `value_and_grad_fn` on each replica's share of
    the batch, steps with this `DiLoCo`, and applies the updates (a landing
    fragment's params set exactly to the shared ones)::

      step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh)
      params, state = step.init(params)       # one copy per replica
      params, state, loss = step(params, state, batch)

    Params and state carry a leading axis of one row per replica, placed
    over `axis_name`; the batch arguments are split over `axis_name` (then
    `axis`) on their first axis, the others passed whole; the value comes
    back one row per replica. Called with a concrete state (not under your
    `jit`), the step count is read on the host (from the state the last call
    returned, without waiting for the device; once from the device for a
    state from elsewhere) and each reduction over `axis_name` (fragment f's
    sync, or its landing with a delay) is a compiled program of its own; the
    steps that send nothing share one more (P + 1 programs). So the inner
    steps' program holds no collective over `axis_name`,
    `jaccum.inspect.collectives(step, params, state, batch)` counts what
    the call with that state sends, and a landing's reduction shares its
    program with nothing but that step's own compute. Under your `jit` the
    phase is read from the traced count (a `lax.switch`).

    Args:
      value_and_grad_fn: `fn(params, *args) -> (value, grads)`, e.g.
        `jax.value_and_grad(loss)`; `value` may be any pytree.
      num_microbatches: K: each replica's step accumulates K micro-batches
        (`jaccum.accumulate`) of its rows.
      mesh: the mesh, holding `axis_name`; defaults to the one set with
        `jax.set_mesh`.
      axis: fast data axes inside each replica (e.g. `"data"`): the replica's
        rows are split over them and `accumulate` reduces over them every
        step (`axis_name=axis`). None: none.
      **accumulate_kwargs: `accumulate`'s options (`batch_argnums`,
        `weight_fn`, `reduce_dtype`, …), for the inner step.

    Returns:
      A step with `init(params) -> (params, state)`, `__call__(params,
      state, *args) -> (params, state, value)`, `lower(params, state, *args)`
      (the program that call runs), `bytes_per_step(params, state, *args)`
      (`{mesh axis: bytes}` a step sends per device, averaged over a round:
      each phase's program compiled once and counted) and `shared(state)`
      (the shared params, one copy, for evaluation).

    Raises:
      ValueError: if `axis_name` or `axis` is not an axis of the mesh, or
        there is no mesh.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaccum
      >>> n = jax.device_count()
      >>> mesh = jax.make_mesh((n,), ("replica",))
      >>> diloco = jaccum.DiLoCo(optax.sgd(0.1), sync_every=2, axis_name="replica")
      >>> loss = lambda w, x: jnp.mean((x @ w - 1.0) ** 2)
      >>> step = diloco.train_step(jax.value_and_grad(loss), mesh=mesh)
      >>> params, state = step.init(jnp.zeros(3))
      >>> x = jnp.ones((16, 3))
      >>> for _ in range(4):
      ...   params, state, value = step(params, state, x)
      >>> params.shape == (n, 3), value.shape == (n,)  # one row per replica
      (True, True)
      >>> bool(jnp.all(params == step.shared(state)))  # just synced
      True
    """
    from jaccum._training import diloco_step

    return diloco_step.TrainStep(
      self._core, value_and_grad_fn, num_microbatches, mesh, axis, accumulate_kwargs
    )

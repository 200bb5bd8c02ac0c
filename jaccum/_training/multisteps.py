"""`MultiSteps`: gradients accumulated across calls, one optimizer step per window.

A drop-in for `optax.MultiSteps` that runs the inner optimizer only on the call
that ends a window, resets the accumulator with `where` (so a non-finite window
cannot leak into the next), takes per-call weights (exact token means), and
reports `has_updated` only for calls that applied an update. Like optax's, its
state takes the params' sharding, and it is itself an optax transformation.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaccum._core import accumulators, exact

EveryK = int | Callable[[jax.Array], Any]
SkipFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]


class MultiStepsState(NamedTuple):
  """State of `MultiSteps`: the fields of `optax.MultiStepsState`, and three more.

  An `optax.MultiSteps` state continues exactly as `MultiStepsState(*state)`:
  the three new fields take their defaults, and `acc_weight=None` says that the
  window holds `mini_step` unweighted mini-steps, as optax's does.

  Attributes:
    mini_step: int32, the mini-steps accumulated so far in the current window.
    gradient_step: int32, the windows completed, i.e. inner optimizer steps.
    inner_opt_state: the state of the wrapped optimizer.
    acc_grads: the window's gradients so far, in the accumulator dtype: their
      weighted mean (`use_grad_mean=True`) or weighted sum. After the call that
      ends a window (`emitted`), its buffer holds that call's updates instead;
      the next call starts the new window from zero (whatever the buffer holds
      while `mini_step` is 0 is never read).
    skip_state: what `should_skip_update_fn` returned on the last call.
    acc_weight: float32, the sum of the weights accumulated in the window; None
      in a state converted from optax, which `update` reads as `mini_step`;
      an exact sum (`exact.Acc`) with `deterministic=True`, as `acc_grads`'s
      leaves are.
    emitted: bool, whether the call that returned this state applied the inner
      optimizer (what `MultiSteps.has_updated` reads).
    num_skipped: int32, the mini-steps `should_skip_update_fn` has rejected.
    num_clamped: int32, with `deterministic=True`: the windows that ended at
      2^15 - 1 mini-steps, the most its bins hold, because a schedule traced
      under `jit` asked for more (outside `jit` that is an error).

  Examples:
    A state that `optax.MultiSteps` left half-way through a window continues:

    >>> import jax.numpy as jnp, optax, jaccum
    >>> params = {"w": jnp.zeros(2)}
    >>> optax_opt = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    >>> optax_state = optax_opt.init(params)
    >>> _, optax_state = optax_opt.update({"w": jnp.ones(2)}, optax_state, params)
    >>> state = jaccum.MultiStepsState(*optax_state)
    >>> int(state.mini_step), state.acc_weight is None
    (1, True)
    >>> opt = jaccum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    >>> updates, state = opt.update({"w": jnp.full(2, 3.0)}, state, params)
    >>> print(updates["w"], int(state.gradient_step), bool(state.emitted))
    [-0.2 -0.2] 1 True
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  inner_opt_state: Any
  acc_grads: Any
  skip_state: Any = ()
  acc_weight: jax.Array | exact.Acc | None = None
  emitted: jax.Array | bool = False
  num_skipped: jax.Array | int = 0
  num_clamped: jax.Array | int = 0


def _check_exact_window(steps: Any, where: str) -> None:
  """Refuses a window longer than the exact sums hold, where its length is known."""
  try:
    steps = int(steps)
  except jax.errors.ConcretizationTypeError:
    return  # traced: `_exact_update` ends the window at the limit
  if steps > exact.MAX_TERMS:
    raise ValueError(
      f"{where}={steps} is more than MultiSteps(deterministic=True) sums "
      f"exactly: at most {exact.MAX_TERMS} mini-steps a window (what its int32 "
      "bins hold). Use a shorter window (fewer, larger micro-batches per "
      "mini-step), or deterministic=False."
    )


def _check_steps(value: Any, where: str) -> Any:
  """Checks a window length: a positive int, or an integer scalar array."""
  if isinstance(value, bool | np.bool_) or getattr(value, "dtype", None) == np.bool_:
    raise TypeError(f"{where} must be a positive int, got the bool {value!r}.")
  if isinstance(value, int | np.integer):
    steps = operator.index(value)
  elif isinstance(value, jax.Array | np.ndarray) and jnp.issubdtype(
    value.dtype, jnp.integer
  ):
    if value.ndim:
      raise ValueError(f"{where} must be a scalar, got shape {value.shape}.")
    try:
      steps = int(value)
    except jax.errors.ConcretizationTypeError:
      return value  # A traced length cannot be checked; below 1 acts as 1.
  else:
    got = getattr(value, "dtype", type(value).__name__)
    raise TypeError(
      f"{where} must be a positive int (or an integer array), got {value!r:.60} "
      f"of type {got}; round it, e.g. int(k)."
    )
  if steps < 1:
    raise ValueError(f"{where} must be a positive int, got {steps}.")
  return value


def _check_weight(weight: Any) -> jax.Array:
  """Checks a mini-step weight: a numeric scalar, and if concrete finite and >= 0."""
  weight = accumulators.check_weight(weight, "weight must be")
  try:
    value = float(weight)
  except jax.errors.ConcretizationTypeError:
    value = 0.0  # A traced weight cannot be checked here.
  if not 0 <= value < np.inf:
    raise ValueError(f"weight must be finite and >= 0, got {value}.")
  return weight.astype(jnp.float32)


def _cast(tree: Any, types: Any) -> Any:
  """Casts each leaf of `tree` to the dtype of the matching leaf of `types`."""
  return jax.tree.map(lambda x, t: x.astype(t.dtype), tree, types)


def _structure(tree: Any) -> str:
  text = str(jax.tree.structure(tree))
  return text if len(text) <= 200 else text[:200] + "…"


def _like_sharding(x: jax.Array, like: jax.Array) -> jax.Array:
  """Gives `x` the sharding of `like` where explicit mesh axes make them differ.

  On an explicit mesh a sharding is part of an array's type, and `where` and
  `cond` refuse operands whose shardings differ. The state's layout wins, so
  it never changes from call to call. Elsewhere the compiler places arrays and
  this does nothing.
  """
  want = jax.typeof(like).sharding
  if not want.mesh.explicit_axes or jax.typeof(x).sharding == want:
    return x
  return jax.sharding.reshard(x, want)


def _numbers_to_arrays(tree: Any, *, bools: bool) -> Any:
  """Turns Python numbers (bools too if `bools`) into arrays, for the cached jit."""

  def convert(x: Any) -> Any:
    if isinstance(x, int | float | complex) and (bools or not isinstance(x, bool)):
      return jnp.asarray(x)  # weakly typed, as the Python number traces
    return x

  return jax.tree.map(convert, tree)


class _MultiSteps:
  """What `MultiSteps` does; `MultiSteps` is the optax-facing `(init, update)`."""

  def __init__(
    self,
    opt: optax.GradientTransformation,
    every_k_schedule: EveryK,
    use_grad_mean: bool,
    should_skip_update_fn: SkipFn | None,
    accumulator_dtype: Any,
    deterministic: bool = False,
  ):
    if not isinstance(deterministic, bool | np.bool_):
      raise TypeError(f"deterministic must be True or False, got {deterministic!r}.")
    if not (
      callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None))
    ):
      raise TypeError(
        f"opt must be an optax.GradientTransformation, got {type(opt).__name__}."
      )
    if not callable(every_k_schedule):
      _check_steps(every_k_schedule, "every_k_schedule")
      if deterministic:
        _check_exact_window(every_k_schedule, "every_k_schedule")
    if should_skip_update_fn is not None and not callable(should_skip_update_fn):
      raise TypeError(
        "should_skip_update_fn must be callable or None, got "
        f"{type(should_skip_update_fn).__name__}."
      )
    self.arguments = (
      opt,
      every_k_schedule,
      use_grad_mean,
      should_skip_update_fn,
      accumulator_dtype,
      deterministic,
    )
    self._deterministic = bool(deterministic)
    self.opt = optax.with_extra_args_support(opt)
    self._every_k_schedule = every_k_schedule
    self._use_grad_mean = bool(use_grad_mean)
    self._should_skip_update_fn = should_skip_update_fn
    self._accumulator_dtype = accumulators.check_accum_dtype(
      accumulator_dtype, "accumulator_dtype"
    )
    self._update_jit = jax.jit(self._update)

  def _steps_in_window(self, gradient_step: jax.Array) -> Any:
    if not callable(self._every_k_schedule):
      return self._every_k_schedule
    steps = self._every_k_schedule(gradient_step)
    steps = _check_steps(steps, "every_k_schedule(gradient_step)")
    if self._deterministic:
      _check_exact_window(steps, "every_k_schedule(gradient_step)")
    return steps

  def _acc_dtype(self, param: Any) -> np.dtype:
    dtype = jnp.result_type(param)
    if self._accumulator_dtype is None:
      return dtype
    return jnp.promote_types(dtype, self._accumulator_dtype)

  def init(self, params: optax.Params) -> MultiStepsState:
    """Returns the state before the first mini-step: empty window, step 0.

    Every params-shaped leaf of the state has its param's sharding and device,
    so that FSDP-sharded params get a sharded accumulator from the start.
    """
    gradient_step = jnp.zeros([], jnp.int32)
    self._steps_in_window(gradient_step)  # a bad schedule fails here, not later
    skip_state = ()
    if self._should_skip_update_fn is not None:
      zeros = optax.tree.zeros_like(params)
      _, skip_state = self._should_skip_update_fn(zeros, gradient_step, params)
    # zeros_like, not zeros(shape): it keeps the param's sharding and device.
    acc_grads = jax.tree.map(lambda p: jnp.zeros_like(p, self._acc_dtype(p)), params)
    acc_weight = jnp.zeros([], jnp.float32)
    if self._deterministic:  # exact sums, in int32 slots (a window of any length)
      acc_grads = jax.tree.map(self._exact_zeros, params)
      acc_weight = exact.zeros((), jnp.float32, integers=True)
    return MultiStepsState(
      mini_step=jnp.zeros([], jnp.int32),
      gradient_step=gradient_step,
      inner_opt_state=self.opt.init(params),
      acc_grads=acc_grads,
      skip_state=skip_state,
      acc_weight=acc_weight,
      emitted=jnp.zeros([], bool),
      num_skipped=jnp.zeros([], jnp.int32),
      num_clamped=jnp.zeros([], jnp.int32),
    )

  def _exact_zeros(self, param: Any) -> exact.Acc:
    """An empty exact sum for `param`'s gradients, with its sharding and device."""
    shape = jnp.shape(param)

    def full(s, value, dtype):
      if s == shape:
        return jnp.full_like(param, value, dtype)
      return jnp.full(s, value, dtype)

    return exact.zeros(shape, self._acc_dtype(param), full, integers=True)

  def _check_state(self, state: Any, updates: optax.Updates) -> None:
    if not isinstance(state, MultiStepsState):
      fix = ""
      if isinstance(state, optax.MultiStepsState):
        fix = "; to continue an optax.MultiSteps state, pass MultiStepsState(*state)"
      raise TypeError(
        "state must be the jaccum.MultiStepsState made by this MultiSteps' init, "
        f"got {type(state).__module__}.{type(state).__qualname__}{fix}."
      )
    is_exact = exact.is_acc
    if self._deterministic != is_exact(state.acc_weight):
      raise TypeError(
        f"state must come from a MultiSteps with deterministic={self._deterministic}"
        " (its accumulator is an exact sum exactly when deterministic=True)."
      )
    structure = jax.tree.structure(state.acc_grads, is_leaf=is_exact)
    if structure != jax.tree.structure(updates):
      raise ValueError(
        "updates must have the structure of the params given to init, "
        f"{_structure(state.acc_grads)}, got {_structure(updates)}."
      )
    for (path, acc), update in zip(
      jax.tree_util.tree_flatten_with_path(state.acc_grads, is_leaf=is_exact)[0],
      jax.tree.leaves(updates),
      strict=True,
    ):
      if jnp.shape(acc.bins[0] if is_exact(acc) else acc) != jnp.shape(update):
        raise ValueError(
          f"updates{jax.tree_util.keystr(path)} must have the shape of its "
          f"param, {jnp.shape(acc)}, got {jnp.shape(update)}."
        )
    weight = state.acc_weight
    if weight is not None and not isinstance(weight, exact.Acc) and jnp.shape(weight):
      raise ValueError(
        "state.acc_weight must be a scalar (or None for a state converted from "
        f"optax), got shape {jnp.shape(weight)}."
      )
    expected = jax.eval_shape(self.opt.init, updates)
    if jax.tree.structure(state.inner_opt_state) != jax.tree.structure(expected):
      raise TypeError(
        "state.inner_opt_state must come from this MultiSteps' inner optimizer, "
        f"whose state is {_structure(expected)}, got "
        f"{_structure(state.inner_opt_state)}; pass the state its init returned."
      )

  def update(
    self,
    updates: optax.Updates,
    state: MultiStepsState,
    params: optax.Params | None = None,
    *,
    weight: Any = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, MultiStepsState]:
    """Accumulates one mini-step; on the last of a window, steps the inner optimizer.

    Args:
      updates: this mini-step's gradients, structured like the params.
      state: the state from `init` or the previous `update`, or
        `jaccum.MultiStepsState(*optax_state)` to continue an
        `optax.MultiSteps` state exactly.
      params: the current params, passed to the inner optimizer.
      weight: this mini-step's weight, e.g. its number of real tokens: the
        window's gradient is `Σ w·g / Σ w` (a total of 0 gives zeros). A
        weight of 0 contributes nothing, even if `updates` is NaN. A concrete
        weight must be finite and >= 0; a traced one cannot be checked.
      **extra_args: passed to the inner optimizer on the emitting call.

    Returns:
      `(updates, new_state)`: the inner optimizer's updates on the call that
      ends a window, exact zeros (of the same dtypes) on every other call.
    """
    self._check_state(state, updates)
    self._steps_in_window(state.gradient_step)  # checks a schedule's value
    if weight is not None:
      weight = _check_weight(weight)
    # Called eagerly, Python numbers (`value=float(loss)`, a state built by
    # hand) would keep every call off the cached jit. Bools in extra_args stay
    # Python: the inner optimizer may branch on them.
    updates, state, params = _numbers_to_arrays((updates, state, params), bools=True)
    extra_args = _numbers_to_arrays(extra_args, bools=False)
    leaves = jax.tree.leaves((updates, state, params, weight, extra_args))
    if all(isinstance(x, jax.Array | np.ndarray | np.generic) for x in leaves):
      # Through a cached jit: called eagerly, one compilation instead of a
      # fresh cond on every call; under an outer jit it is simply inlined.
      return self._update_jit(updates, state, params, weight, extra_args)
    return self._update(updates, state, params, weight, extra_args)

  def _window_so_far(
    self, state: MultiStepsState, updates: optax.Updates
  ) -> tuple[Any, jax.Array]:
    """Returns the window's accumulator and total weight.

    A state converted from optax has no recorded weight: its accumulator holds
    the running mean (or sum) of `mini_step` unweighted mini-steps, whose total
    weight is `mini_step`; it moves to the accumulator dtype here.
    """
    if isinstance(state.acc_weight, jax.Array | np.ndarray | np.generic):
      return state.acc_grads, jnp.asarray(state.acc_weight)
    acc_grads = jax.tree.map(
      lambda acc, u: acc.astype(self._acc_dtype(jnp.promote_types(acc.dtype, u.dtype))),
      state.acc_grads,
      updates,
    )
    return acc_grads, jnp.asarray(state.mini_step).astype(jnp.float32)

  def _skip(
    self, updates: optax.Updates, state: MultiStepsState, params: Any
  ) -> tuple[jax.Array, Any]:
    """`(skip, skip_state)`: whether `should_skip_update_fn` rejects this call."""
    skip, skip_state = jnp.zeros([], bool), state.skip_state
    if self._should_skip_update_fn is not None:
      skip, skip_state = self._should_skip_update_fn(
        updates, state.gradient_step, params
      )
      skip = jnp.asarray(skip)
      if (skip.dtype, skip.shape) != (np.bool_, ()):
        raise ValueError(
          "should_skip_update_fn must return a bool scalar as its first output, "
          f"got {skip.dtype}{list(skip.shape)}."
        )
    return skip, skip_state

  def _exact_update(
    self,
    updates: optax.Updates,
    state: MultiStepsState,
    params: optax.Params | None,
    weight: jax.Array | None,
    extra_args: dict[str, Any],
  ) -> tuple[optax.Updates, MultiStepsState]:
    """`_update` with the window summed exactly (`deterministic=True`).

    Each accepted mini-step adds `w·g` (`g` without weights) to exact sums
    (`exact`): the window's mean is the same bits in any order of its
    mini-steps, and equals `accumulate(..., deterministic=True)` over the same
    micro-batch gradients. A window ends at `exact.MAX_TERMS` mini-steps
    (counted in `num_clamped` when the schedule asked for more), so its int32
    bins never wrap.
    """
    asked = self._steps_in_window(state.gradient_step)
    steps = jnp.minimum(asked, exact.MAX_TERMS)
    skip, skip_state = self._skip(updates, state, params)
    accepted = jnp.logical_not(skip)
    adds = accepted if weight is None else accepted & (weight != 0)
    weight = jnp.ones([], jnp.float32) if weight is None else weight
    weight = jnp.where(adds, weight, 0)  # 0 adds nothing, NaN gradients too
    empty = state.mini_step == 0

    def added(acc: exact.Acc, terms: jax.Array, weight: Any = None) -> exact.Acc:
      # An empty window starts from nothing, whatever the state holds.
      fresh = jax.tree.map(
        lambda old, new: jnp.where(empty, new, old), acc, exact.empty_like(acc)
      )
      return exact.add(fresh, terms, weight)

    acc_grads = jax.tree.map(
      lambda acc, g: added(acc, g, weight),
      state.acc_grads,
      updates,
      is_leaf=exact.is_acc,
    )
    assert isinstance(state.acc_weight, exact.Acc)  # checked by _check_state
    total = added(state.acc_weight, weight)

    def emit_branch(acc_grads, inner_state, params):
      def mean(acc, update):
        summed = exact.divide(acc, total) if self._use_grad_mean else exact.value(acc)
        return summed.astype(update.dtype)

      grads = jax.tree.map(mean, acc_grads, updates, is_leaf=exact.is_acc)
      new_updates, new_inner = self.opt.update(grads, inner_state, params, **extra_args)
      new_inner = jax.tree.map(
        lambda new, old: new.astype(jnp.result_type(old)), new_inner, inner_state
      )
      return _cast(new_updates, updates), new_inner

    def keep_branch(acc_grads, inner_state, params):
      del acc_grads, params
      return jax.tree.map(jnp.zeros_like, updates), inner_state

    emit = accepted & (state.mini_step + 1 >= steps)
    new_updates, inner_opt_state = jax.lax.cond(
      emit, emit_branch, keep_branch, acc_grads, state.inner_opt_state, params
    )
    return new_updates, MultiStepsState(
      mini_step=jnp.where(emit, 0, state.mini_step + accepted.astype(jnp.int32)),
      gradient_step=jnp.where(
        emit, optax.safe_increment(state.gradient_step), state.gradient_step
      ),
      inner_opt_state=inner_opt_state,
      acc_grads=acc_grads,
      skip_state=skip_state,
      acc_weight=total,
      emitted=emit,
      num_skipped=state.num_skipped + skip.astype(jnp.int32),
      num_clamped=state.num_clamped + (emit & (asked > steps)).astype(jnp.int32),
    )

  def _update(
    self,
    updates: optax.Updates,
    state: MultiStepsState,
    params: optax.Params | None,
    weight: jax.Array | None,
    extra_args: dict[str, Any],
  ) -> tuple[optax.Updates, MultiStepsState]:
    if self._deterministic:
      return self._exact_update(updates, state, params, weight, extra_args)
    acc_grads, acc_weight = self._window_so_far(state, updates)
    steps = self._steps_in_window(state.gradient_step)
    skip, skip_state = self._skip(updates, state, params)
    accepted = jnp.logical_not(skip)
    adds = accepted
    if weight is None:
      weight = jnp.ones([], jnp.float32)
    else:
      adds = accepted & (weight != 0)  # `where`, not a product: NaN·0 is NaN
    window_empty = state.mini_step == 0
    total = jnp.where(window_empty, 0, acc_weight) + jnp.where(adds, weight, 0)

    def accumulate(acc, grad):
      # An empty window starts from 0 whatever the buffer holds: after a window
      # ends it holds that call's updates (the buffer is reused), NaN included.
      # Resetting here rather than on the emitting call saves a params-sized
      # buffer and a pass over it.
      acc = jnp.where(window_empty, 0, acc)
      grad, scale = (
        _like_sharding(grad.astype(acc.dtype), acc),
        weight.astype(acc.dtype),
      )
      if self._use_grad_mean:  # a running mean, as optax keeps in acc_grads
        scale = scale / jnp.where(total != 0, total, 1).astype(acc.dtype)
        new = acc + scale * (grad - acc)
      else:
        new = acc + scale * grad
      return jnp.where(adds, new, acc)

    # Accumulating outside the cond lets each gradient die as soon as it is
    # added, instead of all of them living until the cond ends.
    acc_grads = jax.tree.map(accumulate, acc_grads, updates)
    grad_types = jax.tree.map(lambda u: jax.ShapeDtypeStruct(u.shape, u.dtype), updates)

    def inner_step(acc, inner_state, params):
      return self.opt.update(_cast(acc, grad_types), inner_state, params, **extra_args)

    update_types, _ = jax.eval_shape(
      inner_step, acc_grads, state.inner_opt_state, params
    )
    if jax.tree.structure(update_types) != jax.tree.structure(acc_grads) or any(
      u.shape != g.shape
      for u, g in zip(
        jax.tree.leaves(update_types), jax.tree.leaves(grad_types), strict=True
      )
    ):
      raise TypeError(
        "opt.update must return updates shaped like its gradients, "
        f"{_structure(acc_grads)}, got {_structure(update_types)}."
      )
    # One buffer, the "carrier", leaves the cond and becomes acc_grads: the
    # new updates when the window ends, the untouched accumulator otherwise.
    # Neither branch makes a params-sized array, so with donated state XLA
    # runs the whole call in place; `where` below zeroes the updates of a
    # call that does not end a window.
    carrier_types = jax.tree.map(
      lambda u, a: jax.ShapeDtypeStruct(u.shape, jnp.promote_types(u.dtype, a.dtype)),
      update_types,
      acc_grads,
    )

    def emit_branch(acc, inner_state, params):
      new_updates, new_inner_state = inner_step(acc, inner_state, params)
      # Keep the inner state's dtypes, as optax does: gradients narrower than
      # the params (bf16 grads, f32 params) would change those of Adam's moments.
      new_inner_state = jax.tree.map(
        lambda new, old: _like_sharding(new.astype(jnp.result_type(old)), old),
        new_inner_state,
        inner_state,
      )
      new_updates = jax.tree.map(_like_sharding, _cast(new_updates, carrier_types), acc)
      return new_updates, new_inner_state

    def keep_branch(acc, inner_state, params):
      del params
      return _cast(acc, carrier_types), inner_state

    emit = accepted & (state.mini_step + 1 >= steps)
    carrier, inner_opt_state = jax.lax.cond(
      emit, emit_branch, keep_branch, acc_grads, state.inner_opt_state, params
    )
    new_updates = jax.tree.map(
      lambda c, t: jnp.where(emit, c, 0).astype(t.dtype), carrier, update_types
    )
    new_state = MultiStepsState(
      mini_step=jnp.where(emit, 0, state.mini_step + accepted.astype(jnp.int32)),
      gradient_step=jnp.where(
        emit, optax.safe_increment(state.gradient_step), state.gradient_step
      ),
      inner_opt_state=inner_opt_state,
      acc_grads=_cast(carrier, acc_grads),
      skip_state=skip_state,
      acc_weight=jnp.where(emit, 0, total),
      emitted=emit,
      num_skipped=state.num_skipped + skip.astype(jnp.int32),
      num_clamped=state.num_clamped,
    )
    return new_updates, new_state


@jax.tree_util.register_static  # a configuration, not data: no leaves
class MultiSteps(optax.GradientTransformationExtraArgs):
  """Accumulates gradients over several `update` calls; steps `opt` once per window.

  A drop-in for `optax.MultiSteps`, with the same arguments, state fields and
  methods. Each call to `update` takes the gradients of one micro-batch (one
  "mini-step"); after `every_k_schedule(gradient_step)` accepted mini-steps the
  window ends, the inner optimizer runs once on their mean and its updates are
  returned. Every other call returns exact zeros. What a call computes::

    def update(g, state, params, weight=1, **extra_args):
      if should_skip_update_fn(g, gradient_step, params): return zeros  # counted
      acc, total = acc + weight * g, total + weight   # kept as a running mean
      if the window now holds every_k_schedule(gradient_step) mini-steps:
        updates, inner = opt.update(acc / total, inner, params, **extra_args)
        acc, total = 0, 0         # by `where` on the next call, not `0 * acc`
        return updates
      return zeros

  Unlike `optax.MultiSteps`, `opt.update` runs only on the call that ends a
  window (in a `lax.cond`; under `vmap` over states at different mini-steps
  the cond becomes a select that computes both sides, still correct), so K
  mini-steps cost one inner step. The conditional hands one buffer through,
  holding the accumulator or the updates, and the next window resets it, so
  with donated state `update` neither copies nor allocates a params-sized
  array. Since `opt` sees only the window's mean, anything in it (clipping, a
  schedule, Adam's count) acts once per window, on the mean gradient.

  A `MultiSteps` is itself an `optax.GradientTransformationExtraArgs`, the
  tuple `(init, update)`, so inside `optax.chain` its `weight=` and the inner
  optimizer's extra arguments still arrive. The state's params-shaped leaves
  take the params' sharding and device, as optax's do (FSDP stays sharded).

  Args:
    opt: the inner optimizer, any `optax.GradientTransformation`; it goes
      through `optax.with_extra_args_support`, so `update`'s extra keyword
      arguments (e.g. `value=` for `optax.lbfgs`) reach it on the emitting call.
    every_k_schedule: the mini-steps per window, a positive int, or a function
      of `gradient_step` returning one (an integer array under `jit`; a traced
      value below 1 acts as 1).
    use_grad_mean: if True the inner optimizer gets the (weighted) mean of the
      window's gradients, otherwise their (weighted) sum.
    should_skip_update_fn: `fn(updates, gradient_step, params) -> (skip,
      skip_state)`, e.g. `optax.skip_not_finite`; a skipped call changes nothing
      but `skip_state` and `num_skipped`, and returns zeros.
    accumulator_dtype: floating params narrower than this (bf16) accumulate in
      it; wider ones in their own dtype; `None` keeps the params' dtypes.
      For large K: the float32 window mean's rounding error grows about as
      √K, as optax's does (relative rms error 2.5e-7 at K=256, 1e-6 at
      K=4096); accumulating bf16 in bf16 (`None`) stops adding a mini-step
      once its share of the mean falls below bf16's resolution (4% rms, 17%
      in the worst entry at K=4096). Measured by
      `benchmarks/multisteps_precision.py`; see the MultiSteps guide.
    deterministic: sum each window exactly (`accumulate`'s
      `deterministic=True`, in int32 bins): its (weighted) mean is the same
      bits in any order of its mini-steps, and the same as `accumulate(...,
      deterministic=True)` over the same micro-batch gradients (bit for bit
      when they are: `accumulate` writes the micro-step's divisions by traced
      values as products with reciprocals, a plain `jax.grad` does not).
      `acc_grads` and `acc_weight` then hold exact sums (three int32 per
      parameter); a state of `optax.MultiSteps` does not continue here. At
      most 2¹⁵ - 1 mini-steps a window, what the bins hold: a longer int
      window is a ValueError here, and so is a schedule's value wherever it
      is read outside `jit` (`init`, eager calls); a schedule traced under
      `jit` that asks for more ends the window at 2¹⁵ - 1 (its exact mean),
      counted in `state.num_clamped`. Not differentiable (a TypeError says
      so). See the guide "Reproducible and elastic accumulation".

  Raises:
    TypeError, ValueError: for a bad argument, naming it, what was expected and
      what was received; `update` also checks `weight` and the state.

  Examples:
    >>> import jax.numpy as jnp, optax, jaccum
    >>> opt = jaccum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = opt.init(params)
    >>> for g in (1.0, 3.0):
    ...   updates, state = opt.update({"w": jnp.full(2, g)}, state, params)
    ...   print(updates["w"], bool(opt.has_updated(state)))
    [0. 0.] False
    [-0.2 -0.2] True

    In a chain, `weight=` reaches it (here: the weighted mean 2.5 = (1 + 3·3)/4):

    >>> chained = optax.chain(optax.identity(), opt)
    >>> state = chained.init(params)
    >>> for g, w in ((1.0, 1), (3.0, 3)):
    ...   updates, state = chained.update({"w": jnp.full(2, g)}, state, weight=w)
    >>> print(updates["w"])
    [-0.25 -0.25]

  Methods:
    init(params): Returns the `MultiStepsState` before the first mini-step:
      an empty window at gradient step 0. Every params-shaped leaf of the
      state has its param's sharding and device.
    update(updates, state, params=None, *, weight=None, **extra_args): Adds
      one mini-step's gradients `updates` to the window and returns
      `(updates, new_state)`: the inner optimizer's updates on the call that
      ends a window, exact zeros of the same dtypes on every other call.
      `state` comes from `init` or the previous `update` (or is
      `jaccum.MultiStepsState(*optax_state)`, to continue an
      `optax.MultiSteps` state exactly); `params` go to the inner optimizer.
      `weight` is this mini-step's weight, e.g. its number of real tokens:
      the window's gradient is `Σ w·g / Σ w` (a total of 0 gives zeros), and
      a weight of 0 contributes nothing, even if `updates` is NaN; a concrete
      weight must be finite and >= 0. `extra_args` reach the inner optimizer
      on the emitting call. Called outside `jit`, it runs through one cached
      `jit` of its own.
  """

  _window: _MultiSteps

  def __new__(
    cls,
    opt: optax.GradientTransformation,
    every_k_schedule: EveryK,
    use_grad_mean: bool = True,
    should_skip_update_fn: SkipFn | None = None,
    accumulator_dtype: Any = jnp.float32,
    deterministic: bool = False,
  ) -> MultiSteps:
    window = _MultiSteps(
      opt,
      every_k_schedule,
      use_grad_mean,
      should_skip_update_fn,
      accumulator_dtype,
      deterministic,
    )
    # The ignore: `update` narrows optax's `OptState` to MultiStepsState.
    self = super().__new__(cls, window.init, window.update)  # pyright: ignore[reportArgumentType]
    self._window = window
    return self

  def __getnewargs__(self) -> tuple[Any, ...]:
    # copy and pickle rebuild from the constructor's arguments, not (init, update).
    return self._window.arguments

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped optimizer, with extra-argument support.

    Examples:
      >>> import jax.numpy as jnp, optax, jaccum
      >>> opt = jaccum.MultiSteps(optax.adam(1e-3), every_k_schedule=4)
      >>> state = opt.init({"w": jnp.zeros(3)})
      >>> inner_state = opt.inner_opt.init({"w": jnp.zeros(3)})
      >>> type(state.inner_opt_state) == type(inner_state)
      True
    """
    return self._window.opt

  def has_updated(self, state: MultiStepsState) -> jax.Array:
    """Whether the call that returned `state` applied the inner optimizer.

    A bool scalar array: true exactly on the calls that returned the inner
    optimizer's updates, false after a call that only accumulated or that
    `should_skip_update_fn` skipped.

    Examples:
      >>> import jax.numpy as jnp, optax, jaccum
      >>> opt = jaccum.MultiSteps(optax.sgd(0.1), every_k_schedule=3)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = opt.init(params)
      >>> emitted = []
      >>> for _ in range(6):
      ...   _, state = opt.update({"w": jnp.ones(2)}, state, params)
      ...   emitted.append(bool(opt.has_updated(state)))
      >>> emitted
      [False, False, True, False, False, True]
    """
    return jnp.asarray(state.emitted)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """Returns `(init, update)` as a plain optax transformation (as optax does).

    A `MultiSteps` is one already; this is for code written for
    `optax.MultiSteps`, whose instances are not.

    Examples:
      >>> import jax.numpy as jnp, optax, jaccum
      >>> opt = jaccum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
      >>> tx = opt.gradient_transformation()
      >>> isinstance(tx, optax.GradientTransformationExtraArgs)
      True
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> updates, state = tx.update({"w": jnp.ones(2)}, state)
      >>> int(state.mini_step)
      1
    """
    return optax.GradientTransformationExtraArgs(self.init, self.update)

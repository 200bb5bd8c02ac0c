"""`dp_value_and_grad`: DP-SGD's clipped, noised gradient, accumulated.

Each micro-step returns its micro-batch's clipped sum (`clipping`): the
examples' gradients clipped one by one, summed, with the sum of the losses,
the number of real examples and the per-example norms. The ordinary loop
sums them (`reduce="sum"`, exact with `deterministic=True`), the one
reduction over devices adds the devices' sums (`data_parallel`, `mesh=`,
`axis_name` come with it), and the noise is drawn once, after it, on the
whole gradient's shape: the same noise for a key on any number of devices.
The front's keywords become a frozen `PrivateOptions` when it is called;
`accumulate`'s options among them become its `Options`, checked as
`accumulate` checks them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaccum._core import clipping as clipping_lib
from jaccum._core.microbatch import check_batch
from jaccum._core.step import Function
from jaccum._routes import arguments, plan
from jaccum._routes import options as options_lib

NORMS = ("auto", "vmap")

# accumulate's options that dp_value_and_grad sets itself, and why.
_FIXED = {
  "reduce": "the clipped gradients are summed and the loss averaged over the "
  "real examples",
  "weight_fn": "each real example counts once, as the privacy accounting assumes "
  "(mark padding with example_mask)",
  "grad_leaves": "the gradients are those of the params, argument 0",
  "state_argnum": "state threaded through the batch (BatchNorm statistics) couples "
  "the examples, so that no example's gradient is its own",
  "return_stats": "the noise scale of clipped gradients measures the clipping",
  "reduce_fn": "the noise is calibrated to the exact sum of clipped gradients; "
  "a compressed sum has another sensitivity",
}
_MESH = ("mesh", "axis", "param_specs", "fsdp_mode")


@dataclasses.dataclass(frozen=True)
class PrivateOptions:
  """`dp_value_and_grad`'s options, checked.

  Attributes:
    clipping: the micro-step's pieces (the loss, C, the norms' path).
    noise_multiplier: σ; the noise's standard deviation is σ·C.
    normalize_by: what the noised sum is divided by (None: the batch's rows).
    accumulate: the loop's `Options` (its function and positions set per call).
  """

  clipping: clipping_lib.Clipping
  noise_multiplier: float
  normalize_by: float | None
  accumulate: options_lib.Options

  def replace(self, **changes: Any) -> PrivateOptions:
    return dataclasses.replace(self, **changes)


def _number(value: Any, name: str, *, positive: bool) -> float:
  bound = "> 0" if positive else ">= 0"
  if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
    raise TypeError(
      f"{name} must be a Python number {bound}, got {value!r} of type "
      f"{type(value).__name__}; it is fixed when the step is built."
    )
  value = float(value)
  if not math.isfinite(value) or value < 0 or (positive and value == 0):
    raise ValueError(f"{name} must be a finite number {bound}, got {value}.")
  return value


def _norms(norms: Any) -> str:
  if norms not in NORMS:
    raise ValueError(f"norms must be one of {NORMS}, got {norms!r}.")
  return norms


def _accumulate_options(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  batch_argnums: Any,
  options: dict[str, Any],
) -> options_lib.Options:
  for name, why in _FIXED.items():
    if name in options:
      raise TypeError(
        f"{name} is not an option of dp_value_and_grad: {why}. Leave it out."
      )
  on_mesh = None
  if any(name in options for name in _MESH):
    mesh = {name: options.pop(name) for name in _MESH if name in options}
    on_mesh = options_lib.on_mesh(
      mesh.get("mesh"),
      mesh.get("axis", "data"),
      mesh.get("param_specs"),
      mesh.get("fsdp_mode", "gather_once"),
      options,
    )
  made = options_lib.make(
    loss_fn, num_microbatches, batch_argnums=batch_argnums, on_mesh=on_mesh, **options
  )
  if 0 in made.batch_argnums:
    raise ValueError(
      f"batch_argnums={batch_argnums!r} includes 0, the params' position: "
      "loss_fn(params, batch, *rest) differentiates argument 0."
    )
  return made


def make_options(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  l2_clip_norm: Any,
  noise_multiplier: Any,
  normalize_by: Any,
  batch_argnums: Any,
  norms: Any,
  return_norms: Any,
  options: dict[str, Any],
) -> PrivateOptions:
  """Every keyword of `dp_value_and_grad`, converted and checked once."""
  options_lib.function_of(loss_fn, "loss_fn")  # callable, or a TypeError
  accumulate = _accumulate_options(loss_fn, num_microbatches, batch_argnums, options)
  clipping = clipping_lib.Clipping(
    loss_fn=loss_fn,
    clip_norm=_number(l2_clip_norm, "l2_clip_norm", positive=True),
    norms=_norms(norms),
    return_norms=options_lib.check_bool(return_norms, "return_norms"),
    accum_dtype=accumulate.accum_dtype,
  )
  return PrivateOptions(
    clipping,
    _number(noise_multiplier, "noise_multiplier", positive=False),
    None
    if normalize_by is None
    else _number(normalize_by, "normalize_by", positive=True),
    accumulate,
  )


def _mask(example_mask: Any, rows: int) -> Any:
  """The mask of real rows, checked: `[rows]`, bool or numbers (nonzero: real)."""
  if example_mask is None:
    return jnp.ones(rows, bool)
  shape = getattr(example_mask, "shape", None)
  dtype = getattr(example_mask, "dtype", None)
  if (
    shape != (rows,)
    or dtype is None
    or not (jnp.issubdtype(dtype, jnp.bool_) or jnp.issubdtype(dtype, jnp.number))
  ):
    got = type(example_mask).__name__ if shape is None else f"shape {shape} {dtype}"
    raise ValueError(
      f"example_mask must be one bool per row of the batch, shape ({rows},) "
      f"(True for real examples, False for padding), got {got}."
    )
  return example_mask


def _check_key(noise_key: Any, sigma: float) -> None:
  if noise_key is None:
    if sigma > 0:
      raise ValueError(
        f"noise_key is missing: with noise_multiplier={sigma} > 0 the noise is "
        "drawn from it. Pass noise_key=jax.random.key(seed) (a fresh key each "
        "step), or noise_multiplier=0 for no noise."
      )
    return
  if not arguments.is_key(noise_key):
    got = getattr(noise_key, "aval", None) or type(noise_key).__name__
    raise TypeError(
      f"noise_key must be a PRNG key (jax.random.key or jax.random.PRNGKey), got {got}."
    )


def _devices(axes: Sequence[str] | None) -> int:
  """The devices a batch inside the user's `shard_map` is split over (1 outside)."""
  return 1 if axes is None else math.prod(jax.lax.axis_size(a) for a in axes)


def noised(
  summed: Any, params: Any, noise_key: Any, std: float, normalize_by: Any
) -> Any:
  """`(Σ + N(0, std²)) / normalize_by` per leaf, cast to the params' dtypes.

  The noise is drawn on each leaf's whole shape from its own fold of the
  key, so it is the same however the sum was reduced over devices.
  """
  leaves, treedef = jax.tree.flatten(summed)
  kinds = jax.tree.leaves(params)
  if std > 0:
    keys = jax.random.split(noise_key, len(leaves))
    leaves = [
      s + std * jax.random.normal(k, s.shape, s.dtype)
      for s, k in zip(leaves, keys, strict=True)
    ]
  out = [
    (s / jnp.asarray(normalize_by, s.dtype)).astype(p.dtype)
    for s, p in zip(leaves, kinds, strict=True)
  ]
  return jax.tree.unflatten(treedef, out)


def _positions(options: options_lib.Options, args: Sequence[Any]) -> tuple[Any, Any]:
  at = arguments.positions(options.batch_argnums, options.rng_argnum, None, args)
  if 0 in at.batch or at.rng == 0:
    raise ValueError(
      "batch_argnums and rng_argnum must not resolve to 0, the params' position: "
      f"batch_argnums={options.batch_argnums}, rng_argnum={options.rng_argnum} "
      f"with {len(args)} positional arguments."
    )
  return at.batch, at.rng


def run(
  options: PrivateOptions,
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  noise_key: Any,
  example_mask: Any,
  num_real_microbatches: Any,
) -> Any:
  """One call: the micro-steps' sums, reduced, then noised and normalised."""
  if not args:
    raise TypeError("called without arguments; call f(params, batch, *rest).")
  base = options.accumulate
  batch, key = _positions(base, args)
  clipping_lib.check_params(args[0])
  rows = check_batch(
    [args[i] for i in batch], base.num_microbatches, names=[f"args[{i}]" for i in batch]
  )
  mask = _mask(example_mask, rows)
  _check_key(noise_key, options.noise_multiplier)
  layout = clipping_lib.Layout(batch, key)
  step = clipping_lib.micro_step(options.clipping, layout)
  extra = ("concat",) if options.clipping.return_norms else ()
  this = base.replace(
    function=Function(step),
    batch_argnums=(*batch, len(args)),
    rng_argnum=key,
    reduce=("sum", "sum", "sum", *extra),
    grad_leaves=(False, False, True, *(False,) * len(extra)),
  )
  out = plan.run(this, plan.Call((*args, mask), kwargs, num_real_microbatches))
  loss_sum, count, summed, *norms = out
  normalize_by = options.normalize_by
  if normalize_by is None:
    normalize_by = rows * _devices(base.axis_name)
  std = options.noise_multiplier * options.clipping.clip_norm
  grads = noised(summed, args[0], noise_key, std, normalize_by)
  loss = jnp.where(count > 0, loss_sum / jnp.maximum(count, 1), 0)
  return (loss, grads, *norms)


def dp_value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  l2_clip_norm: float,
  noise_multiplier: float,
  normalize_by: float | None = None,
  batch_argnums: int | Sequence[int] = 1,
  norms: str = "auto",
  return_norms: bool = False,
  **options: Any,
) -> Callable[..., Any]:
  """DP-SGD's gradient: per-example clipping in the loop, Gaussian noise once.

  `loss_fn(params, batch, *rest)` returns one loss per example (shape
  `[rows]`). The returned function computes, over the real examples i of
  all K micro-batches (and all devices)::

    grads = (Σ_i clip_C(∇ℓ_i) + N(0, σ²C²)) / normalize_by
    loss = mean_i ℓ_i

  with `clip_C(g) = g · min(1, C / ‖g‖)`, the norm taken over every leaf of
  the params. Each micro-step clips its own examples and sums them; the
  loop sums the micro-batches (exactly with `deterministic=True`), the
  devices' sums are added once, and the noise is drawn once after that, on
  each gradient leaf's whole shape: for a given key, the same noise on any
  number of devices (with `deterministic=True`, the same bits whatever K
  and the devices, for the same global batch).

  Per-example norms. `norms="vmap"` materialises every example's gradient
  (`jax.vmap` of `jax.grad`: the reference). `"auto"` reads the loss's
  program for one example and takes each example's squared norm from the
  activations and output cotangents of the batched backward pass, for the
  uses that dominate models: a parameter that reaches the loss through one
  `dot_general` (matmuls, `einsum`), convolution or embedding gather (after
  transposes, reshapes, casts). Per use, it keeps each example's product
  `a_iᵀ g_i` (the use's own weight gradient, not summed over examples)
  where that is no larger than twice the activations and cotangents the
  backward pass holds for the use anyway, and its weighted sum is the
  clipped sum; elsewhere (wide layers over few positions) it takes the
  ghost norm, Gram matrices over the positions (Li et al. 2021; the choice
  per use is mixed ghost clipping's, Bu et al. 2022), and the clipped sum
  is the weight gradient of the cotangents reweighted (book-keeping, Bu et
  al. 2023). `python -m benchmarks --parts private` measures both paths
  (the guide "Differential privacy" has the table). Other parameters
  (biases, norm scales, a parameter used twice such as a tied embedding, or
  used inside a `scan`) get their per-example gradients from that same
  backward pass, alone. No per-example gradient of the whole
  model is formed; sharding constraints in the model are read as values.

  Padding and Poisson sampling. `example_mask` marks the real rows: a
  padding row adds nothing to the norms, the sum or the loss. With
  `num_real_microbatches=n` only the first n micro-batches run, as in
  `accumulate` (name the split: `split="contiguous"` runs the first n·N/K
  rows, for a batch padded at its end); the rows of those that are padding
  still need the mask. One compilation serves every batch size up to K ×
  rows.

  Args:
    loss_fn: `loss_fn(params, batch, *rest, **kwargs) -> [rows]` floating
      losses, one per example; examples must not interact (no batch
      statistics).
    num_microbatches: K, as for `accumulate`.
    l2_clip_norm: C > 0, the bound on each example's gradient norm.
    noise_multiplier: σ >= 0; the noise's standard deviation is σ·C.
    normalize_by: the noised sum is divided by it; None divides by the
      number of rows given (padding included): under Poisson sampling pass
      the expected batch size.
    batch_argnums: the positional arguments holding the batch (not 0).
    norms: `"auto"` or `"vmap"` (above).
    return_norms: also return each example's gradient norm (before
      clipping; 0 on padding rows and rows not run), shape `[rows]`.
    **options: `accumulate`'s options (`accum_dtype`, `rng_argnum`: each
      example gets `fold_in(micro-batch key, row)`, `split`, `axis_name`,
      `deterministic`, `unroll`, `conv_rewrite`, `overlap_reduction`,
      `reduce_dtype`), and `data_parallel`'s (`mesh`, `axis`,
      `param_specs`, `fsdp_mode`): any of these runs it as `data_parallel`
      does. `reduce`, `weight_fn`, `grad_leaves`, `state_argnum`,
      `return_stats` and `reduce_fn` are set by this function and refused.

  Returns:
    `f(params, batch, *rest, noise_key=None, example_mask=None,
    num_real_microbatches=None, **kwargs) -> (loss, grads)`, or `(loss,
    grads, norms)` with `return_norms`; `grads` has the params' structure and
    dtypes (sums are made in `accum_dtype`, float32 by default). `noise_key`
    is needed when σ > 0; draw a fresh one every step.

  Raises:
    TypeError, ValueError: when called, for a bad option (the message names
      it); when `f` is traced, for a `loss_fn` that does not return one loss
      per example, a mask of the wrong shape, a missing `noise_key`.

  Examples:
    >>> import jax, jax.numpy as jnp, jaccum
    >>> def loss_fn(w, batch):  # one loss per example
    ...   return (batch["x"] @ w - batch["y"]) ** 2
    >>> w = jnp.zeros(3)
    >>> batch = {"x": jnp.arange(24.0).reshape(8, 3) / 10, "y": jnp.ones(8)}
    >>> step = jax.jit(jaccum.dp_value_and_grad(
    ...   loss_fn, 4, l2_clip_norm=1.0, noise_multiplier=0.0))
    >>> loss, grads = step(w, batch)
    >>> per_example = jax.vmap(jax.grad(lambda w, x, y: (x @ w - y) ** 2),
    ...                        (None, 0, 0))(w, batch["x"], batch["y"])
    >>> norms = jnp.linalg.norm(per_example, axis=1)
    >>> clipped = per_example * jnp.minimum(1, 1.0 / norms)[:, None]
    >>> bool(jnp.allclose(grads, clipped.sum(0) / 8))
    True

  References:
    Abadi et al. 2016, Deep learning with differential privacy (DP-SGD).
    Goodfellow 2015, Efficient per-example gradient computations.
    Li et al. 2021, Large language models can be strong differentially
    private learners (ghost clipping).
    Bu et al. 2022, Scalable and efficient training of large convolutional
    neural networks with differential privacy (mixed ghost clipping);
    Bu et al. 2023, Differentially private optimization on large model at
    small cost (book-keeping).
  """
  private = make_options(
    loss_fn,
    num_microbatches,
    l2_clip_norm=l2_clip_norm,
    noise_multiplier=noise_multiplier,
    normalize_by=normalize_by,
    batch_argnums=batch_argnums,
    norms=norms,
    return_norms=return_norms,
    options=options,
  )

  def private_step(
    *args: Any,
    noise_key: Any = None,
    example_mask: Any = None,
    num_real_microbatches: Any = None,
    **kwargs: Any,
  ) -> Any:
    return run(private, args, kwargs, noise_key, example_mask, num_real_microbatches)

  return private_step

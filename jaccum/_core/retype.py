"""A function that closes over arrays on the mesh, run per device under `shard_map`.

On an explicit mesh JAX refuses a `shard_map` whose body uses an array the
body closes over: the array is typed on the mesh outside, the body's values
with the manual axes, and no primitive takes both ("Closing over inputs to
shard_map where the input is sharded on `Explicit` axes is not
implemented"). The same meeting on an auto mesh fails later, where JAX
differentiates a loop that closes over such a value ("Context mesh ...
should match the mesh of sharding").

The per-device loop and the pipeline trace the user's function inside their
`shard_map`. Where that fails, `lift` traces it again in the mesh's own
context, on what one device holds (the body's shapes, typed without the
manual axes): its closed-over arrays become the program's constants
(`Outside`), and `Retrace` asks the caller to run the `shard_map` again with
them as inputs. Inside, `Outside.program` runs the program equation by
equation, with every sharding it records retyped to the body's mesh: the
manual axes dropped from each spec (each device holds its rows already),
the other axes (a tensor-parallel `"model"`) kept. Nested programs (jit,
scan, cond, while, remat, custom derivatives) are retyped the same way, by
tracing their retyped evaluation on their retyped input types. The function
itself is not traced again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jaccum._core.rewrites import without_axes

P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding


def is_hoisted(const: Any) -> bool:
  """Whether a constant of a traced function must cross into `shard_map`.

  Values traced outside it, and arrays placed on a mesh (typed on it). Other
  arrays (NumPy constants, arrays on one device) are the same everywhere and
  stay in the program, as they can inside any `shard_map`.
  """
  if isinstance(const, Tracer):
    return True
  if not isinstance(const, jax.Array):
    return False
  mesh = getattr(getattr(jax.typeof(const), "sharding", None), "mesh", None)
  return mesh is not None and not mesh.empty


class Outside(NamedTuple):
  """A function traced outside `shard_map`, to run inside it.

  Attributes:
    closed: the program, typed on the mesh outside, on one device's shapes.
    hoisted: the indices of its constants that cross into `shard_map` as
      inputs (`consts`).
    out_tree: the structure of the function's output.
  """

  closed: ClosedJaxpr
  hoisted: tuple[int, ...]
  out_tree: Any

  @property
  def consts(self) -> list[Any]:
    return [self.closed.consts[i] for i in self.hoisted]

  def program(self, consts: Sequence[Any]) -> Callable[..., Any]:
    """The function, run inside `shard_map` with `consts` as it hands them in.

    It takes the flat array inputs the function was traced on and returns
    the function's output tree.
    """
    values = list(self.closed.consts)
    for i, value in zip(self.hoisted, consts, strict=True):
      values[i] = value

    def run(*args: Any) -> Any:
      flat = _Retyper().evaluate(self.closed.jaxpr, values, jax.tree.leaves(args))
      return jax.tree.unflatten(self.out_tree, flat)

    return run


class Retrace(Exception):
  """Raised while tracing a `shard_map`'s body: run it again, lifted.

  Attributes:
    outside: the functions traced outside, whose constants must become
      inputs of the `shard_map`.
    cause: the error that tracing inside raised.
  """

  def __init__(self, outside: list[Outside], cause: Exception | None):
    super().__init__(f"run again with the closed-over arrays as inputs ({cause})")
    self.outside = outside
    self.cause = cause


def lift(
  fn: Callable[..., Any], examples: Sequence[Any], mesh: Any, cause: Exception
) -> Outside:
  """`fn` traced in `mesh`'s context on the shapes of `examples`.

  `examples` are values inside the `shard_map` (or their shapes), trees of
  them as `fn` takes them: each is typed on `mesh` with its own spec less
  the manual axes. Raises `cause` if `fn` does not trace there either.
  """
  abstract = mesh.abstract_mesh
  inside = jax.sharding.get_abstract_mesh()
  manual = tuple(getattr(inside, "manual_axes", ()))
  shapes = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      np.shape(x),
      x.dtype,
      sharding=NamedSharding(abstract, without_axes(_spec(x), manual)),
    ),
    list(examples),
  )
  try:
    with jax.sharding.use_abstract_mesh(abstract):
      closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*shapes)
  except Exception as error:
    raise cause from error
  hoisted = tuple(i for i, c in enumerate(closed.consts) if is_hoisted(c))
  return Outside(closed, hoisted, jax.tree.structure(out_shape))


def _spec(x: Any) -> P:
  typed = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  spec = getattr(getattr(typed, "sharding", None), "spec", None)
  return P(*spec) if spec is not None else P()


class _Retyper:
  """Evaluates an outside program inside `shard_map`, types made the body's."""

  def __init__(self) -> None:
    self.mesh = jax.sharding.get_abstract_mesh()
    self.manual = tuple(getattr(self.mesh, "manual_axes", ()))

  def sharding(self, sharding: Any) -> Any:
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(sharding, NamedSharding) or mesh is None or mesh.empty:
      return sharding
    return NamedSharding(self.mesh, without_axes(sharding.spec, self.manual))

  def param(self, value: Any) -> Any:
    """An equation's parameter, retyped: shardings, meshes, nested programs."""
    if isinstance(value, NamedSharding):
      return self.sharding(value)
    if isinstance(value, jax.sharding.AbstractMesh | jax.sharding.Mesh):
      return self.mesh if not value.empty else value
    if isinstance(value, ClosedJaxpr):
      return self.program(value)
    if isinstance(value, Jaxpr):
      retyped = self.program(ClosedJaxpr(value, []))
      if retyped.consts:
        raise NotImplementedError("a nested program made constants when retyped")
      return retyped.jaxpr
    if type(value) is tuple:  # not a NamedTuple of numbers (gather's dimensions)
      return tuple(self.param(v) for v in value)
    return value

  def shape(self, aval: Any) -> Any:
    sharding = getattr(aval, "sharding", None)
    if sharding is None or not hasattr(aval, "shape"):
      return aval
    return jax.ShapeDtypeStruct(
      aval.shape,
      aval.dtype,
      sharding=self.sharding(sharding),
      weak_type=getattr(aval, "weak_type", False),
    )

  def program(self, closed: ClosedJaxpr) -> ClosedJaxpr:
    """A nested program traced again, retyped, on its retyped input types."""
    shapes = [self.shape(v.aval) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(
      lambda *args: self.evaluate(closed.jaxpr, closed.consts, args)
    )(*shapes)

  def evaluate(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list:
    env: dict[Any, Any] = {}
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
      params = {name: self.param(value) for name, value in eqn.params.items()}
      # The equation's context, but the body's mesh rather than the outside one.
      with eqn.ctx.manager, jax.sharding.use_abstract_mesh(self.mesh):
        bind_params = eqn.primitive.get_bind_params(params)
        out = eqn.primitive.bind(*(read(v) for v in eqn.invars), **bind_params)
      outs = out if eqn.primitive.multiple_results else [out]
      env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]

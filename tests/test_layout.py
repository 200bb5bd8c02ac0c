"""The shape of the library: public names, the plan's one entry per trace, sizes.

DESIGN.md, invariant 12: options are decided at the door, each call is
planned once per trace, no function exceeds 100 lines of code and no module
800. Public names live in `jaccum` (their `__module__`), so that pickles of
their states (optimizer states in checkpoints) do not name a private module.
"""

import ast
import pathlib
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaccum
from jaccum._routes import plan

PACKAGE = pathlib.Path(jaccum.__file__).parent


def test_public_names_live_in_jaccum():
  for name in jaccum.__all__:
    assert getattr(jaccum, name).__module__ == "jaccum", name


def test_public_states_pickle_as_jaccum_names():
  """A pickled state names `jaccum.<Class>` and loads back equal."""
  params = {"w": jnp.arange(3.0)}
  multisteps = jaccum.MultiSteps(optax.adam(1e-3), 2)
  powersgd = jaccum.PowerSGD(rank=1)
  controller = jaccum.BatchSizeController(16, max_num_microbatches=8)
  states = [
    multisteps.init(params),
    powersgd.init({"w": jnp.ones((4, 4))}, num_devices=2),
    jaccum.NoiseScaleEMA(decay=0.5).init(),
    controller.init(2),
    jaccum.DiLoCo(optax.adam(1e-3), 4, axis_name="replica").init(params),
    jaccum.AccumulationStats(*(np.float32(i) for i in range(7))),
  ]
  for state in states:
    data = pickle.dumps(jax.device_get(state))
    # The class by its public name: the private module it is defined in may move.
    assert b"jaccum._" not in data, type(state).__name__
    back = pickle.loads(data)
    assert type(back) is type(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
      np.testing.assert_array_equal(a, b)


def _loss(w, batch):
  return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def _routes():
  """`(name, fn, args)`: one accumulated step per route."""
  w = jnp.ones(4)
  batch = {"x": jnp.ones((64, 4)), "y": jnp.ones(64)}
  grad = jax.value_and_grad(_loss)
  auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  placed = jax.device_put(batch, NamedSharding(explicit, P("data")))
  in_shard_map = jax.shard_map(
    jaccum.accumulate(grad, 4, axis_name="data"),
    mesh=auto,
    in_specs=(P(), P("data")),
    out_specs=P(),
  )
  return [
    ("one_device", jaccum.accumulate(grad, 4), (w, batch)),
    ("data_parallel", jaccum.data_parallel(grad, 4, mesh=auto), (w, batch)),
    ("explicit", jaccum.accumulate(grad, 4), (w, placed)),
    ("axis_name", in_shard_map, (w, batch)),
  ]


@pytest.mark.parametrize("route", [0, 1, 2, 3], ids=lambda i: _routes()[i][0])
def test_the_plan_is_made_once_per_trace(route, monkeypatch):
  name, fn, args = _routes()[route]
  made = []
  make = plan.make
  monkeypatch.setattr(plan, "make", lambda *a: made.append(1) or make(*a))
  jax.jit(fn).lower(*args)
  assert len(made) == 1, name


def _code_lines(source: list[str], node: ast.AST) -> int:
  """Lines of code of a function: not blank, not comments, not its docstring."""
  body = getattr(node, "body", [])
  docstring = set()
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
    docstring = set(range(body[0].lineno, body[0].end_lineno + 1))
  lines = range(node.lineno, node.end_lineno + 1)
  return sum(
    1
    for i in lines
    if i not in docstring
    and source[i - 1].strip()
    and not source[i - 1].strip().startswith("#")
  )


def test_functions_and_modules_stay_small():
  """Every function at most 100 lines of code (nested ones too); no module
  over 800 lines."""
  too_long = []
  for path in sorted(PACKAGE.rglob("*.py")):
    text = path.read_text()
    source = text.splitlines()
    if len(source) > 800:
      too_long.append(f"{path.relative_to(PACKAGE)}: {len(source)} lines")
    for node in ast.walk(ast.parse(text)):
      function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
      if function and (n := _code_lines(source, node)) > 100:
        too_long.append(f"{path.relative_to(PACKAGE)}:{node.name}: {n} lines")
  assert not too_long

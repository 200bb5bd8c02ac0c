"""The runtime dependencies are what the library imports: jax, jaxlib and optax.

Flax is the `flax` extra and chex a test dependency. Each check runs in a fresh
interpreter whose import system refuses `flax` and `chex`, as if neither were
installed.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Runs in the subprocess: a meta-path finder that refuses the optional packages,
# then what a user without them does. Prints a JSON report.
_WITHOUT_OPTIONAL = textwrap.dedent("""
  import importlib, importlib.abc, json, sys

  MISSING = ("flax", "chex")

  class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
      if name.split(".")[0] in MISSING:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
      return None

  sys.meta_path.insert(0, Refuse())

  import jax, jax.numpy as jnp
  import jaccum

  def loss(w, x):
    return jnp.mean((x @ w) ** 2)

  grads = jaccum.accumulate(jax.grad(loss), 4)(jnp.ones(3), jnp.ones((8, 3)))
  report = {"grads": grads.tolist(), "modules": {}}
  for name in ("jaccum.inspect", "jaccum.linen", "jaccum.nnx"):
    try:
      importlib.import_module(name)
      report["modules"][name] = "imported"
    except ImportError as e:
      report["modules"][name] = f"{type(e).__name__}: {e}"
  report["loaded"] = sorted(
    name for name in sys.modules if name.split(".")[0] in MISSING)
  print(json.dumps(report))
""")


def test_jaccum_imports_without_flax_or_chex():
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": os.pathsep.join(
      filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    ),
  }
  result = subprocess.run(
    [sys.executable, "-c", _WITHOUT_OPTIONAL],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.splitlines()[-1])
  assert report["grads"] == [6.0, 6.0, 6.0]  # 2 (x·w) x with x·w = 3
  assert report["loaded"] == []
  modules = report["modules"]
  assert modules["jaccum.inspect"] == "imported"
  needs_flax = 'ImportError: {} needs Flax: pip install "jaccum[flax]"'
  assert modules["jaccum.nnx"] == needs_flax.format("jaccum.nnx")
  # jaccum.linen takes Linen's loss functions but imports nothing of Flax's;
  # should it come to, it must fail as jaccum.nnx does, not with a bare
  # "No module named 'flax'".
  assert modules["jaccum.linen"] in ("imported", needs_flax.format("jaccum.linen"))

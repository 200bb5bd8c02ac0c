"""Test configuration: 8 simulated CPU devices, set before any JAX computation.

Float64 tests opt in with `jax.enable_x64(True)`; the default stays float32, as
users run it.

The tests compile hundreds of small programs, and on CPU most of each compile
is LLVM optimising the generated kernels. `--xla_backend_optimization_level=0`
skips that: XLA's HLO passes still run, so the compiled HLO the tests inspect
(convolution layouts, collectives, buffer sizes) is the same text, and every
numeric comparison is against a reference compiled with the same flags. It
cut the time of the slowest test files by a third to a half on a 2-core CPU.
Subprocesses the tests start inherit it.

Many tests compile the same programs (a function traced again in another
test, eager ops, the wheel's re-run of the error and inspect tests): XLA's
persistent compilation cache, shared by every test process of a run in the
system's temporary folder (or `JACCUM_TEST_XLA_CACHE`), compiles each once.
Cached programs are keyed by their HLO, flags and versions, so nothing stale
is reused; a test that reads what XLA prints while it compiles turns the
cache off for itself (the `fresh_compiles` fixture).
"""

import os
import tempfile

_FAST_COMPILE = "--xla_backend_optimization_level=0"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import jax  # noqa: E402  (XLA reads XLA_FLAGS when its backend starts)
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

_CACHE = os.environ.get(
  "JACCUM_TEST_XLA_CACHE", os.path.join(tempfile.gettempdir(), "jaccum-test-xla-cache")
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture
def fresh_compiles():
  """XLA compiles every program of the test itself: none from the cache.

  JAX decides once per process whether to use the cache and remembers it, so
  the flag alone would change nothing once another test had compiled:
  `reset_cache` makes it decide again, on the way in and on the way out.
  """
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()

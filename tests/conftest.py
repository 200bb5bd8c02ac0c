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
"""

import os

_FAST_COMPILE = "--xla_backend_optimization_level=0"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import jax  # noqa: E402  (XLA reads XLA_FLAGS when its backend starts)

jax.config.update("jax_num_cpu_devices", 8)

"""Test configuration: 8 simulated CPU devices, set before any JAX computation.

Float64 tests opt in with `jax.enable_x64(True)`; the default stays float32, as
users run it.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

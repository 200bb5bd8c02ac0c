"""jaccum: exact, fast gradient accumulation for JAX, Flax and optax."""

from jaccum._accumulate import accumulate
from jaccum._microbatch import split_microbatches
from jaccum._parallel import data_parallel

__version__ = "0.1.0"

__all__ = [
  "accumulate",
  "data_parallel",
  "split_microbatches",
]

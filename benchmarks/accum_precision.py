"""Rounding of the accumulated mean as K grows, by accumulator dtype.

Each of K micro-batches contributes one gradient vector of 4,096 entries drawn
from N(1, 1); the reference is their mean in float64. Reported: the largest
entry's error and the root-mean-square error, relative to the largest |mean|.

    python benchmarks/accum_precision.py [--quick]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaccum

CASES = {
  "float32": (jnp.float32, jnp.float32),
  "bfloat16, float32 accumulator": (jnp.bfloat16, jnp.float32),
  "bfloat16, accum_dtype=None": (jnp.bfloat16, None),
}


def errors(
  num_microbatches: int, dtype, accum_dtype, seed: int = 0
) -> tuple[float, float]:
  rng = np.random.default_rng(seed)
  grads = rng.normal(1.0, 1.0, (num_microbatches, 4096))
  batch = jnp.asarray(grads, dtype)
  step = jax.jit(
    jaccum.accumulate(
      lambda rows: rows[0],
      num_microbatches,
      batch_argnums=0,
      accum_dtype=accum_dtype,
      split="contiguous",
    )
  )
  got = np.asarray(step(batch), np.float64)
  exact = np.asarray(batch, np.float64).mean(0)
  scale = np.abs(exact).max()
  return float(np.abs(got - exact).max() / scale), float(
    np.sqrt(np.mean((got - exact) ** 2)) / scale
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  ks = [16, 256] if parser.parse_args().quick else [16, 256, 1024, 4096]
  print("| accumulation | " + " | ".join(f"K={k}" for k in ks) + " |")
  print("|---|" + "--:|" * len(ks))
  for name, (dtype, accum) in CASES.items():
    cells = [errors(k, dtype, accum) for k in ks]
    print(f"| {name} | " + " | ".join(f"{m:.1e} / {r:.1e}" for m, r in cells) + " |")


if __name__ == "__main__":
  main()

"""PowerSGD against the exact reduction: a digits CNN on 8 simulated CPU devices.

`jaccum.data_parallel(..., reduce_fn=jaccum.PowerSGD(rank))` replaces the one
all-reduce of the gradients after the loop by a rank-r estimate with error
feedback. This trains the same CNN on scikit-learn's digits twice, with the
exact reduction and with PowerSGD, from the same start on the same batches,
and reports each run's loss and the bytes its reduction sends per step (read
from the compiled program by `jaccum.inspect.collectives`).

    python examples/powersgd.py            # 300 steps, under a minute
    python examples/powersgd.py --quick    # a few steps, for CI
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any JAX computation

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import jaccum  # noqa: E402
import jaccum.inspect  # noqa: E402

DEVICES, K, ROWS = 8, 2, 16  # 8 devices × 2 micro-batches × 16 images a step


def init(key):
  k1, k2, k3, k4 = jax.random.split(key, 4)
  return {
    "conv1": jax.random.normal(k1, (3, 3, 1, 16)) / 3,
    "conv2": jax.random.normal(k2, (3, 3, 16, 32)) / 12,
    "dense": jax.random.normal(k3, (8 * 8 * 32, 128)) / 45,
    "head": jax.random.normal(k4, (128, 10)) / 11,
  }


def loss(params, images, labels):
  conv = lambda x, k: jax.lax.conv_general_dilated(
    x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  x = jax.nn.relu(conv(images, params["conv1"]))
  x = jax.nn.relu(conv(x, params["conv2"]))
  x = jax.nn.relu(x.reshape(x.shape[0], -1) @ params["dense"])
  logits = x @ params["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(step, params, batches, powersgd=None):
  """Trains from `params`; returns each step's loss and the final params."""
  optimizer = optax.sgd(0.05, momentum=0.9)
  opt_state = optimizer.init(params)
  state = None if powersgd is None else powersgd.init(params, DEVICES)
  losses = []
  for images, labels in batches:
    if powersgd is None:
      (value, grads) = step(params, images, labels)
    else:
      (value, grads), state = step(params, images, labels, reduce_state=state)
    updates, opt_state = optimizer.update(grads, opt_state)
    params = optax.apply_updates(params, updates)
    losses.append(float(value))
  return np.array(losses), params


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few steps, for CI")
  parser.add_argument("--rank", type=int, default=8)
  args = parser.parse_args()
  num_steps = 10 if args.quick else 300

  digits = load_digits()
  images = (digits.images[..., None] / 16).astype(np.float32)
  labels = digits.target.astype(np.int32)
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))
  on_mesh = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
  rng = np.random.default_rng(0)
  per_step = DEVICES * K * ROWS
  held_out = rng.permutation(len(images))
  train_rows, test_rows = held_out[300:], held_out[:300]
  batches = []
  for _ in range(num_steps):
    rows = rng.choice(train_rows, per_step, replace=False)
    batches.append((on_mesh(images[rows]), on_mesh(labels[rows])))

  params = init(jax.random.key(0))
  powersgd = jaccum.PowerSGD(rank=args.rank)
  options = dict(mesh=mesh, batch_argnums=(1, 2))
  grad_fn = jax.value_and_grad(loss)
  exact = jax.jit(jaccum.data_parallel(grad_fn, K, **options))
  compressed = jax.jit(jaccum.data_parallel(grad_fn, K, reduce_fn=powersgd, **options))
  state = powersgd.init(params, DEVICES)
  sent = {
    "exact": jaccum.inspect.collectives(exact, params, *batches[0]).bytes_per_step,
    "powersgd": jaccum.inspect.collectives(
      compressed, params, *batches[0], reduce_state=state
    ).bytes_per_step,
  }
  runs = {
    "exact": train(exact, params, batches),
    "powersgd": train(compressed, params, batches, powersgd),
  }
  tail = max(1, num_steps // 10)  # the last tenth of the steps, averaged
  final = {name: float(np.mean(run[0][-tail:])) for name, run in runs.items()}
  test = {
    name: float(jax.jit(loss)(run[1], images[test_rows], labels[test_rows]))
    for name, run in runs.items()
  }
  for name in runs:
    print(
      f"{name:>9}: training loss {final[name]:.4f} (last {tail} steps), held-out "
      f"loss {test[name]:.4f}; {sent[name]:,} bytes per step per device"
    )
  print(
    f"PowerSGD rank {args.rank}: {sent['exact'] / sent['powersgd']:.1f}x fewer bytes; "
    f"training loss {final['powersgd'] / final['exact'] - 1:+.1%}, held-out loss "
    f"{test['powersgd'] / test['exact'] - 1:+.1%} against the exact reduction"
  )


if __name__ == "__main__":
  main()

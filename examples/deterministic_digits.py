"""Reproducible and elastic: the same parameters, bit for bit, on 1, 8 or 5 devices.

An MLP with dropout trains on scikit-learn's digits, 512 images a step, as
32 micro-batches of 16. One run does it on one device (K = 32); the other
starts on 8 simulated devices (K = 4 each), then, half-way, loses three of
them and goes on with 5: 7 micro-batch slots each over a batch padded to 35
micro-batches, the last device running 4 (`num_real_microbatches`). With
`deterministic=True` micro-batch m is always rows 16m .. 16m + 15 with the
dropout key `fold_in(key, m)`, and the gradients are summed exactly, so every
step prints the same parameter hash for both runs.

The optimizer update runs in a jit of its own: compiled into the same program
as the gradient, XLA may round Adam's arithmetic differently in the one-device
and the many-device program (it did on CPU, from the second step on), which
is nothing `deterministic=True` can fix (see the guide "Reproducible and
elastic accumulation").

    python examples/deterministic_digits.py            # 40 steps
    python examples/deterministic_digits.py --quick    # 6 steps, for CI
"""

import argparse
import hashlib

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any JAX computation

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import jaccum  # noqa: E402

ROWS, MICROBATCHES = 16, 32  # a global batch of 512 images
KEEP = 0.9  # dropout keeps 90% of the hidden units


def loss(params, batch, key):
  hidden = jax.nn.relu(batch["image"] @ params["w1"] + params["b1"])
  hidden = jnp.where(jax.random.bernoulli(key, KEEP, hidden.shape), hidden / KEEP, 0)
  logits = hidden @ params["w2"] + params["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def batch_at(step, images, labels):
  rows = np.random.default_rng(step).integers(0, len(labels), ROWS * MICROBATCHES)
  return {"image": images[rows], "label": labels[rows]}


def padded(batch, slots):
  """`batch` with zero rows appended up to `slots` micro-batches (never run)."""
  extra = slots * ROWS - len(batch["label"])
  return {
    k: np.concatenate([v, np.zeros((extra, *v.shape[1:]), v.dtype)])
    for k, v in batch.items()
  }


def make_step(num_devices):
  """A train step on `num_devices` devices, and the batch layout it takes."""
  optimizer = optax.adam(1e-3)
  grad_fn = jax.grad(loss)
  options = {"rng_argnum": 2, "deterministic": True}
  if num_devices == 1:
    accumulated = jaccum.accumulate(grad_fn, MICROBATCHES, **options)
    slots, counts = MICROBATCHES, None
  else:
    mesh = jax.make_mesh((num_devices,), ("data",), devices=jax.devices()[:num_devices])
    per_device = -(-MICROBATCHES // num_devices)  # slots per device
    slots = per_device * num_devices
    counts = jnp.asarray(
      np.clip(MICROBATCHES - per_device * np.arange(num_devices), 0, per_device)
    )
    accumulated = jaccum.data_parallel(grad_fn, per_device, mesh=mesh, **options)

  # The gradient and the update in two programs (see the module docstring).
  gradients = jax.jit(accumulated)

  @jax.jit
  def update(grads, opt_state, params):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def step(params, opt_state, batch, key):
    grads = gradients(params, batch, key, num_real_microbatches=counts)
    return update(grads, opt_state, params)

  return step, slots, optimizer


def fingerprint(params):
  data = b"".join(np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(params))
  return hashlib.sha256(data).hexdigest()[:16]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="6 steps, for CI")
  parser.add_argument("--steps", type=int, default=None, help="steps (default 40)")
  args = parser.parse_args()
  steps = args.steps or (6 if args.quick else 40)

  images, labels = load_digits(return_X_y=True)
  images, labels = (images / 16.0).astype(np.float32), labels.astype(np.int32)
  rng = np.random.default_rng(0)
  params = {
    "w1": (rng.standard_normal((64, 128)) * np.sqrt(2 / 64)).astype(np.float32),
    "b1": np.zeros(128, np.float32),
    "w2": (rng.standard_normal((128, 10)) * np.sqrt(2 / 128)).astype(np.float32),
    "b2": np.zeros(10, np.float32),
  }
  key = jax.random.key(0)
  runs = {"1 device": (1, 1), "elastic": (8, 5)}  # devices before and after half-way
  states = {name: (params, None) for name in runs}
  steppers = {n: make_step(n) for n in {1, 8, 5}}
  print(f"{'step':>4}  {'devices':>7}  {'1 device':>16}  {'8, then 5':>16}  same bits")
  different = 0
  for step in range(steps):
    batch = batch_at(step, images, labels)
    hashes, devices = {}, None
    for name, (before, after) in runs.items():
      devices = before if step < steps // 2 else after
      train_step, slots, optimizer = steppers[devices]
      state_params, opt_state = states[name]
      if opt_state is None:
        opt_state = optimizer.init(state_params)
      if step == steps // 2 and before != after:
        # Three devices are gone: the state comes back to the host, as from a
        # checkpoint, and goes on with 5 (orbax restores it the same way).
        state_params, opt_state = jax.device_get((state_params, opt_state))
      state_params, opt_state = train_step(
        state_params, opt_state, padded(batch, slots), jax.random.fold_in(key, step)
      )
      states[name] = (state_params, opt_state)
      hashes[name] = fingerprint(state_params)
    same = hashes["1 device"] == hashes["elastic"]
    different += not same
    print(
      f"{step:>4}  {devices:>7}  {hashes['1 device']}  {hashes['elastic']}  {same}",
      flush=True,
    )
  if different:
    raise SystemExit(f"{different} of {steps} steps gave different parameters")
  print(
    f"all {steps} steps: the same parameters, bit for bit, on 1 device and on 8 then 5"
  )


if __name__ == "__main__":
  main()

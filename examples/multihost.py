"""Multi-host accumulation: every process feeds its share, one reduction per step.

Each process loads only its own rows of every global batch; `data_parallel`
accumulates K micro-batches on each device and combines all devices of all
processes once per step. By default this script plays a 2-host cluster on one
machine (2 processes × 2 CPU devices, talking over 127.0.0.1 with gloo):

    python examples/multihost.py            # ~30 s on 2 CPU cores
    python examples/multihost.py --quick    # a few steps, for CI

On a real GPU/TPU cluster, start the same script on every host with
`--cluster`: `jax.distributed.initialize()` then finds the coordinator, the
process count and this process's id from the environment (SLURM, TPU pods,
Kubernetes, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID).
"""

import argparse
import socket
import subprocess
import sys
import time

import numpy as np

NUM_MICROBATCHES = 4
ROWS_PER_MICROBATCH = 16  # per device


def train(steps: int) -> None:
  """The training job one process runs; identical on every process."""
  import jax
  import optax
  from sklearn.datasets import load_digits

  import jaccum

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  batch_sharding = jax.NamedSharding(mesh, jax.P("data"))
  global_rows = jax.device_count() * NUM_MICROBATCHES * ROWS_PER_MICROBATCH
  local_rows = global_rows // jax.process_count()

  def loss(params, x, y):
    logits = jax.nn.relu(x @ params["w1"]) @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  k1, k2 = jax.random.split(jax.random.key(0))  # same seed: same params everywhere
  params = {
    "w1": jax.random.normal(k1, (64, 128)) * 0.125,
    "w2": jax.random.normal(k2, (128, 10)) * 0.09,
  }
  optimizer = optax.adam(3e-3)
  accumulated = jaccum.data_parallel(
    jax.value_and_grad(loss), NUM_MICROBATCHES, mesh=mesh, batch_argnums=(1, 2)
  )

  @jax.jit
  def train_step(params, opt_state, x, y):
    value, grads = accumulated(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  digits = load_digits()
  images = (digits.data / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  opt_state = optimizer.init(params)
  rng = np.random.default_rng(0)  # same on every process: a shared batch order
  start = time.perf_counter()
  for step in range(steps):
    order = rng.permutation(len(images))[:global_rows]
    mine = order[jax.process_index() * local_rows :][:local_rows]  # this host's rows
    x, y = (
      jax.make_array_from_process_local_data(batch_sharding, a[mine])
      for a in (images, labels)
    )
    params, opt_state, value = train_step(params, opt_state, x, y)
    if jax.process_index() == 0 and (step % 10 == 0 or step == steps - 1):
      print(f"step {step:3d}  loss {float(value):.4f}", flush=True)
  if jax.process_index() == 0:
    print(
      f"{jax.process_count()} processes × {jax.local_device_count()} devices × "
      f"K={NUM_MICROBATCHES} × {ROWS_PER_MICROBATCH} rows = {global_rows} rows/step; "
      f"{steps} steps in {time.perf_counter() - start:.1f}s",
      flush=True,
    )


def local_worker(process_id: int, num_processes: int, port: int, steps: int) -> None:
  import jax

  jax.config.update("jax_num_cpu_devices", 2)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=60,
  )
  train(steps)
  jax.distributed.shutdown()


def launch_locally(num_processes: int, steps: int) -> None:
  with socket.socket() as s:  # a free port for the coordinator
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  command = [sys.executable, __file__, "--steps", str(steps), "--worker"]
  workers = [
    subprocess.Popen([*command, str(i), str(num_processes), str(port)])
    for i in range(num_processes)
  ]
  try:
    codes = [w.wait(timeout=300) for w in workers]
  finally:
    for w in workers:
      if w.poll() is None:
        w.kill()
  if any(codes):
    sys.exit(f"a worker failed: exit codes {codes}")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few steps, for CI")
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--cluster", action="store_true", help="run on a real cluster")
  parser.add_argument("--worker", nargs=3, type=int, metavar=("ID", "COUNT", "PORT"))
  args = parser.parse_args()
  steps = args.steps or (5 if args.quick else 60)
  if args.worker:
    local_worker(*args.worker, steps=steps)
  elif args.cluster:
    import jax

    jax.distributed.initialize()
    train(steps)
  else:
    launch_locally(num_processes=2, steps=steps)

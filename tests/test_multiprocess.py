"""`data_parallel` across 2 processes × 2 CPU devices equals one process's gradient.

The test starts two worker processes (this file run as a script) that meet
through `jax.distributed.initialize` on 127.0.0.1 with gloo CPU collectives,
each holding half of the batch; process 0 saves the gradients it computed.
"""

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

# Slow (processes joined over gloo): `pytest -m slow`, run by CI.
pytestmark = pytest.mark.slow

NUM_PROCESSES, LOCAL_DEVICES, NUM_MICROBATCHES, BATCH = 2, 2, 4, 64


def make_problem():
  rng = np.random.default_rng(0)
  params = {
    "w": rng.normal(size=(6, 8)).astype(np.float32),
    "v": rng.normal(size=(8,)).astype(np.float32),
  }
  x = rng.normal(size=(BATCH, 6)).astype(np.float32)
  y = rng.normal(size=(BATCH,)).astype(np.float32)
  return params, x, y


def loss(params, x, y):
  import jax.numpy as jnp

  return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)


def worker(process_id: int, port: int, out_path: str) -> None:
  import jax

  jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=NUM_PROCESSES,
    process_id=process_id,
    initialization_timeout=60,
  )
  import jaccum

  mesh = jax.make_mesh((NUM_PROCESSES * LOCAL_DEVICES,), ("data",))
  sharding = jax.NamedSharding(mesh, jax.P("data"))
  params, x, y = make_problem()
  rows = slice(process_id * BATCH // 2, (process_id + 1) * BATCH // 2)
  x, y = (jax.make_array_from_process_local_data(sharding, a[rows]) for a in (x, y))
  step = jax.jit(
    jaccum.data_parallel(
      jax.value_and_grad(loss), NUM_MICROBATCHES, mesh=mesh, batch_argnums=(1, 2)
    )
  )
  value, grads = step(params, x, y)  # replicated: every process holds all of it
  if process_id == 0:
    np.savez(out_path, value=value, **{k: np.asarray(g) for k, g in grads.items()})
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
  import jax

  out_path = str(tmp_path / "grads.npz")
  port = _free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.path.dirname(__file__)}
  workers = [
    subprocess.Popen(
      [sys.executable, __file__, str(i), str(port), out_path],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(NUM_PROCESSES)
  ]
  deadline = time.monotonic() + 180
  try:
    for w in workers:
      w.wait(timeout=max(1, deadline - time.monotonic()))
  finally:
    for w in workers:
      if w.poll() is None:
        w.kill()
  logs = "\n".join(w.stdout.read() for w in workers)
  assert all(w.returncode == 0 for w in workers), logs

  params, x, y = make_problem()
  value, grads = jax.value_and_grad(loss)(params, x, y)
  saved = np.load(out_path)
  np.testing.assert_allclose(saved["value"], value, rtol=1e-5)
  for name, grad in grads.items():
    np.testing.assert_allclose(saved[name], grad, rtol=1e-5, atol=1e-7)


if __name__ == "__main__":
  worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

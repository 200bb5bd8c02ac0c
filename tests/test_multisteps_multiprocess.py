"""`MultiSteps` on FSDP params across 2 processes × 2 CPU devices.

Two worker processes (this file run as a script) meet through
`jax.distributed.initialize` and hold params sharded `P("data")` over all four
devices of an explicit mesh. Each checks that `init` gives the accumulator the
params' global sharding (not a host-local, replicated array), then both train
two windows; process 0 saves the params, which must equal a one-process run of
`optax.MultiSteps`.
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

NUM_PROCESSES, LOCAL_DEVICES, EVERY_K, CALLS = 2, 2, 2, 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_problem():
  rng = np.random.default_rng(0)
  params = {
    "w": rng.normal(size=(8, 16)).astype(np.float32),
    "v": rng.normal(size=(16, 4)).astype(np.float32),
  }
  xs = rng.normal(size=(CALLS, 16, 8)).astype(np.float32)
  ys = rng.normal(size=(CALLS, 16, 4)).astype(np.float32)
  return params, xs, ys


def loss(params, x, y):
  import jax.numpy as jnp

  return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)


def train(opt, params, xs, ys):
  import jax
  import optax

  @jax.jit
  def step(params, state, x, y):
    updates, state = opt.update(jax.grad(loss)(params, x, y), state, params)
    return optax.apply_updates(params, updates), state

  state = opt.init(params)
  for x, y in zip(xs, ys, strict=True):
    params, state = step(params, state, x, y)
  return params, state


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
  import optax
  from jax.experimental import multihost_utils

  import jaccum

  mesh = jax.make_mesh((NUM_PROCESSES * LOCAL_DEVICES,), ("data",))
  params, xs, ys = make_problem()

  def global_array(array, spec):
    sharding = jax.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(array.shape, sharding, lambda i: array[i])

  with jax.set_mesh(mesh):
    params = {name: global_array(p, jax.P("data")) for name, p in params.items()}
    xs, ys = global_array(xs, jax.P()), global_array(ys, jax.P())
    opt = jaccum.MultiSteps(optax.adam(1e-2), EVERY_K)
    for name, acc in opt.init(params).acc_grads.items():
      param = params[name]
      assert not acc.is_fully_addressable, (name, acc.sharding)
      assert acc.sharding.is_equivalent_to(param.sharding, acc.ndim), acc.sharding
      shard_shape = param.addressable_shards[0].data.shape
      assert acc.addressable_shards[0].data.shape == shard_shape, name
      assert shard_shape[0] * NUM_PROCESSES * LOCAL_DEVICES == param.shape[0]
    params, state = train(opt, params, xs, ys)
    assert int(state.gradient_step) == CALLS // EVERY_K
    for name, acc in state.acc_grads.items():
      assert acc.sharding.is_equivalent_to(params[name].sharding, acc.ndim), name
  params = multihost_utils.process_allgather(params, tiled=True)
  if process_id == 0:
    np.savez(out_path, **{name: np.asarray(p) for name, p in params.items()})
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_fsdp_state_is_global_and_trains_like_optax_in_one_process(tmp_path):
  import optax

  out_path = str(tmp_path / "params.npz")
  port = _free_port()
  # The workers import jaccum from this checkout, as the test process does.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
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
  deadline = time.monotonic() + 240
  try:
    for w in workers:
      w.wait(timeout=max(1, deadline - time.monotonic()))
  finally:
    for w in workers:
      if w.poll() is None:
        w.kill()
  logs = "\n".join(w.stdout.read() for w in workers)
  assert all(w.returncode == 0 for w in workers), logs[-5000:]

  params, xs, ys = make_problem()
  expected, _ = train(optax.MultiSteps(optax.adam(1e-2), EVERY_K), params, xs, ys)
  saved = np.load(out_path)
  for name, value in expected.items():
    assert not np.allclose(value, params[name])  # it trained
    np.testing.assert_allclose(saved[name], value, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

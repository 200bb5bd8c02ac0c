"""jaccum's benchmark suite: `python -m benchmarks` (`--quick` for CI).

Parts, run in this order (`--parts` picks some):

* `sweep` (`sweep.py`, over `models.py` and `methods.py`): every way to take
  an optimizer step at one effective batch (the whole batch, jaccum.accumulate,
  optax.microbatch, a Python loop of jitted micro-steps, optax.MultiSteps and
  jaccum.MultiSteps, nnx.value_and_grad and jaccum.nnx, jaccum with
  return_stats) on an MLP, a CNN and a transformer LM, for several K: step
  time, memory, compile time, time to first step; the plots come from it.
* `loop` (`loop.py`): small micro-batches, the loop's cost per micro-batch
  against the micro-step itself and a bare `lax.scan`, and the loop body's HLO.
* `conv` (`conv_families.py`): five families of convolutional networks
  (ResNet with BatchNorm, MobileNet, 1-D, U-Net with transposed convolutions,
  3-D) accumulated on CPU, with jaccum's convolution rule, with no rewrite,
  with every convolution rewritten, and by optax.microbatch.
* `multisteps` (`multisteps.py`): jaccum.MultiSteps vs optax.MultiSteps with
  Adam and Muon inner optimizers, time per mini-step, memory, buffer copies.
* `precision` (`multisteps_precision.py`): the window mean's rounding error as K
  grows, float32 and bfloat16.
* `distributed` (`distributed.py`, its own process): collectives inside and
  outside the loop and step time on 8 simulated CPU devices.
* `fsdp` (`fsdp.py`, its own process): each `data_parallel` FSDP mode's
  temporaries per device, bytes on the wire per step and CPU step time.
* `reduction` (`reduction.py`, its own process): the reduction after the loop
  per option (float32, overlap, bf16 on the wire, PowerSGD), and bf16's error.
* `pipeline` (`pipeline.py`, its own process): `jaccum.pipeline`'s schedules
  on 4 simulated CPU devices: temporaries against K, FLOPs per tick, the
  bubble with interleaved stages and ZB-V, the temporaries at a small size
  and what each device holds, the head's FLOPs.
* `plan` (`plan.py`): `jaccum.fit_plan`'s choice of K and remat policy,
  by its cost model and with `measure=`, against every point of its grid,
  timed, on an MLP, a digits-sized CNN, a transformer LM and an in-batch
  contrastive loss at three budgets each: the choice's rank, its time
  against the grid's best and against full remat at the smallest K that
  fits, and the compilations.
* `coupled` (`coupled.py`): `jaccum.accumulate_coupled` on a CLIP loss over
  two activation-dominated towers against the whole batch and GradCache
  written by hand, K = 2 … 64: temporaries and step time.
* `overheads` (`overheads.py`, the FSDP half in its own process): issue
  39's four overheads side by side: `deterministic=True` against the plain
  step as the rows per micro-batch grow, the LM against `optax.microbatch`
  (and whether their loop bodies are one program), `fit_plan`'s choice by
  the cost model alone on the LM against its grid timed (with each point's
  page faults per step), and FSDP `shard_all`'s temporaries against
  `gather_once`'s and a hand-written ZeRO-3 loop's.
* `diloco` (`diloco.py`, its own process): `jaccum.DiLoCo` against data
  parallel on 8 simulated CPU devices (4 replicas × 2): the bytes a step
  sends over each mesh axis, averaged over a round of 32 steps, the most a
  call sends over the slow axis, the state it adds, for DiLoCo and
  Streaming DiLoCo (4 fragments, delay 1), with a bf16 wire too.

Standalone scripts, each with `--quick`, results in `results/` (`results/quick/`):

* `python -m benchmarks.conv_kinds`: each kind of convolution in a loop body,
  rewritten or as traced, the measurements behind the rule of
  `jaccum/_core/rewrites.py`;
* `python -m benchmarks.conv_layout`: the tutorial CNN with and without the
  rewrite, and its compile time over K;
* `python -m benchmarks.profile_loop_ops`: ops a loop body runs slower than
  the same ops unrolled;
* `python -m benchmarks.pipeline`: the suite's `pipeline` part on its own,
  writing `results/pipeline.json` and `pipeline.md`;
* `python -m benchmarks.num_real`: a traced number of real micro-batches
  against a static K of that number;
* `bash benchmarks/gpu.sh` (`gpu.py`): the GPU check, one command under 8
  minutes on one GPU: accumulate against the whole batch and
  `optax.microbatch` (MLP, CNN, LM at K = 1, 4, 8, 16), `fit_plan` against a
  timed grid, and the overlap of the reduction on several GPUs; writes
  `results/gpu.md`.

Importing this package starts nothing: JAX is configured by the part that
runs, so the distributed part can set its device count in its own process.
"""

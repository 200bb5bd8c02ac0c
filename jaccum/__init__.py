"""jaccum: exact, fast gradient accumulation for JAX, Flax and optax."""

import importlib

from jaccum._accumulate import accumulate
from jaccum._coupled import accumulate_coupled
from jaccum._fit import MicrobatchFit, fit_microbatches, fit_train_step
from jaccum._microbatch import split_microbatches
from jaccum._multisteps import MultiSteps, MultiStepsState
from jaccum._parallel import data_parallel
from jaccum._pipeline import pipeline
from jaccum._pipeline_schedule import PipelineSchedule, pipeline_schedule
from jaccum._plan import CostModel, Plan, PlanPoint, Remat, fit_plan
from jaccum._powersgd import PowerSGD, PowerSGDState
from jaccum._schedule import (
  BatchSchedule,
  BatchSizeController,
  BatchSizeControllerState,
)
from jaccum._stats import AccumulationStats, NoiseScaleEMA, NoiseScaleEMAState

__version__ = "0.1.0"

__all__ = [
  "AccumulationStats",
  "BatchSchedule",
  "BatchSizeController",
  "BatchSizeControllerState",
  "CostModel",
  "MicrobatchFit",
  "MultiSteps",
  "MultiStepsState",
  "NoiseScaleEMA",
  "NoiseScaleEMAState",
  "PipelineSchedule",
  "Plan",
  "PlanPoint",
  "PowerSGD",
  "PowerSGDState",
  "Remat",
  "accumulate",
  "accumulate_coupled",
  "data_parallel",
  "fit_microbatches",
  "fit_plan",
  "fit_train_step",
  "pipeline",
  "pipeline_schedule",
  "split_microbatches",
]


def __getattr__(name: str):
  # Submodules load on first use: `jaccum.nnx` imports Flax, `jaccum.linen` is
  # for Flax Linen's train steps, `jaccum.inspect` is for checking compiled
  # steps; none is needed to accumulate.
  if name in ("inspect", "linen", "nnx"):
    return importlib.import_module(f"jaccum.{name}")
  raise AttributeError(f"module 'jaccum' has no attribute {name!r}")

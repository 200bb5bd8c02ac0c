"""jaccum: exact, fast gradient accumulation for JAX, Flax and optax."""

import importlib

from jaccum._core.microbatch import split_microbatches
from jaccum._core.stats import AccumulationStats
from jaccum._pipeline.front import pipeline
from jaccum._pipeline.tables import PipelineSchedule, pipeline_schedule
from jaccum._planning.cost import CostModel
from jaccum._planning.fit import MicrobatchFit, fit_microbatches, fit_train_step
from jaccum._planning.fit_plan import fit_plan
from jaccum._planning.points import Plan, PlanPoint, Remat
from jaccum._routes.accumulate import accumulate, data_parallel
from jaccum._routes.coupled import accumulate_coupled
from jaccum._routes.private import dp_value_and_grad
from jaccum._training.diloco import DiLoCo, DiLoCoState
from jaccum._training.multisteps import MultiSteps, MultiStepsState
from jaccum._training.noise_scale import NoiseScaleEMA, NoiseScaleEMAState
from jaccum._training.powersgd import PowerSGD, PowerSGDState
from jaccum._training.schedule import (
  BatchSchedule,
  BatchSizeController,
  BatchSizeControllerState,
)

__version__ = "0.1.0"

__all__ = [
  "AccumulationStats",
  "BatchSchedule",
  "BatchSizeController",
  "BatchSizeControllerState",
  "CostModel",
  "DiLoCo",
  "DiLoCoState",
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
  "dp_value_and_grad",
  "fit_microbatches",
  "fit_plan",
  "fit_train_step",
  "pipeline",
  "pipeline_schedule",
  "split_microbatches",
]


def _documented_here(obj: object) -> None:
  """Gives a public name the module the documentation puts it in, `jaccum`.

  Pickles of public classes (optimizer states in checkpoints) then name
  `jaccum.MultiStepsState`, which stays wherever the private module that
  defines it moves. A class's own functions follow it, so that doctest
  still finds their examples.
  """
  obj.__module__ = __name__
  for member in vars(obj).values() if isinstance(obj, type) else ():
    function = getattr(member, "fget", getattr(member, "__func__", member))
    if callable(function) and hasattr(function, "__module__"):
      function.__module__ = __name__


for _name in __all__:
  _documented_here(globals()[_name])
del _name


def __getattr__(name: str):
  # Submodules load on first use: `jaccum.nnx` imports Flax, `jaccum.linen` is
  # for Flax Linen's train steps, `jaccum.inspect` is for checking compiled
  # steps; none is needed to accumulate.
  if name in ("inspect", "linen", "nnx"):
    return importlib.import_module(f"jaccum.{name}")
  raise AttributeError(f"module 'jaccum' has no attribute {name!r}")

"""Config owned by the trainer: the recipe's `model` and `train` sections, and the resolved job spec.

The recipe's `model` and `train` sections validate into ModelConfig and TrainConfig (sections.py). The flow
resolves everything a pod needs into one TrainJob JSON file (job.py); `python -m trainers.train` reads only that
file. Every name is imported from here: the package is the config's one interface, to the flow as to the trainer.
"""

from trainers.config.job import Stage, TrainJob
from trainers.config.sections import (
    CHECKPOINT_BYTES_PER_PARAM,
    NAME_RESERVE,
    LossGuardConfig,
    MlflowTarget,
    ModelConfig,
    OptimConfig,
    ParallelismConfig,
    StageConfig,
    TrainConfig,
    batch_alignment_error,
    stage_bounds,
)
from trainers.contract import WatchdogConfig

__all__ = [
    "CHECKPOINT_BYTES_PER_PARAM",
    "NAME_RESERVE",
    "LossGuardConfig",
    "MlflowTarget",
    "ModelConfig",
    "OptimConfig",
    "ParallelismConfig",
    "Stage",
    "StageConfig",
    "TrainConfig",
    "TrainJob",
    "WatchdogConfig",
    "batch_alignment_error",
    "stage_bounds",
]

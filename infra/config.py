"""The `compute` section of a recipe: where training jobs run."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class ComputeConfig(BaseModel):
    """Compute backend. `local` runs the trainer as processes on this machine via Composer's launcher."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["local"] = Field("local", description="Where training runs.")
    procs_per_node: PositiveInt = Field(1, description="Training processes (ranks) per node.")
    max_restarts: int = Field(2, ge=0, description="Relaunches of a failed training job before the stage fails.")

"""The `eval` section of a recipe: when and what the gauntlet runs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class EvalConfig(BaseModel):
    """Gauntlet settings. `tasks` and `gauntlet` are the Mosaic Eval Gauntlet's own YAML files, unchanged."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    every: PositiveInt = Field(..., description="Checkpoint and evaluate every this many training tokens.")
    tasks: str = Field(..., description="ICL task list YAML (`icl_tasks: [...]`), Mosaic Eval Gauntlet format.")
    gauntlet: str | None = Field(
        None, description="Gauntlet YAML (`eval_gauntlet: {categories, weighting, ...}`); null reports tasks only."
    )
    data_root: str = Field(".", description="Root that each task's `dataset_uri` resolves against (local or s3://).")
    batch_size: PositiveInt = Field(16, description="Sequences per forward pass.")
    max_seq_len: PositiveInt | None = Field(
        None, description="Left-truncate contexts to this length; null uses the model's sequence length."
    )
    seed: int = Field(1234, description="Seed for few-shot example sampling.")
    strict: bool = Field(False, description="Fail, instead of warning and skipping, when a task file is missing.")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto",
        description="Where the model is scored: auto = the first CUDA device when this machine has one, else CPU.",
    )

"""The `promote` section of a recipe: the rule continued pretraining promotes a challenger by."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PromoteConfig(BaseModel):
    """The `promote` section of a recipe: when a continued run's best version replaces the champion."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    headline: str | None = Field(
        None, description="Average (or category) that must improve; null uses the gauntlet's first average."
    )
    min_gain: float = Field(
        0.0, description="The headline must rise by at least this much (may be negative to accept small losses)."
    )
    max_category_drop: float = Field(
        0.01, ge=0, description="No gauntlet category may fall by more than this (absolute score)."
    )

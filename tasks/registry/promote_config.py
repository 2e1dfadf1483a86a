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
        0.0,
        description="The lower bound of the headline gain's interval must be above this (may be negative to accept "
        "small losses).",
    )
    max_category_drop: float = Field(
        0.01,
        ge=0,
        description="No gauntlet category may fall significantly further than this (absolute score): a drop "
        "whose whole interval lies below -max_category_drop rejects.",
    )
    confidence: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="Confidence of the paired-bootstrap intervals: the headline gain's lower bound must clear "
        "min_gain. 0.95 on a gauntlet of a few hundred examples needs a gain of several points.",
    )
    resamples: int = Field(2000, ge=100, description="Bootstrap resamples of the gauntlet's examples.")
    seed: int = Field(0, description="Seed of the bootstrap: the same two reports always give the same verdict.")

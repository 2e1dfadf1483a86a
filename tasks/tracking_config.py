"""The `tracking` section of a recipe: the MLflow tracking store and registry."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TrackingConfig(BaseModel):
    """MLflow settings. A `sqlite:///` URI keeps everything local; any `mlflow server` URL works too."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tracking_uri: str = Field("sqlite:///.tessera/mlflow.db", description="MLflow tracking (and registry) URI.")
    artifact_location: str | None = Field(
        ".tessera/mlartifacts", description="Artifact root for a new experiment; null uses the server's default."
    )
    experiment: str = Field("tessera", description="MLflow experiment name.")
    registered_model: str = Field(..., description="Registered model that receives one version per checkpoint.")
    register_by_reference_above_mb: float = Field(
        2048.0,
        ge=0,
        description="Versions whose weights exceed this many MiB are registered by reference to the run's object "
        "storage (train.save_folder: s3://...) instead of being copied into the MLflow artifact store; runs with a "
        "local save folder always copy.",
    )

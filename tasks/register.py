"""Register an evaluated checkpoint as a model version and move the `latest-checkpoint` and `best` aliases.

A version is identified by (run id, tokens), so a retried or rerun task finds the version it
already made instead of creating a second one.
"""

from __future__ import annotations

import tempfile

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from tasks.evaluate import EvalSummary
from tasks.tracking import client_for
from tasks.tracking_config import TrackingConfig
from trainers.checkpoints import CheckpointInfo


class Registration(BaseModel):
    """What a register task did."""

    name: str
    version: int
    tokens: int
    created: bool
    latest: int
    best: int


def artifact_path(tokens: int) -> str:
    return f"checkpoints/tok-{tokens:012d}"


def _run_versions(client, name: str, run_id: str) -> dict[int, object]:
    """tokens -> model version, for the versions this run registered (the idempotency key)."""
    versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    return {int(v.tags["tokens"]): v for v in versions if "tokens" in v.tags}


def _ensure_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(
                name, description="Checkpoints of a tessera pretraining run, one version per evaluation."
            )
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
                raise


# MLflow reserves the alias `latest` (models:/name/latest is built in and means the highest version
# number), so the moving "latest" pointer is this alias instead.
LATEST_ALIAS = "latest-checkpoint"
BEST_ALIAS = "best"


def _move_aliases(client, name: str, run_id: str) -> tuple[int, int]:
    """LATEST_ALIAS: this run's furthest checkpoint. BEST_ALIAS: the highest gauntlet average of any version."""
    versions = client.search_model_versions(f"name = '{name}'")
    own = [v for v in versions if v.run_id == run_id]
    latest = max(own, key=lambda v: int(v.tags.get("tokens", -1)))
    scored = [v for v in versions if "gauntlet_average" in v.tags]
    # ties go to the later checkpoint: same score for more training is the better default
    best = max(scored, key=lambda v: (float(v.tags["gauntlet_average"]), int(v.tags.get("tokens", -1))))
    client.set_registered_model_alias(name, LATEST_ALIAS, latest.version)
    client.set_registered_model_alias(name, BEST_ALIAS, best.version)
    return int(latest.version), int(best.version)


def existing_registrations(tracking: TrackingConfig, run_id: str) -> dict[int, Registration]:
    """tokens -> Registration for checkpoints of this run that are already registered."""
    from mlflow.exceptions import MlflowException

    client = client_for(tracking)
    name = tracking.registered_model
    try:
        versions = _run_versions(client, name, run_id)
        aliases = client.get_registered_model(name).aliases
    except MlflowException:  # no registered model yet
        return {}
    return {
        tokens: Registration(
            name=name, version=int(v.version), tokens=tokens, created=False,
            latest=int(aliases.get(LATEST_ALIAS, -1)), best=int(aliases.get(BEST_ALIAS, -1)),
        )  # fmt: skip
        for tokens, v in versions.items()
    }


@task(retries=3, retry_delay_seconds=2, cache_policy=NO_CACHE)
def move_aliases(tracking: TrackingConfig, run_id: str) -> tuple[int, int]:
    """Point the aliases at this run's furthest and the model's best version; returns (latest, best)."""
    return _move_aliases(client_for(tracking), tracking.registered_model, run_id)


@task(retries=3, retry_delay_seconds=2, cache_policy=NO_CACHE)
def register_checkpoint(
    checkpoint: CheckpointInfo,
    summary: EvalSummary,
    tracking: TrackingConfig,
    run_id: str,
    recipe_hash: str,
) -> Registration:
    """Log the checkpoint as an HF model directory under the run and register it."""
    from trainers.export import export_hf

    client = client_for(tracking)
    name = tracking.registered_model
    _ensure_registered_model(client, name)
    existing = _run_versions(client, name, run_id).get(checkpoint.tokens)
    created = existing is None
    if created:
        with tempfile.TemporaryDirectory(prefix="tessera-export-") as tmp:
            export_hf(checkpoint.path, tmp)
            client.log_artifacts(run_id, tmp, artifact_path=artifact_path(checkpoint.tokens))
        source = f"{client.get_run(run_id).info.artifact_uri}/{artifact_path(checkpoint.tokens)}"
        tags = {
            "tokens": str(checkpoint.tokens),
            "stage": checkpoint.stage,
            "batch": str(checkpoint.batch),
            "recipe_hash": recipe_hash,
            "gauntlet_average": f"{summary.average:.6f}",
            **{f"score/{k}": f"{v:.6f}" for k, v in sorted(summary.metrics.items()) if k.startswith("gauntlet/")},
        }
        existing = client.create_model_version(name, source=source, run_id=run_id, tags=tags)
    latest, best = _move_aliases(client, name, run_id)
    return Registration(
        name=name, version=int(existing.version), tokens=checkpoint.tokens, created=created, latest=latest, best=best
    )

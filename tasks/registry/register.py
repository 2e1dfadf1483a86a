"""Register an evaluated checkpoint as an MLflow Model version and keep the aliases and descriptions true.

Each version is an MLflow Model of the transformers flavor (task text-generation), so
`mlflow.transformers.load_model("models:/NAME@champion")` and `mlflow.pyfunc.load_model(...)`
return a model that generates text, and `mlflow models serve` can serve it. Small models are
copied into the run's artifacts; a model over `tracking.register_by_reference_above_mb` whose run
keeps its checkpoints in object storage (`train.save_folder: s3://...`) is written next to them
(`<save_folder>/<run>/models/tok-<T>/`) and registered by that URI instead, so multi-GB weights
are not copied into the artifact store a second time.

A version is identified by (run id, tokens), so a retried or rerun task finds the version it
already made instead of creating a second one. Its tags are the few that people filter on
(`version_record.TAGS`); the checkpoint, storage, batch, recipe hash and per-category scores are
in its record (`version_record(client, name, version)`), and its description says them in words.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff
from pydantic import BaseModel

from tasks.gauntlet.evaluate import EvalSummary
from tasks.mlflow_run import RUN_NAME_TAG, client_for, retrying
from tasks.registry.aliases import (  # noqa: F401 - the alias names are part of this module's interface
    BEST_ALIAS,
    BEST_MARGIN_TAG,
    CHAMPION_ALIAS,
    LATEST_ALIAS,
    PREVIOUS_CHAMPION_ALIAS,
    record_started,
    refresh_descriptions,
    set_aliases,
)
from tasks.registry.version_record import TAGS, checkpoint_of, has_version_record, now, write_version_record  # noqa: F401
from tasks.retry import retry_unless
from tasks.tracking_config import TrackingConfig
from trainers.contract import OneLineError
from trainers.format.checkpoints import CheckpointInfo, DamagedCheckpoint, verify
from trainers.format.mlflow_model import publish, save_mlflow_model, weights_mb


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
                name,
                tags=record_started(),
                description="Checkpoints of tessera pretraining runs, one version per evaluated checkpoint.",
            )
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
                raise


def _move_aliases(client, name: str, run_id: str) -> tuple[int, int]:
    """LATEST_ALIAS: this run's furthest checkpoint. BEST_ALIAS: the highest headline score among the
    versions scored on the same gauntlet as this run's (scores of other gauntlets do not compare)."""
    versions = client.search_model_versions(f"name = '{name}'")
    own = [v for v in versions if v.run_id == run_id]
    latest = max(own, key=lambda v: int(v.tags.get("tokens", -1)))
    gauntlet = latest.tags.get("gauntlet_hash")
    scored = [v for v in versions if "gauntlet_average" in v.tags and v.tags.get("gauntlet_hash") == gauntlet]
    best = max(scored, key=_rank)
    run = client.get_run(run_id).data.tags.get(RUN_NAME_TAG, run_id)
    margin = best_margin(client, scored, best)
    model = client.get_registered_model(name)
    renote = margin != model.tags.get(BEST_MARGIN_TAG)
    if renote and margin is None:
        client.delete_registered_model_tag(name, BEST_MARGIN_TAG)
    elif renote:
        client.set_registered_model_tag(name, BEST_MARGIN_TAG, margin)
    held_before = str(model.aliases.get(BEST_ALIAS))
    set_aliases(client, name, {LATEST_ALIAS: latest.version, BEST_ALIAS: best.version}, observer=f"run {run}")
    if renote and held_before == str(best.version):  # best did not move, so set_aliases left its description
        refresh_descriptions(client, name, [str(best.version)])
    return int(latest.version), int(best.version)


def _rank(version) -> tuple[float, int]:
    # ties go to the later checkpoint: same score for more training is the better default
    return float(version.tags["gauntlet_average"]), int(version.tags.get("tokens", -1))


def _report_of(client, version):
    """The gauntlet report the version was registered with (logged in its run by log_report), or None."""
    from evaluation.mlflow_report import report_paths
    from evaluation.report import GauntletReport

    path = report_paths(int(version.tags.get("tokens", -1))).json
    try:
        with tempfile.TemporaryDirectory(prefix="tessera-report-") as tmp:
            return GauntletReport.from_json(Path(client.download_artifacts(version.run_id, path, tmp)).read_text())
    except Exception:  # noqa: BLE001 - a version registered by hand, or before reports kept their examples
        return None


def best_margin(client, scored: list, best) -> str | None:
    """How `best` stands against the runner-up, paired example by example on their gauntlet reports:
    "within noise of v5, the runner-up: core_average +0.0120 (95% interval -0.0200 to +0.0440) over 373
    examples", or "clear of ..."; None when there is no runner-up or the two cannot be paired."""
    from evaluation.noise import NotPaired, paired_gains

    others = [v for v in scored if str(v.version) != str(best.version)]
    if not others:
        return None
    runner = max(others, key=_rank)
    a, b = _report_of(client, runner), _report_of(client, best)
    if a is None or b is None:
        return None
    try:
        gains = paired_gains(None, a, b, b.headline)
    except NotPaired:
        return None
    iv = gains.of(b.headline)
    where = "within noise of" if iv.low <= 0 else "clear of"
    return (
        f"{where} v{runner.version}, the runner-up: {b.headline} {iv.text(gains.confidence)} over "
        f"{gains.examples} examples"
    )


def best_of_run(client, name: str, run_id: str) -> str | None:
    """The run's own best version by headline score (ties: the later checkpoint), or None."""
    scored = [v for v in _run_versions(client, name, run_id).values() if "gauntlet_average" in v.tags]
    if not scored:
        return None
    return str(max(scored, key=lambda v: (float(v.tags["gauntlet_average"]), int(v.tags["tokens"]))).version)


def run_best(tracking: TrackingConfig, name: str, run_id: str) -> str | None:
    """`best_of_run` through the tracking server's retries: the run's best version of `name`, or None. What the
    champion's bootstrap and continued pretraining's challenger both ask."""
    client = client_for(tracking)
    return retrying("finding the run's best version", lambda: best_of_run(client, name, run_id))


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
            name=name,
            version=int(v.version),
            tokens=tokens,
            created=False,
            latest=int(aliases.get(LATEST_ALIAS, -1)),
            best=int(aliases.get(BEST_ALIAS, -1)),
        )
        for tokens, v in versions.items()
    }


# Idempotent, so retried generously: a tracking server restart mid-run must not lose a version
# (2, 4, ... 128 s: about four minutes in all).
@task(retries=7, retry_delay_seconds=exponential_backoff(backoff_factor=2), cache_policy=NO_CACHE)
def move_aliases(tracking: TrackingConfig, run_id: str) -> tuple[int, int]:
    """Point the aliases at this run's furthest and the model's best version; returns (latest, best)."""
    return _move_aliases(client_for(tracking), tracking.registered_model, run_id)


class NotRegistered(OneLineError, ValueError):
    """A checkpoint refused before it is exported: its bytes are not those its manifest published."""


@task(
    retries=7,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    cache_policy=NO_CACHE,
    retry_condition_fn=retry_unless(NotRegistered),
    task_run_name="register-tok-{checkpoint.tokens}",
)
def register_checkpoint(
    checkpoint: CheckpointInfo,
    summary: EvalSummary,
    tracking: TrackingConfig,
    run_id: str,
    recipe_hash: str,
    model_home: str | None = None,
    extra_tags: dict[str, str] | None = None,
) -> Registration:
    """Log the checkpoint as an MLflow Model (transformers flavor) and register it as a version."""
    from trainers.format.export import export_hf

    client = client_for(tracking)
    name = tracking.registered_model
    _ensure_registered_model(client, name)
    existing = _run_versions(client, name, run_id).get(checkpoint.tokens)
    created = existing is None
    run = client.get_run(run_id)
    extra = extra_tags or {}
    storage = None
    if created:
        if summary.model_uri:  # packaged where it was scored (an evaluation pod): never loaded here
            source, storage = summary.model_uri, "reference"
        else:
            try:  # scored minutes ago, maybe, but what is exported is what is read now
                verify(checkpoint.path, sha256=checkpoint.sha256, files=checkpoint.files)
            except DamagedCheckpoint as exc:
                raise NotRegistered(f"{exc}; not registered") from None
            with tempfile.TemporaryDirectory(prefix="tessera-export-") as tmp:
                hf_dir = export_hf(checkpoint.path, Path(tmp) / "hf")
                card = (
                    f"# {name}\n\nA checkpoint of tessera run {run.data.tags.get(RUN_NAME_TAG, run_id)}, "
                    f"stage {checkpoint.stage}, after {checkpoint.tokens:,} tokens; {summary.headline} "
                    f"{summary.average:.4f} on gauntlet {summary.gauntlet_hash}. The licence is that of the "
                    "training data."
                )
                model_dir = save_mlflow_model(hf_dir, Path(tmp) / "mlflow-model", card)
                if model_home and weights_mb(hf_dir) > tracking.register_by_reference_above_mb:
                    source, storage = publish(model_dir, model_home), "reference"
                else:
                    client.log_artifacts(run_id, str(model_dir), artifact_path=artifact_path(checkpoint.tokens))
                    source, storage = f"{run.info.artifact_uri}/{artifact_path(checkpoint.tokens)}", "copy"
        tags = {
            "tokens": str(checkpoint.tokens),
            "stage": checkpoint.stage,
            "run": run.data.tags.get(RUN_NAME_TAG, run.info.run_name or ""),
            "gauntlet_hash": summary.gauntlet_hash,
            "headline": summary.headline,
            "gauntlet_average": f"{summary.average:.6f}",
            **{k: v for k, v in extra.items() if k in TAGS},
        }
        existing = client.create_model_version(name, source=source, run_id=run_id, tags=tags)
    # A retry that finds the version without its record (killed in between) writes the record then.
    if created or not has_version_record(client, name, existing.version, run_id):
        facts = {
            "checkpoint": checkpoint.path,
            "storage": storage or ("copy" if existing.source.startswith(f"{run.info.artifact_uri}/") else "reference"),
            "model_uri": existing.source,
            "batch": checkpoint.batch,
            "recipe_hash": recipe_hash,
            "run_id": run_id,
            "registered_at": now()[1],
            "scores": {k: round(v, 6) for k, v in sorted(summary.metrics.items()) if k.startswith("gauntlet/")},
            # facts the caller adds that nobody filters on (the checkpoint's lasting place, not its pin)
            **{k: v for k, v in extra.items() if k not in TAGS},
        }
        write_version_record(client, name, existing.version, facts)
        refresh_descriptions(client, name, [existing.version])
    latest, best = _move_aliases(client, name, run_id)
    return Registration(
        name=name, version=int(existing.version), tokens=checkpoint.tokens, created=created, latest=latest, best=best
    )

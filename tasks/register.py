"""Register an evaluated checkpoint as an MLflow Model version and keep the aliases and descriptions true.

Each version is an MLflow Model of the transformers flavor (task text-generation), so
`mlflow.transformers.load_model("models:/NAME@champion")` and `mlflow.pyfunc.load_model(...)`
return a model that generates text, and `mlflow models serve` can serve it. Small models are
copied into the run's artifacts; a model over `tracking.register_by_reference_above_mb` whose run
keeps its checkpoints in object storage (`train.save_folder: s3://...`) is written next to them
(`<save_folder>/<run>/models/tok-<T>/`) and registered by that URI instead, so multi-GB weights
are not copied into the artifact store a second time.

A version is identified by (run id, tokens), so a retried or rerun task finds the version it
already made instead of creating a second one.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff
from pydantic import BaseModel

from tasks.evaluate import EvalSummary
from tasks.retry import retry_unless
from tasks.tracking import RUN_NAME_TAG, client_for
from tasks.tracking_config import TrackingConfig
from trainers.checkpoints import CheckpointInfo
from trainers.mlflow_model import model_uri_for, publish, save_mlflow_model, weights_mb

# MLflow reserves the alias `latest` (models:/name/latest is built in and means the highest version
# number), so the moving "latest" pointer is this alias instead.
LATEST_ALIAS = "latest-checkpoint"
BEST_ALIAS = "best"
CHAMPION_ALIAS = "champion"
PREVIOUS_CHAMPION_ALIAS = "previous-champion"


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
                name, description="Checkpoints of tessera pretraining runs, one version per evaluated checkpoint."
            )
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
                raise


# ------------------------------------------------------------------ descriptions


def _alias_reason(alias: str, tags: dict[str, str]) -> str:
    headline = tags.get("headline", "gauntlet_average")
    if alias == LATEST_ALIAS:
        return f"{alias}: the furthest checkpoint of run {tags.get('run', '?')}"
    if alias == BEST_ALIAS:
        return f"{alias}: the highest {headline} among versions scored on gauntlet {tags.get('gauntlet_hash', '?')}"
    if alias == CHAMPION_ALIAS:
        return f"{alias}: {tags.get('champion.why', 'set before promotion was recorded')}"
    if alias == PREVIOUS_CHAMPION_ALIAS:
        return f"{alias}: {tags.get('previous_champion.why', 'the champion before the current one')}"
    return alias


def describe(tags: dict[str, str], aliases: list[str]) -> str:
    """What a version is, in words: run, stage, tokens, headline score, and each alias it holds and why."""
    headline = tags.get("headline", "gauntlet average")
    score = tags.get("gauntlet_average")
    lines = [
        f"Run {tags.get('run', '?')}, stage {tags.get('stage', '?')}, {int(tags.get('tokens', 0)):,} tokens"
        + (f", continued from {tags['continued_from']}" if "continued_from" in tags else "") + ".",
        f"{headline} {float(score):.4f} on gauntlet {tags.get('gauntlet_hash', '?')}." if score else "Not scored.",
        f"Stored {'by reference at ' + tags['model_uri'] if tags.get('storage') == 'reference' else 'in the run'}.",
    ]
    if aliases:
        lines.append("Aliases: " + "; ".join(_alias_reason(a, tags) for a in sorted(aliases)) + ".")
    if tags.get("promotion"):
        lines.append(f"Last promotion decision: {tags['promotion']} ({tags.get('promotion.summary', '')}).")
    return "\n".join(lines)


def refresh_descriptions(client, name: str, versions: list[str] | None = None) -> None:
    """Rewrite the descriptions of `versions` (default all) from their tags and the current aliases."""
    model = client.get_registered_model(name)
    held: dict[str, list[str]] = {}
    for alias, version in model.aliases.items():
        held.setdefault(str(version), []).append(alias)
    wanted = None if versions is None else {str(v) for v in versions}
    for mv in client.search_model_versions(f"name = '{name}'"):
        if wanted is None or str(mv.version) in wanted:
            text = describe(dict(mv.tags), held.get(str(mv.version), []))
            if text != (mv.description or ""):
                client.update_model_version(name, mv.version, description=text)


def _aliases_of(client, name: str) -> dict[str, str]:
    return {a: str(v) for a, v in client.get_registered_model(name).aliases.items()}


def set_aliases(client, name: str, moves: dict[str, str]) -> None:
    """Point each alias at its version and rewrite the descriptions of every version whose aliases changed."""
    before = _aliases_of(client, name)
    for alias, version in moves.items():
        if before.get(alias) != str(version):
            client.set_registered_model_alias(name, alias, str(version))
    after = _aliases_of(client, name)
    touched = {v for a in set(before) | set(after) if before.get(a) != after.get(a) for v in (before.get(a), after.get(a))}
    refresh_descriptions(client, name, sorted(v for v in touched if v is not None))


def _move_aliases(client, name: str, run_id: str) -> tuple[int, int]:
    """LATEST_ALIAS: this run's furthest checkpoint. BEST_ALIAS: the highest headline score among the
    versions scored on the same gauntlet as this run's (scores of other gauntlets do not compare)."""
    versions = client.search_model_versions(f"name = '{name}'")
    own = [v for v in versions if v.run_id == run_id]
    latest = max(own, key=lambda v: int(v.tags.get("tokens", -1)))
    gauntlet = latest.tags.get("gauntlet_hash")
    scored = [v for v in versions if "gauntlet_average" in v.tags and v.tags.get("gauntlet_hash") == gauntlet]
    # ties go to the later checkpoint: same score for more training is the better default
    best = max(scored, key=lambda v: (float(v.tags["gauntlet_average"]), int(v.tags.get("tokens", -1))))
    set_aliases(client, name, {LATEST_ALIAS: latest.version, BEST_ALIAS: best.version})
    return int(latest.version), int(best.version)


def best_of_run(client, name: str, run_id: str) -> str | None:
    """The run's own best version by headline score (ties: the later checkpoint), or None."""
    scored = [v for v in _run_versions(client, name, run_id).values() if "gauntlet_average" in v.tags]
    if not scored:
        return None
    return str(max(scored, key=lambda v: (float(v.tags["gauntlet_average"]), int(v.tags["tokens"]))).version)


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


# Idempotent, so retried generously: a tracking server restart mid-run must not lose a version
# (2, 4, ... 128 s: about four minutes in all).
@task(retries=7, retry_delay_seconds=exponential_backoff(backoff_factor=2), cache_policy=NO_CACHE)
def move_aliases(tracking: TrackingConfig, run_id: str) -> tuple[int, int]:
    """Point the aliases at this run's furthest and the model's best version; returns (latest, best)."""
    return _move_aliases(client_for(tracking), tracking.registered_model, run_id)


@task(retries=7, retry_delay_seconds=exponential_backoff(backoff_factor=2), cache_policy=NO_CACHE,
      retry_condition_fn=retry_unless(), task_run_name="register-tok-{checkpoint.tokens}")  # fmt: skip
def register_checkpoint(
    checkpoint: CheckpointInfo,
    summary: EvalSummary,
    tracking: TrackingConfig,
    run_id: str,
    recipe_hash: str,
    remote_folder: str | None = None,
    extra_tags: dict[str, str] | None = None,
) -> Registration:
    """Log the checkpoint as an MLflow Model (transformers flavor) and register it as a version."""
    from trainers.export import export_hf

    client = client_for(tracking)
    name = tracking.registered_model
    _ensure_registered_model(client, name)
    existing = _run_versions(client, name, run_id).get(checkpoint.tokens)
    created = existing is None
    if created:
        run = client.get_run(run_id)
        if summary.model_uri:  # packaged where it was scored (an evaluation pod): never loaded here
            source, storage = summary.model_uri, "reference"
        else:
            with tempfile.TemporaryDirectory(prefix="tessera-export-") as tmp:
                hf_dir = export_hf(checkpoint.path, Path(tmp) / "hf")
                card = (f"# {name}\n\nA checkpoint of tessera run {run.data.tags.get(RUN_NAME_TAG, run_id)}, "
                        f"stage {checkpoint.stage}, after {checkpoint.tokens:,} tokens; {summary.headline} "
                        f"{summary.average:.4f} on gauntlet {summary.gauntlet_hash}. The licence is that of the "
                        "training data.")  # fmt: skip
                model_dir = save_mlflow_model(hf_dir, Path(tmp) / "mlflow-model", card)
                if remote_folder and weights_mb(hf_dir) > tracking.register_by_reference_above_mb:
                    source, storage = publish(model_dir, model_uri_for(remote_folder, checkpoint.tokens)), "reference"
                else:
                    client.log_artifacts(run_id, str(model_dir), artifact_path=artifact_path(checkpoint.tokens))
                    source, storage = f"{run.info.artifact_uri}/{artifact_path(checkpoint.tokens)}", "copy"
        tags = {
            "tokens": str(checkpoint.tokens),
            "stage": checkpoint.stage,
            "batch": str(checkpoint.batch),
            "run": run.data.tags.get(RUN_NAME_TAG, run.info.run_name or ""),
            "recipe_hash": recipe_hash,
            "gauntlet_hash": summary.gauntlet_hash,
            "headline": summary.headline,
            "gauntlet_average": f"{summary.average:.6f}",
            "checkpoint": checkpoint.path,
            "storage": storage,
            "model_uri": source,
            **{f"score/{k}": f"{v:.6f}" for k, v in sorted(summary.metrics.items()) if k.startswith("gauntlet/")},
            **(extra_tags or {}),
        }
        existing = client.create_model_version(name, source=source, run_id=run_id, tags=tags)
        refresh_descriptions(client, name, [existing.version])
    latest, best = _move_aliases(client, name, run_id)
    return Registration(
        name=name, version=int(existing.version), tokens=checkpoint.tokens, created=created, latest=latest, best=best
    )

"""A training run's bookkeeping, as tasks: each shows in the flow run's graph with its state, and retries.

- `source_commit`: the code's git sha (dirty or not), which the MLflow run records;
- `tag_flow_run` / `rename_flow_run`: the flow run's tags (`run:<name>`, `promotion:...`) and name in Prefect;
- `record_recipe`: the resolved recipe beside the run and on its MLflow run, with any param that changed;
- `link_mlflow_run`: a link artifact, so the Prefect UI leads to the MLflow run in one click;
- `bootstrap_champion`: a model's first champion is its first run's best version;
- `publish_registrations`: the versions a run registered, as a markdown artifact.

Outside any task: `record_flow_run_end`, which the crash and cancellation hooks call from Prefect's runner
(outside the dead flow process, where no task can run), and `close_after_failure`, which must never hide or
delay the error that ended the flow.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import yaml
from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tasks.artifacts import artifact_key
from tasks.mlflow_run import close_run, find_run, model_ui_url, record_run, run_ui_url
from tasks.recipe import Recipe, run_folder
from tasks.registry.register import Registration, run_best
from tasks.runs.run_slot import add_tags
from tasks.tracking_config import TrackingConfig
from tasks.training.train import what_stays

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# When the run is already failing, waiting out a long tracking outage only delays the real error.
CLOSE_AFTER_FAILURE_S = 30.0


@task(cache_policy=NO_CACHE)
def source_commit() -> str:
    """The code's commit, `-dirty` when tracked files differ from it; `unknown` outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (out.stdout.strip() + ("-dirty" if dirty else "")) if out.returncode == 0 else "unknown"


def mlflow_tags(recipe: Recipe, run_name: str, recipe_path: str, sha: str, extra: dict[str, str]) -> dict[str, str]:
    """The MLflow run's tags: the recipe and code it ran, the Prefect flow run that holds it, and MLflow's own
    source tags (its UI shows them as the run's source and commit)."""
    from prefect.runtime import flow_run

    flow_url = flow_run.ui_url or ""
    return {
        "recipe_hash": recipe.content_hash(),
        "recipe": recipe_path,
        "tessera.recipe_path": str(Path(recipe_path).resolve()),
        "tessera.git_sha": sha,
        "tessera.prefect.flow_run_id": str(flow_run.id or ""),
        "tessera.prefect.flow_run_name": str(flow_run.name or ""),
        "tessera.prefect.flow_run_url": flow_url,
        "mlflow.source.type": "JOB",
        "mlflow.source.name": "flows/pipeline.py:pretrain_pipeline",
        "mlflow.source.git.commit": sha,
        "mlflow.note.content": f"tessera run **{run_name}** of recipe `{recipe_path}`"
        + (f", Prefect flow run [{flow_run.name}]({flow_url})" if flow_url else ""),
        **extra,
    }


@task(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def tag_flow_run(flow_run_id: str | None, tags: list[str]) -> None:
    """Add `tags` to the flow run's own (the runs list filters on them: `run:<name>`, `promotion:...`)."""
    add_tags(flow_run_id, tags)


@task(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def rename_flow_run(flow_run_id: str | None, name: str) -> None:
    """Name the flow run after the tessera run, once that name is known."""
    if not flow_run_id:
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run_id, name=name)


@task(cache_policy=NO_CACHE)
def record_recipe(recipe: Recipe, run_name: str, run_dir: Path, run_id: str) -> None:
    """The resolved recipe as `recipe.yaml` in the run's folder and on its MLflow run, with its params; a param
    this MLflow run was started with another value of is said, and kept as a tag."""
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = run_dir / "recipe.yaml"
    resolved.write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    changed = record_run.fn(recipe.tracking, run_id, recipe.tracked_params(), {}, {"recipe": str(resolved)})
    if changed:
        get_run_logger().warning(
            "run %s: %s differ from the values this MLflow run was started with; kept as tessera.param_changed.* tags",
            run_name,
            ", ".join(changed),
        )


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
def link_mlflow_run(tracking: TrackingConfig, run_name: str, run_id: str) -> None:
    """A link artifact on the flow run, so the Prefect UI leads to the MLflow run in one click."""
    from tasks.mlflow_run import client_for

    experiment_id = client_for(tracking).get_run(run_id).info.experiment_id
    create_link_artifact(
        link=run_ui_url(tracking, run_id, experiment_id),
        link_text=f"MLflow run {run_name}",
        key=artifact_key(run_name, "mlflow-run"),
        description=f"Open the MLflow run of {run_name}: its metrics, gauntlet reports and model versions ({run_id}).",
    )


@task(cache_policy=NO_CACHE)
def publish_registrations(tracking: TrackingConfig, run_name: str, registrations: list[Registration]) -> None:
    """The versions the run registered, with where its aliases stand, as the flow run's markdown artifact."""
    rows = "\n".join(f"| {r.tokens:,} | v{r.version} | {'new' if r.created else 'existing'} |" for r in registrations)
    summary = (
        f"# {tracking.registered_model}\n\n| tokens | version | |\n|---:|---|---|\n{rows}\n\n"
        f"latest-checkpoint = v{registrations[-1].latest}, best = v{registrations[-1].best}\n\n"
        f"[Open {tracking.registered_model} in MLflow's model registry]"
        f"({model_ui_url(tracking, tracking.registered_model)})\n"
        if registrations
        else "No checkpoint was registered."
    )
    create_markdown_artifact(
        key=artifact_key(run_name, "registered-versions"),
        markdown=summary,
        description=f"Model versions registered by run {run_name}",
    )
    count = len(registrations)
    get_run_logger().info("run %s: %d model version%s registered", run_name, count, "" if count == 1 else "s")


@task(cache_policy=NO_CACHE)
def bootstrap_champion(tracking: TrackingConfig, run_name: str, mlflow_run_id: str) -> None:
    """A model's first champion is its first run's best version; after that only the promotion rule moves it."""
    from tasks.mlflow_run import client_for, retrying
    from tasks.registry.promote import bootstrap

    name = tracking.registered_model
    client = client_for(tracking)
    best = run_best(tracking, name, mlflow_run_id)
    if best and retrying("bootstrapping the champion", lambda: bootstrap(client, name, best, run_name)):
        get_run_logger().info("%s: v%s is the first champion (bootstrap)", name, best)


def record_flow_run_end(flow_run, state, tracking: TrackingConfig, run_name: str) -> None:
    """Close run `run_name`'s MLflow run KILLED (a cancel) or FAILED (a crash) if this flow run holds it."""
    try:
        run = find_run(tracking, run_name)
        # A later flow run of the same run name may have taken the MLflow run over meanwhile (the worker runs
        # this hook seconds after a cancel, when a rerun can already be training): never end that one.
        if run is None or run.data.tags.get("tessera.prefect.flow_run_id") not in (None, str(flow_run.id)):
            return
        status = "KILLED" if state.is_cancelled() or state.is_cancelling() else "FAILED"
        note = f"Prefect flow run {flow_run.name!r} ({flow_run.id}) {state.name}: {state.message or ''}".strip()
        close_run.fn(tracking, run.info.run_id, status, note)
    except Exception:  # a hook must never turn one failure into two
        logging.getLogger("tessera.pipeline").warning(
            "could not record the end of flow run %s in MLflow", flow_run.id, exc_info=True
        )


def close_after_failure(tracking: TrackingConfig, run_id: str, error: BaseException) -> None:
    """Mark the MLflow run failed or killed without ever hiding, delaying long or replacing the error
    that ended the flow (it is re-raised by the caller, whatever happens here)."""
    cancelled = not isinstance(error, Exception)  # TerminationSignal, KeyboardInterrupt: a cancel or a signal
    note = f"{'cancelled' if cancelled else 'failed'}: {type(error).__name__}: {error}"
    try:
        close_run.fn(tracking, run_id, "KILLED" if cancelled else "FAILED", note, CLOSE_AFTER_FAILURE_S)
    except Exception as exc:  # noqa: BLE001 - the error that ended the flow is the one to see
        get_run_logger().warning(
            "could not mark MLflow run %s as ended (%s); the error above is what failed", run_id, exc
        )


def close_finished(tracking: TrackingConfig, run_name: str, run_id: str) -> None:
    """Close the MLflow run FINISHED; a tracking server that will not take it costs a warning, not the run."""
    try:
        close_run(tracking, run_id, "FINISHED")
    except Exception as exc:  # noqa: BLE001 - the work is done and registered; only the status flag is stale
        get_run_logger().warning(
            "run %s finished, but MLflow run %s could not be closed (%s); a rerun closes it", run_name, run_id, exc
        )


def job_path_of(work_dir: str | Path, run_name: str) -> Path:
    """Where the run's job file lives: the trainer's one input, and what a stopped run's last line reads."""
    return run_folder(work_dir, run_name) / "job.json"


def stays_of(recipe: Recipe, run_name: str) -> str:
    """What a stopped run of `recipe` keeps, for the line that ends it (every training flow's run_or_end)."""
    return what_stays(job_path_of(recipe.work_dir, run_name), recipe.compute)

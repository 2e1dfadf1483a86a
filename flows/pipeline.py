"""`pretrain_pipeline`: prepare -> curriculum training -> a gauntlet per checkpoint -> registry.

The flow only sequences work. Training runs as an external job; while it runs, the flow
watches the run's checkpoint manifests and gives every new checkpoint its own evaluate and
register task runs, so training never waits for the gauntlet.

Started from the Prefect UI, a schedule or the CLI alike, so it guards itself: one live flow run
per run name (tasks/run_slot.py), the trainer stopped if the flow fails or is cancelled, and the
MLflow run told how the flow run ended even when the flow process itself was killed (the crash
and cancellation hooks, which Prefect's runner calls from outside it).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Annotated, Literal

import yaml
from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.futures import wait
from pydantic import BaseModel, Field

from flows.prepare import prepare_recipe_data
from tasks.aliases import reconcile_registry
from tasks.artifacts import artifact_key
from tasks.flow_outcome import REFUSED, form_values, keep_last_word, run_or_end
from tasks.gauntlet_queue import GauntletQueue, QueueTarget
from tasks.mlflow_run import (
    close_run,
    find_run,
    model_ui_url,
    open_run,
    record_run,
    resolved_uri,
    run_ui_url,
    served_elsewhere,
)
from tasks.recipe import (
    NAME_PATTERN,
    Recipe,
    RecipeOverrides,
    apply_overrides,
    form_input,
    load_recipe,
    run_folder,
)
from tasks.register import Registration, move_aliases
from tasks.run_slot import one_per_run, run_tag
from tasks.runtime import prepare_process
from tasks.train import (
    MlflowTarget,
    TrainJob,
    allow_launches,
    deliver_metrics,
    make_job,
    report_goodput,
    stop_launched_jobs,
    train_stage,
    what_stays,
    write_job,
)

POLL_SECONDS = 2.0
PROJECT_ROOT = Path(__file__).resolve().parents[1]


RUN_NAME_HELP = (
    "This names the tessera run: its checkpoints, its MLflow run and its model versions; the same name resumes "
    "it. Empty: the recipe's name. Letters, digits, '.', '_' and '-', not only dots. (The Run Name at the top of "
    "the page only labels the Prefect flow run, which is renamed after this one.)"
)


class RecipeTarget(BaseModel):
    """The first field of every training form: which recipe."""

    recipe: str = Field(
        ...,
        min_length=1,
        description="Path to the recipe YAML, e.g. configs/tiny.yaml (relative paths resolve against the worker's "
        "directory).",
    )


class RunTarget(RecipeTarget):
    """The first two fields of a training form: which recipe, and which run of it."""

    run_name: Annotated[str | None, *form_input({"type": "string", "pattern": NAME_PATTERN})] = Field(
        None, pattern=NAME_PATTERN, title="Run name", description=RUN_NAME_HELP
    )


class PipelineParams(RecipeOverrides, RunTarget):
    """A training run of a recipe. Only the recipe is required: every other field left empty keeps the recipe's
    value. The run name below, not the Run Name above, names the run."""

    if_running: Literal["refuse", "wait"] = Field(
        "refuse",
        title="If a run of this name is live",
        description="refuse: end at once as Refused, naming the live run; wait: start when it has ended.",
    )


class PipelineResult(BaseModel):
    run_name: str
    mlflow_run_id: str
    registrations: list[Registration]


def _train_and_watch(
    recipe: Recipe, job: TrainJob, job_path: Path, run_dir: Path, queue: GauntletQueue, holder: str, recipe_path: str
) -> None:
    save_folder = Path(job.save_folder)
    for k, stage in enumerate(recipe.train.stages):
        training = train_stage.with_options(retries=recipe.compute.max_restarts).submit(
            str(job_path), k, stage.name, recipe.compute, str(run_dir / "logs"), job.run_name, holder, recipe_path
        )
        while not wait([training], timeout=POLL_SECONDS).done:
            queue.sweep(save_folder)
        training.result()
        queue.sweep(save_folder)
        report_goodput(job, str(run_dir), stage.name)
    deliver_metrics(job)


def _git_sha() -> str:
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


def _resolve(params: PipelineParams) -> tuple[Recipe, str]:
    """The recipe with the form's overrides applied, and the run name: first thing, before anything runs."""
    recipe = apply_overrides(load_recipe(params.recipe), params, params.recipe)
    return recipe, params.run_name or recipe.name


def _flow_run_name() -> str:
    """Flow runs are named after the tessera run (`tiny`), not Prefect's random names."""
    from prefect.runtime import flow_run

    params = flow_run.parameters.get("params")
    params = params.model_dump() if isinstance(params, BaseModel) else dict(params or {})
    if params.get("run_name"):
        return str(params["run_name"])
    try:  # the recipe's own name; the flow itself reports a bad recipe properly
        return str(yaml.safe_load(Path(params["recipe"]).read_text())["name"])
    except Exception:  # noqa: BLE001
        return Path(str(params.get("recipe", "tessera"))).stem or "tessera"


def tag_flow_run(flow_run_id: str | None, tags: list[str]) -> None:
    if not flow_run_id:
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        current = client.read_flow_run(flow_run_id).tags
        client.update_flow_run(flow_run_id, tags=sorted(set(current) | set(tags)))


def _record_end(flow, flow_run, state) -> None:
    """on_crashed / on_cancellation: mark the MLflow run, even when the flow process is already gone.

    Prefect's runner calls this from outside the dead flow process, so it rebuilds what it needs
    from the flow run's parameters.
    """
    if state.name == REFUSED:  # the MLflow run is the live holder's: it is not this flow run's to close
        return
    if state.is_cancelling() or state.is_cancelled():  # first: the runner's own Cancelled comes after the hooks
        keep_last_word(flow_run.id)
    try:
        recipe, run_name = _resolve(PipelineParams.model_validate(flow_run.parameters["params"]))
    except Exception:  # noqa: BLE001 - a recipe that does not load opened no MLflow run
        return
    record_flow_run_end(flow_run, state, recipe.tracking, run_name)


def record_flow_run_end(flow_run, state, tracking, run_name: str) -> None:
    """Close run `run_name`'s MLflow run KILLED (a cancel) or FAILED (a crash) if this flow run holds it."""
    import logging

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


# When the run is already failing, waiting out a long tracking outage only delays the real error.
CLOSE_AFTER_FAILURE_S = 30.0


def _close_after_failure(tracking, run_id: str, error: BaseException) -> None:
    """Mark the MLflow run failed or killed without ever hiding, delaying long or replacing the error
    that ended the flow (it is re-raised by the caller, whatever happens here)."""
    cancelled = not isinstance(error, Exception)  # TerminationSignal, KeyboardInterrupt: a cancel or a signal
    note = f"{'cancelled' if cancelled else 'failed'}: {type(error).__name__}: {error}"
    try:
        close_run.fn(tracking, run_id, "KILLED" if cancelled else "FAILED", note, CLOSE_AFTER_FAILURE_S)
    except Exception as exc:  # noqa: BLE001
        get_run_logger().warning(
            "could not mark MLflow run %s as ended (%s); the error above is what failed", run_id, exc
        )


def run_pipeline(
    recipe: Recipe,
    run_name: str,
    recipe_path: str,
    if_running: Literal["refuse", "wait"] = "refuse",
    run_tags: dict[str, str] | None = None,
    version_tags: dict[str, str] | None = None,
) -> PipelineResult:
    """Prepare, train every stage, evaluate and register each checkpoint; the body of every training flow.

    `run_tags` go on the MLflow run, `version_tags` on every model version it registers (continued
    pretraining records what it continued from).
    """
    from prefect.runtime import flow_run

    logger = get_run_logger()
    flow_run_id = flow_run.id
    run_folder(recipe.work_dir, run_name)  # a name that would escape the runs folder: one line, before anything
    for line in [*recipe.notices(), served_elsewhere(recipe.tracking.tracking_uri)]:
        if line:
            logger.warning("%s", line)
    allow_launches()  # an earlier flow run in this same process may have stopped its jobs
    tag_flow_run(flow_run_id, ["tessera", f"recipe:{recipe.name}", run_tag(run_name)])
    with one_per_run(run_name, if_running, flow_run_id):
        return _run_exclusively(recipe, run_name, recipe_path, run_tags or {}, version_tags or {}, logger)


def _run_exclusively(
    recipe: Recipe, run_name: str, recipe_path: str, run_tags: dict[str, str], version_tags: dict[str, str], logger
) -> PipelineResult:
    from prefect.runtime import flow_run

    run_dir = run_folder(recipe.work_dir, run_name)
    flow_url = flow_run.ui_url or ""
    tags = {
        "recipe_hash": recipe.content_hash(),
        "recipe": recipe_path,
        "tessera.recipe_path": str(Path(recipe_path).resolve()),
        "tessera.git_sha": (sha := _git_sha()),
        "tessera.prefect.flow_run_id": str(flow_run.id or ""),
        "tessera.prefect.flow_run_name": str(flow_run.name or ""),
        "tessera.prefect.flow_run_url": flow_url,
        # MLflow's own source tags: its UI shows them as the run's source and commit
        "mlflow.source.type": "JOB",
        "mlflow.source.name": "flows/pipeline.py:pretrain_pipeline",
        "mlflow.source.git.commit": sha,
        "mlflow.note.content": f"tessera run **{run_name}** of recipe `{recipe_path}`"
        + (f", Prefect flow run [{flow_run.name}]({flow_url})" if flow_url else ""),
        **run_tags,
    }
    # first: a dead tracking server should stop the run before any compute is spent
    run_id = open_run(recipe.tracking, run_name, tags=tags)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved = run_dir / "recipe.yaml"
        resolved.write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
        changed = record_run(recipe.tracking, run_id, recipe.tracked_params(), {}, {"recipe": str(resolved)})
        if changed:
            logger.warning(
                "run %s: %s differ from the values this MLflow run was started with; kept as "
                "tessera.param_changed.* tags",
                run_name,
                ", ".join(changed),
            )
        _link_mlflow_run(recipe, run_name, run_id)

        data = prepare_recipe_data(recipe.data, recipe.train.stages, run_name)
        job = make_job(
            run_name,
            recipe.model,
            recipe.train,
            recipe.data.seq_len,
            data.prepared,
            data.seq_len_streams,
            recipe.eval.every,
            run_dir,
            MlflowTarget(tracking_uri=resolved_uri(recipe.tracking.tracking_uri), run_id=run_id),
        )
        job_path = write_job(job, _job_path(recipe, run_name))
        record_run(recipe.tracking, run_id, {"data.vocab_size": str(job.vocab_size)}, {}, {"recipe": str(job_path)})
        queue = GauntletQueue(
            QueueTarget(
                run_name=run_name,
                run_id=run_id,
                eval=recipe.eval,
                tracking=recipe.tracking,
                compute=recipe.compute,
                seq_len=recipe.data.seq_len,
                recipe_hash=recipe.content_hash(),
                remote_folder=job.remote_folder,
            ),
            run_dir,
            version_tags,
        )
        holder = f"flow run {flow_run.name!r} ({flow_run.id}{', ' + flow_url if flow_url else ''})"
        try:
            _train_and_watch(recipe, job, job_path, run_dir, queue, holder, recipe_path)
        except BaseException:
            # The stage runs in a task thread that Prefect cannot interrupt: stop its job here, so a
            # failed or interrupted flow never leaves a trainer writing into the run's folder.
            stop_launched_jobs()
            raise
        registrations = queue.results()
        if registrations:  # a rerun after a crash between registering and moving aliases heals here
            latest, best = move_aliases(recipe.tracking, run_id)
            registrations = [r.model_copy(update={"latest": latest, "best": best}) for r in registrations]
    except BaseException as error:
        _close_after_failure(recipe.tracking, run_id, error)
        raise
    try:
        close_run(recipe.tracking, run_id, "FINISHED")
    except Exception as exc:  # noqa: BLE001 - the work is done and registered; only the status flag is stale
        logger.warning(
            "run %s finished, but MLflow run %s could not be closed (%s); a rerun closes it", run_name, run_id, exc
        )

    rows = "\n".join(f"| {r.tokens:,} | v{r.version} | {'new' if r.created else 'existing'} |" for r in registrations)
    summary = (
        f"# {recipe.tracking.registered_model}\n\n| tokens | version | |\n|---:|---|---|\n{rows}\n\n"
        f"latest-checkpoint = v{registrations[-1].latest}, best = v{registrations[-1].best}\n\n"
        f"[Open {recipe.tracking.registered_model} in MLflow's model registry]"
        f"({model_ui_url(recipe.tracking, recipe.tracking.registered_model)})\n"
        if registrations
        else "No checkpoint was registered."
    )
    create_markdown_artifact(
        key=artifact_key(run_name, "registered-versions"),
        markdown=summary,
        description=f"Model versions registered by run {run_name}",
    )
    logger.info("run %s: %d versions registered", run_name, len(registrations))
    return PipelineResult(run_name=run_name, mlflow_run_id=run_id, registrations=registrations)


def _link_mlflow_run(recipe: Recipe, run_name: str, run_id: str) -> None:
    """A link artifact on the flow run, so the Prefect UI leads to the MLflow run in one click."""
    from tasks.mlflow_run import client_for

    experiment_id = client_for(recipe.tracking).get_run(run_id).info.experiment_id
    url = run_ui_url(recipe.tracking, run_id, experiment_id)
    create_link_artifact(
        link=url,
        link_text=f"MLflow run {run_name}",
        key=artifact_key(run_name, "mlflow-run"),
        description=f"Open the MLflow run of {run_name}: its metrics, gauntlet reports and model versions ({run_id}).",
    )


# validate_parameters=False: the form's values are validated first thing in the body, in one line
# (form_values), also when the UI's "Validate parameters" switch was off; Prefect's own check would
# fail the run with a traceback.
@flow(
    name="pretrain_pipeline",
    flow_run_name=_flow_run_name,
    log_prints=True,
    validate_parameters=False,
    on_crashed=[_record_end],
    on_cancellation=[_record_end],
)
def pretrain_pipeline(params: PipelineParams) -> PipelineResult:
    """Prepare the recipe's data, train its curriculum, and evaluate and register every checkpoint."""
    prepare_process()
    params = form_values(PipelineParams, params)
    recipe, run_name = _resolve(params)  # a bad recipe or override fails here, in one line
    # alias moves made in MLflow's UI since tessera last looked go into the versions' history first
    for line in reconcile_registry(recipe.tracking, f"pretrain_pipeline run {run_name}"):
        get_run_logger().warning("%s", line)

    def body() -> PipelineResult:
        result = run_pipeline(recipe, run_name, params.recipe, params.if_running)
        if result.registrations:
            _bootstrap_champion(recipe, run_name, result)
        return result

    return run_or_end(run_name, body, stays=lambda: stays_of(recipe, run_name))


def _job_path(recipe: Recipe, run_name: str) -> Path:
    return run_folder(recipe.work_dir, run_name) / "job.json"


def stays_of(recipe: Recipe, run_name: str) -> str:
    """What a stopped run of `recipe` keeps, for the line that ends it (every training flow's run_or_end)."""
    return what_stays(_job_path(recipe, run_name), recipe.compute)


def _bootstrap_champion(recipe: Recipe, run_name: str, result: PipelineResult) -> None:
    """A model's first champion is its first run's best version; after that only the promotion rule moves it."""
    from tasks.mlflow_run import client_for, retrying
    from tasks.promote import bootstrap
    from tasks.register import best_of_run

    name = recipe.tracking.registered_model
    client = client_for(recipe.tracking)
    best = retrying("finding the run's best version", lambda: best_of_run(client, name, result.mlflow_run_id))
    if best and retrying("bootstrapping the champion", lambda: bootstrap(client, name, best, run_name)):
        get_run_logger().info("%s: v%s is the first champion (bootstrap)", recipe.tracking.registered_model, best)

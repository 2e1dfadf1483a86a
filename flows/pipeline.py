"""`pretrain_pipeline`: prepare -> curriculum training -> a gauntlet per checkpoint -> registry.

The flow only sequences work. Training runs as an external job; while it runs, the flow
watches the run's checkpoint manifests and gives every new checkpoint its own evaluate and
register task runs, so training never waits for the gauntlet.

Started from the Prefect UI, a schedule or the CLI alike, so it guards itself: one live flow run
per run name (tasks/runs/run_slot.py), the trainer stopped if the flow fails or is cancelled, and the
MLflow run told how the flow run ended even when the flow process itself was killed (the crash
and cancellation hooks, which Prefect's runner calls from outside it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from prefect import flow, get_run_logger
from prefect.futures import wait
from pydantic import BaseModel, Field

from flows.prepare import prepare_recipe_data
from tasks.mlflow_run import open_run, record_run, resolved_uri, served_elsewhere
from tasks.recipe import NAME_PATTERN, Recipe, load_recipe, run_folder
from tasks.recipe_form import RecipeOverrides, apply_overrides, form_input
from tasks.registry.aliases import reconcile_registry
from tasks.registry.register import Registration, move_aliases
from tasks.runs.flow_outcome import REFUSED, form_values, keep_last_word, run_or_end
from tasks.runs.run_record import (
    bootstrap_champion,
    close_after_failure,
    close_finished,
    job_path_of,
    link_mlflow_run,
    mlflow_tags,
    publish_registrations,
    record_flow_run_end,
    record_recipe,
    source_commit,
    stays_of,
    tag_flow_run,
)
from tasks.runs.run_slot import one_per_run, run_tag
from tasks.runs.runtime import prepare_process
from tasks.training.gauntlet_queue import GauntletQueue, QueueTarget
from tasks.training.goodput import report_goodput
from tasks.training.train import MlflowTarget, TrainJob, allow_launches, deliver_metrics, stage_task, stop_launched_jobs
from tasks.training.train_job import checkpoint_store, make_job, write_job

POLL_SECONDS = 2.0


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
    except Exception:  # noqa: BLE001 - any unreadable recipe: the flow's first step says what is wrong with it
        return Path(str(params.get("recipe", "tessera"))).stem or "tessera"


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


def run_pipeline(
    recipe: Recipe,
    run_name: str,
    recipe_path: str,
    if_running: Literal["refuse", "wait"] = "refuse",
    run_tags: dict[str, str] | None = None,
    version_tags: dict[str, str] | None = None,
) -> PipelineResult:
    """Prepare, train every stage, evaluate and register each checkpoint: the body both training flows share
    (a subflow would give it a flow run of its own, whose id the run slot and the MLflow run's tags would name).

    `run_tags` go on the MLflow run, `version_tags` on every model version it registers (continued
    pretraining records what it continued from).
    """
    from prefect.runtime import flow_run

    logger = get_run_logger()
    run_dir = run_folder(recipe.work_dir, run_name)  # a name that would escape the runs folder: one line, first
    for line in [*recipe.notices(), served_elsewhere(recipe.tracking.tracking_uri)]:
        if line:
            logger.warning("%s", line)
    allow_launches()  # an earlier flow run in this same process may have stopped its jobs
    tag_flow_run(flow_run.id, ["tessera", f"recipe:{recipe.name}", run_tag(run_name)])
    with one_per_run(run_name, if_running, flow_run.id):
        # first: a dead tracking server should stop the run before any compute is spent
        tags = mlflow_tags(recipe, run_name, recipe_path, source_commit(), run_tags or {})
        run_id = open_run(recipe.tracking, run_name, tags=tags)
        try:
            record_recipe(recipe, run_name, run_dir, run_id)
            link_mlflow_run(recipe.tracking, run_name, run_id)
            data = prepare_recipe_data(recipe.data, recipe.train.stages, run_name, recipe.compute)
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
            job_path = write_job(job, job_path_of(recipe.work_dir, run_name))
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
                ),
                checkpoint_store(job, recipe.compute, pins=run_dir / "pins"),
                version_tags or {},
            )
            _train_and_watch(recipe, job, job_path, run_dir, queue, recipe_path)
            registrations = queue.results()
            if registrations:  # a rerun after a crash between registering and moving aliases heals here
                latest, best = move_aliases(recipe.tracking, run_id)
                registrations = [r.model_copy(update={"latest": latest, "best": best}) for r in registrations]
        except BaseException as error:
            close_after_failure(recipe.tracking, run_id, error)
            raise
        close_finished(recipe.tracking, run_name, run_id)
        publish_registrations(recipe.tracking, run_name, registrations)
        return PipelineResult(run_name=run_name, mlflow_run_id=run_id, registrations=registrations)


def _train_and_watch(
    recipe: Recipe, job: TrainJob, job_path: Path, run_dir: Path, queue: GauntletQueue, recipe_path: str
) -> None:
    """Each stage in turn, sweeping its new checkpoints into the gauntlet queue while it trains; the stage's
    trainer is stopped here when the flow fails or is interrupted (its task thread cannot be)."""
    from prefect.runtime import flow_run

    flow_url = flow_run.ui_url or ""
    holder = f"flow run {flow_run.name!r} ({flow_run.id}{', ' + flow_url if flow_url else ''})"
    try:
        for k, stage in enumerate(recipe.train.stages):
            training = stage_task(recipe.compute).submit(
                str(job_path), k, stage.name, recipe.compute, str(run_dir / "logs"), job.run_name, holder, recipe_path
            )
            while not wait([training], timeout=POLL_SECONDS).done:
                queue.sweep()
            training.result()
            queue.sweep()
            report_goodput(job, str(run_dir), stage.name)
        deliver_metrics(job)
    except BaseException:
        stop_launched_jobs()
        raise


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
            bootstrap_champion(recipe.tracking, run_name, result.mlflow_run_id)
        return result

    return run_or_end(run_name, body, stays=lambda: stays_of(recipe, run_name))

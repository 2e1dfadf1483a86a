"""`pretrain_pipeline`: prepare -> curriculum training -> a gauntlet per checkpoint -> registry.

The flow only sequences work. Training runs as an external job; while it runs, the flow
watches the run's checkpoint manifests and gives every new checkpoint its own evaluate and
register task runs, so training never waits for the gauntlet.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.futures import PrefectFuture
from pydantic import BaseModel, Field

from flows.prepare import prepare_data
from flows.recipe import Recipe, load_recipe
from tasks.evaluate import evaluate_checkpoint
from tasks.register import Registration, existing_registrations, register_checkpoint
from tasks.tracking import close_run, open_run, resolved_uri
from tasks.train import train_stage, write_job
from trainers.checkpoints import CheckpointInfo, list_complete
from trainers.config import MlflowTarget, TrainJob

POLL_SECONDS = 2.0


class PipelineParams(BaseModel):
    """What the Prefect UI asks for when a run is triggered."""

    recipe: str = Field(..., description="Path to the recipe YAML (relative paths resolve against the worker's cwd).")
    run_name: str | None = Field(
        None, description="Names the run; the same name resumes its checkpoints and MLflow run. Defaults to the recipe name."
    )


class PipelineResult(BaseModel):
    run_name: str
    mlflow_run_id: str
    registrations: list[Registration]


class _CheckpointWatcher:
    """Submits evaluate -> register for each checkpoint not seen before, registers in order."""

    def __init__(self, recipe: Recipe, run_id: str, max_seq_len: int):
        self.recipe, self.run_id, self.max_seq_len = recipe, run_id, max_seq_len
        self.seen: set[int] = set()
        self.registrations: list[PrefectFuture | Registration] = []
        self.already = existing_registrations(recipe.tracking, run_id)

    def sweep(self, save_folder: Path) -> None:
        for ckpt in list_complete(save_folder):
            if ckpt.tokens not in self.seen:
                self.seen.add(ckpt.tokens)
                self._submit(ckpt)

    def _submit(self, ckpt: CheckpointInfo) -> None:
        if ckpt.tokens in self.already:  # a rerun: evaluated and registered before
            self.registrations.append(self.already[ckpt.tokens])
            return
        summary = evaluate_checkpoint.submit(
            ckpt, self.recipe.eval, self.recipe.tracking, self.run_id, self.max_seq_len
        )
        # Registration waits on the previous one so alias moves never interleave.
        previous = [f for f in self.registrations[-1:] if isinstance(f, PrefectFuture)] or None
        registration = register_checkpoint.submit(
            ckpt, summary, self.recipe.tracking, self.run_id, self.recipe.content_hash(), wait_for=previous
        )
        self.registrations.append(registration)

    def results(self) -> list[Registration]:
        return [f.result() if isinstance(f, PrefectFuture) else f for f in self.registrations]


@flow(name="pretrain_pipeline", log_prints=True)
def pretrain_pipeline(params: PipelineParams) -> PipelineResult:
    logger = get_run_logger()
    recipe = load_recipe(params.recipe)
    run_name = params.run_name or recipe.name
    run_dir = Path(recipe.work_dir).resolve() / "runs" / run_name

    run_id = open_run(
        recipe.tracking,
        run_name,
        tags={"recipe_hash": recipe.content_hash(), "recipe": params.recipe},
        params={"seq_len": str(recipe.data.seq_len), "n_layers": str(recipe.model.n_layers),
                "d_model": str(recipe.model.d_model), "stages": ",".join(s.name for s in recipe.train.stages)},
    )  # fmt: skip
    # after open_run: a dead tracking server should stop the run before any compute is spent
    prepared = prepare_data(recipe.data)
    job = TrainJob(
        run_name=run_name,
        model=recipe.model,
        train=recipe.train,
        vocab_size=prepared.tokenizer.vocab_size,
        eos_token_id=prepared.tokenizer.eos_token_id,
        seq_len=recipe.data.seq_len,
        streams={name: str(src.path) for name, src in prepared.sources.items()},
        save_folder=str(run_dir / "checkpoints"),
        checkpoint_every_tokens=recipe.eval.every,
        tokenizer_dir=str(prepared.tokenizer.hf_dir),
        mlflow=MlflowTarget(tracking_uri=resolved_uri(recipe.tracking.tracking_uri), run_id=run_id),
    )
    job_path = write_job(job, run_dir / "job.json")

    watcher = _CheckpointWatcher(recipe, run_id, recipe.data.seq_len)
    status = "FAILED"
    try:
        for k, stage in enumerate(recipe.train.stages):
            training = train_stage.with_options(retries=recipe.compute.max_restarts).submit(
                str(job_path), k, stage.name, recipe.compute, str(run_dir / "logs"), wait_for=None
            )
            while not training.state.is_final():
                watcher.sweep(Path(job.save_folder))
                time.sleep(POLL_SECONDS)
            training.result()
            watcher.sweep(Path(job.save_folder))
        registrations = watcher.results()
        status = "FINISHED"
    finally:
        close_run(recipe.tracking, run_id, status)

    table = "\n".join(
        f"| {r.tokens} | {r.version} | {'created' if r.created else 'existing'} |" for r in registrations
    )
    create_markdown_artifact(
        key="registered-versions",
        markdown=f"# {recipe.tracking.registered_model}\n\n| tokens | version | |\n|---|---|---|\n{table}\n\n"
        f"latest = v{registrations[-1].latest}, best = v{registrations[-1].best}\n" if registrations else "none",
        description=f"Model versions registered by run {run_name}",
    )
    logger.info("run %s: %d versions registered", run_name, len(registrations))
    return PipelineResult(run_name=run_name, mlflow_run_id=run_id, registrations=registrations)

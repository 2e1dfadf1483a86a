"""`pretrain_pipeline`: prepare -> curriculum training -> a gauntlet per checkpoint -> registry.

The flow only sequences work. Training runs as an external job; while it runs, the flow
watches the run's checkpoint manifests and gives every new checkpoint its own evaluate and
register task runs, so training never waits for the gauntlet.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.futures import PrefectFuture, wait
from prefect.utilities.annotations import allow_failure
from pydantic import BaseModel, Field

from flows.prepare import prepare_data
from flows.recipe import NAME_PATTERN, Recipe, load_recipe
from infra import cancel_all
from tasks.evaluate import evaluate_checkpoint
from tasks.register import (
    Registration,
    existing_registrations,
    move_aliases,
    register_checkpoint,
)
from tasks.tracking import close_run, open_run, resolved_uri
from tasks.train import train_stage, write_job
from trainers.checkpoints import CheckpointInfo, list_complete
from trainers.config import MlflowTarget, TrainJob

POLL_SECONDS = 2.0


class PipelineParams(BaseModel):
    """What the Prefect UI asks for when a run is triggered."""

    recipe: str = Field(..., description="Path to the recipe YAML (relative paths resolve against the worker's cwd).")
    run_name: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="Names the run; the same name resumes its checkpoints and MLflow run. Defaults to the recipe name.",
    )


class PipelineResult(BaseModel):
    run_name: str
    mlflow_run_id: str
    registrations: list[Registration]


class _CheckpointWatcher:
    """Evaluates, then registers, each checkpoint not seen before.

    Evaluations run one at a time (they share the CPU with training) and registrations one at a
    time (alias moves must not interleave); a failed evaluation skips only its own registration.
    Each checkpoint is hard-linked into `pins/` first, so a keep-last-K cleanup in the trainer
    cannot delete it while it waits to be scored and exported.
    """

    def __init__(self, recipe: Recipe, run_id: str, run_dir: Path):
        self.recipe, self.run_id = recipe, run_id
        self.pins = run_dir / "pins"
        self.seen: set[int] = set()
        self.pending: list[tuple[PrefectFuture, PrefectFuture, Path]] = []
        self.done: list[Registration] = []
        self.already = existing_registrations(recipe.tracking, run_id)

    def sweep(self, save_folder: Path) -> None:
        for ckpt in list_complete(save_folder):
            if ckpt.tokens not in self.seen:
                self.seen.add(ckpt.tokens)
                self._submit(ckpt)
        self._unpin_finished()

    def _pin(self, ckpt: CheckpointInfo) -> CheckpointInfo | None:
        self.pins.mkdir(parents=True, exist_ok=True)
        pin = self.pins / Path(ckpt.path).name
        try:
            if not pin.exists():
                os.link(ckpt.path, pin)
        except FileNotFoundError:  # deleted between the listing and now: nothing left to score
            return None
        return ckpt.model_copy(update={"path": str(pin)})

    def _submit(self, ckpt: CheckpointInfo) -> None:
        if ckpt.tokens in self.already:  # a rerun: evaluated and registered before
            self.done.append(self.already[ckpt.tokens])
            return
        pinned = self._pin(ckpt)
        if pinned is None:
            return
        previous = self.pending[-1] if self.pending else None
        summary = evaluate_checkpoint.submit(
            pinned, self.recipe.eval, self.recipe.tracking, self.run_id, self.recipe.data.seq_len,
            wait_for=[allow_failure(previous[0])] if previous else None,
        )  # fmt: skip
        registration = register_checkpoint.submit(
            pinned, summary, self.recipe.tracking, self.run_id, self.recipe.content_hash(),
            wait_for=[allow_failure(previous[1])] if previous else None,
        )  # fmt: skip
        self.pending.append((summary, registration, Path(pinned.path)))

    def _unpin_finished(self) -> None:
        finished = wait([r for _, r, _ in self.pending], timeout=0).done  # local futures: no API round trip
        for _, registration, pin in self.pending:
            if registration in finished:
                pin.unlink(missing_ok=True)

    def results(self) -> list[Registration]:
        """Every registration, oldest first; raises the first evaluation or registration error."""
        wait([f for pair in self.pending for f in pair[:2]])
        self._unpin_finished()
        for summary, registration, _ in self.pending:
            summary.result()  # surfaces a failed evaluation as itself, not as an unfinished registration
            self.done.append(registration.result())
        return sorted(self.done, key=lambda r: r.tokens)


def _train_and_watch(recipe: Recipe, job: TrainJob, job_path: Path, run_dir: Path, watcher: _CheckpointWatcher):
    save_folder = Path(job.save_folder)
    for k, stage in enumerate(recipe.train.stages):
        training = train_stage.with_options(retries=recipe.compute.max_restarts).submit(
            str(job_path), k, stage.name, recipe.compute, str(run_dir / "logs")
        )
        while not wait([training], timeout=POLL_SECONDS).done:
            watcher.sweep(save_folder)
        training.result()
        watcher.sweep(save_folder)


def _prepare_stage_lengths(recipe: Recipe, tokenizer_dir: str) -> dict[int, dict[str, str]]:
    """Stages with their own seq_len read their sources packed at that length: prepare those too.

    Each length is its own cached output (seq_len is part of a source's hash), so this costs one
    tokenization per (source, length) and nothing on a rerun. The tokenizer is the one already
    prepared, by path: a `train:` tokenizer would otherwise be retrained on the subset of sources.
    """
    wanted: dict[int, set[str]] = {}
    for stage in recipe.train.stages:
        if stage.seq_len and stage.seq_len != recipe.data.seq_len:
            wanted.setdefault(stage.seq_len, set()).update(stage.mixture)
    tokenizer = recipe.data.tokenizer
    if tokenizer.train is not None:
        tokenizer = tokenizer.model_copy(update={"path": tokenizer_dir, "train": None})
    streams = {}
    for seq_len, names in sorted(wanted.items()):
        sources = [s for s in recipe.data.sources if s.name in names]
        data = recipe.data.model_copy(update={"seq_len": seq_len, "sources": sources, "tokenizer": tokenizer})
        prepared = prepare_data.with_options(flow_run_name=f"prepare-data-seq{seq_len}")(data)
        streams[seq_len] = {name: str(src.path) for name, src in prepared.sources.items()}
    return streams


def _local_save_folder(recipe: Recipe, run_name: str, run_dir: Path) -> Path:
    """The trainer's local checkpoint folder; with an s3:// train.save_folder it is the working copy."""
    folder = recipe.train.save_folder
    if folder is None or folder.startswith("s3://"):
        return run_dir / "checkpoints"
    return Path(folder).resolve() / run_name


@flow(name="pretrain_pipeline", log_prints=True)
def pretrain_pipeline(params: PipelineParams) -> PipelineResult:
    logger = get_run_logger()
    recipe = load_recipe(params.recipe)
    run_name = params.run_name or recipe.name
    run_dir = Path(recipe.work_dir).resolve() / "runs" / run_name

    # first: a dead tracking server should stop the run before any compute is spent
    run_id = open_run(
        recipe.tracking,
        run_name,
        tags={"recipe_hash": recipe.content_hash(), "recipe": params.recipe},
        params={"seq_len": str(recipe.data.seq_len), "n_layers": str(recipe.model.n_layers),
                "d_model": str(recipe.model.d_model), "stages": ",".join(s.name for s in recipe.train.stages)},
    )  # fmt: skip
    status = "FAILED"
    try:
        prepared = prepare_data(recipe.data)
        seq_len_streams = _prepare_stage_lengths(recipe, prepared.tokenizer.hf_dir)
        job = TrainJob(
            run_name=run_name,
            model=recipe.model,
            train=recipe.train,
            vocab_size=prepared.tokenizer.vocab_size,
            eos_token_id=prepared.tokenizer.eos_token_id,
            seq_len=recipe.data.seq_len,
            streams={name: str(src.path) for name, src in prepared.sources.items()},
            seq_len_streams=seq_len_streams,
            val_streams={name: str(src.val_path) for name, src in prepared.sources.items() if src.val_path},
            save_folder=str(_local_save_folder(recipe, run_name, run_dir)),
            checkpoint_every_tokens=recipe.eval.every,
            tokenizer_dir=str(prepared.tokenizer.hf_dir),
            mlflow=MlflowTarget(tracking_uri=resolved_uri(recipe.tracking.tracking_uri), run_id=run_id),
        )
        job_path = write_job(job, run_dir / "job.json")
        watcher = _CheckpointWatcher(recipe, run_id, run_dir)
        try:
            _train_and_watch(recipe, job, job_path, run_dir, watcher)
        except BaseException:
            # The stage runs in a task thread that Prefect cannot interrupt: stop its job here, so a
            # failed or interrupted flow never leaves a trainer writing into the run's folder.
            cancel_all()
            raise
        registrations = watcher.results()
        if registrations:  # a rerun after a crash between registering and moving aliases heals here
            latest, best = move_aliases(recipe.tracking, run_id)
            registrations = [r.model_copy(update={"latest": latest, "best": best}) for r in registrations]
        status = "FINISHED"
    finally:
        close_run(recipe.tracking, run_id, status)

    rows = "\n".join(f"| {r.tokens:,} | v{r.version} | {'new' if r.created else 'existing'} |" for r in registrations)
    summary = (
        f"# {recipe.tracking.registered_model}\n\n| tokens | version | |\n|---:|---|---|\n{rows}\n\n"
        f"latest-checkpoint = v{registrations[-1].latest}, best = v{registrations[-1].best}\n"
        if registrations
        else "No checkpoint was registered."
    )
    create_markdown_artifact(
        key="registered-versions", markdown=summary, description=f"Model versions registered by run {run_name}"
    )
    logger.info("run %s: %d versions registered", run_name, len(registrations))
    return PipelineResult(run_name=run_name, mlflow_run_id=run_id, registrations=registrations)

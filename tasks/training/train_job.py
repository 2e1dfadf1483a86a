"""The job file a stage's trainer reads: the recipe's model and train sections resolved against the prepared data.

`python -m trainers.train --job job.json` reads only this file (trainers.config.TrainJob), so a pod never sees
the rest of the recipe; the flow writes it atomically before any launch.
"""

from __future__ import annotations

from pathlib import Path

from infra.config import ComputeConfig
from tasks.data.results import PreparedData
from trainers.config import MlflowTarget, ModelConfig, TrainConfig, TrainJob
from trainers.format.atomic import atomic_write
from trainers.format.store import CheckpointStore, open_store


def local_save_folder(train: TrainConfig, run_name: str, run_dir: Path) -> Path:
    """The trainer's local checkpoint folder; with an s3:// train.save_folder it is the working copy."""
    folder = train.save_folder
    if folder is None or folder.startswith("s3://"):
        return run_dir / "checkpoints"
    return Path(folder).resolve() / run_name


def make_job(
    run_name: str,
    model: ModelConfig,
    train: TrainConfig,
    seq_len: int,
    prepared: PreparedData,
    seq_len_streams: dict[int, dict[str, str]],
    every: int,
    run_dir: Path,
    mlflow: MlflowTarget,
) -> TrainJob:
    """The TrainJob of a run: its model and train sections, resolved against the prepared data."""
    return TrainJob(
        run_name=run_name,
        model=model,
        train=train,
        vocab_size=prepared.tokenizer.vocab_size,
        eos_token_id=prepared.tokenizer.eos_token_id,
        seq_len=seq_len,
        streams={name: str(src.path) for name, src in prepared.sources.items()},
        seq_len_streams=seq_len_streams,
        val_streams={name: str(src.val_path) for name, src in prepared.sources.items() if src.val_path},
        save_folder=str(local_save_folder(train, run_name, run_dir)),
        checkpoint_every_tokens=every,
        tokenizer_dir=prepared.tokenizer.uri or str(prepared.tokenizer.hf_dir),
        mlflow=mlflow,
        compile_cache_dir=str(run_dir / "compile-cache"),  # a pod uses its node's cache volume instead
    )


def checkpoint_store(job: TrainJob, compute: ComputeConfig | None = None, pins: Path | None = None) -> CheckpointStore:
    """Where the flow reads the run's checkpoints: the s3 mirror when the ranks run in pods (whose disks the flow
    never sees), else the trainer's own folder (with an s3 save folder, the mirror's working copy)."""
    elsewhere = compute is not None and compute.backend != "local"
    return open_store(job.save_folder, job.remote_folder, pins, folder_elsewhere=elsewhere)


def write_job(job: TrainJob, path: Path) -> Path:
    """Publish the job spec atomically and durably: a pod must never read half a file.

    The flow calls it as it starts, before any launch, whatever the file already holds: a job file cut
    short by a power loss (the trainer refuses it as fatal, since it cannot know the job) is thereby
    rewritten by the rerun that resumes the run.
    """
    return atomic_write(path, job.model_dump_json(indent=2))

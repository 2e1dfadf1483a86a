"""Train one curriculum stage as a job on the recipe's compute backend.

The job itself (`python -m trainers.train`) resumes from the run's save folder, so a Prefect
retry of this task is a relaunch that continues where the dead job stopped.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from infra import backend_for
from infra.config import ComputeConfig
from tasks.retry import retry_unless
from trainers.config import TrainJob
from trainers.exit_codes import FATAL

USAGE_ERROR = 2  # argparse


class TrainingFailed(RuntimeError):
    """A training job exited non-zero; relaunching it resumes from its last checkpoint."""


class TrainingFatal(TrainingFailed):
    """A training job failed in a way a relaunch would repeat (bad job, divergence, edited stage)."""


def write_job(job: TrainJob, path: Path) -> Path:
    """Publish the job spec atomically: a pod must never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".job-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(job.model_dump_json(indent=2))
    os.replace(tmp, path)
    return path


@task(retries=2, retry_delay_seconds=5, retry_condition_fn=retry_unless(TrainingFatal), cache_policy=NO_CACHE)
def train_stage(job_path: str, stage_index: int, stage_name: str, compute: ComputeConfig, log_dir: str) -> int:
    """Run stage `stage_index` of the job to its end; returns the job's exit code (0)."""
    logger = get_run_logger()
    backend = backend_for(compute)
    job = backend.launch(
        "trainers.train", ["--job", job_path, "--stage", str(stage_index)], log_dir=Path(log_dir) / stage_name
    )
    logger.info("stage %s: launched %d rank(s), log at %s", stage_name, compute.procs_per_node, job.log_path)
    try:
        code = job.wait()
    finally:
        job.cancel()
    if code != 0:
        # Signals (a node lost, an OOM kill) and unknown crashes resume from the last checkpoint;
        # only the trainer's fatal codes and usage errors would fail the same way again.
        retryable = code not in FATAL and code != USAGE_ERROR
        error = TrainingFailed if retryable else TrainingFatal
        kind = "retryable" if retryable else "fatal"
        last = next((line for line in reversed(job.tail().splitlines()) if line.strip()), "")
        logger.error("stage %s: last lines of %s:\n%s", stage_name, job.log_path, job.tail())
        raise error(f"stage {stage_name}: trainer exited with code {code} ({kind}), see {job.log_path}: {last[:300]}")
    return code

"""Train one curriculum stage as a job on the recipe's compute backend.

The job itself (`python -m trainers.train`) resumes from the run's save folder, so every relaunch
continues where the dead job stopped. Two budgets decide whether to relaunch, because being
stopped from outside says nothing about the run while a crash may well repeat:

- preempted (relaunched here, up to `compute.max_preemptions` times): a rank killed by a signal
  (eviction, a lost node, the OOM killer, kill -9) or the trainer's exit 76 after a SIGTERM;
- failed (a Prefect retry of this task, up to `compute.max_restarts` times): the trainer's
  retryable exit 75 (lost peer collectives, timeouts, a loss-anomaly rollback) or any other crash.
  On Kubernetes the cluster restarts the group itself after such a failure, up to
  `compute.kubernetes.max_restarts` times, and that budget is the one that counts them: a group that
  failed after spending it ends the task (RestartsSpent) instead of starting a new group with a fresh
  budget, so the two never multiply. The task's retries there count what the cluster cannot retry:
  the launcher losing track of the API, an image never pulled, an API server refusing a create;
- fatal (no retry): exit 78 (bad job, divergence, an edited stage, a run already being trained)
  and 2 (usage).

Before any of these, the launcher restarts a crashed or hung launch's ranks in place (compute.restarts_in_place,
infra/launcher.py): no new launcher or pod. Each restart is in the launch's record with its cause and is charged to
the budget a relaunch for the same cause would draw on (a signal or a hang: preemptions; a crash: restarts).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect.states import Cancelled

from infra import allow_launches, backend_for, stopping
from infra import cancel_all as stop_launched_jobs
from infra.config import ComputeConfig
from infra.launch_outcome import LaunchOutcome
from infra.watchdog import budgets_env
from tasks.retry import retry_unless
from tasks.training import launch_records
from tasks.training.stage_ends import (
    DataDamaged,
    DiskFull,
    NoProgress,
    PreemptionBudgetSpent,
    RestartsSpent,
    TrainingFailed,
    TrainingFatal,
    exit_kind,
)
from tasks.training.train_job import checkpoint_store
from tasks.training.train_progress import ProgressRelay
from trainers.config import MlflowTarget, TrainJob
from trainers.contract import HOLDER_ENV, WARM_MODULES
from trainers.progress import parse_damage

POLL_SECONDS = 1.0
PREEMPTION_DELAY_S = 2.0  # let the dead job's ports and shared memory go before the relaunch takes them


__all__ = ["MlflowTarget", "TrainJob", "allow_launches", "stop_launched_jobs"]  # for flows, which never import infra


def _run_once(job, relay: ProgressRelay) -> LaunchOutcome:
    """Wait for one launch to end, relaying its progress; the job never outlives this call."""
    try:
        while job.poll() is None:
            relay.feed(job.new_output())
            time.sleep(POLL_SECONDS)
        result = job.result()
        relay.feed(job.new_output())
        return result
    finally:
        job.cancel()
        relay.close()


# Prefect retries: the recipe's compute.max_restarts, through stage_task (a task's retries are fixed when it is built).
@task(
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless(TrainingFatal, PreemptionBudgetSpent, RestartsSpent),  # NoProgress: Fatal
    cache_policy=NO_CACHE,
    task_run_name="train-{stage_name}",
)
def train_stage(
    job_path: str,
    stage_index: int,
    stage_name: str,
    compute: ComputeConfig,
    log_dir: str,
    run_name: str = "",
    holder: str = "",
    recipe_path: str = "",
) -> int:
    """Run stage `stage_index` of the job to its end; returns the job's exit code (0), or a Cancelled state
    when the flow stopped the job.

    `holder` names this flow run in the trainer's lease, so a second trainer of the same run
    says who is training it; `recipe_path`, what re-prepares damaged data, is named in that error.
    """
    logger = get_run_logger()
    backend = backend_for(compute)
    spec = TrainJob.model_validate_json(Path(job_path).read_text())
    run_dir = Path(log_dir).parent
    env = {HOLDER_ENV: holder} if holder else {}
    if spec.train.watchdog.enabled:  # the launcher runs the watchdog beside the ranks with these budgets
        env |= budgets_env(spec.train.watchdog.model_dump())
    ended = _finished(spec, stage_index)
    if ended is not None:
        logger.info(
            "stage %s: already complete at %s tokens (checkpoint %s); no trainer launched",
            stage_name,
            f"{ended.tokens:,}",
            Path(ended.path).name,
        )
        return 0
    preemptions = 0
    relay_name = run_name or Path(job_path).parent.name
    while True:
        job, result, record = _launch_once(
            backend, spec, job_path, stage_index, stage_name, compute, log_dir, env, relay_name
        )
        code, hang = result.code, result.hung
        # evictions the job restarted through by itself (a JobSet's) and its restarts in place for a signal or a hang
        preemptions += result.preemptions + sum(exit_kind(r.code or 0) != "failed" for r in result.restarts)
        kind = record["kind"]
        _record_launch(logger, run_dir, record)
        failures = sum(exit_kind(r.code or 0) == "failed" for r in result.restarts)
        if failures > compute.max_restarts and kind != "ok":
            kind = "failed"  # the crashes restarted in place spent what relaunches for them may spend
        if kind == "ok":
            return code
        if job.stopped or stopping():  # the flow is failing or being cancelled: a relaunch would outlive it
            # a stop is not this task's failure: grey Cancelled, not red Failed, in the run's graph
            return Cancelled(message=f"stage {stage_name}: the trainer was stopped because its flow run is ending")
        last = _last_word(job.tail(200))
        _stop_if_fatal(job, kind, stage_name, job_path, recipe_path, compute, logger)
        _stop_without_progress(run_dir, stage_name, spec, last, job.log_path)
        if kind == "preempted" and preemptions < compute.max_preemptions:
            preemptions += 1
            cause = (
                f"the watchdog found {hang.line()}; it killed the group after writing every rank's stacks to "
                f"{job.log_path}"
                if hang is not None
                else f"the job was stopped from outside (exit {code}: {last[:200]})"
            )
            logger.warning(
                "stage %s: %s; relaunching from the last checkpoint (preemption %d of compute.max_preemptions=%d)",
                stage_name,
                cause,
                preemptions,
                compute.max_preemptions,
            )
            time.sleep(PREEMPTION_DELAY_S)
            continue
        logger.error("stage %s: last lines of %s:\n%s", stage_name, job.log_path, job.tail())
        raise _failure(job, result, kind, code, stage_name, preemptions, last)


def _launch_once(
    backend, spec: TrainJob, job_path: str, stage_index: int, stage_name: str, compute, log_dir, env, relay_name
):
    """One launch of the stage's job, its progress relayed until it ends: (the job, its exit code, its launch
    record for tasks/training/launch_records.py)."""
    logger = get_run_logger()
    before, started = _newest_tokens(spec, compute), time.time()
    job = backend.launch(
        "trainers.train",
        ["--job", job_path, "--stage", str(stage_index)],
        log_dir=Path(log_dir) / stage_name,
        env=env or None,
        warm=WARM_MODULES,
    )
    logger.info("stage %s: launched %d rank(s) per node, log at %s", stage_name, compute.ranks_per_node, job.log_path)
    avoid = job.avoid_node if compute.kubernetes and compute.kubernetes.avoid_slow_nodes else None
    relay = ProgressRelay(logger, relay_name, stage_name, avoid_node=avoid)
    result = _run_once(job, relay)
    code, hang = result.code, result.hung
    kind = exit_kind(code)
    for restart in (r for r in result.restarts if r.attempt not in relay.restarts_said):  # each said once
        logger.warning(
            "stage %s: %s; the launcher restarted the ranks from the last checkpoint", stage_name, restart.line()
        )
    return (
        job,
        result,
        {
            "stage": stage_name,
            "started": started,
            "ended": time.time(),
            "code": code,
            "kind": kind,
            "hung": hang.to_json() if hang is not None else None,
            "tokens_before": before,
            "tokens_after": _newest_tokens(spec, compute),
            "stopped": job.stopped or stopping(),  # by its flow (a cancel): not the run failing
            "pending_s": round(result.pending_s, 3),  # in the cluster's queue (Kubernetes)
            "restarts": [r.to_json() for r in result.restarts],  # in place, each with its cause
            "flow_run": str(flow_run.id) if flow_run.id else None,  # gaps inside one flow run are the run's
        },
    )


def _failure(
    job, result: LaunchOutcome, kind: str, code: int, stage_name: str, preemptions: int, last: str
) -> Exception:
    """The error a stage ends with when it is not relaunched: what kind of end, and what budget it spent."""
    error = {"fatal": TrainingFatal, "preempted": PreemptionBudgetSpent}.get(kind, TrainingFailed)
    budget = f" {preemptions} times, compute.max_preemptions spent" if kind == "preempted" else ""
    if kind == "failed" and result.group_restarts_spent:
        error = RestartsSpent
        budget = (
            f" after {result.group_restarts} restarts of the group in the cluster, compute.kubernetes.max_restarts "
            f"spent: not retried again"
        )
    return error(
        f"stage {stage_name}: trainer exited with code {code} ({kind}{budget}), see {job.log_path}: {last[:300]}"
    )


def _record_launch(logger, run_dir: Path, record: dict) -> None:
    """Append the launch to the run's launch records. A record the disk cannot take is said and passed over: the
    launch's outcome decides what happens next, and a full disk is classified from the save folder right after."""
    try:
        launch_records.append(run_dir, record)
    except OSError as exc:
        logger.warning("could not record the launch in %s (%s)", launch_records.path(run_dir), exc)


def _stop_if_fatal(job, kind: str, stage_name: str, job_path: str, recipe_path: str, compute, logger) -> None:
    """Faults no relaunch fixes, classified before any: damaged prepared data, a disk with no room for a checkpoint."""
    damage = next((d for d in map(parse_damage, job.tail(200).splitlines()) if d), None)
    if kind == "fatal" and damage is not None:
        logger.error("stage %s: last lines of %s:\n%s", stage_name, job.log_path, job.tail())
        raise DataDamaged(_withdraw_damaged(stage_name, damage, recipe_path))
    full = _no_room_for_a_checkpoint(job_path) if compute.backend == "local" else None
    if full is not None:  # whatever the trainer managed to say on that disk: a retry would fill it again
        logger.error("stage %s: last lines of %s:\n%s", stage_name, job.log_path, job.tail())
        raise DiskFull(f"stage {stage_name}: {full}")


def _stop_without_progress(run_dir: Path, stage_name: str, spec: TrainJob, last: str, log_path) -> None:
    """K launches of the stage in a row (its Prefect retries included) that ended without a new checkpoint: stop as
    fatal, instead of spending the rest of the preemption budget on a run that is going nowhere."""
    limit = spec.train.watchdog.no_progress_launches
    records = launch_records.read(run_dir)
    streak = launch_records.no_progress_streak(records, stage_name)
    if streak >= limit:
        newest = records[-1].get("tokens_after") or 0
        raise NoProgress(
            f"stage {stage_name}: {streak} launches in a row ended without a new checkpoint (the newest is at "
            f"{newest:,} tokens; train.watchdog.no_progress_launches={limit}); stopping instead of relaunching "
            f"again. The last one ended: {last[:200]} (see {log_path})"
        )


def _finished(spec: TrainJob, stage_index: int):
    """The stage's end checkpoint when the run's records already show it (trainers/trained_stages.finished), else
    None. Records that cannot be read leave the decision to a launch, as before: never a failure here."""
    from trainers.trained_stages import finished

    try:
        return finished(spec, stage_index)
    except Exception:  # noqa: BLE001 - an unreadable folder or mirror: the launch decides, and says why if it must
        return None


def _newest_tokens(spec: TrainJob, compute: ComputeConfig) -> int:
    """The tokens of the run's newest complete checkpoint (0: none, or none readable)."""
    try:
        newest = newest_checkpoint(spec, compute)
    except Exception:  # noqa: BLE001 - an unreadable folder counts as no progress, never as a failure here
        return 0
    return newest.tokens if newest is not None else 0


def newest_checkpoint(spec: TrainJob, compute: ComputeConfig):
    """The run's newest complete checkpoint where the flow can read it (tasks/training/train_job.checkpoint_store);
    None when there is none."""
    return checkpoint_store(spec, compute).newest()


def what_stays(job_path: Path, compute: ComputeConfig) -> str:
    """What a stopped run keeps, for the line that explains its end: its newest checkpoint (tokens, step, stage)
    and that a rerun resumes from it, or that nothing was saved and a rerun starts fresh."""
    try:
        spec = TrainJob.model_validate_json(Path(job_path).read_text())
    except (OSError, ValueError):  # no job file: the run never got as far as training
        return "nothing was saved yet, so a rerun of the same run name starts it fresh"
    try:
        newest = newest_checkpoint(spec, compute)
    except Exception:  # noqa: BLE001 - the line must be written whatever the folder's state; say what is known
        return "its complete checkpoints (if any) stay, and a rerun of the same run name resumes from the newest"
    if newest is None:
        return "nothing was saved yet, so a rerun of the same run name starts it fresh"
    return (
        f"its checkpoint at {newest.tokens:,} tokens (step {newest.batch:,}, stage {newest.stage}) stays, and a "
        "rerun of the same run name resumes from it"
    )


def _no_room_for_a_checkpoint(job_path: str) -> str | None:
    """Why the save folder's disk cannot take the next checkpoint, or None. Checked after a failed launch, because
    the trainer's own line about a full disk may not have reached its log, which is on that disk too."""
    import shutil

    from trainers.disk import existing, human_bytes
    from trainers.format.checkpoints import list_complete

    try:
        job = TrainJob.model_validate_json(Path(job_path).read_text())
        folder = existing(job.save_folder)
        usage = shutil.disk_usage(folder)
    except (OSError, ValueError):
        return None
    need = job.model.checkpoint_bytes(job.vocab_size)
    if usage.free >= need:
        return None
    done = list_complete(job.save_folder)
    resume = f"the checkpoint at {done[-1].tokens:,} tokens" if done else "the start (no checkpoint was completed)"
    return (
        f"no space for a checkpoint: the disk holding {folder} has {human_bytes(usage.free)} free of "
        f"{human_bytes(usage.total)}, and one checkpoint of this model takes about {human_bytes(need)}; free some "
        f"space (or give train.save_folder a larger disk), then rerun: it resumes from {resume}"
    )


def _last_word(tail: str) -> str:
    """What a failed launch said last: a rank's own `tessera.train:` line (which a multi-rank launcher's own lines
    about the ranks it stopped follow), else the log's last line."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("tessera.train: ")]
    return (said or lines or [""])[-1]


def _withdraw_damaged(stage_name: str, damage: dict, recipe_path: str) -> str:
    """Withdraw the done-marker of the output the trainer found damaged; the one line that says what and the fix."""
    from tasks.data.home import home_at

    folder = damage["path"].rstrip("/")
    out = folder.rsplit("/", 1)[0]  # <data root>/<source>-<hash>, holding the train/ and val/ splits
    withdrawn = home_at(out).withdraw(damage.get("shard"))
    shard = f"shard {damage['shard']}" if damage.get("shard") else "its index"
    if damage.get("samples"):
        shard += f" (samples {damage['samples'][0]:,}-{damage['samples'][1]:,})"
    marker = "its done-marker is withdrawn" if withdrawn else "it was already withdrawn"
    prepare = f"`tessera prepare {recipe_path}`" if recipe_path else "`tessera prepare RECIPE`"
    return (
        f"stage {stage_name}: prepared data of source {damage['source']} is damaged: {shard} in {folder} "
        f"{damage['why']}; {marker}, so {prepare} prepares it again (and a rerun of this run does, before it resumes)"
    )


def stage_task(compute: ComputeConfig):
    """`train_stage` with the recipe's `compute.max_restarts` as its Prefect retries: failures a relaunch may get
    past (a crash, a lost node over the preemption budget), each from the newest checkpoint."""
    return train_stage.with_options(retries=compute.max_restarts)


@task(cache_policy=NO_CACHE)
def deliver_metrics(job: TrainJob) -> int:
    """After the last stage: deliver the trainer's metrics that a tracking outage held back; returns rows left.

    Each launch delivers what an earlier one left, but after the last stage no launch follows, so
    the flow does it, within the trainer's own bounded wait. With an s3 save folder the journal that
    counts is the trainer's copy there (a pod's disk is gone, and the flow never sees it): it is
    restored into the flow's working copy of the save folder first, and what is left is written back.
    """
    from trainers.metrics_journal import deliver, remote_copy

    if job.mlflow is None:
        return 0
    copy = remote_copy(job)
    if copy is not None:
        Path(job.save_folder).mkdir(parents=True, exist_ok=True)
    left = deliver(job.mlflow, job.save_folder, job.run_name, copy=copy)
    if left:
        get_run_logger().warning(
            "%d metric rows of run %s could not reach MLflow yet; they stay in %s and the next "
            "launch of this run delivers them",
            left,
            job.run_name,
            copy.uri if copy is not None else job.save_folder,
        )
    return left

"""Loss anomalies (NaN/inf, spikes): roll back to the last good checkpoint and skip the data that caused them.

What happens (train.loss_guard configures it):
1. LossGuard (trainers/callbacks.py) checks every step's rank-averaged loss at BATCH_END, before
   the checkpoint event, so a poisoned step is never saved. It raises LossAnomaly.
2. The entrypoint calls `record_anomaly`: rank 0 appends to `<save_folder>/<run>-rollbacks.json`
   the checkpoint the relaunch will resume from (C) and how many samples to skip from there:
   every sample trained since C, the bad batch included. The job exits RETRYABLE, so the
   supervisor relaunches it; after `max_rollbacks` records it exits FATAL instead.
3. The relaunch resumes from C as usual (weights, optimizer, data position) and `apply_skip`
   moves the Streaming position forward by the recorded count. The token counter, and so the
   LR schedule and the stage boundaries, do not move: the skipped data is simply not trained on.

The relaunch is what restores the weights, so no in-memory state of a diverged model is reused.

The records are written whole and durably (trainers/format/atomic.py). A file cut short by a power
loss before that (empty, typically) is read as no records, and rewritten so: the anomaly it recorded
comes back at the same step on the relaunch (the same data from the same checkpoint) and is recorded
again, so what is lost is at most a skip already taken and some of the `max_rollbacks` budget, which
the supervisor's restart budget still bounds. Refusing the file instead would fail every relaunch.
With an s3 mirror, the mirror's whole copy replaces it first (RemoteFolder.pull_json_list).
"""

from __future__ import annotations

import logging
import sys

from trainers.config import TrainJob
from trainers.exit_codes import ExitCode, LossAnomaly
from trainers.format.atomic import CutShort, atomic_write_json, read_json
from trainers.layout import RunFolder
from trainers.remote import RemoteFolder

log = logging.getLogger("tessera.rollback")


def read_rollbacks(folder: RunFolder) -> list[dict]:
    """The run's rollback records; none when there is no file or it was cut short (see the module docstring).
    Rank 0 only, which holds the run's lease while it reads."""
    try:
        return read_json(folder.rollbacks, missing=[])
    except CutShort as why:
        log.warning("%s; read as no rollback records (a loss anomaly they held recurs and is recorded again)", why)
        atomic_write_json(folder.rollbacks, [], indent=1)  # repaired once, not warned about at every read
        return []


def record_anomaly(job: TrainJob, exc: BaseException) -> int | None:
    """Exit code for a loss anomaly (and its rollback record), or None when `exc` is not one."""
    from composer.utils import dist

    if not isinstance(exc, LossAnomaly):
        return None
    # Rank 0's record is the truth (other nodes may not see its folder): every rank takes its count.
    # The guard checks the rank-averaged loss, so all ranks raise at the same step and meet here.
    folder = RunFolder.of(job)
    records = read_rollbacks(folder) if dist.get_global_rank() == 0 else []
    count = [len(records)]
    if dist.get_world_size() > 1 and dist.is_initialized():
        dist.broadcast_object_list(count, src=0)
    if count[0] >= job.train.loss_guard.max_rollbacks:
        print(
            f"tessera.train: fatal: {exc}; {count[0]} rollback(s) already used "
            f"(train.loss_guard.max_rollbacks={job.train.loss_guard.max_rollbacks})",
            file=sys.stderr,
        )
        return ExitCode.FATAL
    skip = exc.already_skipped + (exc.tokens - exc.resume_tokens) // job.stage(exc.stage_index).seq_len
    if dist.get_global_rank() == 0:
        records.append(
            {
                "stage_index": exc.stage_index,
                "resume_tokens": exc.resume_tokens,
                "skip_samples": skip,
                "bad_tokens": exc.tokens,
                "reason": str(exc),
            }
        )
        atomic_write_json(folder.rollbacks, records, indent=1)
        remote = RemoteFolder.for_job(job)
        if remote is not None:  # the relaunch may land on another node
            remote.push_file(folder.rollbacks)
    print(
        f"tessera.train: {exc}; rolling back to the checkpoint at {exc.resume_tokens} tokens and skipping "
        f"{skip} samples on relaunch",
        file=sys.stderr,
    )
    return ExitCode.RETRYABLE


def pending_skip(folder: RunFolder, stage_index: int, resume_tokens: int) -> int:
    """Samples to skip when starting stage `stage_index` from the checkpoint at `resume_tokens`."""
    skips = [
        r["skip_samples"]
        for r in read_rollbacks(folder)
        if r["stage_index"] == stage_index and r["resume_tokens"] == resume_tokens
    ]
    return max(skips, default=0)


def apply_skip(trainer, samples: int) -> None:
    """Advance the data position of a freshly built (resumed) trainer by `samples` global samples."""
    if samples <= 0:
        return
    state = trainer.state
    dataset = state.train_dataloader.dataset
    now = int(state.timestamp.sample_in_epoch)
    position = dataset.state_dict(now, True)
    position["epoch"] = max(position["epoch"], 0)  # a stage just entered has no epoch yet
    position["sample_in_epoch"] = now + samples
    dataset.load_state_dict(position)
    state.dataset_resumption["train"] = True
    # The checkpointed data position is timestamp.sample_in_epoch: it must count the skipped samples.
    steps = samples // (state.train_dataloader.batch_size * max(1, _world()))
    state.timestamp = state.timestamp.copy(
        sample_in_epoch=now + samples,
        batch_in_epoch=int(state.timestamp.batch_in_epoch) + steps,
    )


def _world() -> int:
    from composer.utils import dist

    return dist.get_world_size()

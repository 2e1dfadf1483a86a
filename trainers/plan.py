"""Where a launch starts from: the repair of what a kill left in the save folder, and the start plan.

The order of a save (trainers/saver.py) is: write .pt (or every rank's shard) -> publish manifest -> repoint
the latest symlink.
A kill at any point leaves the symlink on the previous complete checkpoint, so autoresume never
follows a half-written file. Before each launch, rank 0's `plan_start` repairs what a kill can leave
behind (trainers/layout.py names the files and removes them):
- a .pt without a manifest that fails its checks was cut short: discarded (the relaunch re-trains
  those steps deterministically); one that verifies gets its manifest re-derived from the
  curriculum, or is set aside if no step explains it. A file that verifies is never deleted;
- a published checkpoint that fails its checks is withdrawn for the one before it;
- the latest symlink is re-derived from the newest surviving manifest of the stage.

A launch of stage K is one of:
    resume  a checkpoint of stage K exists: autoresume loads everything, data position included
            (the RNG state is put back by trainers/rng.py: Composer would not, inside an epoch).
    enter   none does, K > 0: load the end checkpoint of stage K-1 (weights, optimizer, RNG,
            timestamp) but not its data position, since stage K reads a different mixture.
    fresh   K == 0 and nothing saved yet.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainers import trained_stages
from trainers.config import Stage, TrainJob
from trainers.exit_codes import FatalError, RetryableError
from trainers.faults import maybe_stall
from trainers.format import checkpoints, sharded
from trainers.format.checkpoints import CheckpointInfo, is_intact
from trainers.layout import RunFolder, discard
from trainers.remote import RemoteFolder, reconcile

log = logging.getLogger("tessera.plan")


@dataclass(frozen=True)
class StartPlan:
    kind: Literal["fresh", "resume", "enter"]
    load_path: str | None  # what Composer loads when autoresume finds nothing (the previous stage's end)
    tokens: int  # tokens of the run already trained at the start point
    checkpoint: dict | None = None  # CheckpointInfo of the checkpoint loaded (resume or enter)
    vocab_rows: int | None = None  # the embedding rows of that checkpoint (trainers/build.py decides on them)


def plan_start(job: TrainJob, stage_index: int) -> StartPlan:
    """Repair the save folder after a kill and decide where stage `stage_index` starts. Rank 0 only."""
    if not 0 <= stage_index < len(job.train.stages):
        raise FatalError(f"--stage: {stage_index} is out of range, the job has {len(job.train.stages)} stage(s)")
    if "://" in job.save_folder:
        raise FatalError(
            f"save_folder: {job.save_folder} must be a local folder; put the s3:// URI in train.save_folder"
        )
    folder = RunFolder.of(job)
    folder.path.mkdir(parents=True, exist_ok=True)
    remote = RemoteFolder.for_job(job)
    if remote is not None:
        remote.pull_json_list(folder.stages_record)
        remote.pull_json_list(folder.rollbacks)
    trained_stages.check(folder, job.train.stages)

    good: list[CheckpointInfo] = []
    for info in _repaired(folder, [job.stage(k) for k in range(len(job.train.stages))]):
        if is_intact(info.path):
            good.append(info)
        else:
            folder.withdraw(info, "cut short: no zip directory")
    stage = job.stage(stage_index)
    if remote is not None:
        good = reconcile(remote, folder, job.train.keep_checkpoints, stage, good)
    good = _verified_newest(folder, stage_index, good, remote)

    own = [c for c in good if c.stage_index == stage_index]
    if own:
        newest = max(own, key=lambda c: c.tokens)
        folder.point_latest(stage_index, Path(newest.path))
        trained_stages.record(folder, job.train.stages, stage_index, remote)
        return StartPlan("resume", None, newest.tokens, newest.model_dump())
    folder.point_latest(stage_index, None)
    if stage_index == 0:
        trained_stages.record(folder, job.train.stages, 0, remote)
        return StartPlan("fresh", None, 0)
    ends = [c for c in good if c.stage_index == stage_index - 1 and c.tokens == stage.start]
    if not ends:
        prev = job.train.stages[stage_index - 1].name
        raise FatalError(
            f"--stage {stage_index}: stage {prev!r} has no complete checkpoint at its end ({stage.start} tokens) "
            f"in {job.save_folder}; train stage {stage_index - 1} first"
        )
    trained_stages.record(folder, job.train.stages, stage_index, remote)
    return StartPlan("enter", ends[-1].path, stage.start, ends[-1].model_dump())


def _repaired(folder: RunFolder, stages: list[Stage]) -> list[CheckpointInfo]:
    """This run's published checkpoints, oldest first, after dealing with the files that have no manifest.

    A .pt without a manifest was cut short by a kill (discarded: the relaunch re-trains and re-saves
    those steps deterministically), or finished before its manifest was written or after the manifest
    was lost: a file that verifies gets its manifest back, and is never deleted.
    """
    complete = folder.complete()
    published = {Path(c.path).resolve() for c in complete}
    for stage_index, tokens, path in folder.files():
        if path.resolve() in published:
            continue
        if not is_intact(path) or (checkpoints.damage(path) if path.is_file() else sharded.cut_short(path)) is not None:
            discard(path)
            continue
        info = _rederived(stages[stage_index], tokens, path) if stage_index < len(stages) else None
        if info is None:  # not a step of this curriculum: kept out of the way, not deleted
            folder.set_aside(path)
            continue
        complete.append(checkpoints.publish(folder.path, info))
        log.warning("checkpoint %s had no manifest but verifies: manifest re-derived", path)
    return sorted(complete, key=lambda c: c.tokens)


def _rederived(stage: Stage, tokens: int, path: Path) -> CheckpointInfo | None:
    """The manifest a complete checkpoint named `<run>-s<K>-tok<T>` had: its step count follows from the
    curriculum's batch sizes. None if no step of stage K ends at T tokens.

    A sharded folder is hashed as it is now, once `_repaired` found every extent its `.metadata` names
    inside its files (`sharded.cut_short`): DCP keeps no checksums to check it against.
    """
    into = tokens - stage.start
    if not 0 < into <= stage.tokens or into % stage.tokens_per_batch:
        return None
    files = None
    if path.is_dir():
        files = checkpoints.shard_files(path, sorted(p.name for p in path.iterdir() if p.is_file()))
    return CheckpointInfo(
        files=files,
        path=str(path.resolve()),
        tokens=tokens,
        batch=stage.first_batch + into // stage.tokens_per_batch,
        stage=stage.name,
        stage_index=stage.index,
    )


def _verified_newest(
    folder: RunFolder, stage_index: int, good: list[CheckpointInfo], remote: RemoteFolder | None
) -> list[CheckpointInfo]:
    """`good` without the damaged checkpoints among those this launch would start from: the newest of
    this stage, or the previous stage's end when entering. Older ones are checked only if needed.

    A sharded checkpoint saved by several nodes on node-local disks has only this node's shards here:
    the others are fetched from the s3:// save folder first, then the whole folder is verified."""
    good = list(good)
    while True:
        own = [c for c in good if c.stage_index == stage_index]
        candidates = own or [c for c in good if c.stage_index == stage_index - 1]
        if not candidates:
            return good
        newest = max(candidates, key=lambda c: c.tokens)
        if newest.sharded and checkpoints.missing(newest) and remote is not None:
            with contextlib.suppress(RetryableError):  # not in the mirror (yet): withdrawn below as incomplete
                newest = remote.download(newest, folder.path)
        why = checkpoints.damage_of(newest)
        if why is None:
            return good
        folder.withdraw(newest, why)
        good.remove(newest)


def prepare_node(job: TrainJob, stage_index: int, plan: StartPlan) -> None:
    """On the first rank of a node other than rank 0's: put the plan's checkpoint in this node's folder.

    Composer loads from the same absolute path on every node. On a shared filesystem the file is
    already there; on node-local disks it is fetched from the s3:// save folder. The latest symlink
    is set to the plan's own choice either way, so a stale one left on this disk by an earlier
    launch is never followed.
    """
    maybe_stall("node")
    folder = RunFolder.of(job)
    folder.path.mkdir(parents=True, exist_ok=True)
    if plan.checkpoint is None:  # fresh: nothing to load
        folder.point_latest(stage_index, None)
        return
    info = CheckpointInfo.model_validate(plan.checkpoint)
    path = Path(info.path)
    if checkpoints.missing(info) or not is_intact(path):
        remote = RemoteFolder.for_job(job)
        if remote is None:
            raise FatalError(
                f"save_folder: {path} is on rank 0's node only; ranks on other nodes need a shared save folder "
                "or train.save_folder: s3://..."
            )
        path = Path(remote.download(info, folder.path).path)
    folder.point_latest(stage_index, path if plan.kind == "resume" else None)


def drop_dataset_state(state_dict: dict) -> None:
    """load_ignore_keys for entering a stage: the previous stage's data position means nothing here."""
    state_dict["state"].pop("dataset_state", None)

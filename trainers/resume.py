"""Where a launch starts from: the save folder's layout, its repair, and the start plan.

Layout of `save_folder` (names are scoped by run_name, so two runs can share a folder):
    <run>-s<K>-tok<T>-rank0.pt       Composer checkpoint of stage K after T tokens of the run
    latest-<run>-s<K>-rank0.pt       symlink Composer autoresume follows, per stage
    manifests/tok-<T>.json           done-marker (trainers.checkpoints), written after the .pt is complete
    <run>-stages.json                ledger of stage specs already trained on
With an s3:// train.save_folder the same names also live remotely (trainers/remote.py).

The order of a save (trainers/saver.py) is: write .pt -> publish manifest -> repoint the latest symlink. A kill at
any point leaves the symlink on the previous complete checkpoint, so autoresume never follows
a half-written file. Before each launch, `plan_start` repairs what a kill can leave behind:
.pt files without a manifest are deleted, manifests whose file fails an integrity check are
withdrawn, and the symlink is re-derived from the newest surviving manifest of the stage.

A launch of stage K is one of:
    resume  a checkpoint of stage K exists: autoresume loads everything, data position included
            (the RNG state is put back by trainers/rng.py: Composer would not, inside an epoch).
    enter   none does, K > 0: load the end checkpoint of stage K-1 (weights, optimizer, RNG,
            timestamp) but not its data position, since stage K reads a different mixture.
    fresh   K == 0 and nothing saved yet.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainers import checkpoints
from trainers.checkpoints import CheckpointInfo, is_intact
from trainers.config import StageConfig, TrainJob, stage_bounds
from trainers.exit_codes import FatalError
from trainers.faults import maybe_stall
from trainers.remote import RemoteFolder, reconcile
from trainers.rollback import rollbacks_path

log = logging.getLogger("tessera.resume")


def checkpoint_name(job: TrainJob, stage_index: int) -> str:
    """Composer filename template (it fills {token} and {rank})."""
    return f"{job.run_name}-s{stage_index}-tok{{token}}-rank{{rank}}.pt"


def latest_name(job: TrainJob, stage_index: int) -> str:
    return f"latest-{job.run_name}-s{stage_index}-rank{{rank}}.pt"


def _ledger_path(job: TrainJob) -> Path:
    return Path(job.save_folder) / f"{job.run_name}-stages.json"


def atomic_symlink(target: Path, link: Path) -> None:
    tmp = link.with_name(f".tmp-{link.name}")
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    os.replace(tmp, link)


def _check_ledger(job: TrainJob) -> None:
    """Refuse edits to stages that have already been trained on; allow appending new ones."""
    path = _ledger_path(job)
    trained = json.loads(path.read_text()) if path.exists() else []
    for i, recorded in enumerate(trained):
        if i >= len(job.train.stages):
            raise FatalError(
                f"train.stages: stage {recorded['name']!r} (index {i}) was already trained on but is missing from the job; "
                "stages can be appended, not removed"
            )
        current = job.train.stages[i].model_dump(mode="json")
        # Through the model, so fields added to StageConfig since the ledger was written compare as their defaults.
        recorded = StageConfig.model_validate(recorded).model_dump(mode="json")
        for field in sorted(set(recorded) | set(current)):
            if recorded.get(field) != current.get(field):
                raise FatalError(
                    f"train.stages[{i}].{field}: stage {recorded['name']!r} was already trained with "
                    f"{field}={recorded.get(field)!r}, the job now says {current.get(field)!r}; editing a trained "
                    "stage is refused (append a new stage instead)"
                )


def _record_ledger(job: TrainJob, stage_index: int, remote: RemoteFolder | None) -> None:
    """Remember the specs of stages 0..stage_index once training of stage_index is about to start."""
    path = _ledger_path(job)
    trained = json.loads(path.read_text()) if path.exists() else []
    needed = [s.model_dump(mode="json") for s in job.train.stages[: stage_index + 1]]
    if len(needed) > len(trained):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        tmp.write_text(json.dumps(needed, indent=1))
        os.replace(tmp, path)
        if remote is not None:
            remote.push_file(path)


def own_file(job: TrainJob, name: str) -> re.Match | None:
    """Whether a file name is one of this run's checkpoints (not another run's sharing the folder)."""
    return re.match(rf"^{re.escape(job.run_name)}-s(\d+)-tok(\d+)-rank0\.pt$", name)


def _run_checkpoints(job: TrainJob) -> list[tuple[int, int, Path]]:
    """(stage_index, tokens, path) of this run's checkpoint files on disk."""
    found = []
    for path in Path(job.save_folder).glob(f"{job.run_name}-s*-tok*-rank0.pt"):
        match = own_file(job, path.name)
        if match:
            found.append((int(match[1]), int(match[2]), path))
    return found


def _rederived(job: TrainJob, stage_index: int, tokens: int, path: Path) -> CheckpointInfo | None:
    """The manifest a complete checkpoint named `<run>-s<K>-tok<T>` had: its step count follows from the
    curriculum's batch sizes. None if no step of stage K ends at T tokens."""
    bounds = stage_bounds(job.train)
    if not 0 <= stage_index < len(bounds) or not bounds[stage_index][0] < tokens <= bounds[stage_index][1]:
        return None
    batch = sum(job.train.stages[k].tokens // job.stage_tokens_per_batch(k) for k in range(stage_index))
    into, per_batch = tokens - bounds[stage_index][0], job.stage_tokens_per_batch(stage_index)
    if into % per_batch:
        return None
    return CheckpointInfo(path=str(path.resolve()), tokens=tokens, batch=batch + into // per_batch,
                          stage=job.train.stages[stage_index].name, stage_index=stage_index)  # fmt: skip


@dataclass(frozen=True)
class StartPlan:
    kind: Literal["fresh", "resume", "enter"]
    load_path: str | None  # what Composer loads when autoresume finds nothing (the previous stage's end)
    tokens: int  # tokens of the run already trained at the start point
    checkpoint: dict | None = None  # CheckpointInfo of the checkpoint loaded (resume or enter)


def plan_start(job: TrainJob, stage_index: int) -> StartPlan:
    """Repair the save folder after a kill and decide where stage `stage_index` starts. Rank 0 only."""
    if not 0 <= stage_index < len(job.train.stages):
        raise FatalError(f"--stage: {stage_index} is out of range, the job has {len(job.train.stages)} stage(s)")
    if "://" in job.save_folder:
        raise FatalError(
            f"save_folder: {job.save_folder} must be a local folder; put the s3:// URI in train.save_folder"
        )
    folder = Path(job.save_folder)
    folder.mkdir(parents=True, exist_ok=True)
    remote = RemoteFolder.for_job(job)
    if remote is not None:
        remote.pull_json_list(_ledger_path(job))
        remote.pull_json_list(rollbacks_path(job))
    _check_ledger(job)

    complete = [c for c in checkpoints.list_complete(folder) if own_file(job, Path(c.path).name)]
    published = {Path(c.path).resolve() for c in complete}
    # A .pt without a manifest was cut short by a kill (drop it: the relaunch re-trains and re-saves
    # those steps deterministically), or finished before its manifest was written or after the
    # manifest was lost: a file that verifies gets its manifest back, and is never deleted.
    for stage, tokens, path in sorted(_run_checkpoints(job)):
        if path.resolve() in published:
            continue
        if not is_intact(path) or checkpoints.damage(path) is not None:
            path.unlink(missing_ok=True)
            continue
        info = _rederived(job, stage, tokens, path)
        if info is None:  # not a step of this curriculum: kept out of the way, not deleted
            os.replace(path, path.with_name(path.name + ".unpublished"))
            log.warning("checkpoint %s matches no step of this job's curriculum: set aside as %s.unpublished",
                        path, path.name)  # fmt: skip
            continue
        checkpoints.publish(folder, info)
        complete.append(info)
        log.warning("checkpoint %s had no manifest but verifies: manifest re-derived", path)
    complete.sort(key=lambda c: c.tokens)

    good: list[CheckpointInfo] = []
    for info in complete:
        if is_intact(info.path):
            good.append(info)
        else:
            _withdraw(job, info, "cut short: no zip directory")
    if remote is not None:
        good = reconcile(remote, job, stage_index, good)

    link = folder / latest_name(job, stage_index).format(rank=0)
    good = _verified_newest(job, stage_index, good)
    own = [c for c in good if c.stage_index == stage_index]
    if own:
        newest = max(own, key=lambda c: c.tokens)
        atomic_symlink(Path(newest.path), link)
        _record_ledger(job, stage_index, remote)
        return StartPlan("resume", None, newest.tokens, newest.model_dump())
    link.unlink(missing_ok=True)
    if stage_index == 0:
        _record_ledger(job, 0, remote)
        return StartPlan("fresh", None, 0)
    prev_end = stage_bounds(job.train)[stage_index - 1][1]
    ends = [c for c in good if c.stage_index == stage_index - 1 and c.tokens == prev_end]
    if not ends:
        prev = job.train.stages[stage_index - 1].name
        raise FatalError(
            f"--stage {stage_index}: stage {prev!r} has no complete checkpoint at its end ({prev_end} tokens) "
            f"in {job.save_folder}; train stage {stage_index - 1} first"
        )
    _record_ledger(job, stage_index, remote)
    return StartPlan("enter", ends[-1].path, prev_end, ends[-1].model_dump())


def _withdraw(job: TrainJob, info: CheckpointInfo, why: str) -> None:
    """Neither autoresume nor an evaluator may pick it up again. The newest damaged file is kept beside
    the others as `<name>.corrupt` for a look; this run's older ones go, so they cannot pile up (another
    run sharing the folder keeps its own)."""
    log.warning("checkpoint %s is damaged (%s): withdrawn, the previous one is used", info.path, why)
    checkpoints.manifest_path(job.save_folder, info.tokens).unlink(missing_ok=True)
    kept = Path(f"{info.path}.corrupt")
    for old in Path(job.save_folder).glob("*.corrupt"):
        if old != kept and own_file(job, old.name.removesuffix(".corrupt")):
            old.unlink(missing_ok=True)
    os.replace(info.path, kept)


def _verified_newest(job: TrainJob, stage_index: int, good: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """`good` without the damaged checkpoints among those this launch would start from: the newest of
    this stage, or the previous stage's end when entering. Older ones are checked only if needed."""
    good = list(good)
    while True:
        own = [c for c in good if c.stage_index == stage_index]
        candidates = own or [c for c in good if c.stage_index == stage_index - 1]
        if not candidates:
            return good
        newest = max(candidates, key=lambda c: c.tokens)
        why = checkpoints.damage(newest.path)
        if why is None:
            return good
        _withdraw(job, newest, why)
        good.remove(newest)


def prepare_node(job: TrainJob, stage_index: int, plan: StartPlan) -> None:
    """On the first rank of a node other than rank 0's: put the plan's checkpoint in this node's folder.

    Composer loads from the same absolute path on every node. On a shared filesystem the file is
    already there; on node-local disks it is fetched from the s3:// save folder. The latest symlink
    is set to the plan's own choice either way, so a stale one left on this disk by an earlier
    launch is never followed.
    """
    maybe_stall("node")
    folder = Path(job.save_folder)
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / latest_name(job, stage_index).format(rank=0)
    if plan.checkpoint is None:  # fresh: nothing to load
        link.unlink(missing_ok=True)
        return
    info = CheckpointInfo.model_validate(plan.checkpoint)
    path = Path(info.path)
    if not (path.is_file() and is_intact(path)):
        remote = RemoteFolder.for_job(job)
        if remote is None:
            raise FatalError(
                f"save_folder: {path} is on rank 0's node only; ranks on other nodes need a shared save folder "
                "or train.save_folder: s3://..."
            )
        path = Path(remote.download(info, folder).path)
    if plan.kind == "resume":
        atomic_symlink(path, link)
    else:
        link.unlink(missing_ok=True)


def drop_dataset_state(state_dict: dict) -> None:
    """load_ignore_keys for entering a stage: the previous stage's data position means nothing here."""
    state_dict["state"].pop("dataset_state", None)

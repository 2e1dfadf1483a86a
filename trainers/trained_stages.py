"""Trained stages: the specs of the stages a run has trained on, so a trained stage is never edited; and whether
the run's records alone show a stage finished (`finished`), so a rerun with nothing to do launches no trainer.

(Not to be confused with tasks/consumed_files.py, the input files continued runs consumed.)

`<save_folder>/<run>-stages.json` lists every stage from the first to the one being trained, as
its StageConfig. A later launch may append stages (continued pretraining adds one) but not change
or drop one: its checkpoints were made with those numbers, and the LR schedule, the data position
and the token boundaries of every later stage follow from them.

The record is written whole and durably (trainers/format/atomic.py). One written before that, and
cut short by a power loss (typically an empty file: the rename reached the disk, the bytes did
not), is re-derived rather than refused: refusing would fail every relaunch of a run that has
nothing wrong with it but this file.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from trainers.config import StageConfig, TrainJob
from trainers.exit_codes import FatalError
from trainers.format.atomic import CutShort, atomic_write_json, read_json
from trainers.format.checkpoints import CheckpointInfo, is_intact
from trainers.layout import RunFolder
from trainers.remote import RemoteFolder

log = logging.getLogger("tessera.plan")


def _write(folder: RunFolder, stages: Sequence[StageConfig]) -> None:
    atomic_write_json(folder.stages_record, [s.model_dump(mode="json") for s in stages], indent=1)


def _rederived(folder: RunFolder, stages: Sequence[StageConfig], why: CutShort) -> list[dict]:
    """The record a cut-short one stood for, from what the run left on disk; written back.

    Every stage with a checkpoint file of this run (published or not: a file is saved only after its
    stage was recorded) was trained on, so the record held at least stages 0..K of the highest such K;
    the launch's own `record` then appends the stage being started, as a clean run would have. What a
    re-derived record cannot tell is an edit of a trained stage's numbers made meanwhile; the stage
    names the published manifests record are checked, and a stage that is gone is still refused.
    """
    highest = -1
    for stage_index, _, path in folder.files():
        if stage_index >= len(stages):
            raise FatalError(
                f"train.stages: stage index {stage_index} was already trained on ({path.name}) but is missing "
                "from the job; stages can be appended, not removed"
            )
        highest = max(highest, stage_index)
    for info in folder.complete():
        if info.stage_index >= len(stages) or stages[info.stage_index].name != info.stage:
            raise FatalError(
                f"train.stages[{info.stage_index}]: stage {info.stage!r} was already trained on ({info.path}) but "
                "the job names another stage there; editing a trained stage is refused (append a new stage instead)"
            )
        highest = max(highest, info.stage_index)
    # No checkpoint at all (highest -1): nothing was trained that the record must protect; the empty
    # list is replaced by the launch's own record of the stage it starts.
    log.warning("%s; re-derived from this run's checkpoints: %d stage(s)", why, highest + 1)
    _write(folder, stages[: highest + 1])
    return [s.model_dump(mode="json") for s in stages[: highest + 1]]


def _trained(folder: RunFolder, stages: Sequence[StageConfig]) -> list[dict]:
    try:
        return read_json(folder.stages_record, missing=[])
    except CutShort as why:
        return _rederived(folder, stages, why)


def check(folder: RunFolder, stages: Sequence[StageConfig]) -> None:
    """Refuse edits to stages that have already been trained on; allow appending new ones."""
    trained = _trained(folder, stages)
    for i, recorded in enumerate(trained):
        if i >= len(stages):
            raise FatalError(
                f"train.stages: stage {recorded['name']!r} (index {i}) was already trained on but is missing from "
                "the job; stages can be appended, not removed"
            )
        current = stages[i].model_dump(mode="json")
        # Through the model, so fields added to StageConfig since the record was written compare as their defaults.
        recorded = StageConfig.model_validate(recorded).model_dump(mode="json")
        for field in sorted(set(recorded) | set(current)):
            if recorded.get(field) != current.get(field):
                raise FatalError(
                    f"train.stages[{i}].{field}: stage {recorded['name']!r} was already trained with "
                    f"{field}={recorded.get(field)!r}, the job now says {current.get(field)!r}; editing a trained "
                    "stage is refused (append a new stage instead)"
                )


def covers(folder: RunFolder, stages: Sequence[StageConfig], stage_index: int) -> bool:
    """The record records stages 0..stage_index as the job has them: no launch would refuse an edit of them."""
    try:
        check(folder, stages)
    except FatalError:  # the launch says it, in the trainer's own words
        return False
    return len(_trained(folder, stages)) > stage_index


def finished(job: TrainJob, stage_index: int) -> CheckpointInfo | None:
    """The checkpoint that ends stage `stage_index` when the run's records alone say the stage is complete, so the
    flow need not launch ranks to learn it (a rerun with nothing to do); None when a launch must decide.

    Complete means: a published manifest of the stage at or past its end, in the s3 mirror when the run has one
    (where a pod's or a fresh node's work lands, and a manifest is uploaded after its file), its file whole where it
    is local, and the trained-stages record agreeing with the job's stages up to this one (an edit of a trained stage is
    left to the launch, which refuses it in one line). Read-only except that a mirror's record is pulled into the
    local one, as a launch's plan would. Anything the records do not settle is the launch's to decide.
    """
    stage = job.stage(stage_index)
    folder = RunFolder.of(job)
    remote = RemoteFolder.for_job(job)
    if remote is not None:
        folder.path.mkdir(parents=True, exist_ok=True)
        remote.pull_json_list(folder.stages_record)
        done = [c for c in remote.complete() if folder.owns(Path(c.path).name)]
    else:
        done = [c for c in folder.complete() if is_intact(c.path)]
    ends = [c for c in done if c.stage_index == stage_index and c.tokens >= stage.end]
    if not ends or not covers(folder, job.train.stages, stage_index):
        return None
    return max(ends, key=lambda c: c.tokens)


def record(folder: RunFolder, stages: Sequence[StageConfig], stage_index: int, remote: RemoteFolder | None) -> None:
    """Remember the specs of stages 0..stage_index once training of stage_index is about to start."""
    trained = _trained(folder, stages)
    if stage_index + 1 > len(trained):
        _write(folder, stages[: stage_index + 1])
        if remote is not None:
            remote.push_file(folder.stages_record)

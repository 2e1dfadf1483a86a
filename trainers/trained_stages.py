"""Trained stages: the specs of the stages a run has trained on, so a trained stage is never edited.

(Not to be confused with tasks/consumed_files.py, the input files continued runs consumed.)

`<save_folder>/<run>-stages.json` lists every stage from the first to the one being trained, as
its StageConfig. A later launch may append stages (continued pretraining adds one) but not change
or drop one: its checkpoints were made with those numbers, and the LR schedule, the data position
and the token boundaries of every later stage follow from them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from trainers.config import StageConfig
from trainers.exit_codes import FatalError
from trainers.layout import RunFolder
from trainers.remote import RemoteFolder


def check(folder: RunFolder, stages: Sequence[StageConfig]) -> None:
    """Refuse edits to stages that have already been trained on; allow appending new ones."""
    trained = json.loads(folder.ledger.read_text()) if folder.ledger.exists() else []
    for i, recorded in enumerate(trained):
        if i >= len(stages):
            raise FatalError(
                f"train.stages: stage {recorded['name']!r} (index {i}) was already trained on but is missing from "
                "the job; stages can be appended, not removed"
            )
        current = stages[i].model_dump(mode="json")
        # Through the model, so fields added to StageConfig since the ledger was written compare as their defaults.
        recorded = StageConfig.model_validate(recorded).model_dump(mode="json")
        for field in sorted(set(recorded) | set(current)):
            if recorded.get(field) != current.get(field):
                raise FatalError(
                    f"train.stages[{i}].{field}: stage {recorded['name']!r} was already trained with "
                    f"{field}={recorded.get(field)!r}, the job now says {current.get(field)!r}; editing a trained "
                    "stage is refused (append a new stage instead)"
                )


def record(folder: RunFolder, stages: Sequence[StageConfig], stage_index: int, remote: RemoteFolder | None) -> None:
    """Remember the specs of stages 0..stage_index once training of stage_index is about to start."""
    path = folder.ledger
    trained = json.loads(path.read_text()) if path.exists() else []
    needed = [s.model_dump(mode="json") for s in stages[: stage_index + 1]]
    if len(needed) > len(trained):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        tmp.write_text(json.dumps(needed, indent=1))
        os.replace(tmp, path)
        if remote is not None:
            remote.push_file(path)

"""Where a launch's time went, as rank 0 saw it: one JSON line at every checkpoint and at the stage's end.

`<save_folder>/<run>-time.jsonl` (mirrored to an s3 save folder): the launch's process start, the moment
of the record, the tokens it had reached, and the seconds spent so far in each phase of its heartbeat
(trainers/heartbeat.py: startup, plan, download, load, first_step, compile, data, step, eval, save,
upload, close). A record is written only once its checkpoint is published, so the steps it counts are steps
that stay; whatever a launch did after its last record, until it died, was lost, and the flow's
goodput ledger (tasks/training/goodput.py) counts it so. Appended and flushed, fsynced with the checkpoint's
own files; a line cut short by a kill is skipped on reading.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainers import heartbeat
from trainers.format.atomic import append_record, read_records


def path(save_folder: str | Path, run_name: str) -> Path:
    return Path(save_folder) / f"{run_name}-time.jsonl"


def record(save_folder: str | Path, run_name: str, stage: str, tokens: int, final: bool, remote=None) -> None:
    """Append this launch's phase totals so far (rank 0; a no-op without a heartbeat)."""
    beat = heartbeat.current()
    if beat is None:
        return
    line = {
        "pid": os.getpid(),
        "process_start": round(beat.started, 3),
        "at": round(time.time(), 3),
        "stage": stage,
        "tokens": tokens,
        "final": final,
        "phases": beat.spent(),
    }
    target = path(save_folder, run_name)
    append_record(target, line)
    if remote is not None:
        # pushed whole with each record: one that fails in an object store outage is carried by the next, and
        # never stops training (the checkpoints' own uploads are retried in the background)
        remote.push_file(target, best_effort=True)


def read(save_folder: str | Path, run_name: str) -> list[dict]:
    return read_records(path(save_folder, run_name))

"""The launches of a run, one JSON line each, written by the stage task as each launch ends.

What the flow alone knows about a launch: when it was started and ended, how it ended (exit code and
kind, a hang the watchdog saw), and the run's newest checkpoint before and after it. Two readers:
the no-progress stop (`no_progress_streak`: launches in a row that ended without a new checkpoint,
counted across the stage task's Prefect retries, which start with no memory of their own) and the
goodput ledger (tasks/training/goodput.py), which adds what the trainer recorded inside each launch.

`<run_dir>/ledger/launches.jsonl`, appended and fsynced per record; a line cut short by a crash is
skipped on reading.
"""

from __future__ import annotations

from pathlib import Path

from trainers.format.atomic import append_record, fsync_path, read_records


def path(run_dir: Path) -> Path:
    return Path(run_dir) / "ledger" / "launches.jsonl"  # the goodput ledger's folder: its inputs


def append(run_dir: Path, record: dict) -> None:
    target = path(run_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    append_record(target, record)
    fsync_path(target.parent)


def read(run_dir: Path) -> list[dict]:
    return read_records(path(run_dir))


def no_progress_streak(records: list[dict], stage: str) -> int:
    """How many of `stage`'s latest launches in a row failed or were preempted without a checkpoint newer than the
    one they started from (a launch its own flow stopped, a cancel, ends the count)."""
    streak = 0
    for record in reversed([r for r in records if r.get("stage") == stage]):
        ended_well = record.get("kind") == "ok" or record.get("stopped")  # done, or stopped by its flow (a cancel)
        if ended_well or (record.get("tokens_after") or 0) > (record.get("tokens_before") or 0):
            break
        streak += 1
    return streak

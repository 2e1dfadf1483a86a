"""A full disk as the CLI and flows report it: one line naming the folder and its free space (trainers/disk.py)."""

from __future__ import annotations

from pathlib import Path

from trainers.disk import full_disk_line, no_space

FIX = "free some space, then rerun: a run resumes from its last complete checkpoint, prepare from its last output"


def full_disk(exc: BaseException, work_dir: str | Path) -> str | None:
    """The one line for `exc` if a full disk is behind it (anywhere in its chain), else None."""
    full = no_space(exc)
    return None if full is None else full_disk_line(full, work_dir, FIX)

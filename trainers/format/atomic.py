"""The one way tessera writes a state file: whole or not at all, and on the disk when this returns.

A state file is one a later process reads back to decide what to do: the trained-stages record, the rollback
records, the job file, checkpoint manifests, the metrics marker, prepared data's provenance and
done-marker. Written with a plain `write_text`, or with a temp file renamed in but never fsynced, a
power loss can leave it empty or cut short: the rename reached the disk, the bytes did not (the
classic zero-length file of delayed allocation). `atomic_write` writes a temp file in the same
folder, flushes and fsyncs it, renames it over the target and fsyncs the folder, so after a crash
the path holds the old content or the new one, never a part.

Readers still meet files written before this existed, or by hand: `read_json` says "cut short"
with its own exception, so each reader can repair (re-derive or treat as none) instead of failing.

Part of the checkpoint-format package so that trainers/, tasks/ and evaluation/ share it; it
imports nothing of tessera.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

TEMP_PREFIX = ".tmp-"  # temp files start with it (dot: hidden, and no glob of a run's files matches them)


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder by path (a folder's fsync makes its entries, renames included, durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and folder under `root`, `root` included: before a done-marker names what it holds."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Replace `path` with `data` atomically and durably; returns the path.

    On any failure the temp file is removed and `path` keeps what it held before.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TEMP_PREFIX}{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_path(path.parent)  # the rename itself: without it the folder may still name the old file
    return path


def atomic_write_json(path: str | Path, obj: Any, **dumps: Any) -> Path:
    """`atomic_write` of `json.dumps(obj, **dumps)`."""
    return atomic_write(path, json.dumps(obj, **dumps))


class CutShort(ValueError):
    """A state file is there but does not parse: empty or cut short by a crash (or edited by hand)."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: empty or cut short ({why})")
        self.path = path


def read_json(path: str | Path, missing: Any = None) -> Any:
    """The JSON value in `path`; `missing` when there is no such file; CutShort when it does not parse."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return missing
    if not data.strip():  # what a power loss leaves most often: the rename on disk, the bytes not
        raise CutShort(path, "no content")
    try:
        return json.loads(data)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise CutShort(path, str(exc)) from None


def append_record(path: str | Path, record: dict) -> None:
    """Append `record` to a JSON-lines journal as one line, flushed and fsynced (a journal's one write)."""
    with open(path, "a") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: str | Path) -> list[dict]:
    """A JSON-lines journal's records; none when there is no file; a line cut short by a crash mid-append is
    skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records

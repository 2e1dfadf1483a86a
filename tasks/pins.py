"""Checkpoints held for the gauntlet: pinned against the trainer's keep-last-K, and a bounded queue.

A checkpoint waiting to be scored and exported is pinned: hard-linked into the run's `pins/`
folder, so the trainer's rotation cannot delete it meanwhile. Across filesystems (a save folder on
another volume) a hard link fails with EXDEV and the pin is a copy instead, written beside the
pins and renamed into place so a crash never leaves half a pin.

With the trainer in pods, the flow sees only the s3 mirror: there a pin is a marker object
`<save folder>/pins/<checkpoint name>` that the trainer's remote keep-last-K leaves alone
(RemoteFolder.pin/unpin/drop_pins in trainers/remote.py, which the rotation reads too).

Pins escape keep-last-K, so the queue of pinned checkpoints is bounded, local or remote: when the
gauntlet is slower than the checkpoint interval, the oldest waiting checkpoints are skipped (and
unpinned), each named in a log line, and the newest are scored.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger("tessera.pins")

T = TypeVar("T")

MAX_WAITING = 2  # checkpoints queued behind the one being scored


def pin(path: str | Path, pins: Path) -> Path | None:
    """`path` held in `pins/`; None (and a log line) if it was deleted before it could be pinned."""
    source = Path(path)
    pins.mkdir(parents=True, exist_ok=True)
    target = pins / source.name
    if target.exists():
        return target
    if source.is_dir():  # a sharded checkpoint: a folder of links to its files, renamed into place whole
        return _pin_folder(source, target)
    try:
        os.link(source, target)
    except FileNotFoundError:
        log.warning(
            "checkpoint %s was deleted before it could be pinned (keep-last-K rotated it out): "
            "it will not be evaluated or registered",
            source,
        )
        return None
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        staging = pins / f".{source.name}.copying"
        try:
            shutil.copyfile(source, staging)
        except FileNotFoundError:
            staging.unlink(missing_ok=True)
            log.warning(
                "checkpoint %s was deleted while it was being pinned: it will not be evaluated or registered", source
            )
            return None
        os.replace(staging, target)
    return target


def _pin_folder(source: Path, target: Path) -> Path | None:
    staging = target.with_name(f".{target.name}.linking")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for file in sorted(source.iterdir()):
            try:
                os.link(file, staging / file.name)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                shutil.copyfile(file, staging / file.name)
    except FileNotFoundError:
        shutil.rmtree(staging, ignore_errors=True)
        log.warning(
            "checkpoint %s was deleted before it could be pinned (keep-last-K rotated it out): "
            "it will not be evaluated or registered",
            source,
        )
        return None
    os.replace(staging, target)
    return target


def unpin(pinned: Path) -> None:
    if pinned.is_dir():
        shutil.rmtree(pinned, ignore_errors=True)
    else:
        pinned.unlink(missing_ok=True)


def drop_stale(pins: Path) -> list[str]:
    """Every pin in the folder, deleted; their names. Called as a flow starts, when any pin there is a
    crashed flow's: one flow runs per run name (tasks/run_slot.py), so no live flow holds one."""
    if not pins.is_dir():
        return []
    stale = sorted(p.name for p in pins.iterdir())
    for name in stale:
        unpin(pins / name)
    return stale


@dataclass
class Backlog(Generic[T]):
    """Checkpoints waiting for the gauntlet, oldest first, at most `limit` of them."""

    limit: int = MAX_WAITING
    waiting: list[T] = field(default_factory=list)

    def add(self, item: T) -> list[T]:
        """Queue `item`; returns the oldest waiting items skipped to make room."""
        self.waiting.append(item)
        skipped = self.waiting[: max(0, len(self.waiting) - self.limit)]
        del self.waiting[: len(skipped)]
        return skipped

    def take(self) -> T | None:
        return self.waiting.pop(0) if self.waiting else None

    def __len__(self) -> int:
        return len(self.waiting)

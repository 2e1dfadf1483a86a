"""The save folder's lock: one trainer per run name; global rank 0 holds a flock on `<save_folder>/<run>.lock`.

(The other two exclusions: the run-name slot, tasks/runs/run_slot.py, one live flow run per run name; an
output's claim, tasks/data/claim.py, one writer per prepared-data directory.)

Why the trainer enforces it itself: `plan_start` deletes unpublished checkpoint files and
re-points the latest symlink, so a second trainer of a live run would delete the file the first
is writing, and then both would write the same names. Second trainers happen: a flow retry
while the orphaned first job still runs, a second flow run started from the UI, a hand-started
trainer. The flow checks too, but only the trainer sees every way of being started.

Why flock: the kernel drops it when the holder dies, however it dies (SIGKILL included), so
there is no stale lock to clean up and no heartbeat to tune. The lock is tried without blocking
and retried for TESSERA_LEASE_WAIT_S seconds (default 60), because a cancelled trainer may still
be exiting when its relaunch starts. The holder rewrites the file's content to say who holds it
(pid, host, since when, and TESSERA_HOLDER, which the flow sets to its flow run) so that a
refused trainer can name it in its one-line error.

Scope: the lock lives in rank 0's save folder. It excludes trainers that share that folder (the
local backend, one node, a shared filesystem); ranks on other nodes learn rank 0's verdict over
the process group. Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from trainers.contract import HOLDER_ENV
from trainers.exit_codes import FatalError

LEASE_WAIT_ENV = "TESSERA_LEASE_WAIT_S"
DEFAULT_WAIT_S = 60.0
_POLL_S = 0.25

log = logging.getLogger("tessera.train")

# Lock file -> descriptor, open for the life of the process: closing it would release the lock.
_held: dict[Path, int] = {}


def _drop_in_child() -> None:
    # A forked child shares the lock's open file description: were it to outlive a SIGKILLed
    # parent, the run would stay locked. Closing its copy leaves the parent's lock in place.
    for fd in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_drop_in_child)


def lease_path(save_folder: str | Path, run_name: str) -> Path:
    return Path(save_folder) / f"{run_name}.lock"


@dataclass(frozen=True)
class Holder:
    """Who holds a run's lease, as its lock file says."""

    pid: int
    host: str
    since: float  # epoch seconds when it took the lease
    label: str | None  # TESSERA_HOLDER of the holder, e.g. its flow run

    def describe(self) -> str:
        label = f" ({self.label})" if self.label else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host}{label} since {since}"


def read_holder(path: str | Path) -> Holder | None:
    """The holder named in a lock file; None if it names nobody (yet)."""
    try:
        record = json.loads(Path(path).read_text())
        return Holder(int(record["pid"]), str(record["host"]), float(record["since"]), record.get("label"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def acquire(save_folder: str | Path, run_name: str, wait_s: float | None = None) -> Path:
    """Take the run's lease for the life of this process (waiting up to wait_s), or raise a one-line FatalError.

    Idempotent within a process. wait_s defaults to TESSERA_LEASE_WAIT_S, else 60 s.
    """
    path = lease_path(save_folder, run_name).absolute()
    if path in _held:
        return path
    if wait_s is None:
        wait_s = float(os.environ.get(LEASE_WAIT_ENV, DEFAULT_WAIT_S))
    path.parent.mkdir(parents=True, exist_ok=True)
    # No O_TRUNC: opening must not wipe the current holder's name before we hold the lock.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                os.close(fd)
                raise FatalError(
                    f"run {run_name!r} is already being trained by {_holder_text(path)}; "
                    "a second trainer would corrupt its checkpoints"
                ) from None
            if not announced:
                log.info(
                    "run %r is held by %s; waiting up to %.0f s for it to exit", run_name, _holder_text(path), left
                )
                announced = True
            time.sleep(min(_POLL_S, left))
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.time(),
        "label": os.environ.get(HOLDER_ENV) or None,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)
    _held[path] = fd
    return path


def _holder_text(path: Path) -> str:
    # The holder writes its name just after locking: a waiter can read an empty file for an instant.
    for _ in range(8):
        holder = read_holder(path)
        if holder is not None:
            return holder.describe()
        time.sleep(0.05)
    return f"another process (its lock file {path} names no holder)"

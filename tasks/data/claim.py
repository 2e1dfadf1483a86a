"""An output's claim: one writer per prepared-data directory, across processes and hosts sharing the data root.

One of tessera's three exclusions, each named for what it guards: the run-name slot (tasks/runs/run_slot.py,
one live flow run per run name), this claim (one writer per prepared output), and the save folder's
lock (trainers/folder_lock.py, one trainer per run's checkpoints).

A claim (a "lease" in the code below) is a lock file beside the output, `.<name>.lease`, created with
O_CREAT|O_EXCL (atomic on local filesystems and on NFSv3+), holding its owner's token, host and pid. The
holder refreshes the file's mtime every TTL_S/4; that mtime is the heartbeat. A lease is stale when its
heartbeat is older than TTL_S, or at once when its host is this one and its pid is gone (a killed run on
this machine need not wait out the TTL). A waiter takes a stale lease over; while the holder lives, it
waits and then finds the output done and reuses it. Only the lease holder touches the output's staging
directories, so no run deletes a live run's work, whatever host it is on.

Why not fcntl/flock: their behaviour on network filesystems varies (NFS needs lockd, many FUSE
and object-store mounts ignore them), and a dead host's lock is then released when the server
says so. A lease file works wherever O_EXCL does, and a dead host's lease expires on a clock we
set. The cost is trusting mtimes across hosts: clocks must agree to well within TTL_S.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tasks.data import interrupt

TTL_S = float(os.environ.get("TESSERA_LEASE_SECONDS", "120"))
POLL_S = 0.5
HOST = socket.gethostname()


class LeaseLost(RuntimeError):
    """Another run took this lease over (ours went stale): publishing now could clobber its work."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as its file says."""

    owner: str
    host: str
    pid: int
    mtime: float

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, heartbeat {max(0.0, time.time() - self.mtime):.0f}s ago"


def path_for(out: str) -> str:
    parent, base = os.path.split(os.path.abspath(out))
    return os.path.join(parent, f".{base}.lease")


def _read(path: str) -> Holder | None:
    try:
        with open(path) as f:
            text = f.read()
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        return None
    try:
        info = json.loads(text)
        return Holder(str(info["owner"]), str(info["host"]), int(info["pid"]), mtime)
    except (ValueError, KeyError, TypeError):
        # Created but not yet written (or by something else): held, by nobody we can name.
        return Holder("", "?", 0, mtime)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale(h: Holder, now: float | None = None) -> bool:
    if (now if now is not None else time.time()) - h.mtime > TTL_S:
        return True
    return h.host == HOST and h.pid > 0 and not _alive(h.pid)


class Lease:
    """A held lease: refreshed in the background until released."""

    def __init__(self, path: str, owner: str):
        self.path, self.owner = path, owner
        self._stop = threading.Event()
        self._lost = False
        self._thread = threading.Thread(target=self._beat, name="tessera-lease", daemon=True)

    def check(self) -> None:
        """Raise LeaseLost if another run has taken this lease over."""
        if self._lost or self._mine() is False:
            self._lost = True
            raise LeaseLost(f"{self.path}: lease taken over by another run while this one worked; not publishing")

    def _mine(self) -> bool | None:
        h = _read(self.path)
        return None if h is None else h.owner == self.owner

    def _beat(self) -> None:
        while not self._stop.wait(TTL_S / 4):
            if self._mine() is not True:
                self._lost = True
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._mine():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        _HELD.discard(self)


_HELD: set[Lease] = set()


def _create(path: str, owner: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(
            {
                "owner": owner,
                "host": HOST,
                "pid": os.getpid(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            f,
        )
    return True


def _break(path: str, seen: Holder) -> None:
    """Remove a stale lease, unless it changed since it was judged stale.

    Breakers serialise on `<lease>.break` (O_EXCL too), so two waiters cannot both break it and the
    second remove the first's fresh lease. A breaker lives for milliseconds: one older than TTL_S
    was left by a process that died mid-break, and is removed.
    """
    breaker = f"{path}.break"
    try:
        fd = os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        with contextlib.suppress(FileNotFoundError):
            if time.time() - os.stat(breaker).st_mtime > TTL_S:
                os.unlink(breaker)
        return
    try:
        if _read(path) == seen:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(breaker)


@contextlib.contextmanager
def hold(
    out: str, on_wait: Callable[[Holder], None] | None = None, check_stop: Callable[[], None] | None = None
) -> Iterator[Lease]:
    """Hold the lease on `out` for the block, waiting while a live run holds it.

    `on_wait(holder)` is called once when this run has to wait; `check_stop()` between polls,
    so a stop request is not held up by waiting.
    """
    path = path_for(out)
    owner = uuid.uuid4().hex
    told = False
    while not _create(path, owner):
        h = _read(path)
        if h is None:
            continue  # released between our create and read
        if stale(h):
            _break(path, h)
            continue
        if on_wait is not None and not told:
            on_wait(h)
            told = True
        if check_stop is not None:
            check_stop()
        time.sleep(POLL_S)
    lease = Lease(path, owner)
    _HELD.add(lease)
    lease._thread.start()
    try:
        yield lease
    finally:
        lease.release()


def release_all() -> None:
    """Drop every lease this process holds: it is about to exit without unwinding its threads."""
    for lease in list(_HELD):
        lease.release()


# A stop releases every claim this process holds, so a rerun on another host need not wait for them to expire.
interrupt.on_exit(lambda deadline: release_all(), last=True)

"""Every job this process launched, on any backend: a dying flow stops them all and launches no more.

Both backends register their jobs here; `cancel_all` is what a failing or cancelled flow calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol


class StoppableJob(Protocol):
    stopped: bool

    def cancel(self, grace_s: float = 10.0) -> None: ...


class LaunchRefused(RuntimeError):
    """A launch after cancel_all: the process that owns the jobs is shutting them down."""


# Jobs started by this process and not yet cancelled: a dying flow must not leave trainers behind.
_LIVE: set[StoppableJob] = set()
_LOCK = threading.Lock()
# Set by cancel_all: a supervisor thread that sees its job die must not relaunch it while the owner stops.
_STOPPING = threading.Event()


@contextmanager
def launching() -> Iterator[set[StoppableJob]]:
    """Hold while starting a job and registering it (add it to the yielded set): never between
    cancel_all's decision to stop and its sweep of the live jobs."""
    with _LOCK:
        refuse_if_stopping()
        yield _LIVE


def refuse_if_stopping() -> None:
    """Raise LaunchRefused once cancel_all has begun; for launches that register with `register` afterwards."""
    if _STOPPING.is_set():
        raise LaunchRefused("not launching: this process is stopping its jobs (the flow failed or was cancelled)")


def register(job: StoppableJob, replaces: Callable[[StoppableJob], bool] | None = None) -> bool:
    """Add a started job to the live set (dropping those `replaces` picks); False, and nothing added, when
    cancel_all has begun meanwhile: the caller then stops what it started itself.

    For launches whose start talks to a remote API (Kubernetes): the lock is held only for this, never across the
    API's calls, so a cancel never waits behind a slow API server (`launching` holds it across the start)."""
    with _LOCK:
        if _STOPPING.is_set():
            return False
        if replaces is not None:
            _LIVE.difference_update([j for j in _LIVE if replaces(j)])
        _LIVE.add(job)
        return True


def forget(job: StoppableJob) -> None:
    """A job that ended and was cleaned up: nothing left to cancel."""
    with _LOCK:
        _LIVE.discard(job)


def cancel_all(grace_s: float = 10.0) -> int:
    """Stop every job this process launched and refuse new launches; returns how many were cancelled.

    A job ended this way is marked `stopped`, so whoever waits on it knows it was stopped on
    purpose and must not treat it as a preemption to recover from.
    """
    with _LOCK:
        _STOPPING.set()
        jobs = list(_LIVE)
    for job in jobs:
        job.stopped = True
        job.cancel(grace_s)
    return len(jobs)


def allow_launches() -> None:
    """Undo cancel_all's refusal: a new flow run in this same process (the CLI, tests) may launch again."""
    _STOPPING.clear()


def stopping() -> bool:
    return _STOPPING.is_set()

"""No orphan trainers: every rank stops when the process that launched the job is gone.

The local backend starts a job in its own session, so that cancelling it reaches every rank;
the price is that nothing stops the job when the flow process dies without cancelling it
(SIGKILL, an OOM kill, a crashed worker). Such an orphan keeps training the run while the
flow's retry, or a new flow run, launches a second trainer beside it.

`infra.local` sets TESSERA_SUPERVISOR_PID to the launching process. A daemon thread on each
rank checks about once a second that this process still exists, is not a zombie and is the
same process (its start time in /proc/<pid>/stat, so a recycled pid does not count as alive),
and otherwise leaves with ExitCode.INTERRUPTED: a relaunch resumes from the last checkpoint.
Without the variable (a Kubernetes pod, whose lifetime the cluster manages; a trainer started
by hand) there is no watchdog.

Standard library only: it starts before torch is imported, so a rank still importing is covered.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from trainers.contract import SUPERVISOR_PID_ENV as SUPERVISOR_ENV
from trainers.exit_codes import ExitCode

CHECK_EVERY_S = 1.0


def _identity(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of a live process, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], fields[19]  # fields 3 and 22 of proc(5)


def _alive(pid: int, started: str | None) -> bool:
    identity = _identity(pid)
    if identity is None:
        if os.path.isdir("/proc/self"):
            return False
        try:  # no procfs (not Linux): existence is all that can be checked
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    state, start = identity
    return state not in ("Z", "X") and (started is None or start == started)


_WATCHED: list[tuple[int, str | None]] = []  # (pid, start time) of the supervisor being watched


def supervisor_gone() -> bool:
    """The watched supervisor has died. A rank whose peer left for that reason fails in a collective
    ("connection reset by peer") before its own watchdog fires: that is the job being stopped, not a fault."""
    return bool(_WATCHED) and not _alive(*_WATCHED[0])


def watch_supervisor(every_s: float = CHECK_EVERY_S) -> threading.Thread | None:
    """Start the watchdog if TESSERA_SUPERVISOR_PID is set; returns its thread (None without one)."""
    value = os.environ.get(SUPERVISOR_ENV, "").strip()
    if not value:
        return None
    pid = int(value)
    identity = _identity(pid)
    started = identity[1] if identity else None
    _WATCHED[:] = [(pid, started)]

    def watch() -> None:
        while _alive(pid, started):
            time.sleep(every_s)
        print(
            f"tessera.train: supervisor process {pid} is gone; stopping (a relaunch resumes from the last checkpoint)",
            file=sys.stderr,
            flush=True,
        )
        # os._exit, not sys.exit: this is not the main thread, and the main thread may sit in a
        # collective or a C call that would never see an exception raised for it.
        os._exit(ExitCode.INTERRUPTED)

    thread = threading.Thread(target=watch, name="tessera-supervisor-watchdog", daemon=True)
    thread.start()
    return thread

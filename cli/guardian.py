"""The guard of one `tessera` command: whatever ends the command, nothing it started outlives it.

Every process a command starts (a temporary Prefect server, an MLflow server, a launcher and its ranks, tokenizer
workers, and whatever those start) inherits the command's mark, `TESSERA_COMMAND=<pid>.<start ns>`, in the
environment it was started with, which no re-parenting or new session takes away. Two ends of the same sweep
(`end_marked`) use it:

- the command itself, at its last atexit hook or once a stop has waited long enough (cli/stopping.py): so that when
  the command has exited, its children are gone;
- this guard, a second process the command starts first, in a session of its own (a Ctrl-C in the terminal or a
  kill of the command's process group does not reach it). It asks Linux for a signal when its parent dies
  (PR_SET_PDEATHSIG), however the parent died, SIGKILL included, then sweeps and exits. A process tree walk from
  the command could not do that: once the command is gone its children belong to PID 1.

Standard library only, and no import of the project: the guard starts as `python -S cli/guardian.py MARK PID`,
in milliseconds, before the command imports anything heavy.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterable

MARK_VAR = "TESSERA_COMMAND"
GRACE_S = 10.0  # for a SIGTERM to end a process (a launcher stops its ranks in 5 s, a server drains) before SIGKILL


def new_mark() -> str:
    return f"{os.getpid()}.{time.time_ns()}"


def marked(mark: str, exclude: Iterable[int] = ()) -> list[int]:
    """Pids of the live processes started with `mark` in their environment (a zombie's environment reads empty)."""
    needle = f"{MARK_VAR}={mark}".encode()
    skip = {os.getpid(), *exclude}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def end_marked(mark: str, exclude: Iterable[int] = (), grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every process carrying `mark`, SIGKILL those still there after `grace_s`; the pids signalled.

    Each round looks again, so a process started while the first ones stop (a rank a launcher restarts) is found
    too; a pid is signalled only while it still carries the mark, so one reused by another process is spared."""
    exclude = set(exclude)
    signalled: set[int] = set()
    deadline = time.monotonic() + grace_s
    while True:
        alive = marked(mark, exclude)
        if not alive:
            return sorted(signalled)
        late = time.monotonic() >= deadline
        for pid in alive:
            if late or pid not in signalled:
                try:
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                except ProcessLookupError:
                    continue
                signalled.add(pid)
        _reap()
        time.sleep(0.05)


def _reap() -> None:
    # the caller's own children that ended are zombies until waited for: collect them (others' children are theirs)
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def guard(mark: str, parent: int) -> None:
    """Wait for `parent` to die, then end what carries its mark.

    The parent's death arrives as SIGUSR1, not SIGTERM: a command that stops its own tree signals this guard too
    (`tessera up` terminates all its children, then its servers), and a guard that swept on that SIGTERM ended the
    servers before the flow runs had recorded how they ended (CI's test_deploy, Cancelling left as the last
    state). A SIGTERM while the parent lives means the command is tidying up itself: the guard just goes."""
    died = []
    signal.signal(signal.SIGUSR1, lambda *_: died.append(True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
    # the parent may have died before prctl took effect; elsewhere than Linux, polling is all there is
    while not died and os.getppid() == parent:
        time.sleep(1.0 if sys.platform == "linux" else 0.2)
    end_marked(mark)


if __name__ == "__main__":
    guard(sys.argv[1], int(sys.argv[2]))

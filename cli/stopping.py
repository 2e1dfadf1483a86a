"""How a `tessera` command ends when it is told to stop, at any moment from its first line to its last.

`supervise()` is the first thing the `tessera` script does (cli/entry.py), before any heavy import:

- it marks the command and starts its guard (cli/guardian.py), which ends whatever carries the mark once the
  command is gone, however it went, SIGKILL included;
- SIGINT, SIGTERM and SIGHUP raise in the main thread (`Stopped`; inside a flow run, Prefect's TerminationSignal),
  wherever it is: importing, waiting for Prefect's temporary server, inside a flow. A signal the command was
  started with ignored (`nohup`, a background job of a script) stays ignored.
  While a flow runs, Prefect's engine swaps in its own SIGTERM handler: the flow ends
  Cancelled with its explanation (tasks/runs/flow_outcome.py), and Prefect hands the signal back here after;
- a stop is given STOP_GRACE_S for the main thread to unwind (a flow to record how it ended, Prefect to stop its
  server); a main thread stuck longer (retrying a server the same Ctrl-C killed) is cut short, and a second signal
  cuts it short at once;
- the last atexit hook, and the cut-short path, end every process still carrying the mark: when the command has
  exited, its children are gone.

The command exits 128+N for signal N (130 for Ctrl-C, 143 for SIGTERM) with one line saying so; `tessera up` exits
0, as it does after any stop.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from cli import guardian

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# for the main thread to unwind after a stop before the command ends itself: a flow ending Cancelled, its trainers
# stopped (their launcher gives ranks 5 s), Prefect's temporary server stopped (5 s)
STOP_GRACE_S = 30.0
NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


class Stopped(KeyboardInterrupt):
    """A stop signal, raised in the main thread. A KeyboardInterrupt, so that Prefect's engine, retry policies and
    `except Exception` treat it as an interrupt, never as a failure to retry."""

    def __init__(self, signum: int) -> None:
        super().__init__(NAMES.get(signum, signal.Signals(signum).name))
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Supervision:
    def __init__(self) -> None:
        self.mark = guardian.new_mark()
        self.guard: subprocess.Popen | None = None
        self.signum: int | None = None
        self.ending = threading.Lock()
        self.exiting = False  # the last atexit hook has begun: a stop now only hurries it
        self.last_line: str | None = None

    def start_guard(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != guardian.MARK_VAR}  # the guard must not sweep itself
        self.guard = subprocess.Popen(
            [sys.executable, "-S", str(Path(guardian.__file__)), self.mark, str(os.getpid())],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def at_exit(self) -> None:
        self.exiting = True
        self.sweep()
        self.end_guard()
        if self.last_line:
            print(self.last_line, file=sys.stderr, flush=True)

    def end_guard(self) -> None:
        # the sweep is done: the guard has nothing left to watch, and reaped here it leaves no zombie for PID 1
        if self.guard is not None:
            self.guard.terminate()  # a SIGTERM while its parent lives ends it without a sweep (cli/guardian.py)
            try:
                self.guard.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass

    def sweep(self, grace_s: float = guardian.GRACE_S) -> None:
        exclude = [self.guard.pid] if self.guard else []
        # multiprocessing's resource tracker ignores SIGTERM and ends by itself once this process has, after
        # unlinking what shared memory was left: killed, it would leak that (and the sweep waited out its grace)
        tracker = sys.modules.get("multiprocessing.resource_tracker")
        if tracker is not None and getattr(tracker._resource_tracker, "_pid", None):
            exclude.append(tracker._resource_tracker._pid)
        guardian.end_marked(self.mark, exclude=exclude, grace_s=grace_s)

    def on_signal(self, signum: int, frame) -> None:
        if self.signum is not None or self.exiting:  # a second signal, or one while the command exits: no waiting
            self.end_now(self.signum or signum, grace_s=1.0)
        self.signum = signum
        threading.Thread(target=self._cut_short, name="tessera-stop", daemon=True).start()
        raise _interrupt(signum)

    def _cut_short(self) -> None:
        time.sleep(STOP_GRACE_S)
        self.end_now(self.signum or signal.SIGTERM)

    def end_now(self, signum: int, grace_s: float = guardian.GRACE_S) -> None:
        """End the command from any thread: its children first, then itself, with the stop's one line."""
        if not self.ending.acquire(blocking=False):
            while True:  # another thread is already ending the process
                time.sleep(1)
        self.sweep(grace_s)
        self.end_guard()
        print(f"\ntessera: {stop_line(signum)}", file=sys.stderr, flush=True)
        os._exit(128 + signum)


def _interrupt(signum: int) -> BaseException:
    """Inside a flow run, Prefect's own stop, as its SIGTERM handler raises it: the flow ends Cancelled saying why
    and what the run keeps (tasks/runs/flow_outcome.py), for Ctrl-C and SIGHUP as for SIGTERM, where a
    KeyboardInterrupt would end it Crashed. Anywhere else, Stopped."""
    if "prefect.context" in sys.modules:  # never imported here for this: a command that has not loaded Prefect
        from prefect.context import FlowRunContext
        from prefect.exceptions import TerminationSignal

        if FlowRunContext.get() is not None:
            return TerminationSignal(signum)
    return Stopped(signum)


_SUPERVISION: _Supervision | None = None


def supervise() -> None:
    """Mark this command, start its guard, and make a stop signal a `Stopped` in the main thread (see the module)."""
    global _SUPERVISION
    if _SUPERVISION is not None:
        return
    _SUPERVISION = sup = _Supervision()
    os.environ[guardian.MARK_VAR] = sup.mark  # every child from here on inherits it
    atexit.register(sup.at_exit)  # registered first, so it runs last: after Prefect has stopped its own server
    for signum in SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, sup.on_signal)
    sup.start_guard()


def say_last(line: str) -> None:
    """Print `line` as the command's last: after Prefect's own exit logs (its server stopping) when supervised."""
    if _SUPERVISION is None:
        print(line, file=sys.stderr)
    else:
        _SUPERVISION.last_line = line


def stop_line(signum: int, what: str | None = None) -> str:
    """The one line a stopped command ends with: `what` the stop left (a flow's Cancelled message), or the
    general truth."""
    name = NAMES.get(signum, signal.Signals(signum).name)
    return f"stopped by {name}: " + (what or "nothing it started is left running; the same command again carries on")

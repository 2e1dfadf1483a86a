"""What a signal does to the prepare stage: stop tokenizing, publish nothing partial, exit in bounded time.

Why a plain Ctrl-C is not enough for `tessera prepare`: Prefect runs each source in a thread of its
task runner, and only the main thread ever sees a KeyboardInterrupt. The source threads would run
on and publish their outputs. The pool's processes, in the terminal's process group, got the
SIGINT too (a ProcessPoolExecutor hands it back as a job's result and the workers live on), and so
did Prefect's temporary API server, which died: py-spy showed the main thread inside the flow
engine's crash handling, retrying `set_flow_run_state` against that dead server with backoff,
with the pool's workers still alive, and interpreter exit would then have joined the task
threads and the pool as well.

So a stop is one process-wide flag. `request()` sets it and terminates the pool's workers; the
source threads check it between batches and before publishing (outputs.staging), so what they
staged is removed and never renamed in. `stop_on_signals()` wraps a CLI command: SIGINT or SIGTERM
requests the stop and interrupts the main thread, and the process then exits with 128+signal after
at most GRACE_S for the source threads to clear their staging, killing its child processes
(the pool, Prefect's temporary server) first. A second signal exits at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from tasks.data import parallel

# for source threads to clear their staging (they check every batch or 0.2 s); killing children takes at most 1 s more
GRACE_S = 1.5
_STOP = threading.Event()
_EXITING = threading.Lock()
_signal: int | None = None
_since: float = 0.0
_exit_on_stop = False  # inside stop_on_signals(): a stop ends the process
_watching = threading.Event()


class Interrupted(KeyboardInterrupt):
    """Raised in a source's thread when the process has been told to stop.

    A KeyboardInterrupt, so that Prefect records the task run as crashed by an interrupt and no
    retry policy or `except Exception` treats it as a failure to try again.
    """


def requested() -> bool:
    return _STOP.is_set()


def check() -> None:
    """Raise Interrupted if a stop was requested: called between batches and before publishing."""
    if _STOP.is_set():
        raise Interrupted(f"interrupted by {_name(_signal)}")


def request(signum: int | None = None) -> None:
    """Stop this process's prepare work: no new batch, nothing published, the pool's workers gone."""
    global _signal, _since
    if not _STOP.is_set():
        _since = time.monotonic()
        _STOP.set()
    if signum and _signal is None:
        _signal = signum
    if _exit_on_stop:
        _start_watchdog()
    parallel.terminate()


def _name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "a stop request"


def _kill_children(timeout_s: float = 0.5) -> None:
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(alive, timeout=timeout_s)


# Registered by the modules that hold what a stop must leave clean (outputs.py, claim.py), which themselves
# check for a stop: they import this module, never the other way round. Each takes a deadline (or None: now).
_ON_EXIT: list = []
_ON_EXIT_LAST: list = []


def on_exit(cleanup, last: bool = False) -> None:
    """Run `cleanup(deadline)` when a stop ends the process, before its children are killed; `last` ones
    after the others (claims are released only once the staging they guard is gone)."""
    (_ON_EXIT_LAST if last else _ON_EXIT).append(cleanup)


def exit_now(wait: bool = True) -> None:
    """End the process after a stop: wait (bounded) for staging to clear, kill children, exit 128+signal.

    wait=False (a second signal) skips the wait and any other thread already ending the process.
    """
    if wait and not _EXITING.acquire(blocking=False):
        while True:  # another thread is already ending the process
            time.sleep(1)
    signum = _signal or signal.SIGTERM
    for cleanup in _ON_EXIT + _ON_EXIT_LAST:  # outputs.py: clear staging (until the deadline); claim.py: release
        cleanup(_since + GRACE_S if wait else None)
    _kill_children()
    # On a line of its own: Prefect's logging may have left one unfinished.
    print(
        f"\ntessera: interrupted by {_name(signum)}: nothing partial was published; finished sources "
        "and partitions are kept and a rerun reuses them",
        file=sys.stderr,
    )
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(128 + signum)


def _start_watchdog() -> None:
    if not _watching.is_set():
        _watching.set()
        threading.Thread(target=_watchdog, name="tessera-stop", daemon=True).start()


def _watchdog() -> None:
    # The main thread may be stuck reporting the crash to a Prefect server the same Ctrl-C killed.
    parallel.terminate()
    time.sleep(max(0.0, _since + GRACE_S - time.monotonic()))
    exit_now()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within this block (main thread only), SIGINT and SIGTERM stop prepare and end the process."""

    seen = []

    def on_signal(signum: int, frame) -> None:
        seen.append(signum)
        if len(seen) > 1:
            exit_now(wait=False)  # a second signal: no more waiting
        global _signal, _since
        _signal = _signal or signum
        if not _STOP.is_set():  # (Prefect re-delivers a SIGTERM after its flow already stopped us)
            _since = time.monotonic()
            _STOP.set()
        # No locks here: the handler runs on top of whatever the main thread holds. (Prefect's own
        # SIGTERM handler, installed while a flow runs, raises in the flow instead, whose stop
        # request starts the same watchdog.)
        _start_watchdog()
        raise KeyboardInterrupt

    global _exit_on_stop
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    _exit_on_stop = True
    try:
        yield
    except BaseException:
        if _STOP.is_set():
            exit_now()
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

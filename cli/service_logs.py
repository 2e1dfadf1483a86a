"""Errors that `tessera up`'s services log, said on its terminal instead of only in their log files.

A background service of the Prefect server (the scheduler, the repossessor, ...) that fails does not
stop the server: it logs a traceback every loop and the feature it serves silently does nothing. The
weekly schedule never fired for exactly that reason, with 49 tracebacks in a log nobody opened. So
`tessera up` reads its services' logs as they grow and prints one line per distinct error: which
service, which component, the exception, and the log to open. A repeat of the same error is counted
and said again at most every REPEAT_EVERY_S, so a failing loop cannot flood the terminal.

The services' own errors are read as above; a flow run's, which a process worker relays into its log (a hook
that fails after a cancel, a flow run that fails), are said too, under the flow run's name ("Flow run 'twin'"):
Prefect's UI shows them only to whoever opens that run. Each log is appended to, not truncated, by a restarted
`tessera up`, and read from where this session's part begins.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPEAT_EVERY_S = 300.0
MAX_LINE = 500
# SQLite lets one writer in at a time, and a transaction that must upgrade to a write while another
# writes fails at once instead of waiting: under load the Prefect server's heartbeat or state writes
# sometimes do, and are retried by their callers. Worth saying, with what it means.
SQLITE_CONTENTION = "(sqlite3.OperationalError) database is locked"
CONTENTION_HINT = "SQLite write contention under load; the write is retried; a PostgreSQL database avoids it"

# Prefect's console format: "10:42:06.237 | ERROR   | prefect.server.services.scheduler - message"; a flow run's
# own lines, which a process worker relays, name it instead of a logger: "| ERROR   | Flow run 'twin' - message"
_PREFECT = re.compile(r"^\d\d:\d\d:\d\d\.\d+ \| (?P<level>[A-Z]+)\s*\| (?P<logger>.+?) - (?P<message>.*)$")
# MLflow's server and its uvicorn: "2026/11/25 10:41:52 ERROR mlflow.server: message", "... ERROR:    message"
_MLFLOW = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (?P<level>[A-Z]+):?\s+(?:(?P<logger>[\w.]+): )?(?P<message>.*)$")
_ERROR_LEVELS = {"ERROR", "CRITICAL"}
# Timing and counters inside a message make every repeat look new: "↩ [    29ms] schedule_deployments()".
_NOISE = re.compile(r"\[\s*\d+(\.\d+)?m?s\]|\b0x[0-9a-f]+\b|\d+")
# docket (Prefect's service runner) prefixes a failed task's line with its return arrow and duration
_DOCKET_PREFIX = re.compile(r"^\W*\[\s*\d+(\.\d+)?m?s\]\s*")


@dataclass
class _Pending:
    """An error whose traceback may still follow."""

    logger: str
    message: str
    exception: str | None = None
    in_traceback: bool = False
    after_frames: bool = False  # frames seen since the last "Traceback": the next unindented line is the exception


@dataclass
class ServiceLog:
    """Follows one service's log file from where it was when watching began.

    An error is a line logged at ERROR or CRITICAL by one of the service's own loggers, or a traceback
    that no log line introduced (a crash); its exception is the traceback's last unindented line. A
    traceback under a WARNING or INFO line belongs to that line and is not an error.
    """

    service: str
    path: Path
    wanted: Callable[[str], bool] = lambda logger: True  # which loggers are the service's own
    offset: int = 0
    _partial: str = ""
    _pending: _Pending | None = None
    _under_other: bool = False  # the last header was not an error: a traceback now is its, not a crash

    def errors(self) -> list[tuple[str, str, str | None]]:
        """(logger, message, exception line) of every error completed since the last call.

        A call that finds nothing new also completes the pending error (and an unterminated last
        line): a traceback is written at once, so one that did not grow for a poll interval is done.
        """
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        found: list[tuple[str, str, str | None]] = []
        if not chunk:
            return self.flush()
        self.offset += len(chunk)
        lines = (self._partial + chunk.decode("utf-8", errors="replace")).split("\n")
        self._partial = lines.pop()  # an unfinished last line waits for its end
        for line in lines:
            self._feed(line.rstrip("\r"), found)
        return found

    def flush(self) -> list[tuple[str, str, str | None]]:
        """The pending error, when the caller stops waiting for its traceback's end."""
        found: list[tuple[str, str, str | None]] = []
        if self._partial:
            self._feed(self._partial, found)
            self._partial = ""
        self._close(found)
        return found

    def _feed(self, line: str, found: list) -> None:
        header = _header(line)
        if header is not None:
            self._close(found)
            level, logger, message = header
            if level in _ERROR_LEVELS and self.wanted(logger):
                self._pending, self._under_other = _Pending(logger, message), False
            else:
                # a traceback after a warning (a retried call) or a flow run's error is theirs; an info
                # line carries none, so one after it is a crash
                self._under_other = level == "WARNING" or level in _ERROR_LEVELS
            return
        if line.startswith(("Traceback (most recent call last)", "During handling", "The above exception")):
            if self._pending is None and not self._under_other:
                self._pending = _Pending("", "a traceback, no log line before it (a crash?)")
            if self._pending is not None:
                self._pending.in_traceback, self._pending.after_frames = True, False
            return
        pending = self._pending
        if pending is None or not pending.in_traceback or not line.strip():
            return
        if line.startswith((" ", "\t")):
            pending.after_frames = True
        elif pending.after_frames:
            # the exception (the final one when chained); what follows it unindented is its detail, such as
            # SQLAlchemy's [SQL: ...] and "(Background on this error at: ...)" lines
            pending.exception, pending.after_frames = line.strip(), False

    def _close(self, found: list) -> None:
        if self._pending is not None:
            p, self._pending = self._pending, None
            found.append((p.logger, p.message, p.exception))


def _header(line: str) -> tuple[str, str, str] | None:
    for pattern in (_PREFECT, _MLFLOW):
        match = pattern.match(line)
        if match:
            return match["level"], match["logger"] or "", match["message"]
    return None


def prefect_worker_own(logger: str) -> bool:
    """The worker's own components, not the flow runs whose output it relays."""
    return "worker" in logger and not logger.startswith(("prefect.flow_runs.", "prefect.task_runs"))


def flow_run_own(logger: str) -> bool:
    """A flow run's lines that the worker relays: "Flow run 'twin'" (and a task run's of it)."""
    return logger.startswith(("Flow run '", "Task run '"))


@dataclass
class ErrorReporter:
    """Turns the errors of several ServiceLogs into terminal lines, each distinct error once per REPEAT_EVERY_S."""

    logs: list[ServiceLog]
    say: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    repeat_every_s: float = REPEAT_EVERY_S
    _seen: dict[tuple, list] = field(default_factory=dict)  # key -> [last said at, repeats since]

    def poll(self, final: bool = False) -> int:
        """Read what the logs added; say new errors and due repeats. Returns the lines said."""
        said = 0
        for log in self.logs:
            for logger, message, exception in log.errors() + (log.flush() if final else []):
                said += self._report(log, logger, message, exception)
        return said

    def _report(self, log: ServiceLog, logger: str, message: str, exception: str | None) -> int:
        key = (log.service, logger, _NOISE.sub("#", message), _NOISE.sub("#", exception or ""))
        now = self.clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.repeat_every_s:
            seen[1] += 1
            return 0
        repeats = f" (again; {seen[1] + 1} times since it was last said)" if seen is not None else ""
        self._seen[key] = [now, 0]
        where = f"{logger}: " if logger else ""
        message = _DOCKET_PREFIX.sub("", message)
        text = f"{message} -> {exception}" if exception else message
        if exception and SQLITE_CONTENTION in exception:
            text += f" ({CONTENTION_HINT})"
        line = f"tessera up: {log.service} logged an error{repeats}: {where}{text}"
        if len(line) > MAX_LINE:
            line = line[: MAX_LINE - 3] + "..."
        self.say(f"{line} (see {log.path})")
        return 1

"""What every tessera process sets up before a flow runs: an offline environment and one-line errors.

The CLI calls this before it starts a flow; flows call it first thing too, because a flow run
started by a worker never went through the CLI.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from trainers.contract import OneLineError


def quiet_environment() -> None:
    # Offline by design: never let HF libraries reach for the hub.
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    # The temporary Prefect server migrates a fresh database on first start; 20 s is not enough on 2 cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline: no telemetry
    # The gauntlet's and the tracking retries' own log lines (progress, outages) belong in the run's log too.
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "evaluation,tessera")
    os.environ.setdefault(*PREFECT_SERVER_OUTAGE)
    # At exit Prefect's event queue warns "Still processing items" while it sends its last events (a
    # concurrency slot released, a state set): its own bookkeeping, nothing a person can act on.
    logging.getLogger("EventsWorker").setLevel(logging.ERROR)
    # MLflow logs each failed SQLite statement with its traceback before it raises; tessera reports the error it
    # raises in one line (an outage retried, a full disk not).
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


# A Prefect server that restarts (or is down a minute) must not fail a run that trains for days: every
# engine call (a task run starting, a state change) retries with backoff 2, 4, ... 2^N s. Prefect's 5
# retries ride out about one minute; 8 ride out several (tests/test_server_restart.py: 70 s down).
PREFECT_SERVER_OUTAGE = ("PREFECT_CLIENT_MAX_RETRIES", "8")


# What Prefect's engine logs, at ERROR, when a flow raises: after bad input it repeats, in red, what the run's one-line
# Failed message already says.
ENGINE_EXITED = "Engine execution exited with unexpected exception"


class _NoTracebackForBadInput(logging.Filter):
    """Prefect logs every task failure with its traceback; for bad input the one-line message is the story."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], OneLineError):
            if record.msg == ENGINE_EXITED:
                return False
            record.exc_info, record.exc_text = None, None
        return True


def install_log_filter() -> None:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, _NoTracebackForBadInput) for f in handler.filters):
                handler.addFilter(_NoTracebackForBadInput())


class _CancelledIsNotAnError(logging.Filter):
    """Prefect's task engine logs every end but Completed at ERROR: a stage task that ends Cancelled because its flow
    run is being stopped (tasks/training/train.train_stage) would put a red line in a clean cancel's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        # the stage task stopped with its flow, or a task (a registration) the task runner cancelled as the stopping
        # flow shut it down: Prefect calls the latter a crash, in red, though nothing went wrong
        if record.levelno == logging.ERROR and (
            text.startswith("Finished in state Cancelled(") or RUNNER_CANCELLED in text
        ):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


RUNNER_CANCELLED = "CancelledError: Task run cancelled by the task runner"


def prepare_process() -> None:
    """Both of the above, idempotent: safe to call from the CLI and again inside the flow."""
    quiet_environment()
    install_log_filter()
    tasks_logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _CancelledIsNotAnError) for f in tasks_logger.filters):
        tasks_logger.addFilter(_CancelledIsNotAnError())


def work_prefect_home(work_dir: str) -> None:
    """Keep Prefect's database in the work dir, so `prefect server start` there shows these runs."""
    if "PREFECT_API_URL" not in os.environ and "PREFECT_HOME" not in os.environ:
        home = Path(work_dir).resolve() / "prefect"
        try:
            home.mkdir(parents=True, exist_ok=True)  # the server's sqlite cannot create its own folder
        except OSError as exc:  # a file in the way, a read-only disk: no retry or traceback helps
            from tasks.recipe import RecipeError

            raise RecipeError(
                f"work_dir {work_dir}: cannot hold Prefect's database in {home} ({exc.strerror or exc})"
            ) from None
        os.environ["PREFECT_HOME"] = str(home)
        # profiles live under PREFECT_HOME by default: keep the user's (an API URL set with
        # `prefect config set`, a Cloud login) instead of silently dropping them
        profiles = Path("~/.prefect/profiles.toml").expanduser()
        if profiles.is_file():
            os.environ.setdefault("PREFECT_PROFILES_PATH", str(profiles))


class _InOwnSession:
    """The `subprocess` module as Prefect's server module sees it while `temporary_server_apart` starts the server:
    the same, except that Popen starts a session of its own."""

    def __getattr__(self, name: str):
        import subprocess

        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args, **kwargs):  # subprocess's own name
        import subprocess

        return subprocess.Popen(*args, **{**kwargs, "start_new_session": True})


def temporary_server_apart() -> None:
    """Start Prefect's temporary server now, in a session of its own, when no server is configured.

    Prefect starts it at a flow's first API call as a plain child, in the terminal's process group, so a Ctrl-C in
    the terminal reached it too: during its start-up it printed its own KeyboardInterrupt traceback, and later it
    died while the flow still had to record how it ended (the engine retried the dead server, with tracebacks, until
    the command gave up). Apart, only tessera hears the terminal, and the server is stopped at exit as Prefect stops
    it (its atexit hook; then cli/stopping.py's sweep). Prefect's later calls reuse this instance: it is the class's
    one instance for the default port. Prefect offers no setting for the child's session, hence the substitution of
    its module's `subprocess` for the length of the start."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    import subprocess

    from prefect.server.api import server as api

    instance = api.SubprocessASGIServer()
    if instance.running:
        return
    api.subprocess = _InOwnSession()
    try:
        instance.start()
    finally:
        api.subprocess = subprocess


def usable_data_root(recipe) -> None:
    """A data root that is a file or read-only fails here in one line, not after Prefect has started."""
    from tasks.data.outputs import ensure_root

    ensure_root(recipe.data.local_root)

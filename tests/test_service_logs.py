"""`tessera up` says its services' errors on its terminal (cli/service_logs.py).

The fixture log is a real Prefect 3.8.8 server log from a `tessera up` on SQLAlchemy 2.1.9: its scheduler
failed every loop, and nobody saw it because the errors stayed in that file.
"""

from __future__ import annotations

from pathlib import Path

from cli.service_logs import ErrorReporter, ServiceLog, prefect_worker_own

FIXTURE = Path(__file__).parent / "fixtures" / "prefect-server-scheduler-error.log"
BULK_DML = (
    "sqlalchemy.exc.InvalidRequestError: Can't evaluate bulk DML statement; please supply a bulk_dml decorated function"
)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def reporter(*logs: ServiceLog) -> tuple[ErrorReporter, list[str], Clock]:
    said: list[str] = []
    clock = Clock()
    return ErrorReporter(list(logs), said.append, clock=clock), said, clock


def test_the_scheduler_failure_is_one_line_per_distinct_error_even_when_the_log_grows_mid_line(tmp_path):
    log = tmp_path / "prefect-server.log"
    log.write_bytes(b"")
    errors, said, clock = reporter(ServiceLog("prefect-server", log))
    text = FIXTURE.read_bytes()
    for i in range(0, len(text), 700):  # the server writes as it goes; lines are cut between polls
        with open(log, "ab") as f:
            f.write(text[i : i + 700])
        errors.poll()
    errors.poll()  # nothing new: the last traceback is complete
    assert said == [
        f"tessera up: prefect-server logged an error: docket.dependencies: schedule_recent_deployments()"
        f"{{schedule_recent_deployments}} -> {BULK_DML} (see {log})",
        f"tessera up: prefect-server logged an error: docket.dependencies: schedule_deployments()"
        f"{{schedule_deployments}} -> {BULK_DML} (see {log})",
    ]

    # The loop fails again a minute later: counted, not said, until REPEAT_EVERY_S has passed.
    block = text.decode().split("\n10:42:56")[0].split("\n", 16)[-1]  # the first error, as logged
    assert block.startswith("10:42:06.237 | ERROR")
    for _ in range(3):
        with open(log, "a") as f:
            f.write(block.replace("29ms", "31ms") + "\n")
        clock.now += 60
        errors.poll()
    errors.poll()
    assert len(said) == 2
    clock.now += errors.repeat_every_s
    with open(log, "a") as f:
        f.write(block + "\n")
    errors.poll()
    errors.poll()
    assert said[2].startswith(
        "tessera up: prefect-server logged an error (again; 4 times since it was last said): "
        "docket.dependencies: schedule_recent_deployments()"
    )


def test_warnings_flow_run_output_and_info_tracebacks_are_not_errors(tmp_path):
    worker = tmp_path / "prefect-worker.log"
    worker.write_text(
        "11:00:01.000 | INFO    | prefect.flow_runs.worker - Worker submitting flow run 'abc'\n"
        "11:00:02.000 | ERROR   | prefect.flow_runs - Finished in state Failed('Flow run encountered an exception.')\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "ValueError: a flow's own failure\n"
        "11:00:02.500 | ERROR   | Flow run 'twin' - Engine execution exited with unexpected exception\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 2, in <module>\n'
        "ValueError: a flow's own failure, as the worker relays it\n"
        "11:00:03.000 | WARNING | prefect.workers.process.tessera-up@vm - Attempt 1 failed\n"
        "Traceback (most recent call last):\n"
        '  File "y.py", line 2, in <module>\n'
        "httpx.ConnectError: a retried blip\n"
        "11:00:04.000 | ERROR   | prefect.workers.process.tessera-up@vm - Failed to submit flow run\n"
        "Traceback (most recent call last):\n"
        '  File "z.py", line 3, in <module>\n'
        "RuntimeError: no such pool\n"
    )
    errors, said, _ = reporter(ServiceLog("prefect-worker", worker, prefect_worker_own))
    errors.poll()
    errors.poll()
    assert said == [
        "tessera up: prefect-worker logged an error: prefect.workers.process.tessera-up@vm: "
        f"Failed to submit flow run -> RuntimeError: no such pool (see {worker})"
    ]


def test_mlflow_errors_a_crash_with_no_log_line_and_chained_exceptions_are_said(tmp_path):
    mlflow = tmp_path / "mlflow.log"
    mlflow.write_text(
        "2026/11/25 10:41:49 INFO mlflow.store.db.utils: Creating initial MLflow database tables...\n"
        "2026/11/25 10:41:52 ERROR mlflow.server: Exception on /api/2.0/mlflow/runs/get\n"
        "Traceback (most recent call last):\n"
        '  File "handlers.py", line 9, in get\n'
        "sqlalchemy.exc.OperationalError: database is locked\n"
        "2026/11/25 10:41:53 INFO:     Application startup complete.\n"
        "Traceback (most recent call last):\n"
        '  File "cli.py", line 1, in <module>\n'
        "ModuleNotFoundError: No module named 'MySQLdb'\n"
        "2026/11/25 10:41:54 ERROR mlflow.server: Exception on /api/2.0/mlflow/runs/update\n"
        "Traceback (most recent call last):\n"
        '  File "base.py", line 2000, in _exec_single_context\n'
        "sqlite3.IntegrityError: UNIQUE constraint failed: runs.name\n"
        "\n"
        "The above exception was the direct cause of the following exception:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "handlers.py", line 9, in update\n'
        "sqlalchemy.exc.IntegrityError: (sqlite3.IntegrityError) UNIQUE constraint failed: runs.name\n"
        "[SQL: UPDATE runs SET name=? WHERE runs.run_uuid = ?]\n"
        "(Background on this error at: https://sqlalche.me/e/20/gkpj)"  # no newline: the process died mid-write
    )
    errors, said, _ = reporter(ServiceLog("mlflow", mlflow))
    errors.poll()
    assert said == [
        f"tessera up: mlflow logged an error: mlflow.server: Exception on /api/2.0/mlflow/runs/get -> "
        f"sqlalchemy.exc.OperationalError: database is locked (see {mlflow})",
        f"tessera up: mlflow logged an error: a traceback, no log line before it (a crash?) -> "
        f"ModuleNotFoundError: No module named 'MySQLdb' (see {mlflow})",
    ]
    errors.poll(final=True)  # the last error's traceback was cut off mid-line: said when the service has exited
    assert said[2:] == [  # a chained SQLAlchemy error: its final exception, not the detail lines after it
        f"tessera up: mlflow logged an error: mlflow.server: Exception on /api/2.0/mlflow/runs/update -> "
        f"sqlalchemy.exc.IntegrityError: (sqlite3.IntegrityError) UNIQUE constraint failed: runs.name (see {mlflow})"
    ]


def test_a_flow_runs_error_in_the_workers_log_is_said_with_the_runs_name(tmp_path):
    """What `tessera up` reads beside the worker's own errors (cli/up_stack.py): the flow runs' ERROR lines, such as a
    hook that failed after a cancel, said once each with the run's name; the worker's own lines are not theirs."""
    from cli.service_logs import flow_run_own

    worker = tmp_path / "prefect-worker.log"
    worker.write_text(
        "11:00:01.000 | INFO    | prefect.flow_runs.worker - Worker submitting flow run 'abc'\n"
        "11:00:02.000 | ERROR   | Flow run 'weekly-cpt-v1-0123abcd' - An error was encountered while running hook "
        "'_record_end'\n"
        "Traceback (most recent call last):\n"
        '  File "runner.py", line 1, in <module>\n'
        "TypeError: _record_end() got an unexpected keyword argument 'flow_run'\n"
        "11:00:04.000 | ERROR   | prefect.workers.process.tessera-up@vm - Failed to submit flow run\n"
        "11:00:05.000 | INFO    | Flow run 'weekly-cpt-v1-0123abcd' - Hook '_record_end' finished running\n"
    )
    errors, said, _ = reporter(ServiceLog("a flow run", worker, flow_run_own))
    errors.poll()
    errors.poll()
    assert said == [
        "tessera up: a flow run logged an error: Flow run 'weekly-cpt-v1-0123abcd': An error was encountered while "
        "running hook '_record_end' -> TypeError: _record_end() got an unexpected keyword argument 'flow_run' "
        f"(see {worker})"
    ]


def test_a_restarted_stack_appends_to_its_logs_and_reads_errors_from_its_own_start(tmp_path):
    """`tessera up` started again keeps the last session's log (its tracebacks were lost to truncation), and says
    only the errors its own session logs."""
    import sys

    from cli.up_stack import Service, _Stack

    log = tmp_path / "prefect-server.log"
    line = "11:00:02.000 | ERROR   | prefect.server.services.scheduler - {}"
    for text in ("the last session's error", "this session's error"):
        stack = _Stack()
        said: list[str] = []
        stack.errors.say = said.append
        code = f"print({line.format(text)!r})"
        service = stack.start(Service("prefect-server", [sys.executable, "-c", code], {}, log, ""))
        assert service.process is not None and service.process.wait(timeout=60) == 0
        stack.errors.poll(final=True)
        assert said == [
            f"tessera up: prefect-server logged an error: prefect.server.services.scheduler: {text} (see {log})"
        ]
    kept = log.read_text()
    assert "the last session's error" in kept and "this session's error" in kept
    assert kept.count("===== tessera up (pid ") == 2

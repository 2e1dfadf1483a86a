"""A stopped flow run's explanation stays its last state (tasks/runs/last_word.py), against a real Prefect API.

What Prefect's runner does after a cancel is replayed here with the same call it makes: a forced Cancelled,
"Flow run was cancelled successfully.", over the flow's own. The full path (a cancel from the UI on `tessera up`'s
worker) is tests/test_live_pipeline.py::test_cancel_from_the_ui_stops_every_rank_and_marks_the_mlflow_run.
"""

from __future__ import annotations

import time

import pytest

from tasks.runs.last_word import GENERIC_CANCEL, keep, spawn

OURS = (
    "cancelled: every rank of run 'x' was stopped; nothing was saved yet, so a rerun of the same run name starts it "
    "fresh"
)


@pytest.fixture()
def flow_run(prefect_harness):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    @flow(name="last-word-probe")
    def probe() -> None:
        pass

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(probe)
        client.set_flow_run_state(run.id, Running(), force=True)
    return run.id


def _force(run_id, state) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, state, force=True)


def _last(run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state


def test_the_runners_generic_cancel_is_replaced_by_the_flows_explanation(flow_run, monkeypatch):
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelled

    monkeypatch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())  # the watcher is a process of its own
    _force(flow_run, Cancelled(message=OURS))
    spawn(flow_run)  # as the on_cancellation hook does, before the runner's write
    time.sleep(2)
    _force(flow_run, Cancelled(message=GENERIC_CANCEL))  # the runner's finalize, as Prefect 3.8 makes it
    deadline = time.monotonic() + 60
    while (last := _last(flow_run)).message != OURS:
        assert time.monotonic() < deadline, f"still {last.name}: {last.message!r}"
        time.sleep(0.5)
    assert (last.type.value, last.name) == ("CANCELLED", "Cancelled")


def test_nothing_is_touched_without_an_explanation_or_once_the_run_moved_on(flow_run):
    from prefect.states import Cancelled, Scheduled

    _force(flow_run, Cancelled(message=GENERIC_CANCEL))  # the flow's process was killed before it wrote one
    assert keep(flow_run, watch_s=5) is False and _last(flow_run).message == GENERIC_CANCEL
    _force(flow_run, Cancelled(message=OURS))
    _force(flow_run, Scheduled())  # a retry of the run
    assert keep(flow_run, watch_s=5) is False and _last(flow_run).type.value == "SCHEDULED"


def test_the_explanation_is_set_through_a_server_whose_database_is_locked_for_seconds(flow_run):
    """The cancel's explanation survives what the issue met under load: Prefect's SQLite "database is locked".
    The API's database is held in an exclusive transaction for 15 s; the forced state goes through after it. (Here,
    in Prefect's test mode, the server waits up to 30 s on a lock; `prefect server` waits 10 s and then answers
    an error, which set_state retries: the next test.)"""
    import sqlite3
    import threading

    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL
    from prefect.states import Cancelled

    from tasks.runs.last_word import set_state

    db = PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split(":///", 1)[1]
    locked, held_s = threading.Event(), 15.0

    def hold() -> None:
        conn = sqlite3.connect(db, timeout=60, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        locked.set()
        time.sleep(held_s)
        conn.execute("COMMIT")
        conn.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert locked.wait(60)
    started = time.monotonic()
    try:
        set_state(flow_run, Cancelled(message=OURS), within_s=60)
    finally:
        holder.join()
    assert time.monotonic() - started >= held_s - 1  # it did meet the lock, not slip past it
    last = _last(flow_run)
    assert (last.type.value, last.message) == ("CANCELLED", OURS)


def test_an_api_that_refuses_is_tried_again_until_the_deadline(flow_run, monkeypatch):
    """A refused call is tried again with backoff until `within_s`, then raises: the state is never dropped
    silently, and a refusal does not end the attempt."""
    import httpx
    import prefect.client.orchestration as orchestration
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelled

    from tasks.runs.last_word import set_state
    from tests.conftest import free_port

    tries, real = [], orchestration.get_client
    monkeypatch.setattr(orchestration, "get_client", lambda **kw: (tries.append(time.monotonic()), real(**kw))[1])
    nobody = f"http://127.0.0.1:{free_port()}/api"
    with temporary_settings({PREFECT_API_URL: nobody}), pytest.raises(httpx.ConnectError):
        set_state(flow_run, Cancelled(message=OURS), within_s=4)
    assert len(tries) >= 2 and tries[-1] - tries[0] < 8, tries
    assert _last(flow_run).message != OURS  # that API never had it

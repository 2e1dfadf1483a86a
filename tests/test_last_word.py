"""A stopped flow run's explanation stays its last state (tasks/last_word.py), against a real Prefect API.

What Prefect's runner does after a cancel is replayed here with the same call it makes: a forced Cancelled,
"Flow run was cancelled successfully.", over the flow's own. The full path (a cancel from the UI on `tessera up`'s
worker) is tests/test_live_pipeline.py::test_cancel_from_the_ui_stops_every_rank_and_marks_the_mlflow_run.
"""

from __future__ import annotations

import time

import pytest

from tasks.last_word import GENERIC_CANCEL, keep, spawn

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

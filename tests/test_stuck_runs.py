"""A deployment deleted while its runs are live leaves none of them stuck (tasks/runs/stuck_runs.py), on a real Prefect
API: the 500 the server answers for such a run is reproduced first, then `tessera up`'s reconciler undoes it."""

from __future__ import annotations

import pytest

from tasks.runs.stuck_runs import Reconciler


def test_runs_of_a_deleted_deployment_end_instead_of_staying_stuck(prefect_harness):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.states import Cancelled, Cancelling, Completed, Pending, Running

    @flow(name="stuck-probe")
    def probe() -> None:
        pass

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("stuck-probe")
        deployment = client.create_deployment(
            flow_id=flow_id, name="stuck", concurrency_limit=3, entrypoint="tests/test_stuck_runs.py:probe"
        )
        cancelled, training, long_one = (client.create_flow_run_from_deployment(deployment) for _ in range(3))
        for run in (cancelled, training, long_one):
            for state in (Pending(), Running()):  # as the worker moves it: Running holds a lease on the slot
                client.set_flow_run_state(run.id, state)
        assert client.read_flow_run(training.id).state.state_details.deployment_concurrency_lease_id
        client.delete_deployment(deployment)
        client.set_flow_run_state(cancelled.id, Cancelling())  # a cancel from the UI
        with pytest.raises(PrefectHTTPStatusError, match="500"):  # what Prefect's own worker then meets
            client.set_flow_run_state(cancelled.id, Cancelled(), force=True)

    reconciler = Reconciler(grace_s=0.0)
    lines = reconciler.round()
    with get_client(sync_client=True) as client:
        ended = client.read_flow_run(cancelled.id).state
        assert ended.type.value == "CANCELLED"
        assert ended.message.startswith("cancelled: its deployment was deleted while it ran and no worker finished")
        # the run still training can end normally now
        assert client.set_flow_run_state(training.id, Completed()).state.type.value == "COMPLETED"
    assert sum("the lease on the gone limit's slot is revoked" in line for line in lines) == 3
    assert sum(line.endswith("resumes from the newest") for line in lines) == 1
    # nothing left to do: a second round says nothing, though long_one still runs and its state names the lease
    # (`tessera up` said its revoke every 10 s while such a run lived)
    assert reconciler.round() == []

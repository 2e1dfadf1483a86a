"""Flow runs a deleted deployment (or a removed concurrency limit) would leave stuck, ended or unstuck.

A run of a deployment with a concurrency limit holds a lease on the limit's slot, named in its state. Delete the
deployment (its limit goes with it) while the run is live, and every later transition of the run has Prefect's
server release that lease against a limit that no longer exists: it answers 500 ("Failed to release concurrency
slots for lease ..."), forced transitions included. The run can then neither complete nor be cancelled; a cancel
leaves it in Cancelling for good. (Prefect's behaviour, seen with Prefect 3.8's server.)

Revoking the lease through Prefect's own API (`release_concurrency_slots_with_lease`, which revokes it whatever the
limit's state) makes the run's transitions work again. `tessera up` runs `reconcile` every few seconds: a live run
whose lease points at a gone limit gets its lease revoked (it trains on and ends normally), and a run left in
Cancelling that long after its deployment went is ended Cancelled with a message saying why.
"""

from __future__ import annotations

import time
from uuid import UUID

from prefect.client.schemas.objects import StateType

LIVE = [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
CANCELLING_GRACE_S = 60.0  # the worker's own cancel gets this long to finish before tessera ends the run


class Reconciler:
    """What `tessera up` keeps between rounds: when each stuck Cancelling run was first seen."""

    def __init__(self, grace_s: float = CANCELLING_GRACE_S):
        self.grace_s = grace_s
        self._cancelling_since: dict[UUID, float] = {}
        # Leases already revoked: the run's state keeps naming its lease while it lives (said once, not each round)
        self._revoked: set[UUID] = set()

    def round(self) -> list[str]:
        """One look at the server's live runs; a line for each run unstuck or ended."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
        from prefect.exceptions import ObjectNotFound
        from prefect.states import Cancelled

        lines, now, still = [], time.monotonic(), set()
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=LIVE))),
                limit=200,
            )
            deployments: dict[UUID, object | None] = {}  # None: deleted

            def deployment(deployment_id: UUID):
                if deployment_id not in deployments:
                    try:
                        deployments[deployment_id] = client.read_deployment(deployment_id)
                    except ObjectNotFound:
                        deployments[deployment_id] = None
                return deployments[deployment_id]

            for run in runs:
                if run.deployment_id is None or run.state is None:
                    continue
                found = deployment(run.deployment_id)
                lease = run.state.state_details.deployment_concurrency_lease_id
                gone = found is None or found.concurrency_limit_id is None
                if lease is not None and gone and lease not in self._revoked:
                    client.release_concurrency_slots_with_lease(lease)
                    self._revoked.add(lease)
                    lines.append(
                        f"flow run {run.name!r} ({run.id}): its deployment or its concurrency limit was removed while "
                        "it ran; the lease on the gone limit's slot is revoked, so the run can end"
                    )
                if run.state.type != StateType.CANCELLING or found is not None:
                    continue
                # Cancelling with its deployment gone: after the grace, no worker is going to finish the cancel
                still.add(run.id)
                if now - self._cancelling_since.setdefault(run.id, now) < self.grace_s:
                    continue
                message = (
                    "cancelled: its deployment was deleted while it ran and no worker finished the cancel; ended by "
                    "`tessera up`. Its complete checkpoints stay, and a rerun of the same run name resumes from the "
                    "newest"
                )
                client.set_flow_run_state(run.id, Cancelled(message=message), force=True)
                lines.append(f"flow run {run.name!r} ({run.id}): {message}")
                still.discard(run.id)
        self._cancelling_since = {k: v for k, v in self._cancelling_since.items() if k in still}
        return lines

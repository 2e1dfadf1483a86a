"""One live pipeline per run name, through Prefect's global concurrency limits.

Runs start from clicks and schedules: a double click, or a schedule firing while someone's manual
run of the same name trains, must never put two trainers into one save folder. The flow takes the
only slot of a global concurrency limit named after the run, on a lease it renews while it
lives, so a flow process killed outright frees the slot when its lease expires. The trainer
holds its own lease on the save folder too (trainers/lease.py), which covers trainers started
outside Prefect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

from prefect.logging import get_run_logger

# Short: after a SIGKILLed flow, a rerun should not wait long for the slot to be freed. The
# renewal runs at 3/4 of it, and the server's repossessor frees expired ones every 15 s.
LEASE_S = 60.0
REFUSE_AFTER_S = 5.0


class RunBusy(RuntimeError):
    """Another flow run holds this run name; str() is one line naming it."""


def limit_name(run_name: str) -> str:
    return f"tessera-run-{run_name}"


def run_tag(run_name: str) -> str:
    return f"run:{run_name}"


def _ensure_limit(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another flow run made it first
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))


def live_holder(run_name: str, me: str | None) -> str:
    """Describe the other live flow run of `run_name` (tagged by `run_tag`), for the refusal message."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_UI_URL

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[run_tag(run_name)]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.CANCELLING])),
                id=FlowRunFilterId(not_any_=[me]) if me else None,
            ),
            limit=5,
        )
    if not runs:
        return "a flow run that has not released it yet (a killed one frees it within about a minute)"
    run = runs[0]
    ui = PREFECT_UI_URL.value()
    return f"flow run {run.name!r} ({run.id}{f', {ui}/runs/flow-run/{run.id}' if ui else ''})"


@contextlib.contextmanager
def one_per_run(run_name: str, if_running: Literal["refuse", "wait"], flow_run_id: str | None) -> Iterator[None]:
    """Hold run `run_name`'s slot for the body; refuse at once (RunBusy) or wait when another run holds it."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency._asyncio import AcquireConcurrencySlotTimeoutError
    from prefect.concurrency.sync import concurrency

    name = limit_name(run_name)
    _ensure_limit(name)
    holder = ConcurrencyLeaseHolder(type="flow_run", id=flow_run_id) if flow_run_id else None
    if if_running == "wait":
        get_run_logger().info("run %s: waiting for the run name to be free (concurrency limit %s)", run_name, name)
    slot = concurrency(
        name,
        occupy=1,
        timeout_seconds=REFUSE_AFTER_S if if_running == "refuse" else None,
        lease_duration=LEASE_S,
        holder=holder,
        strict=True,
        # A failed renewal must not kill a training run; the trainer's own lease still guards the folder.
        raise_on_lease_renewal_failure=False,
    )
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(slot)
        except AcquireConcurrencySlotTimeoutError:
            raise RunBusy(
                f"run {run_name!r} is already running in {live_holder(run_name, flow_run_id)}; wait for it to finish, "
                "cancel it, or start this one with if_running=wait"
            ) from None
        yield

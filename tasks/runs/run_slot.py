"""The run-name slot: one live pipeline per run name, through Prefect's global concurrency limits.

(The other exclusions: an output's claim, tasks/data/claim.py; the save folder's lock,
trainers/folder_lock.py, which also covers trainers started outside Prefect; the promotion lock,
tasks/registry/promote_lock.py.)

Runs start from clicks and schedules: a double click, or a schedule firing while someone's manual
run of the same name trains, must never put two trainers into one save folder. The flow takes the
only slot of a global concurrency limit named after the run, on a lease it renews while it
lives, so a flow process killed outright frees the slot when its lease expires. The trainer
holds its own lock on the save folder too (trainers/folder_lock.py), which covers trainers started
outside Prefect.

A slot can also outlive its holder: when the Prefect server restarts, a lease renewal can fail
(410 Gone) while the slot stays counted, and nothing frees it. So the flow run that holds the slot
says so with a tag on itself (`holder_tag`), and a run that finds the slot taken checks the holder:
a slot no live flow run holds, seen twice RECLAIM_CONFIRM_S apart, is reclaimed with a log line.

And a holder can die without ending: `tessera run` killed with -9 (an OOM kill, a lost node) takes its
temporary Prefect server with it, so its flow run stays Running in the database and the slot's lease,
kept in the server's memory, is gone with the server. The holder also tags itself with its process
(`process_tag`: host, pid, start time); a run that finds the slot taken marks such a holder Crashed when
its process is gone from this host, and the slot is then reclaimed like any orphan. `if_running=wait`
looks again every round, so it never waits on a dead run.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Literal

from prefect.logging import get_run_logger

from tasks.slots import ensure_limit, slot_timeout
from trainers.contract import OneLineError

# Short: after a SIGKILLed flow, a rerun should not wait long for the slot to be freed. The
# renewal runs at 3/4 of it, and the server's repossessor frees expired ones every 15 s.
LEASE_S = 60.0
REFUSE_AFTER_S = 5.0
# Prefect's timeout covers the whole acquisition, its HTTP calls included: a loaded server that takes longer than
# REFUSE_AFTER_S to answer times out a slot nobody holds (a CI run refused a lone run so, 2026-11-29). A slot found
# free (or reclaimed) after a timeout is asked for again this long before the run is refused as unanswered.
SLOW_SERVER_S = 60.0
# A run that has just taken the slot tags itself within milliseconds; a slot that still has no live
# holder this long after it was first seen holderless is orphaned, not being taken.
RECLAIM_CONFIRM_S = 2.0
WAIT_ROUND_S = 30.0  # with if_running=wait: how often a waiter checks for an orphaned slot
LIVE_STATES = ("PENDING", "RUNNING", "CANCELLING", "PAUSED")


class RunBusy(OneLineError, RuntimeError):
    """Another flow run holds this run name (or the server never granted its free slot); str() is one line."""


def limit_name(run_name: str) -> str:
    return f"tessera-run-{run_name}"


def run_tag(run_name: str) -> str:
    return f"run:{run_name}"


def holder_tag(run_name: str) -> str:
    """The tag of the flow run that holds `run_name`'s slot (set once it has it)."""
    return f"holds:{limit_name(run_name)}"


def free_by_hand(run_name: str) -> str:
    return (
        f"if no run of it is live, free the slot by hand with `prefect gcl update {limit_name(run_name)} "
        "--active-slots 0`"
    )


def _live_runs(tag: str, me: str | None) -> list:
    """Flow runs other than `me` that carry `tag` and have not ended."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[tag]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType(s) for s in LIVE_STATES])),
                id=FlowRunFilterId(not_any_=[me]) if me else None,
            ),
            limit=5,
        )


def live_holder(run_name: str, me: str | None) -> str:
    """Describe the live flow run holding `run_name`, for the refusal message."""
    from prefect.settings import PREFECT_UI_URL

    runs = _live_runs(holder_tag(run_name), me) or _live_runs(run_tag(run_name), me)
    if not runs:
        return f"a flow run that has not released it yet ({free_by_hand(run_name)})"
    run = runs[0]
    ui = PREFECT_UI_URL.value()
    return f"flow run {run.name!r} ({run.id}{f', {ui}/runs/flow-run/{run.id}' if ui else ''})"


def process_tag() -> str:
    """This process as a flow-run tag: `proc:<host>:<pid>:<start>` (the start tells a reused pid apart)."""
    import psutil

    me = psutil.Process()
    return f"proc:{socket.gethostname()}:{me.pid}:{int(me.create_time())}"


def _process_gone(tag: str) -> str | None:
    """Why the process a `proc:` tag names is gone, or None when it lives or is on another host (not ours to tell:
    there the lease, which outlives no server restart on Kubernetes' persistent server, frees the slot)."""
    import psutil

    try:
        _, host, pid, start = tag.split(":")
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    try:
        proc = psutil.Process(int(pid))
        if abs(proc.create_time() - int(start)) <= 1 and proc.status() != psutil.STATUS_ZOMBIE:
            return None
    except psutil.NoSuchProcess:
        pass
    return f"its process {pid} on {host} is gone"


def crash_dead_holders(run_name: str, me: str | None) -> list[str]:
    """Mark *Crashed* every live-looking flow run of `run_name` whose process is gone (a flow process killed with
    -9, an OOM kill, a lost node's CLI run: its server state stays Running for ever); the names of those marked."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    marked = []
    for run in _live_runs(run_tag(run_name), me):
        why = next((w for t in run.tags if t.startswith("proc:") and (w := _process_gone(t))), None)
        if why is None:
            continue
        message = f"crashed: {why} (found by the next run of {run_name!r}); its last complete checkpoint stays"
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(run.id, Crashed(message=message), force=True)
        get_run_logger().warning("run %s: flow run %r (%s) was left Running: %s", run_name, run.name, run.id, message)
        marked.append(run.name)
    return marked


def _held_slots(name: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


def reclaim_orphaned(run_name: str, me: str | None, confirm_s: float = RECLAIM_CONFIRM_S) -> bool:
    """Free `run_name`'s slot if it is held but no live flow run holds it; True when it was freed.

    The holder is the live flow run tagged `holder_tag`. Two looks `confirm_s` apart must both find the
    slot held and holderless: between taking the slot and tagging itself a run is holderless for an
    instant, and that run must not lose its slot.
    """
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    name = limit_name(run_name)
    crash_dead_holders(run_name, me)
    for look in range(2):
        if _held_slots(name) == 0 or _live_runs(holder_tag(run_name), me):
            return False
        if look == 0:
            time.sleep(confirm_s)
    with get_client(sync_client=True) as client:
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
    get_run_logger().warning(
        "run %s: reclaimed the slot of concurrency limit %s: it was held, but no live flow run holds it (its "
        "holder ended without releasing it, e.g. its lease was lost while the Prefect server restarted)",
        run_name,
        name,
    )
    return True


def _tag_holder(run_name: str, flow_run_id: str | None) -> None:
    add_tags(flow_run_id, [holder_tag(run_name), process_tag()])


def add_tags(flow_run_id: str | None, tags: list[str]) -> None:
    """Add `tags` to a flow run's own: Prefect's update replaces the list, so it is read and the union written."""
    if not flow_run_id:
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        current = client.read_flow_run(flow_run_id).tags
        client.update_flow_run(flow_run_id, tags=sorted(set(current) | set(tags)))


@contextlib.contextmanager
def one_per_run(run_name: str, if_running: Literal["refuse", "wait"], flow_run_id: str | None) -> Iterator[None]:
    """Hold run `run_name`'s slot for the body; refuse at once (RunBusy) or wait when another run holds it."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency.sync import concurrency

    name = limit_name(run_name)
    ensure_limit(name)
    holder = ConcurrencyLeaseHolder(type="flow_run", id=flow_run_id) if flow_run_id else None

    def slot(timeout_s: float):
        return concurrency(
            name,
            occupy=1,
            timeout_seconds=timeout_s,
            lease_duration=LEASE_S,
            holder=holder,
            strict=True,
            # A failed renewal must not kill a training run; the trainer's own lock still guards the folder.
            raise_on_lease_renewal_failure=False,
        )

    reclaim_orphaned(run_name, flow_run_id)
    if if_running == "wait":
        get_run_logger().info("run %s: waiting for the run name to be free (concurrency limit %s)", run_name, name)
    patience = REFUSE_AFTER_S if if_running == "refuse" else WAIT_ROUND_S
    with contextlib.ExitStack() as stack:
        while True:
            try:
                stack.enter_context(slot(patience))
                break
            except slot_timeout():
                if reclaim_orphaned(run_name, flow_run_id):
                    patience = max(patience, SLOW_SERVER_S)
                    continue
                if if_running == "wait":
                    continue
                if _held_slots(name) == 0:  # nobody holds it: the server was too slow to grant it in time
                    if patience >= SLOW_SERVER_S:
                        raise RunBusy(
                            f"run {run_name!r} was not started: the Prefect server did not grant its free slot "
                            f"(concurrency limit {name}) within {patience:.0f} s; it is overloaded or unreachable, "
                            "so start the run again once it answers"
                        ) from None
                    get_run_logger().warning(
                        "run %s: the Prefect server did not grant the free slot of concurrency limit %s within "
                        "%.0f s (a slow server, not another run); asking again for up to %.0f s",
                        run_name,
                        name,
                        patience,
                        SLOW_SERVER_S,
                    )
                    patience = SLOW_SERVER_S
                    continue
                raise RunBusy(
                    f"run {run_name!r} is already running in {live_holder(run_name, flow_run_id)}; wait for it to "
                    "finish, cancel it, or start this one with if_running=wait"
                ) from None
        _tag_holder(run_name, flow_run_id)
        yield

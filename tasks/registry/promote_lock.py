"""The promotion lock: one move of a registered model's `champion` at a time, whoever makes it.

Promotion reads the champion, scores for minutes to hours, then moves `champion`. Every path that
moves it (a continued run's promotion, from either deployment or `tessera continue`; the first
champion's bootstrap; `tessera promote`) takes this lock, re-reads the champion inside it, and
decides again when it changed (tasks/registry/promote.py), so a promotion made meanwhile is never reverted
and `previous-champion` always names a version that was champion.

The lock is a one-slot Prefect global concurrency limit, `tessera-promote-<model>`, on a lease: a
holder killed outright frees it when the lease expires. It is held for the seconds a decision takes
to record, never while scoring. (The other exclusions: tasks/runs/run_slot.py, tasks/data/claim.py,
trainers/folder_lock.py.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tasks.slots import ensure_limit, slot_timeout
from trainers.contract import EXIT_FAILED, OneLineError

LEASE_S = 60.0
WAIT_S = 300.0  # a decision records in seconds: a lock held this long is held by something gone wrong


class PromotionBusy(OneLineError, RuntimeError):
    """The lock stayed held; str() is one line naming the limit and how to free it."""

    exit_code = EXIT_FAILED  # a promotion that waited its turn out: a rerun promotes then


def lock_name(model: str) -> str:
    return f"tessera-promote-{model}"


@contextlib.contextmanager
def promotion_lock(model: str, who: str) -> Iterator[None]:
    """Hold `model`'s promotion lock for the body; `who` names the waiter in the error when it cannot."""
    from prefect.concurrency.sync import concurrency

    name = lock_name(model)
    ensure_limit(name)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(
                concurrency(
                    name,
                    occupy=1,
                    timeout_seconds=WAIT_S,
                    lease_duration=LEASE_S,
                    strict=True,
                    raise_on_lease_renewal_failure=False,
                )
            )
        except slot_timeout():
            raise PromotionBusy(
                f"{who}: {model}'s promotion lock (concurrency limit {name}) stayed held for {WAIT_S:.0f} s; if no "
                f"promotion is running, free it with `prefect gcl update {name} --active-slots 0`"
            ) from None
        yield

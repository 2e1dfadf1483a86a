"""One-slot Prefect global concurrency limits, as tessera's exclusions take them: created once (their creation
serialized through NAMES_LOCK), and the error of a slot not freed in time. The run-name slot
(tasks/runs/run_slot.py) and the promotion lock (tasks/registry/promote_lock.py) are both built on them; a module
of its own, below both, so that neither package imports the other.
"""

from __future__ import annotations

import contextlib

# Creating a run name's limit is serialized through this one: two flow runs of a new run name (a double
# click) would both create it, and the server, while answering the second 409, logs an IntegrityError
# that `tessera up` would rightly print as a server error. `tessera up` and `tessera deploy` create it.
NAMES_LOCK = "tessera-run-names"
# Held for one create, but a waiter retries when the server's 423 says (Retry-After, up to 30 s plus jitter, longer
# as denials pile up): with 60 s, a double click on a loaded machine failed its second run TimedOut on this lock
# instead of refusing it. A wait this long only ever means a server that barely answers.
NAMES_LOCK_WAIT_S = 300


def ensure_names_lock() -> None:
    """Create NAMES_LOCK (one slot) unless the server has it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(NAMES_LOCK)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=NAMES_LOCK, limit=1))


def ensure_limit(name: str) -> None:
    """Create the one-slot global concurrency limit `name` unless the server has it (creations serialized)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    def missing(client) -> bool:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return False
        except ObjectNotFound:
            return True

    with get_client(sync_client=True) as client:
        if not missing(client):
            return
        try:
            client.read_global_concurrency_limit_by_name(NAMES_LOCK)
            serialized = concurrency(NAMES_LOCK, occupy=1, timeout_seconds=NAMES_LOCK_WAIT_S, strict=True)
        except ObjectNotFound:  # a server `tessera up`/`tessera deploy` never set up (the CLI's own): no race
            serialized = contextlib.nullcontext()
        with serialized:
            if missing(client):
                with contextlib.suppress(ObjectAlreadyExists):
                    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))


def slot_timeout() -> type[TimeoutError]:
    """What Prefect's `concurrency()` raises when no slot freed up in time. No public module of Prefect 3 exports
    it (it is prefect.concurrency._asyncio's), and the builtin TimeoutError it extends would also catch a stalled
    server's asyncio timeout, which is no busy run: so this is tessera's one import of a private Prefect module."""
    from prefect.concurrency._asyncio import AcquireConcurrencySlotTimeoutError

    return AcquireConcurrencySlotTimeoutError

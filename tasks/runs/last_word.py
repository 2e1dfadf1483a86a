"""A stopped flow run's explanation stays its last state, as Prefect's UI shows only the last.

Prefect's runner (in the worker: `prefect worker start`, `tessera up`'s) ends a cancel in this order: it SIGTERMs
the flow's process, which stops its trainer and ends the run Cancelled with what stays (tasks/runs/flow_outcome.py);
it runs the flow's on_cancellation hooks, in a subprocess of their own; then it forces a Cancelled of its own over
the flow's, "Flow run was cancelled successfully.". The hook cannot wait for that write (the runner waits for the
hook first), so it starts this watcher as a process of its own session: for at most WATCH_S it reads the run's
states, and once the runner's has replaced the flow's explanation it sets the explanation again, then exits. It
never outlives WATCH_S, touches nothing when the flow wrote no explanation (a process killed before it could), and
leaves a run that moved on (a retry) alone.

    python -m tasks.runs.last_word FLOW_RUN_ID
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

GENERIC_CANCEL = "Flow run was cancelled successfully."  # what Prefect's runner writes once the process is gone
WATCH_S = 120.0
POLL_S = 1.0

log = logging.getLogger("tessera.last_word")


# The explanation is the one thing a person reads after a stop: worth a minute of retries against a server that is
# slow or whose database is locked (SQLite answers 500 then, which Prefect's client does not retry).
SET_STATE_RETRY_S = 60.0


def set_state(flow_run_id, state, *, within_s: float = SET_STATE_RETRY_S):
    """Set the flow run's state (forced), retrying with backoff for `within_s`; the server's answer."""
    from prefect.client.orchestration import get_client

    deadline, delay = time.monotonic() + within_s, 0.5
    while True:
        try:
            with get_client(sync_client=True) as client:
                return client.set_flow_run_state(flow_run_id, state, force=True)
        except Exception:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 8.0)


def spawn(flow_run_id) -> None:
    """Start the watcher for `flow_run_id` beside the caller (a hook subprocess that is about to exit). Only against
    a Prefect server of its own: a run on `tessera run`'s temporary server has no worker to overwrite its state, and
    a watcher there would start a temporary server of its own."""
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return
    subprocess.Popen(
        [sys.executable, "-m", "tasks.runs.last_word", str(flow_run_id)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # the hook's process group may be signalled as it ends
        cwd=os.getcwd(),
    )


def keep(flow_run_id, watch_s: float = WATCH_S, poll_s: float = POLL_S) -> bool:
    """Watch the run; True once the explanation was put back as its last state."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            states = sorted(client.read_flow_run_states(flow_run_id), key=lambda s: s.timestamp)
        ours = next((s for s in reversed(states) if s.is_cancelled() and s.message != GENERIC_CANCEL), None)
        if ours is None or not ours.message:  # the flow wrote no explanation: nothing to keep
            return False
        last = states[-1]
        if not last.is_cancelled():  # the run moved on (a retry of it): not ours to touch
            return False
        if last.message == GENERIC_CANCEL:
            set_state(flow_run_id, Cancelled(name=ours.name, message=ours.message))
            return True
        time.sleep(poll_s)
    return False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        keep(args[0])
    except Exception:  # the explanation stays in the run's state history and its log
        log.warning("could not keep the explanation of flow run %s as its last state", args[0], exc_info=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

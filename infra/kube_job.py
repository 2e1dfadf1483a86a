"""One Kubernetes launch as a job with the same interface as infra.local's: poll, wait, cancel, tail,
new_output, log_path, stopped, and the preemptions and restarts the group went through.

A job runs two threads from `start` until its group ends: the watch (infra/kube_watch.py), which
decides the Outcome, and the relay of pod 0's output into the local log (infra/kube_relay.py). This
module ties them together: the end is written once, after pod 0's last lines, and a cancel deletes
every object (infra/kube_cleanup.py) before the job counts as ended.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from infra.config import ComputeConfig
from infra.joblog import JobLog
from infra.kube_api import Kube, KubeError
from infra.kube_cleanup import delete_launch
from infra.kube_names import Workload
from infra.kube_nodes import avoid
from infra.kube_outcome import INTERRUPTED, RETRYABLE, Outcome, parse_indexes
from infra.kube_relay import LogRelay
from infra.kube_watch import GroupWatch
from infra.launch_outcome import RECORD_PREFIX, LaunchOutcome, hang_of, read_records
from infra.lifecycle import forget

log = logging.getLogger(__name__)


class KubernetesJob:
    """One launch: a group of objects in one namespace, watched by a thread until it ends."""

    watch_s = 2  # a watch request's length: how often pods and timeouts are looked at without a group event
    delete_wait_s = 120.0  # how long cancel waits for the pods of a deleted group to be gone
    # How long the end waits at most for the relay to bring pod 0's last output in; it waits no longer than the relay
    # takes. A finished pod's log is read to its end in one request, but on a loaded node (or a slow API) a few
    # rounds of list/log/get can take many seconds: 10 s once left a completed group's whole output out of its log
    # on a loaded CI machine (the explanation came, the output it explains did not).
    relay_drain_s = 30.0

    def __init__(
        self,
        kube: Kube,
        compute: ComputeConfig,
        work: Workload,
        objects: list[dict],
        container: str,
        log_path: Path,
        *,
        recreate: bool,
        created: bool,
    ):
        self.kube, self.compute, self.work, self.objects = kube, compute, work, objects
        self.group = objects[-1]  # the JobSet or Job; ConfigMap and Service come first
        self.kind, self.name = self.group["kind"], self.group["metadata"]["name"]
        self.log_path = log_path
        self.log_offset = log_path.stat().st_size if log_path.exists() else 0
        self.stopped = False
        self.created = created  # False: re-attached to a group an earlier process created
        self._outcome: Outcome | None = None
        self._stop = threading.Event()
        self._ended = threading.Event()
        self._log = JobLog(log_path, self.log_offset)
        self._relay = LogRelay(kube, work, container, log_path, ended=self._ended, stop=self._stop)
        self._group = GroupWatch(
            kube,
            compute,
            work,
            self.group,
            container,
            recreate=recreate,
            created=created,
            stop=self._stop,
            report=self._relay.line,
            delete_wait_s=self.delete_wait_s,
        )
        self._watcher = threading.Thread(target=self._watch, name=f"k8s-watch-{self.name}", daemon=True)
        self._logger = threading.Thread(target=self._relay.run, name=f"k8s-log-{self.name}", daemon=True)

    def start(self) -> KubernetesJob:
        # The relay first: a group that has already ended when the watcher first looks ends the launch at once, and
        # `end` waits for pod 0's output only from a relay that has started (CI lost pod 0's line to that order).
        self._logger.start()
        self._watcher.start()
        return self

    # -- the job interface ---------------------------------------------------------------------------

    @property
    def preemptions(self) -> int:
        """Evictions this group restarted through (JobSet) or was recreated after (indexed job)."""
        return self._group.preemptions

    def avoid_node(self, node: str, why: str) -> str:
        """Keep the group's next pods off `node` (compute.kubernetes.avoid_slow_nodes); the line saying what was done,
        also written to the job's log."""
        line = avoid(self.kube, node, why)
        self._relay.line(line)
        return line

    @property
    def pending_s(self) -> float:
        """Seconds the group waited in the cluster's queue (suspended, or a pod unschedulable)."""
        return self._group.pending_s

    @property
    def restarts(self) -> int:
        """Restarts after application failures."""
        return self._group.restarts

    def indexes_done(self) -> list[int]:
        """Completion indexes of an Indexed Job that have succeeded, as its status said when last looked at (a data
        preparation's partitions done); empty for a JobSet."""
        return parse_indexes(self._group.status.get("completedIndexes"))

    def poll(self) -> int | None:
        return None if self._outcome is None else self._outcome.code

    def wait(self, timeout: float | None = None) -> int:
        if self._watcher.ident is not None:
            self._watcher.join(timeout)
        if self._outcome is None:
            raise TimeoutError(f"{self.kind} {self.name} still running after {timeout}s")
        return self._outcome.code

    @property
    def outcome(self) -> Outcome | None:
        return self._outcome

    def result(self) -> LaunchOutcome:
        """How the launch ended (waits for it), the stage task's one view of it: pod 0's launcher's records (its
        restarts in place, a hang that ended it) with what the cluster did (evictions and group restarts it went
        through, time in its queue)."""
        code = self.wait()
        restarts, end = read_records(self._log.lines_with(RECORD_PREFIX))
        return LaunchOutcome(
            code=code,
            hung=hang_of(end),
            restarts=restarts,
            preemptions=self.preemptions,
            group_restarts=self.restarts,
            group_restarts_spent=self.restarts_spent,
            pending_s=self.pending_s,
        )

    def new_output(self, max_bytes: int = 4 << 20) -> list[str]:
        """Complete lines of pod 0's output (and the launcher's own lines) since the last call."""
        return self._log.new_lines(max_bytes)

    def tail(self, lines: int = 1000, max_bytes: int = 1 << 20) -> str:
        """The end of this launch's log: by default all of a failed attempt's pod-0 output, within 1 MiB,
        and the failing pod's last lines, then the line that explains the end."""
        return self._log.tail(lines, max_bytes)

    @property
    def restarts_spent(self) -> bool:
        """The group failed after its in-cluster restarts (compute.kubernetes.max_restarts): no task retry on top."""
        return self._outcome is not None and self._outcome.restarts_spent

    @property
    def lost(self) -> bool:
        """The launcher lost the API, not the group: it may still be training, and is left for the retry to adopt."""
        return self._outcome is not None and self._outcome.lost

    def cancel(self, grace_s: float = 10.0) -> None:
        """Delete every object of the launch (foreground: the pods go first) and wait until they are gone.

        After "lost track" the objects are left alone unless the flow itself is stopping (`stopped`): the group
        may be training still, and the task's retry looks it up and re-attaches to it (infra/kubernetes.py)
        rather than restart it from its last checkpoint. Deleting it blind would throw that work away."""
        self._stop.set()
        if self.lost and not self.stopped:
            if self._watcher.ident is not None:
                self._watcher.join(timeout=5.0)
            if self._logger.ident is not None:
                self._logger.join(timeout=5.0)
            return  # still registered: a flow that fails from here on deletes it in cancel_all
        delete_launch(self.kube, self.objects, grace_s + self.delete_wait_s, self._relay.line)
        if self._watcher.ident is not None:
            self._watcher.join(timeout=max(5.0, grace_s))
        if self._outcome is None:
            self.end(Outcome(INTERRUPTED, "disruption", f"{self.kind} {self.name} was deleted by its launcher"))
        if self._logger.ident is not None:
            self._logger.join(timeout=5.0)
        forget(self)

    # -- for the launcher (infra/kubernetes.py) ------------------------------------------------------

    def note(self, text: str) -> None:
        """One line of the launcher's own in the job log (until the end is written)."""
        self._relay.line(text)

    def end(self, outcome: Outcome) -> None:
        """The launch ended with `outcome`: pod 0's last output, the failing pod's last lines, then the
        line that explains the end; poll and wait report it from then on."""
        self._relay.ask_again = not outcome.lost
        self._ended.set()
        if self._logger.ident is not None and self._logger is not threading.current_thread():
            # pod 0's last lines before the explanation; a pod 0 still running has written all it had once its
            # stream goes quiet
            deadline = time.monotonic() + self.relay_drain_s
            while self._logger.is_alive() and time.monotonic() < deadline and not self._relay.caught_up(1.0):
                self._logger.join(timeout=0.2)
        if outcome.cause != "done":
            failure = self._group.failure_behind(outcome)
            if failure is not None:
                self._relay.last_lines_of(failure.pod)
        self._relay.close(outcome.message)
        self._outcome = outcome

    def _watch(self) -> None:
        # Whatever happens here must end in an Outcome: a watcher thread that died would leave poll() at None and
        # the training task waiting forever on a group that may long have ended.
        try:
            outcome = self._group.until_end(self.watch_s)
        except KubeError as exc:
            outcome = Outcome(RETRYABLE, "failure", f"lost track of {self.kind} {self.name}: {exc}")
        except Exception as exc:  # a bug or an unforeseen client error: retryable, and said
            log.exception("the watch of %s %s failed", self.kind, self.name)
            outcome = Outcome(
                RETRYABLE, "failure", f"lost track of {self.kind} {self.name}: {type(exc).__name__}: {exc}", lost=True
            )
        if outcome is not None:
            self.end(outcome)

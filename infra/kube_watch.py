"""Watching one launched group until it ends: a watch on the JobSet or Job, with its pods and the
scheduler's events looked at on every event and every `watch_s`, turned into an Outcome.

The classification of a single pod or condition is infra/kube_outcome.py; this module keeps what
only shows over time: how long a pod has been unschedulable or pulling its image, how long a JobSet
has been suspended by Kueue, the restarts a JobSet went through (and which were evictions), and,
with `api: indexed-job`, the restarts this launcher makes itself by deleting and recreating the Job.

A data preparation's Job (infra/prepare_job.py) is watched the same way, with one difference: its pods
are independent, and the Job controller replaces a failed one itself (backoffLimitPerIndex), so a pod
failure is reported and the watch goes on; only the Job's own end (or exit 78, which fails the Job at
once by its pod failure policy) ends it, and a failed Job is explained by its first failed index.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

from infra.config import ComputeConfig, KubernetesConfig
from infra.kube_api import Kube, KubeError
from infra.kube_cleanup import delete_for_recreate
from infra.kube_names import COMPLETION_INDEX_ANNOTATION, Workload, selector_string
from infra.kube_nodes import avoid
from infra.kube_outcome import (
    FATAL,
    IMAGE_PULL,
    INTERRUPTED,
    INVALID_SPEC,
    RETRYABLE,
    Outcome,
    PodFailure,
    condition,
    explain_end,
    most_telling,
    parse_indexes,
    pod_failure,
    scheduler_message,
    unschedulable,
    waiting,
)

# Between attempts to reach an API server that does not answer: doubling from the first to the second, so a blip
# costs a second and an outage is asked about every few seconds, not hammered.
BACKOFF_S = (0.5, 8.0)


class GroupWatch:
    """One group's watch: `until_end` returns its Outcome (None when stopped), counting restarts on the way."""

    def __init__(
        self,
        kube: Kube,
        compute: ComputeConfig,
        work: Workload,
        group: dict,
        container: str,
        *,
        recreate: bool,
        created: bool,
        stop: threading.Event,
        report: Callable[[str], None],
        delete_wait_s: float,
    ):
        self.kube, self.compute, self.work, self.group = kube, compute, work, group
        self.cfg: KubernetesConfig = compute.kubernetes
        self.kind, self.name = group["kind"], group["metadata"]["name"]
        self.container, self.recreate, self.created = container, recreate, created
        self.delete_wait_s = delete_wait_s  # how long a recreate waits for the old group's pods to be gone
        self.preemptions = 0  # evictions this group restarted through (JobSet) or was recreated after (indexed job)
        self.restarts = 0  # restarts after application failures
        self._stop, self._report = stop, report
        self._failures: dict[str, PodFailure] = {}  # by pod uid, in the order seen
        self._since: dict[tuple[str, str], float] = {}  # (pod uid, what) -> when first seen stuck
        self._restarts_seen: int | None = None
        # Seconds the group waited to run: suspended (Kueue had not admitted it), or a pod not yet scheduled. The
        # goodput ledger's `pending` (tasks/training/goodput.py).
        self.pending_s = 0.0
        self._judged_at: float | None = None
        self._recreated = False  # an indexed job was deleted and created again: watch the new one afresh
        # A data preparation: the Job controller retries each completion index on its own; a pod's failure is not
        # the group's (module docstring).
        self.per_index = work.component == "prepare"
        self._indexes: dict[str, int] = {}  # pod uid -> its completion index, for the failures seen
        self.status: dict = {}  # the group's status as last seen (completedIndexes, failedIndexes, ...)

    def failure_behind(self, outcome: Outcome) -> PodFailure | None:
        """The pod failure of this attempt that `outcome` reports, if it reports one."""
        return next((f for f in self._failures.values() if f.message in outcome.message), None)

    def until_end(self, watch_s: float) -> Outcome | None:
        """Watch from the last resourceVersion seen, through dropped connections, 5xx answers and API restarts
        (each retried with backoff), and a compacted version (410: read the group again, watch from there).
        An API server that stays away longer than compute.kubernetes.api_lost_s ends the watch as retryable
        "lost track": the group is left running for the task's retry to find and re-attach to."""
        # Where the next watch starts; "" = read the group first. After a recreate (on any of the three judgements
        # below) the new incarnation is read afresh: a watch from the old one's version would replay the old Job's
        # deletion, still Failed, and count its failure a second time (CI once ended with 75 under max_restarts=1).
        version = ""
        lost_since: float | None = None
        delay = BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                if not version:
                    obj, version = self.kube.get_with_version(self.kind, self.name)
                    if obj is None:
                        return self._gone()
                    outcome = self._judge(obj)
                    if outcome is not None:
                        return outcome
                    if self._recreated:
                        self._recreated, version = False, ""
                        continue
                for kind, obj in self.kube.watch(self.kind, self.name, watch_s, version):
                    if self._stop.is_set():
                        return None
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    if kind == "DELETED":
                        return self._gone()
                    if kind == "BOOKMARK":
                        continue
                    outcome = self._judge(obj)
                    if outcome is not None:
                        return outcome
                    if self._recreated:
                        self._recreated, version = False, ""
                        break
                if self._stop.is_set():
                    return None
                obj = self.kube.get(self.kind, self.name)
                if obj is None:
                    return self._gone()
                outcome = self._judge(obj)  # pods and timeouts change without an event on the group
                if outcome is not None:
                    return outcome
                if self._recreated:
                    self._recreated, version = False, ""
            except KubeError as exc:
                if not exc.transient:
                    raise
                if exc.status == 410:  # compacted: nothing lost, the group is read again below
                    version = ""
                    continue
                now = time.monotonic()
                if lost_since is None:
                    lost_since = now
                    self._report(f"the Kubernetes API is not answering ({exc}); watching {self._what()} again")
                away = now - lost_since
                if away > self.cfg.api_lost_s:
                    return Outcome(
                        RETRYABLE,
                        "failure",
                        f"lost track of {self._what()}: the Kubernetes API did not answer for {away:.0f}s "
                        f"(compute.kubernetes.api_lost_s={self.cfg.api_lost_s:.0f}): {exc}; the group was left "
                        f"running, and the stage's retry re-attaches to it if it still runs",
                        lost=True,
                    )
                self._stop.wait(min(delay, max(0.0, self.cfg.api_lost_s - away) + 0.1))
                delay = min(delay * 2, BACKOFF_S[1])
                continue
            if lost_since is not None:
                self._report(f"the Kubernetes API answers again after {time.monotonic() - lost_since:.0f}s")
                lost_since, delay = None, BACKOFF_S[0]
        return None

    def _gone(self) -> Outcome | None:
        if self._stop.is_set():
            return None
        return Outcome(INTERRUPTED, "disruption", f"{self.kind} {self.name} was deleted from outside")

    def _pods(self) -> list[dict]:
        return self.kube.list("Pod", selector_string(self.work.selector(with_attempt=True)))

    def _stuck(self, uid: str, what: str, now: float) -> float:
        return now - self._since.setdefault((uid, what), now)

    def _judge(self, group: dict) -> Outcome | None:
        """An Outcome once the group has ended (or must be ended), else None; recreates an indexed job."""
        now = time.monotonic()
        pods = [p for p in self._pods() if not (p.get("metadata") or {}).get("deletionTimestamp")]
        suspended = condition(group, "Suspended") is not None
        queued = suspended or any(unschedulable(p) for p in pods)
        # A preparation with a pod running goes on with the nodes it has: its other pods may wait for room. Once none
        # runs, a pod unschedulable past pending_timeout_s ends it, as it ends a training group.
        progressing = self.per_index and any((p.get("status") or {}).get("phase") == "Running" for p in pods)
        if suspended:  # Kueue's queue, not the scheduler: a pod's pending clock starts once the group is admitted
            self._since = {k: v for k, v in self._since.items() if k[1] != "pending"}
        if queued and self._judged_at is not None:
            self.pending_s += now - self._judged_at
        self._judged_at = now
        for pod in pods:
            uid = pod["metadata"].get("uid", pod["metadata"]["name"])
            name = pod["metadata"]["name"]
            failure = pod_failure(pod, self.container)
            if failure is not None and uid not in self._failures:
                self._failures[uid] = failure
                self._indexes[uid] = _completion_index(pod)
                node = (pod.get("spec") or {}).get("nodeName")
                if failure.hung and node and self.cfg.avoid_slow_nodes:  # before the group's restart is scheduled
                    self._report(avoid(self.kube, node, failure.message))
                if self.per_index:
                    outcome = self._index_failure(failure, self._indexes[uid])
                    if outcome is not None:
                        return outcome
                elif failure.cause == "fatal":  # OOM or exit 78: a restart would fail the same way
                    return Outcome(failure.code, "fatal", f"{self._what()} failed: {failure.message}")
            stuck = waiting(pod, self.container)
            if stuck and stuck[0] in INVALID_SPEC:
                return Outcome(FATAL, "fatal", f"pod {name} cannot start: {stuck[0]}: {stuck[1]}".rstrip(": "))
            if stuck and stuck[0] in IMAGE_PULL:
                if self._stuck(uid, "pull", now) > self.cfg.image_pull_timeout_s:
                    return Outcome(
                        RETRYABLE,
                        "failure",
                        f"pod {name}: image {self.cfg.image} not pulled in "
                        f"{self.cfg.image_pull_timeout_s:.0f}s: {stuck[0]}: {stuck[1]}".rstrip(": "),
                    )
            message = unschedulable(pod)
            if (
                message is not None
                and self._stuck(uid, "pending", now) > self.cfg.pending_timeout_s
                and not progressing
            ):
                events = self.kube.list("Event", field_selector=f"involvedObject.name={name}")
                message = scheduler_message(events) or message
                return Outcome(
                    FATAL,
                    "fatal",
                    f"pod {name} unschedulable for {self.cfg.pending_timeout_s:.0f}s "
                    f"(compute.kubernetes.pending_timeout_s): {message}",
                )
        if self.kind == "JobSet":
            return self._judge_jobset(group, now)
        return self._judge_job(group)

    def _what(self) -> str:
        return f"{self.kind} {self.name}"

    def _attempt_failures(self) -> list[PodFailure]:
        return list(self._failures.values())

    def _judge_jobset(self, js: dict, now: float) -> Outcome | None:
        status = js.get("status") or {}
        restarts = int(status.get("restarts") or 0)
        counted = int(status.get("restartsCountTowardsMax") or 0)
        self.preemptions, self.restarts = restarts - counted, counted
        if self._restarts_seen is None:  # re-attached: the earlier restarts were logged by the earlier process
            self._restarts_seen = 0 if self.created else restarts
        if restarts > self._restarts_seen:
            last = most_telling(list(self._failures.values())).message if self._failures else "no pod failure was seen"
            self._report(
                f"{self._what()} restarted the whole group (restart {restarts}: {counted} of "
                f"max_restarts={self.cfg.max_restarts} counted, {restarts - counted} disruptions); {last}"
            )
            self._restarts_seen = restarts
            self._failures.clear()
            self._since.clear()
        if condition(js, "Completed"):
            return Outcome(0, "done", f"{self._what()} completed")
        failed = condition(js, "Failed")
        if failed:
            outcome = explain_end(self._attempt_failures(), self._what(), failed)
            return replace(outcome, restarts_spent=outcome.cause == "failure")
        if self.preemptions > self.compute.max_preemptions:
            return Outcome(
                INTERRUPTED,
                "disruption",
                f"{self._what()}: restarts exhausted on evictions "
                f"({self.preemptions} > compute.max_preemptions={self.compute.max_preemptions})",
            )
        suspended = condition(js, "Suspended")
        limit = self.cfg.queue_timeout_s
        if suspended and limit is not None and self._stuck(self.name, "suspended", now) > limit:
            queue = f" in queue {self.cfg.queue_name}" if self.cfg.queue_name else ""
            return Outcome(
                FATAL,
                "fatal",
                f"{self._what()} suspended for {limit:.0f}s (compute.kubernetes.queue_timeout_s), not "
                f"admitted{queue}: {suspended.get('message', '')}".rstrip(": "),
            )
        if not suspended:
            self._since.pop((self.name, "suspended"), None)
        return None

    def _index_failure(self, failure: PodFailure, index: int) -> Outcome | None:
        """A preparation's pod failed: exit 78 ends it at once (its Job's FailJob rule fails the Job anyway); any
        other failure is the Job controller's to retry, and is said in the log."""
        if failure.cause == "fatal" and not failure.oom:
            return Outcome(failure.code, "fatal", f"{self._what()}: {_failed(index)}: {failure.message}")
        if failure.cause == "disruption":
            self.preemptions += 1
            self._report(f"{failure.message}; the Job controller replaces it (not counted against its index's budget)")
        else:
            budget = self.cfg.prepare.backoff_limit_per_index
            self._report(
                f"index {index}: {failure.message}; the Job controller retries the index while its budget lasts "
                f"(compute.kubernetes.prepare.backoff_limit_per_index={budget})"
            )
        return None

    def _explain_failed_indexes(self, failed: dict) -> Outcome:
        """A failed preparation: its first failed index (status.failedIndexes) and that index's most telling pod
        failure; else the failure that ended the Job by its policy (exit 78, whose index need not be listed: it
        fails the Job before its budget is spent); else the Job's own condition."""
        listed = parse_indexes(self.status.get("failedIndexes"))
        seen = [(self._indexes.get(uid, -1), f) for uid, f in self._failures.items()]
        index, failures = -1, []
        if listed:
            index = listed[0]
            failures = [f for i, f in seen if i == index and f.cause != "disruption"] or [
                f for i, f in seen if i == index
            ]
        if not failures:
            fatal = [(i, f) for i, f in seen if f.cause == "fatal"]
            if fatal:
                index, failures = fatal[-1][0], [fatal[-1][1]]
        others = f" (failed indexes: {self.status['failedIndexes']})" if len(listed) > 1 else ""
        if not failures:
            outcome = explain_end([], self._what(), failed)
            where = f": {_failed(index)}" if index >= 0 else ""
            return replace(outcome, message=f"{outcome.message}{where}{others}")
        worst = most_telling(failures[::-1])  # the latest of the best-ranked: the index's last try
        return Outcome(
            worst.code,
            worst.cause,
            f"{self._what()}: {_failed(index)}: {worst.message}{others}",
            restarts_spent=worst.cause == "failure",  # the Job controller spent the index's budget on it
        )

    def _judge_job(self, job: dict) -> Outcome | None:
        self.status = job.get("status") or {}
        if condition(job, "Complete"):
            return Outcome(0, "done", f"{self._what()} completed")
        failed = condition(job, "Failed")
        if not failed:
            return None
        if self.per_index:
            return self._explain_failed_indexes(failed)
        outcome = explain_end(self._attempt_failures(), self._what(), failed)
        if not self.recreate:
            return outcome
        if outcome.cause == "disruption" and self.preemptions < self.compute.max_preemptions:
            self.preemptions += 1
        elif outcome.cause == "failure" and self.restarts < self.cfg.max_restarts:
            self.restarts += 1
        else:
            if outcome.cause == "failure":
                return replace(outcome, restarts_spent=True)
            if outcome.cause == "disruption":
                return Outcome(
                    outcome.code,
                    outcome.cause,
                    f"{outcome.message}; restarts exhausted on evictions "
                    f"(compute.max_preemptions={self.compute.max_preemptions})",
                )
            return outcome
        self._report(
            f"{outcome.message}; deleting and recreating the whole group (restart {self.restarts} of "
            f"max_restarts={self.cfg.max_restarts}, {self.preemptions} disruptions)"
        )
        self._recreate()
        return None

    def _recreate(self) -> None:
        """The Job's restart as a group, as a JobSet's BlockingRecreate does it (infra/kube_cleanup.py)."""
        delete_for_recreate(self.kube, self.kind, self.name, self.delete_wait_s, self._stop)
        self.kube.create(self.group)
        self._recreated = True
        self._failures.clear()
        self._since.clear()


def _completion_index(pod: dict) -> int:
    """The pod's completion index in its Indexed Job (-1: none)."""
    meta = pod.get("metadata") or {}
    value = (meta.get("annotations") or {}).get(COMPLETION_INDEX_ANNOTATION) or (meta.get("labels") or {}).get(
        COMPLETION_INDEX_ANNOTATION
    )
    return int(value) if value is not None and str(value).isdigit() else -1


def _failed(index: int) -> str:
    return f"index {index} failed" if index >= 0 else "failed"

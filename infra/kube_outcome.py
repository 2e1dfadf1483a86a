"""Why a group of pods ended, read from the objects the API server reports.

The launcher turns what it sees (pod phases and conditions, container states, Job and JobSet
conditions, the scheduler's events) into an Outcome: an exit code that lands in the right class
of tasks.training.stage_ends.exit_kind, and one line saying what happened, which becomes the last line of the
job's log and so the task's error message.

| what happened                                        | cause      | code |
|------------------------------------------------------|------------|------|
| every pod succeeded                                  | done       | 0    |
| eviction, preemption, DisruptionTarget, a lost node  | disruption | 76   |
| the pod's watchdog killed a hung group (exit 79)     | disruption | 76   |
| the trainer exited non-zero (75, 1, ...)             | failure    | its own code |
| a Job failed by its DisruptionTarget rule, the pod    | disruption | 76   |
|   gone before the launcher saw it                    |            |      |
| JobSet/Job failed with no pod left to explain it     | failure    | 75   |
| image not pulled within image_pull_timeout_s         | failure    | 75   |
| the trainer's fatal exit 78                          | fatal      | 78   |
| a container OOMKilled                                | fatal      | 78   |
| invalid spec (refused by the API, bad image name,    | fatal      | 78   |
|   missing Secret/ConfigMap key)                      |            |      |
| a pod unschedulable past pending_timeout_s           | fatal      | 78   |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from infra.kube_names import PREPARE_CONTAINER, TRAIN_CONTAINER
from infra.manifests import DISRUPTION_MESSAGE
from trainers.contract import FATAL, HUNG, INTERRUPTED, RETRYABLE

Cause = Literal["done", "disruption", "failure", "fatal"]

# Pod status reasons the kubelet or node controller give a pod that was stopped from outside.
_DISRUPTED = {"Evicted", "NodeLost", "Shutdown", "Terminated", "Preempting", "NodeShutdown", "UnexpectedAdmissionError"}
# Container waiting reasons that no amount of waiting fixes.
INVALID_SPEC = {"CreateContainerConfigError", "CreateContainerError", "InvalidImageName", "RunContainerError"}
IMAGE_PULL = {"ImagePullBackOff", "ErrImagePull"}


@dataclass(frozen=True)
class Outcome:
    code: int
    cause: Cause
    message: str
    lost: bool = False  # the API was lost, not the group: it may still run, and must not be deleted blind
    # The group failed after the cluster restarted it compute.kubernetes.max_restarts times: that budget counted
    # these application failures, so the training task must not spend its own retries on them too.
    restarts_spent: bool = False


@dataclass(frozen=True)
class PodFailure:
    """A pod of the group that ended badly, as its status says."""

    pod: str
    uid: str
    cause: Cause
    code: int
    message: str
    hung: bool = False  # its watchdog killed the group: the cause of the other pods' failures, not one of them
    oom: bool = False  # its container was OOMKilled


def condition(obj: dict, kind: str) -> dict | None:
    """The status condition of this type that is True, or None."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return cond
    return None


def _container(pod: dict, name: str) -> dict:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == name:
            return status
    return {}


def _limit(pod: dict, container: str, resource: str) -> str:
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == container:
            return ((c.get("resources") or {}).get("limits") or {}).get(resource, "none")
    return "none"


def pod_failure(pod: dict, container: str) -> PodFailure | None:
    """Why this pod failed, or None while it has not."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    name, uid = meta.get("name", "?"), meta.get("uid", meta.get("name", "?"))
    disrupted = condition(pod, "DisruptionTarget")
    if disrupted is not None:
        why = f"{disrupted.get('reason', 'DisruptionTarget')}: {disrupted.get('message', '')}".rstrip(": ")
        return PodFailure(name, uid, "disruption", INTERRUPTED, f"pod {name} was disrupted ({why})")
    if status.get("reason") in _DISRUPTED:
        why = f"{status['reason']}: {status.get('message', '')}".rstrip(": ")
        return PodFailure(name, uid, "disruption", INTERRUPTED, f"pod {name} was stopped from outside ({why})")
    terminated = (_container(pod, container).get("state") or {}).get("terminated")
    if terminated:
        code = int(terminated.get("exitCode", 0))
        if terminated.get("reason") == "OOMKilled":
            remedy = (
                "raise compute.kubernetes.prepare.memory"
                if container == PREPARE_CONTAINER
                else "raise compute.kubernetes.memory or lower train.device_microbatch_size"
            )
            return PodFailure(
                name,
                uid,
                "fatal",
                FATAL,
                f"pod {name}: container {container} was OOMKilled (memory "
                f"limit {_limit(pod, container, 'memory')}); {remedy}",
                oom=True,
            )
        if code == FATAL:
            who = "the trainer" if container == TRAIN_CONTAINER else f"container {container}"
            return PodFailure(name, uid, "fatal", FATAL, f"pod {name}: {who} exited {FATAL} (fatal)")
        if code == HUNG:  # the launcher's watchdog, restarts spent; its line is the container's termination message
            said = (terminated.get("message") or "the watchdog found a hung rank").strip().splitlines()[0]
            return PodFailure(name, uid, "disruption", INTERRUPTED, f"pod {name}: {said}", hung=True)
        if code != 0:
            detail = f" ({terminated['reason']})" if terminated.get("reason") not in (None, "Error") else ""
            return PodFailure(name, uid, "failure", code, f"pod {name}: container {container} exited {code}{detail}")
    if status.get("phase") == "Failed":
        why = f"{status.get('reason', 'Failed')}: {status.get('message', '')}".rstrip(": ")
        return PodFailure(name, uid, "failure", RETRYABLE, f"pod {name} failed ({why})")
    return None


def waiting(pod: dict, container: str) -> tuple[str, str] | None:
    """(reason, message) of a container that waits to start, or None."""
    state = (_container(pod, container).get("state") or {}).get("waiting")
    if not state or state.get("reason") in (None, "ContainerCreating", "PodInitializing"):
        return None
    return state["reason"], state.get("message", "")


def unschedulable(pod: dict) -> str | None:
    """The scheduler's message for a pod it cannot place, or None."""
    if (pod.get("status") or {}).get("phase") != "Pending":
        return None
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return cond.get("message") or cond.get("reason") or "unschedulable"
    return None


def scheduler_message(events: list[dict]) -> str | None:
    """The newest FailedScheduling event's message ("0/4 nodes are available: ...")."""
    failed = [e for e in events if e.get("reason") == "FailedScheduling"]
    if not failed:
        return None

    def when(e: dict) -> str:
        return e.get("lastTimestamp") or e.get("eventTime") or (e.get("metadata") or {}).get("creationTimestamp") or ""

    return max(failed, key=when).get("message")


def _rank(f: PodFailure) -> int:
    """Which failure explains a group best: a pod the others were stopped because of, not the others.
    A rank that exits 76 or by a signal was most likely stopped when the group was torn down; a hung
    group's peers on other nodes fail in their collectives because the watchdog killed it."""
    if f.cause == "fatal":
        return 0
    if f.hung:
        return 1
    if f.cause == "failure" and f.code != INTERRUPTED and 0 < f.code < 128:
        return 2
    return 3 if f.cause == "disruption" else 4


def most_telling(failures: list[PodFailure]) -> PodFailure:
    """The failure that explains the group's end best (the earliest of the best-ranked: min is stable)."""
    return min(failures, key=_rank)


def explain_end(failures: list[PodFailure], what: str, cond: dict | None) -> Outcome:
    """The outcome of a failed group: its most telling pod failure, else the group's own condition."""
    if failures:
        worst = most_telling(failures)
        return Outcome(worst.code, worst.cause, f"{what} failed: {worst.message}")
    why = f"{(cond or {}).get('reason', 'Failed')}: {(cond or {}).get('message', '')}".rstrip(": ")
    if disrupted_by_policy(cond):
        return Outcome(INTERRUPTED, "disruption", f"{what} failed ({why})")
    return Outcome(RETRYABLE, "failure", f"{what} failed ({why})")


def parse_indexes(text: str | None) -> list[int]:
    """Completion indexes as a Job's status lists them ("1,3-5" -> [1, 3, 4, 5]; completedIndexes, failedIndexes)."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def disrupted_by_policy(cond: dict | None) -> bool:
    """A Job ended by its pod failure policy's DisruptionTarget rule: the Job controller's own condition says a pod
    was disrupted ("Pod ns/p has condition DisruptionTarget matching FailJob rule at index 1"), also when that pod
    is already gone by the time the launcher looks (a lost node, or a launcher slow to poll)."""
    cond = cond or {}
    return cond.get("reason") == "PodFailurePolicy" and DISRUPTION_MESSAGE in (cond.get("message") or "")

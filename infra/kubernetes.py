"""The `kubernetes` compute backend: a training stage as a JobSet (or an Indexed Job and a headless Service),
a checkpoint's evaluation as a one-pod Job, launched and watched through the Kubernetes API.

Same interface as infra.local: `launch(module, args, *, log_dir, env)` returns a job with poll,
wait, cancel, tail, new_output, log_path and stopped. The job:

- creates the objects (infra/manifests.py), or re-attaches to the live group of the same run and
  stage that an earlier process created (a flow pod that was evicted and rescheduled must not start
  a second trainer beside the first);
- watches the group (a watch on the JobSet or Job, the pods and the scheduler's events) until it
  ends, and turns the end into an exit code and one line (infra/kube_outcome.py);
- streams pod 0's output into a local log file, whose lines the training task relays;
- deletes everything it created (foreground propagation) when cancelled or done.

The JobSet controller restarts the group by itself; with `api: indexed-job` this launcher deletes
and recreates the Job on a retryable failure, counting restarts the same way. Evictions restart
without counting against compute.kubernetes.max_restarts, up to compute.max_preemptions; past
that the job ends as preempted and reports the count in `preemptions`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from infra.config import ComputeConfig, KubernetesConfig
from infra.joblog import JobLog
from infra.kube_api import Kube, KubeError
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
    pod_failure,
    scheduler_message,
    unschedulable,
    waiting,
)
from infra.lifecycle import forget, launching
from infra.manifests import (
    COMPLETION_INDEX_ANNOTATION,
    EVAL_CONTAINER,
    JOB_DIR,
    JOB_FILE,
    LABEL_ATTEMPT,
    TRAIN_CONTAINER,
    Workload,
    eval_job,
    selector_string,
    stage_manifests,
)

PREFIX = "tessera.k8s:"  # the launcher's own lines in the job log


class KubernetesJob:
    """One launch: a group of objects in one namespace, watched by a thread until it ends."""

    watch_s = 2  # a watch request's length: how often pods and timeouts are looked at without a group event
    delete_wait_s = 120.0  # how long cancel waits for the pods of a deleted group to be gone

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
        self.cfg: KubernetesConfig = compute.kubernetes
        self.group = objects[-1]  # the JobSet or Job; ConfigMap and Service come first
        self.kind, self.name = self.group["kind"], self.group["metadata"]["name"]
        self.container, self.recreate = container, recreate
        self.log_path = log_path
        self.log_offset = log_path.stat().st_size if log_path.exists() else 0
        self.stopped = False
        self.preemptions = 0  # evictions this group restarted through (JobSet) or was recreated after (indexed job)
        self.restarts = 0  # restarts after application failures
        self.created = created  # False: re-attached to a group an earlier process created
        self._outcome: Outcome | None = None
        self._stop = threading.Event()
        self._ended = threading.Event()
        self._write_lock = threading.Lock()
        self._closed = False
        self._log = JobLog(log_path, self.log_offset)
        self._failures: dict[str, PodFailure] = {}  # by pod uid, in the order seen
        self._since: dict[tuple[str, str], float] = {}  # (pod uid, what) -> when first seen stuck
        self._restarts_seen: int | None = None
        self._watcher = threading.Thread(target=self._watch, name=f"k8s-watch-{self.name}", daemon=True)
        self._logger = threading.Thread(target=self._stream_pod0, name=f"k8s-log-{self.name}", daemon=True)

    def start(self) -> KubernetesJob:
        self._watcher.start()
        self._logger.start()
        return self

    # -- the job interface ---------------------------------------------------------------------------

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

    def new_output(self, max_bytes: int = 4 << 20) -> list[str]:
        """Complete lines of pod 0's output (and the launcher's own lines) since the last call."""
        return self._log.new_lines(max_bytes)

    def tail(self, lines: int = 1000, max_bytes: int = 1 << 20) -> str:
        """The end of this launch's log: by default all of a failed attempt's pod-0 output, within 1 MiB,
        and the failing pod's last lines, then the line that explains the end."""
        return self._log.tail(lines, max_bytes)

    def cancel(self, grace_s: float = 10.0) -> None:
        """Delete every object of the launch (foreground: the pods go first) and wait until they are gone."""
        self._stop.set()
        for obj in reversed(self.objects):  # the group first, so nothing recreates pods while the rest goes
            try:
                self.kube.delete(obj["kind"], obj["metadata"]["name"])
            except KubeError as exc:
                self._line(f"could not delete {obj['kind']} {obj['metadata']['name']}: {exc}")
        deadline = time.monotonic() + grace_s + self.delete_wait_s
        for obj in self.objects:
            while self.kube.get(obj["kind"], obj["metadata"]["name"]) is not None and time.monotonic() < deadline:
                time.sleep(0.5)
        if self._watcher.ident is not None:
            self._watcher.join(timeout=max(5.0, grace_s))
        if self._outcome is None:
            self._finish(Outcome(INTERRUPTED, "disruption", f"{self.kind} {self.name} was deleted by its launcher"))
        if self._logger.ident is not None:
            self._logger.join(timeout=5.0)
        forget(self)

    # -- watching ------------------------------------------------------------------------------------

    def _watch(self) -> None:
        try:
            outcome = self._watch_until_end()
        except KubeError as exc:
            outcome = Outcome(RETRYABLE, "failure", f"lost track of {self.kind} {self.name}: {exc}")
        if outcome is not None:
            self._finish(outcome)

    def _watch_until_end(self) -> Outcome | None:
        while not self._stop.is_set():
            for kind, obj in self.kube.watch(self.kind, self.name, self.watch_s):
                if self._stop.is_set():
                    return None
                if kind == "DELETED":
                    return self._gone()
                outcome = self._judge(obj)
                if outcome is not None:
                    return outcome
            if self._stop.is_set():
                return None
            obj = self.kube.get(self.kind, self.name)
            if obj is None:
                return self._gone()
            outcome = self._judge(obj)  # pods and timeouts change without an event on the group
            if outcome is not None:
                return outcome
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
        for pod in pods:
            uid = pod["metadata"].get("uid", pod["metadata"]["name"])
            name = pod["metadata"]["name"]
            failure = pod_failure(pod, self.container)
            if failure is not None and uid not in self._failures:
                self._failures[uid] = failure
                if failure.cause == "fatal":  # OOM or exit 78: a restart would fail the same way
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
            if message is not None and self._stuck(uid, "pending", now) > self.cfg.pending_timeout_s:
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
            last = list(self._failures.values())[-1].message if self._failures else "no pod failure was seen"
            self._line(
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
            return explain_end(self._attempt_failures(), self._what(), failed)
        if self.preemptions > self.compute.max_preemptions:
            return Outcome(
                INTERRUPTED,
                "disruption",
                f"{self._what()}: restarts exhausted on evictions "
                f"({self.preemptions} > compute.max_preemptions={self.compute.max_preemptions})",
            )
        suspended = condition(js, "Suspended")
        if suspended and self._stuck(self.name, "suspended", now) > self.cfg.pending_timeout_s:
            queue = f" in queue {self.cfg.queue_name}" if self.cfg.queue_name else ""
            return Outcome(
                FATAL,
                "fatal",
                f"{self._what()} suspended for {self.cfg.pending_timeout_s:.0f}s, not "
                f"admitted{queue}: {suspended.get('message', '')}".rstrip(": "),
            )
        if not suspended:
            self._since.pop((self.name, "suspended"), None)
        return None

    def _judge_job(self, job: dict) -> Outcome | None:
        if condition(job, "Complete"):
            return Outcome(0, "done", f"{self._what()} completed")
        failed = condition(job, "Failed")
        if not failed:
            return None
        outcome = explain_end(self._attempt_failures(), self._what(), failed)
        if not self.recreate:
            return outcome
        if outcome.cause == "disruption" and self.preemptions < self.compute.max_preemptions:
            self.preemptions += 1
        elif outcome.cause == "failure" and self.restarts < self.cfg.max_restarts:
            self.restarts += 1
        else:
            if outcome.cause == "disruption":
                return Outcome(
                    outcome.code,
                    outcome.cause,
                    f"{outcome.message}; restarts exhausted on evictions "
                    f"(compute.max_preemptions={self.compute.max_preemptions})",
                )
            return outcome
        self._line(
            f"{outcome.message}; deleting and recreating the whole group (restart {self.restarts} of "
            f"max_restarts={self.cfg.max_restarts}, {self.preemptions} disruptions)"
        )
        self._recreate()
        return None

    def _recreate(self) -> None:
        """What BlockingRecreate does for a JobSet: every old pod is gone before the new group starts."""
        self.kube.delete(self.kind, self.name)
        deadline = time.monotonic() + self.delete_wait_s
        while self.kube.get(self.kind, self.name) is not None:
            if time.monotonic() > deadline or self._stop.is_set():
                raise KubeError(0, "", f"{self._what()} was not deleted within {self.delete_wait_s:.0f}s")
            time.sleep(0.5)
        self.kube.create(self.group)
        self._failures.clear()
        self._since.clear()

    def _finish(self, outcome: Outcome) -> None:
        self._ended.set()
        if self._logger.ident is not None and self._logger is not threading.current_thread():
            # pod 0's last lines before the explanation; a pod 0 still running has written all it had
            self._logger.join(timeout=2.0)
        if outcome.cause != "done":
            self._failing_pod_lines(outcome)
        with self._write_lock:
            self._closed = True
            self._write(f"{PREFIX} {outcome.message}\n".encode())
        self._outcome = outcome

    def _failing_pod_lines(self, outcome: Outcome) -> None:
        """The last lines of the pod that failed, when it is not pod 0 (whose output is already here)."""
        failures = [f for f in self._failures.values() if f.message in outcome.message]
        for failure in failures[:1]:
            if failure.pod == getattr(self, "_pod0_name", None):
                continue
            try:
                text = self.kube.log_tail(failure.pod, self.container, 200)
            except KubeError:
                continue
            self._line(f"last lines of pod {failure.pod}:")
            with self._write_lock:
                self._write(text.encode() + (b"" if text.endswith("\n") else b"\n"))

    # -- pod 0's log ---------------------------------------------------------------------------------

    def _line(self, text: str) -> None:
        with self._write_lock:
            if not self._closed:
                self._write(f"{PREFIX} {text}\n".encode())

    def _write(self, data: bytes) -> None:
        with open(self.log_path, "ab") as f:
            f.write(data)

    def _pod0(self) -> dict | None:
        pods = [
            p
            for p in self._pods()
            if (p["metadata"].get("annotations") or {}).get(COMPLETION_INDEX_ANNOTATION, "0") == "0"
        ]
        started = [p for p in pods if (p.get("status") or {}).get("phase") in ("Running", "Succeeded", "Failed")]
        return max(started, key=lambda p: p["metadata"].get("creationTimestamp", ""), default=None)

    def _stream_pod0(self) -> None:
        written: dict[str, int] = {}  # pod uid -> bytes of its log already in the file
        done: set[str] = set()
        while True:
            ended = self._ended.is_set()
            try:
                pod = self._pod0()
            except KubeError:
                pod = None
            uid = pod["metadata"].get("uid", pod["metadata"]["name"]) if pod else None
            if pod is not None and uid not in done:
                name = pod["metadata"]["name"]
                if uid not in written:
                    written[uid] = 0
                    self._pod0_name = name
                    self._line(f"output of pod {name}:")
                skip = written[uid]
                try:
                    for chunk in self.kube.follow_log(name, self.container):
                        if skip:
                            dropped = min(skip, len(chunk))
                            chunk, skip = chunk[dropped:], skip - dropped
                        if chunk:
                            with self._write_lock:
                                if self._closed:
                                    return
                                self._write(chunk)
                            written[uid] += len(chunk)
                except (KubeError, OSError, ValueError):
                    pass  # the pod went away under the stream; the next round sees what replaced it
                phase = ((self.kube_get_pod(name) or {}).get("status") or {}).get("phase")
                if phase in (None, "Succeeded", "Failed"):
                    done.add(uid)
                continue
            if ended or self._stop.is_set():
                return
            time.sleep(0.5)

    def kube_get_pod(self, name: str) -> dict | None:
        pods = self.kube.list("Pod", field_selector=f"metadata.name={name}")
        return pods[0] if pods else None


def _option(args: Sequence[str], flag: str) -> str:
    try:
        return args[list(args).index(flag) + 1]
    except (ValueError, IndexError):
        raise ValueError(f"kubernetes backend: the command needs {flag} VALUE, got {' '.join(args)}") from None


def _with_option(args: Sequence[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


class KubernetesBackend:
    """Launches a training stage as a group of pods, and an evaluation as one pod, in compute.kubernetes.namespace."""

    def __init__(self, compute: ComputeConfig, kube: Kube | None = None):
        if compute.kubernetes is None:
            raise ValueError("compute.kubernetes: required with compute.backend: kubernetes")
        self.compute, self.cfg = compute, compute.kubernetes
        self._kube = kube
        self._next_attempt: dict[tuple, int] = {}

    @property
    def kube(self) -> Kube:
        if self._kube is None:
            self._kube = Kube(self.cfg.namespace)
        return self._kube

    def launch(
        self, module: str, args: Sequence[str], *, log_dir: Path, env: Mapping[str, str] | None = None
    ) -> KubernetesJob:
        """A training stage: `args` name the job file (--job, shipped as a ConfigMap) and the stage (--stage)."""
        job_json = Path(_option(args, "--job")).read_text()
        stage = int(_option(args, "--stage"))
        run = json.loads(job_json)["run_name"]
        pod_args = _with_option(args, "--job", f"{JOB_DIR}/{JOB_FILE}")

        def build(work: Workload) -> list[dict]:
            return stage_manifests(self.cfg, work, self.compute.ranks_per_node, module, pod_args, job_json, env or {})

        return self._start(
            Workload(run, "train", stage=stage), build, TRAIN_CONTAINER, log_dir, recreate=self.cfg.api == "indexed-job"
        )

    def launch_one(
        self,
        module: str,
        args: Sequence[str],
        *,
        run: str,
        tokens: int,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
    ) -> KubernetesJob:
        """One pod running `python -m module args` (a checkpoint's evaluation); no restarts of its own."""
        return self._start(
            Workload(run, "eval", tokens=tokens),
            lambda work: [eval_job(self.cfg, work, module, args, env or {})],
            EVAL_CONTAINER,
            log_dir,
            recreate=False,
        )

    def _start(self, unit: Workload, build, container: str, log_dir: Path, *, recreate: bool) -> KubernetesJob:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / ("pod0.log" if unit.component == "train" else "eval.log")
        kind = "JobSet" if unit.component == "train" and self.cfg.api == "jobset" else "Job"
        with launching() as live:
            found = self.kube.list(kind, selector_string(unit.selector()))
            attempts = [int(o["metadata"]["labels"].get(LABEL_ATTEMPT, 0)) for o in found]
            key = (unit.run, unit.component, unit.stage, unit.tokens)
            attempt = max([self._next_attempt.get(key, 0), *(a + 1 for a in attempts)])
            for obj in found:
                if _is_live(obj):  # re-attach: this run's stage is already training
                    work = Workload(**{**unit.__dict__, "attempt": int(obj["metadata"]["labels"][LABEL_ATTEMPT])})
                    job = KubernetesJob(
                        self.kube,
                        self.compute,
                        work,
                        build(work),
                        container,
                        log_path,
                        recreate=recreate,
                        created=False,
                    )
                    job._line(
                        f"re-attached to the live {kind} {obj['metadata']['name']} (attempt {work.attempt}) "
                        f"instead of creating another"
                    )
                    live.add(job)
                    self._next_attempt[key] = work.attempt + 1
                    return job.start()
            for obj in found:  # ended groups an earlier process left behind: never two groups of one stage
                _delete_group(self.kube, kind, obj["metadata"]["name"])
            work = Workload(**{**unit.__dict__, "attempt": attempt})
            self._next_attempt[key] = attempt + 1
            objects = build(work)
            job = KubernetesJob(
                self.kube, self.compute, work, objects, container, log_path, recreate=recreate, created=True
            )
            try:
                for obj in objects:
                    self.kube.create(obj)
            except KubeError as exc:
                if exc.status in (0, 429) or exc.status >= 500:
                    raise  # the API server is unwell: a retry of the task may find it well
                job._finish(Outcome(FATAL, "fatal", _refusal(obj, exc)))
                live.add(job)
                return job
            names = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in objects)
            job._line(f"created {names} in namespace {self.cfg.namespace}")
            live.add(job)
            return job.start()


def _is_live(obj: dict) -> bool:
    if (obj.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return not any(condition(obj, c) for c in ("Completed", "Complete", "Failed"))


def _delete_group(kube: Kube, kind: str, name: str) -> None:
    """Delete an ended group and the objects created beside it (same name), waiting until it is gone."""
    for each in (kind, "Service", "ConfigMap"):
        kube.delete(each, name)
    deadline = time.monotonic() + KubernetesJob.delete_wait_s
    while kube.get(kind, name) is not None and time.monotonic() < deadline:
        time.sleep(0.5)


def _refusal(obj: dict, exc: KubeError) -> str:
    """One line for a create the API server refused: an invalid spec, missing RBAC, a missing CRD."""
    what = f"{obj['kind']} {obj['metadata']['name']}"
    if exc.status == 404 and obj["kind"] == "JobSet":
        return (
            f"cannot create {what}: the JobSet API (jobset.x-k8s.io/v1alpha2) is not installed in this cluster; "
            f"install JobSet (docs/KUBERNETES.md) or set compute.kubernetes.api: indexed-job"
        )
    if exc.status == 403:
        return f"cannot create {what}: forbidden ({exc.message}); apply infra/k8s/rbac.yaml to the flow's account"
    return f"cannot create {what}: invalid spec: {exc.message}"

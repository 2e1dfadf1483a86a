"""The `kubernetes` compute backend: a training stage as a JobSet (or an Indexed Job and a headless Service),
a checkpoint's evaluation as a one-pod Job, the data's preparation as an Indexed Job of CPU pods (one
completion index per partition), launched through the Kubernetes API.

Same interface as infra.local: `launch(module, args, *, log_dir, env)` returns a job (infra/kube_job.py)
with poll, wait, cancel, tail, new_output, log_path and stopped. This module decides what a launch
does with the cluster as it finds it: it creates the objects (infra/manifests.py), or re-attaches to
the live group of the same run and stage that an earlier process created (a flow pod that was
evicted and rescheduled must not start a second trainer beside the first), and turns a create the
API server refuses into one line.

Once started, the job watches the group until it ends and turns the end into an exit code and one
line (infra/kube_watch.py, infra/kube_outcome.py), relays pod 0's output into a local log file whose
lines the training task relays (infra/kube_relay.py), and deletes everything it created (foreground
propagation) when cancelled or done (infra/kube_cleanup.py).

The JobSet controller restarts the group by itself; with `api: indexed-job` the job deletes and
recreates the Job on a retryable failure, counting restarts the same way. Evictions restart
without counting against compute.kubernetes.max_restarts, up to compute.max_preemptions; past
that the job ends as preempted and reports the count in `preemptions`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from infra.config import ComputeConfig
from infra.kube_api import Kube, KubeError
from infra.kube_cleanup import delete_ended_group
from infra.kube_job import KubernetesJob
from infra.kube_names import (
    EVAL_CONTAINER,
    LABEL_ATTEMPT,
    PREPARE_CONTAINER,
    TRAIN_CONTAINER,
    Workload,
    selector_string,
)
from infra.kube_outcome import FATAL, Outcome, condition
from infra.lifecycle import LaunchRefused, refuse_if_stopping, register
from infra.manifests import eval_job, stage_manifests
from infra.pod_spec import JOB_DIR, JOB_FILE, RankLaunch
from infra.prepare_job import prepare_job

log = logging.getLogger(__name__)


def _option(args: Sequence[str], flag: str) -> str:
    try:
        return args[list(args).index(flag) + 1]
    except (ValueError, IndexError):
        raise ValueError(f"kubernetes backend: the command needs {flag} VALUE, got {' '.join(args)}") from None


def _with_option(args: Sequence[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


# The local log file of each kind of launch, in its log_dir.
_LOG_NAMES = {"train": "pod0.log", "eval": "eval.log", "prepare": "prepare.log"}


class KubernetesBackend:
    """Launches a training stage as a group of pods, an evaluation as one pod, and a data preparation as an Indexed
    Job of CPU pods, in compute.kubernetes.namespace."""

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
        self,
        module: str,
        args: Sequence[str],
        *,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        warm: Sequence[str] = (),
    ) -> KubernetesJob:
        """A training stage: `args` name the job file (--job, shipped as a ConfigMap) and the stage (--stage); each
        pod's launcher restarts its ranks in place (compute.restarts_in_place), forked from `warm` modules."""
        launch = RankLaunch(self.compute.restarts_in_place, tuple(warm))
        job_json = Path(_option(args, "--job")).read_text()
        stage = int(_option(args, "--stage"))
        run = json.loads(job_json)["run_name"]
        pod_args = _with_option(args, "--job", f"{JOB_DIR}/{JOB_FILE}")

        def build(work: Workload) -> list[dict]:
            return stage_manifests(
                self.cfg, work, self.compute.ranks_per_node, module, pod_args, job_json, env or {}, launch
            )

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

    def launch_prepare(
        self,
        argv: Sequence[str],
        *,
        run: str,
        key: str,
        completions: int,
        fail_fast: bool,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
    ) -> KubernetesJob:
        """The partitions of the plan with content key `key` prepared by an Indexed Job (infra/prepare_job.py): pod
        i runs `argv` and reads its partition's number from JOB_COMPLETION_INDEX. The job ends when the Job does
        (0 once every index succeeded; a failed Job names its first failed index); a pod the Job controller retries
        does not end it. A live Job of the same run and key is re-attached to, never doubled."""
        return self._start(
            Workload(run, "prepare", key=key),
            lambda work: [
                prepare_job(
                    self.cfg, work, completions=completions, argv=list(argv), env=env or {}, fail_fast=fail_fast
                )
            ],
            PREPARE_CONTAINER,
            log_dir,
            recreate=False,
        )

    def _start(self, unit: Workload, build, container: str, log_dir: Path, *, recreate: bool) -> KubernetesJob:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / _LOG_NAMES[unit.component]
        kind = "JobSet" if unit.component == "train" and self.cfg.api == "jobset" else "Job"
        # The process-wide launch lock is not held across the API calls below (a list, deletes that wait up to
        # delete_wait_s, creates): a cancel must never wait behind a slow API server. It is taken to check
        # "stopping" here and to register the job at the end, where a cancel that came meanwhile is honoured.
        refuse_if_stopping()
        found = self.kube.list(kind, selector_string(unit.selector()))
        attempts = [int(o["metadata"]["labels"].get(LABEL_ATTEMPT, 0)) for o in found]
        key = (unit.run, unit.component, unit.stage, unit.tokens, unit.key)
        attempt = max([self._next_attempt.get(key, 0), *(a + 1 for a in attempts)])
        for obj in found:
            if _is_live(obj):  # re-attach: this run's stage is already training
                work = Workload(**{**unit.__dict__, "attempt": int(obj["metadata"]["labels"][LABEL_ATTEMPT])})
                job = KubernetesJob(
                    self.kube, self.compute, work, build(work), container, log_path, recreate=recreate, created=False
                )
                job.note(
                    f"re-attached to the live {kind} {obj['metadata']['name']} (attempt {work.attempt}) "
                    f"instead of creating another"
                )
                self._next_attempt[key] = work.attempt + 1
                # the launch that lost track of this group hands it over to this one
                return self._registered(job, replaces=_lost_launch_of(job.name)).start()
        for obj in found:  # ended groups an earlier process left behind: never two groups of one stage
            delete_ended_group(self.kube, kind, obj["metadata"]["name"], KubernetesJob.delete_wait_s)
        work = Workload(**{**unit.__dict__, "attempt": attempt})
        self._next_attempt[key] = attempt + 1
        objects = build(work)
        job = KubernetesJob(
            self.kube, self.compute, work, objects, container, log_path, recreate=recreate, created=True
        )
        try:
            for obj in objects:
                group = self.kube.create(obj)  # the group is created last
        except KubeError as exc:
            if exc.transient:
                raise  # the API server is unwell: a retry of the task may find it well (and re-attach)
            job.end(Outcome(FATAL, "fatal", _refusal(obj, exc)))
            return self._registered(job)
        self._own(objects[:-1], group)
        names = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in objects)
        job.note(f"created {names} in namespace {self.cfg.namespace}")
        return self._registered(job).start()

    def _registered(self, job: KubernetesJob, replaces=None) -> KubernetesJob:
        if not register(job, replaces):  # cancel_all came while this launch talked to the API
            job.stopped = True
            if job.created:
                job.cancel(grace_s=0)
            raise LaunchRefused(f"not launching {job.kind} {job.name}: this process is stopping its jobs")
        return job

    def _own(self, objects: list[dict], group: dict) -> None:
        """The group owns the objects created beside it (ConfigMap, Service, NetworkPolicy): should the launcher
        die before it deletes them, Kubernetes' garbage collector removes them with the group."""
        owner = {
            "apiVersion": group.get("apiVersion", ""),
            "kind": group["kind"],
            "name": group["metadata"]["name"],
            "uid": group["metadata"]["uid"],
            "blockOwnerDeletion": False,
        }
        for obj in objects:
            try:
                self.kube.patch(obj["kind"], obj["metadata"]["name"], {"metadata": {"ownerReferences": [owner]}})
            except KubeError as exc:
                if exc.transient:
                    raise
                # a safety net only (the launcher deletes them itself): an account without `patch` still trains
                log.warning("could not make %s %s owned by its group: %s", obj["kind"], obj["metadata"]["name"], exc)


def _lost_launch_of(name: str):
    return lambda j: getattr(j, "lost", False) and getattr(j, "name", None) == name


def _is_live(obj: dict) -> bool:
    if (obj.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return not any(condition(obj, c) for c in ("Completed", "Complete", "Failed"))


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

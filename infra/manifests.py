"""Kubernetes objects of one training stage (a JobSet, or an Indexed Job and a headless Service) and of
one checkpoint's evaluation (a one-pod Job), as plain dicts in the API's own JSON shape.

Pure functions of the recipe's `compute.kubernetes` section and a Workload: the launcher creates
them, `tessera k8s render` prints them, and the schema tests validate them.

Names are deterministic from (run, stage, attempt) so that a relaunched flow finds the group it
already created; every object carries the run, stage and attempt as labels.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from infra.config import KubernetesConfig
from trainers.contract import CACHE_DIR_ENV as CACHE_ENV
from trainers.contract import FATAL as FATAL_EXIT
from trainers.contract import MASTER_ADDR_ENV
from trainers.contract import SUPERVISOR_PID_ENV as SUPERVISOR_ENV

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
REPLICATED_JOB = "node"  # the one replicated job of a training JobSet: one Indexed Job of N pods

# Where things are inside a pod. CODE_DIR is the image's WORKDIR (infra/Dockerfile).
CODE_DIR = "/opt/tessera"
JOB_DIR = "/etc/tessera/job"
JOB_FILE = "job.json"
WORK_DIR = "/var/tessera/work"
POD_SAVE_FOLDER = f"{WORK_DIR}/checkpoints"
CACHE_DIR = "/var/cache/tessera"
TRAIN_CONTAINER, EVAL_CONTAINER = "trainer", "evaluator"

LABEL_NAME, LABEL_COMPONENT, LABEL_MANAGED_BY = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
)
LABEL_RUN, LABEL_STAGE, LABEL_ATTEMPT = "tessera.dev/run", "tessera.dev/stage", "tessera.dev/attempt"
ANNOTATION_RUN = "tessera.dev/run-name"  # the run name as written (a label value may be a slug of it)
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"

# What the Job controller writes into a Job's failure message when a pod failure policy rule fires
# (pkg/controller/job/pod_failure_policy.go); the JobSet rules below match on it.
FATAL_MESSAGE = f"failed with exit code {FATAL_EXIT} matching FailJob rule"
DISRUPTION_MESSAGE = "has condition DisruptionTarget matching FailJob rule"

_SLUG_MAX = 20
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _digest(text: str, n: int = 6) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def slug(run: str) -> str:
    """A DNS-label-safe, bounded form of a run name; a hash suffix keeps distinct names distinct."""
    plain = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", run.lower())).strip("-")
    if plain == run and len(plain) <= _SLUG_MAX:
        return plain
    return f"{plain[: _SLUG_MAX - 7].rstrip('-')}-{_digest(run)}".lstrip("-")


def label_value(text: str) -> str:
    return text if len(text) <= 63 and _LABEL_VALUE.match(text) else slug(text)


@dataclass(frozen=True)
class Workload:
    """Which unit of work a group of objects runs: stage `stage` of `run`, or the evaluation of one checkpoint."""

    run: str
    component: Literal["train", "eval"]
    stage: int = 0  # train: the 0-based stage index
    tokens: int = 0  # eval: the checkpoint's tokens
    attempt: int = 0  # launches of this unit so far (a relaunch after a preemption is the next)

    @property
    def name(self) -> str:
        unit = f"s{self.stage}" if self.component == "train" else f"e{self.tokens}"
        return f"tessera-{slug(self.run)}-{unit}-a{self.attempt}"

    def selector(self, with_attempt: bool = False) -> dict[str, str]:
        """Labels every object of this unit carries (with_attempt: of this very launch)."""
        unit = str(self.stage) if self.component == "train" else f"tok-{self.tokens}"
        labels = {
            LABEL_NAME: "tessera",
            LABEL_COMPONENT: self.component,
            LABEL_RUN: label_value(self.run),
            LABEL_STAGE: unit,
        }
        if with_attempt:
            labels[LABEL_ATTEMPT] = str(self.attempt)
        return labels

    @property
    def labels(self) -> dict[str, str]:
        return {**self.selector(with_attempt=True), LABEL_MANAGED_BY: "tessera"}


def selector_string(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


@dataclass(frozen=True)
class PodCommand:
    """What runs in a pod: the command line, plus the plain environment the caller adds."""

    argv: list[str]
    env: Mapping[str, str] = field(default_factory=dict)


def pod0_address(cfg: KubernetesConfig, work: Workload) -> str:
    """Stable DNS name of the pod with completion index 0 (the rendezvous host).

    JobSet: `<jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>`, subdomain defaulting to
    the JobSet's name. Indexed Job: `<job>-<index>.<service>`, the pod's hostname and subdomain.
    """
    if cfg.api == "jobset":
        return f"{work.name}-{REPLICATED_JOB}-0-0.{work.name}"
    return f"{work.name}-0.{work.name}"


def train_command(cfg: KubernetesConfig, ranks_per_node: int, module: str, args: Sequence[str]) -> list[str]:
    """Composer's launcher on one node, behind infra.pod_launch (which reports the first failing rank's code).

    `$(VAR)` is expanded by the kubelet from the container's environment: JOB_COMPLETION_INDEX is
    added to every container of an Indexed Job by the Job controller.
    """
    return [
        "python",
        "-m",
        "infra.pod_launch",
        "composer",
        "-n",
        str(ranks_per_node),
        "--world_size",
        str(cfg.nodes * ranks_per_node),
        "--node_rank",
        "$(JOB_COMPLETION_INDEX)",
        "--master_addr",
        f"$({MASTER_ADDR_ENV})",
        "--master_port",
        str(cfg.master_port),
        "-m",
        module,
        *args,
    ]


def _env(cfg: KubernetesConfig, extra: Mapping[str, str]) -> tuple[list[dict], list[dict]]:
    """(env, envFrom): plain values first, then credentials by reference only."""
    plain = {"PYTHONUNBUFFERED": "1", **cfg.env, **{k: v for k, v in extra.items() if k != SUPERVISOR_ENV}}
    if cfg.cache is not None:
        plain.setdefault(CACHE_ENV, CACHE_DIR)
    env = [{"name": k, "value": v} for k, v in plain.items()]
    env_from = []
    for ref in (cfg.s3_credentials, cfg.mlflow_credentials):
        if ref is None:
            continue
        if ref.keys:
            env += [
                {"name": var, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": key}}}
                for var, key in ref.keys.items()
            ]
        else:
            env_from.append({"secretRef": {"name": ref.name}})
    return env, env_from


def _resources(cfg: KubernetesConfig, gpus: int, cpu: str | None, memory: str | None) -> dict:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if cpu:
        requests["cpu"] = cpu
    if memory:
        requests["memory"] = limits["memory"] = memory
    if gpus:
        limits[cfg.gpu_resource] = str(gpus)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def pod_spec(
    cfg: KubernetesConfig,
    *,
    container: str,
    command: PodCommand,
    gpus: int,
    cpu: str | None,
    memory: str | None,
    job_config_map: str | None = None,
    subdomain: str | None = None,
    ports: Sequence[int] = (),
) -> dict:
    """A pod that runs `command` as a non-root user with nothing it does not need."""
    env, env_from = _env(cfg, command.env)
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "scratch", "mountPath": WORK_DIR}]
    volumes: list[dict] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.shm_size}},
        {"name": "scratch", "emptyDir": {"sizeLimit": cfg.scratch_size}},
    ]
    if job_config_map:
        mounts.append({"name": "job", "mountPath": JOB_DIR, "readOnly": True})
        volumes.append({"name": "job", "configMap": {"name": job_config_map}})
    if cfg.cache is not None:
        mounts.append({"name": "cache", "mountPath": CACHE_DIR})
        volumes.append(
            {"name": "cache", "persistentVolumeClaim": {"claimName": cfg.cache.claim_name}}
            if cfg.cache.claim_name
            else {"name": "cache", "emptyDir": {"sizeLimit": cfg.cache.size}}
        )
    main = {
        "name": container,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "workingDir": CODE_DIR,
        "command": command.argv,
        "env": env,
        "resources": _resources(cfg, gpus, cpu, memory),
        "volumeMounts": mounts,
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if env_from:
        main["envFrom"] = env_from
    if ports:
        main["ports"] = [{"name": "rendezvous", "containerPort": p, "protocol": "TCP"} for p in ports]
    spec: dict = {
        "restartPolicy": "Never",  # the Job (and JobSet) decide about restarts, as a group
        # The trainer never talks to the API server; the flow pod does, with its own account.
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [main],
        "volumes": volumes,
    }
    optional = {
        "subdomain": subdomain,
        "nodeSelector": dict(cfg.node_selector) or None,
        "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in cfg.tolerations] or None,
        "affinity": cfg.affinity.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
        if cfg.affinity
        else None,
        "priorityClassName": cfg.priority_class_name,
        "serviceAccountName": cfg.service_account_name,
        "imagePullSecrets": [{"name": n} for n in cfg.image_pull_secrets] or None,
    }
    spec.update({k: v for k, v in optional.items() if v})
    return spec


def _pod_failure_policy(container: str) -> dict:
    """Fail the Job at once on the fatal exit code and on a disruption, so the group's owner decides
    (with the Job's failure message naming which) instead of the Job replacing one pod of a gang."""
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": container, "operator": "In", "values": [FATAL_EXIT]},
            },
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }


def _metadata(cfg: KubernetesConfig, work: Workload, name: str | None = None, queue: bool = False) -> dict:
    labels = dict(work.labels)
    if queue and cfg.queue_name:
        labels[KUEUE_QUEUE_LABEL] = cfg.queue_name
    return {
        "name": name or work.name,
        "namespace": cfg.namespace,
        "labels": labels,
        "annotations": {ANNOTATION_RUN: work.run},
    }


def _indexed_job_spec(
    cfg: KubernetesConfig, work: Workload, command: PodCommand, ranks_per_node: int, subdomain: str | None
) -> dict:
    return {
        "completionMode": "Indexed",
        "completions": cfg.nodes,
        "parallelism": cfg.nodes,
        "backoffLimit": 0,  # one failed pod fails the group: ranks of a collective cannot be replaced one by one
        "podFailurePolicy": _pod_failure_policy(TRAIN_CONTAINER),
        "template": {
            "metadata": {"labels": dict(work.labels), "annotations": {ANNOTATION_RUN: work.run}},
            "spec": pod_spec(
                cfg,
                container=TRAIN_CONTAINER,
                command=command,
                gpus=cfg.gpus_per_node,
                cpu=cfg.cpu,
                memory=cfg.memory,
                job_config_map=work.name,
                subdomain=subdomain,
                ports=[cfg.master_port],
            ),
        },
    }


def _train_command(
    cfg: KubernetesConfig, work: Workload, ranks_per_node: int, module: str, args: Sequence[str], env: Mapping[str, str]
) -> PodCommand:
    return PodCommand(
        train_command(cfg, ranks_per_node, module, args), {MASTER_ADDR_ENV: pod0_address(cfg, work), **env}
    )


def job_config_map(cfg: KubernetesConfig, work: Workload, job_json: str) -> dict:
    """The trainer's job file, mounted read-only at JOB_DIR/JOB_FILE in every pod of the group."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(cfg, work), "data": {JOB_FILE: job_json}}


def jobset(
    cfg: KubernetesConfig,
    work: Workload,
    ranks_per_node: int,
    module: str,
    args: Sequence[str],
    env: Mapping[str, str] = {},
) -> dict:
    """One replicated job `node` (an Indexed Job of `nodes` pods), restarted as a whole group."""
    command = _train_command(cfg, work, ranks_per_node, module, args, env)
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": _metadata(cfg, work, queue=True),
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "successPolicy": {"operator": "All"},
            "failurePolicy": {
                "maxRestarts": cfg.max_restarts,
                # every pod of the old group is gone before the new group starts: no stale rank joins
                "restartStrategy": "BlockingRecreate",
                "rules": [
                    {
                        "name": "FatalExitCode",
                        "action": "FailJobSet",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                        "onJobFailureMessagePatterns": [FATAL_MESSAGE],
                    },
                    {
                        "name": "Disruption",
                        "action": "RestartJobSetAndIgnoreMaxRestarts",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                        "onJobFailureMessagePatterns": [DISRUPTION_MESSAGE],
                    },
                ],  # anything else: RestartJobSet, counted against maxRestarts
            },
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {
                        "metadata": {"labels": dict(work.labels)},
                        "spec": _indexed_job_spec(cfg, work, command, ranks_per_node, subdomain=None),
                    },
                }
            ],
        },
    }


def indexed_job(
    cfg: KubernetesConfig,
    work: Workload,
    ranks_per_node: int,
    module: str,
    args: Sequence[str],
    env: Mapping[str, str] = {},
) -> dict:
    """The fallback without operators: an Indexed Job whose pods find pod 0 through headless_service."""
    command = _train_command(cfg, work, ranks_per_node, module, args, env)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(cfg, work, queue=True),
        "spec": _indexed_job_spec(cfg, work, command, ranks_per_node, subdomain=work.name),
    }


def headless_service(cfg: KubernetesConfig, work: Workload) -> dict:
    """Gives each pod of the Indexed Job a DNS name (`<job>-<index>.<service>`), published before it is
    ready: the rendezvous happens before any readiness could be reported."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(cfg, work),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": work.selector(with_attempt=True),
            "ports": [{"name": "rendezvous", "port": cfg.master_port, "targetPort": cfg.master_port}],
        },
    }


def eval_job(
    cfg: KubernetesConfig, work: Workload, module: str, args: Sequence[str], env: Mapping[str, str] = {}
) -> dict:
    """One pod that scores one checkpoint; Prefect's task retries are its restarts."""
    command = PodCommand(["python", "-m", module, *args], env)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(cfg, work, queue=True),
        "spec": {
            "completions": 1,
            "parallelism": 1,
            "backoffLimit": 0,
            "podFailurePolicy": _pod_failure_policy(EVAL_CONTAINER),
            "template": {
                "metadata": {"labels": dict(work.labels), "annotations": {ANNOTATION_RUN: work.run}},
                "spec": pod_spec(
                    cfg,
                    container=EVAL_CONTAINER,
                    command=command,
                    gpus=cfg.eval_gpus,
                    cpu=cfg.eval_cpu,
                    memory=cfg.eval_memory,
                ),
            },
        },
    }


def pod_job_file(job_json: str, cfg: KubernetesConfig) -> str:
    """The trainer's job as the pod sees it: checkpoints in the pod's scratch volume (mirrored to s3 by
    the trainer), everything else as the flow wrote it, except that a cache emptyDir bounds Streaming's
    cache when the recipe did not: past its sizeLimit the kubelet evicts the pod, so the trainer keeps
    to 90% of it."""
    job = json.loads(job_json)
    job["save_folder"] = POD_SAVE_FOLDER
    if cfg.cache is not None and cfg.cache.claim_name is None and job["train"].get("stream_cache_limit") is None:
        from kubernetes.utils import parse_quantity  # "500Gi", "1.5T" -> bytes, as the API server reads them

        job["train"]["stream_cache_limit"] = str(int(parse_quantity(cfg.cache.size)) * 9 // 10)
    return json.dumps(job, indent=2)


def stage_manifests(
    cfg: KubernetesConfig,
    work: Workload,
    ranks_per_node: int,
    module: str,
    args: Sequence[str],
    job_json: str,
    env: Mapping[str, str] = {},
) -> list[dict]:
    """Every object of one training launch, in creation order."""
    config_map = job_config_map(cfg, work, pod_job_file(job_json, cfg))
    if cfg.api == "jobset":
        return [config_map, jobset(cfg, work, ranks_per_node, module, args, env)]
    return [config_map, headless_service(cfg, work), indexed_job(cfg, work, ranks_per_node, module, args, env)]

"""Kubernetes objects of one training stage (a JobSet, or an Indexed Job and a headless Service) and of
one checkpoint's evaluation (a one-pod Job), as plain dicts in the API's own JSON shape.

Pure functions of the recipe's `compute.kubernetes` section and a Workload: the launcher creates
them, `tessera k8s render` prints them, and the schema tests validate them. This module answers how
a group is shaped and restarted (failure policies, the rendezvous DNS, the job file it mounts); the
pod inside each group comes from infra/pod_spec.py, and every name and label from infra/kube_names.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from infra.config import KubernetesConfig
from infra.kube_names import (
    ANNOTATION_RUN,
    EVAL_CONTAINER,
    JOBSET_GROUP,
    JOBSET_VERSION,
    KUEUE_QUEUE_LABEL,
    REPLICATED_JOB,
    TRAIN_CONTAINER,
    Workload,
    pod0_address,
)
from infra.pod_spec import JOB_FILE, POD_SAVE_FOLDER, PodCommand, RankLaunch, pod_spec, train_command
from trainers.contract import FATAL as FATAL_EXIT
from trainers.contract import HUNG as HUNG_EXIT
from trainers.contract import MASTER_ADDR_ENV

# What the Job controller writes into a Job's failure message when a pod failure policy rule fires
# (pkg/controller/job/pod_failure_policy.go); the JobSet rules below match on it.
FATAL_MESSAGE = f"failed with exit code {FATAL_EXIT} matching FailJob rule"
DISRUPTION_MESSAGE = "has condition DisruptionTarget matching FailJob rule"
HUNG_MESSAGE = f"failed with exit code {HUNG_EXIT} matching FailJob rule"


def _pod_failure_policy(container: str) -> dict:
    """Fail the Job at once on the fatal exit code, on a hang the pod's watchdog killed and on a disruption, so
    the group's owner decides (with the Job's failure message naming which) instead of the Job replacing one pod
    of a gang."""
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": container, "operator": "In", "values": [FATAL_EXIT]},
            },
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": container, "operator": "In", "values": [HUNG_EXIT]},
            },
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }


def object_metadata(cfg: KubernetesConfig, work: Workload, name: str | None = None, queue: bool = False) -> dict:
    """An object's name, namespace, labels (with `queue`, Kueue's queue label: set on the group Kueue admits) and
    the run name as written."""
    labels = dict(work.labels)
    if queue and cfg.queue_name:
        labels[KUEUE_QUEUE_LABEL] = cfg.queue_name
    return {
        "name": name or work.name,
        "namespace": cfg.namespace,
        "labels": labels,
        "annotations": {ANNOTATION_RUN: work.run},
    }


def _job_spec(work: Workload, container: str, pods: int, pod: dict) -> dict:
    """An Indexed-or-not Job's spec: `pods` pods that all must succeed, none replaced one by one (a failed
    rank fails the group; an evaluation is retried by its Prefect task), and the pod template."""
    return {
        "completions": pods,
        "parallelism": pods,
        "backoffLimit": 0,  # one failed pod fails the group: ranks of a collective cannot be replaced one by one
        "podFailurePolicy": _pod_failure_policy(container),
        "template": {"metadata": {"labels": dict(work.labels), "annotations": {ANNOTATION_RUN: work.run}}, "spec": pod},
    }


def _indexed_job_spec(
    cfg: KubernetesConfig, work: Workload, command: PodCommand, ranks_per_node: int, subdomain: str | None
) -> dict:
    pod = pod_spec(
        cfg,
        container=TRAIN_CONTAINER,
        command=command,
        gpus=cfg.gpus_per_node,
        cpu=cfg.cpu,
        memory=cfg.memory,
        job_config_map=work.name,
        subdomain=subdomain,
        ports=[cfg.master_port],
    )
    return {"completionMode": "Indexed", **_job_spec(work, TRAIN_CONTAINER, cfg.nodes, pod)}


def _train_command(
    cfg: KubernetesConfig,
    work: Workload,
    ranks_per_node: int,
    module: str,
    args: Sequence[str],
    env: Mapping[str, str],
    launch: RankLaunch,
) -> PodCommand:
    return PodCommand(
        train_command(cfg, ranks_per_node, module, args, launch), {MASTER_ADDR_ENV: pod0_address(cfg, work), **env}
    )


def network_policy(cfg: KubernetesConfig, work: Workload) -> dict:
    """Only the group's own pods may reach its pods: rank 0's rendezvous store, and the ranks' collectives.

    The store (trainers/rendezvous.py) hands out the launch's start plan and the collectives carry
    the weights; nothing else in the cluster needs to reach a training pod. Enforced by the
    cluster's network plugin (Calico, Cilium, ...); one without NetworkPolicy support ignores it.
    """
    group = {"matchLabels": work.selector(with_attempt=True)}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_metadata(cfg, work),
        "spec": {"podSelector": group, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": group}]}]},
    }


def job_config_map(cfg: KubernetesConfig, work: Workload, job_json: str) -> dict:
    """The trainer's job file, mounted read-only at JOB_DIR/JOB_FILE in every pod of the group."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_metadata(cfg, work),
        "data": {JOB_FILE: job_json},
    }


def jobset(
    cfg: KubernetesConfig,
    work: Workload,
    ranks_per_node: int,
    module: str,
    args: Sequence[str],
    env: Mapping[str, str] = {},
    launch: RankLaunch = RankLaunch(),
) -> dict:
    """One replicated job `node` (an Indexed Job of `nodes` pods), restarted as a whole group."""
    command = _train_command(cfg, work, ranks_per_node, module, args, env, launch)
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": object_metadata(cfg, work, queue=True),
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
                    {
                        # the pod's watchdog killed a hung group: the node's or the network's fault, not the job's
                        "name": "Hang",
                        "action": "RestartJobSetAndIgnoreMaxRestarts",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                        "onJobFailureMessagePatterns": [HUNG_MESSAGE],
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
    launch: RankLaunch = RankLaunch(),
) -> dict:
    """The fallback without operators: an Indexed Job whose pods find pod 0 through headless_service."""
    command = _train_command(cfg, work, ranks_per_node, module, args, env, launch)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": object_metadata(cfg, work, queue=True),
        "spec": _indexed_job_spec(cfg, work, command, ranks_per_node, subdomain=work.name),
    }


def headless_service(cfg: KubernetesConfig, work: Workload) -> dict:
    """Gives each pod of the Indexed Job a DNS name (`<job>-<index>.<service>`), published before it is
    ready: the rendezvous happens before any readiness could be reported."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(cfg, work),
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
    pod = pod_spec(
        cfg, container=EVAL_CONTAINER, command=command, gpus=cfg.eval_gpus, cpu=cfg.eval_cpu, memory=cfg.eval_memory
    )
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": object_metadata(cfg, work, queue=True),
        "spec": _job_spec(work, EVAL_CONTAINER, 1, pod),
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
    launch: RankLaunch = RankLaunch(),
) -> list[dict]:
    """Every object of one training launch, in creation order: the policy first, so no pod is ever reachable
    from outside its group, the group last."""
    config_map = job_config_map(cfg, work, pod_job_file(job_json, cfg))
    fenced = [network_policy(cfg, work), config_map]
    if cfg.api == "jobset":
        return [*fenced, jobset(cfg, work, ranks_per_node, module, args, env, launch)]
    return [*fenced, headless_service(cfg, work), indexed_job(cfg, work, ranks_per_node, module, args, env, launch)]

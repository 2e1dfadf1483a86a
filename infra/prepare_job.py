"""The Kubernetes Job that prepares a recipe's data: one Indexed Job of CPU pods, one completion index per
partition to prepare (compute.kubernetes.prepare), as the API's JSON.

Each pod runs the command the data side gives (`python -m tasks.data.pod PLAN_URI`), which reads its
partition's number from JOB_COMPLETION_INDEX (set by the Job controller in every pod of an Indexed Job).
Unlike a training group, the pods are independent: the Job controller replaces a failed pod of one index
on its own (backoffLimitPerIndex) while the others go on, so the launcher (infra/kube_watch.py) waits for
the Job's own end rather than the first pod failure. The failure policy:

- a pod with a `DisruptionTarget` condition (evicted, preempted, its node drained) is ignored: the
  controller replaces it without spending the index's budget;
- exit 78 (trainers.contract.FATAL: bad input, or a refusal) fails the whole Job at once: another try would
  read the same bytes;
- with `fail_fast` (the recipe's sources are in on_error: fail mode) `maxFailedIndexes: 0` ends the Job once
  one index has spent its budget; without it, the other indexes go on and a rerun does the rest.

The pod is infra/pod_spec.py's, on a variant of the section that carries the prepare pods' own placement
(CPU nodes), resources and scratch volume, and no GPU, cache or training affinity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from infra.config import KubernetesConfig
from infra.kube_names import ANNOTATION_RUN, PREPARE_CONTAINER, Workload
from infra.manifests import object_metadata
from infra.pod_spec import WORK_DIR, PodCommand, pod_spec
from trainers.contract import FATAL as FATAL_EXIT

# The tokenizer processes a prepare pod runs (compute.kubernetes.prepare.worker_count); the pod reads it.
WORKERS_ENV = "TESSERA_PREPARE_WORKERS"


def prepare_pod_config(cfg: KubernetesConfig) -> KubernetesConfig:
    """The section as a prepare pod sees it: its own node selector, tolerations, priority and scratch size; none of
    the training pods' GPU-node affinity, slow-node avoidance or shard cache (a claim there could even be held by
    a training pod). /dev/shm is bounded by the pod's memory, which limits what it may hold anyway."""
    prep = cfg.prepare
    return cfg.model_copy(
        update={
            "node_selector": dict(prep.node_selector),
            "tolerations": list(prep.tolerations),
            "affinity": None,
            "avoid_slow_nodes": False,
            "priority_class_name": prep.priority_class_name,
            "cache": None,
            "scratch_size": prep.scratch_size,
            "shm_size": prep.memory,
        }
    )


def prepare_failure_policy(container: str = PREPARE_CONTAINER) -> dict:
    """A disruption is no failure of the index; exit 78 is the whole Job's (module docstring)."""
    return {
        "rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": container, "operator": "In", "values": [FATAL_EXIT]},
            },
        ]
    }


def prepare_job(
    cfg: KubernetesConfig,
    work: Workload,
    *,
    completions: int,
    argv: Sequence[str],
    env: Mapping[str, str],
    fail_fast: bool,
) -> dict:
    """The Indexed Job of `completions` partitions, `cfg.prepare.pods` of them at a time.

    `backoffLimit` is left out on purpose: with backoffLimitPerIndex the API defaults it to the largest int32, so
    only the per-index budget counts; a value here would be one budget for all indexes together. restartPolicy is
    Never (pod_spec), which a pod failure policy and backoffLimitPerIndex both require."""
    if work.component != "prepare":
        raise ValueError(f"prepare_job: a prepare Workload is needed, got {work.component}")
    if completions < 1:
        raise ValueError(f"prepare_job: completions must be at least 1, got {completions}")
    prep = cfg.prepare
    # TMPDIR: a working copy made with tempfile lands on the scratch volume (scratch_size), not the node's root disk
    command = PodCommand(list(argv), {WORKERS_ENV: str(prep.worker_count), "TMPDIR": WORK_DIR, **env})
    pod = pod_spec(
        prepare_pod_config(cfg), container=PREPARE_CONTAINER, command=command, gpus=0, cpu=prep.cpu, memory=prep.memory
    )
    spec: dict = {
        "completionMode": "Indexed",
        "completions": completions,
        "parallelism": min(prep.pods, completions),
        "backoffLimitPerIndex": prep.backoff_limit_per_index,
    }
    if fail_fast:
        spec["maxFailedIndexes"] = 0  # the first index out of budget ends the Job: bad input ends the prepare
    spec["podFailurePolicy"] = prepare_failure_policy(PREPARE_CONTAINER)
    spec["template"] = {
        "metadata": {"labels": dict(work.labels), "annotations": {ANNOTATION_RUN: work.run}},
        "spec": pod,
    }
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": object_metadata(cfg, work, queue=True), "spec": spec}

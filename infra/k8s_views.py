"""What `tessera k8s render` and `tessera k8s status` print: the manifests of a stage or of a data preparation,
the live objects of a run."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from infra.config import ComputeConfig
from infra.kube_api import Kube
from infra.kube_names import (
    LABEL_ATTEMPT,
    LABEL_COMPONENT,
    LABEL_NAME,
    LABEL_RUN,
    LABEL_STAGE,
    Workload,
    label_value,
    selector_string,
)
from infra.kube_outcome import condition
from infra.manifests import stage_manifests
from infra.pod_spec import JOB_DIR, JOB_FILE, RankLaunch
from infra.prepare_job import prepare_job
from trainers.contract import WARM_MODULES


def render_stage(
    compute: ComputeConfig, job_file: Path, stage: int, attempt: int = 0, env: dict[str, str] | None = None
) -> str:
    """The objects a launch of stage `stage` creates, as multi-document YAML for review or `kubectl apply -f -`."""
    job_json = job_file.read_text()
    run = json.loads(job_json)["run_name"]
    work = Workload(run, "train", stage=stage, attempt=attempt)
    args = ["--job", f"{JOB_DIR}/{JOB_FILE}", "--stage", str(stage)]
    launch = RankLaunch(compute.restarts_in_place, WARM_MODULES)
    objects = stage_manifests(
        compute.kubernetes, work, compute.ranks_per_node, "trainers.train", args, job_json, env or {}, launch
    )
    return yaml.safe_dump_all(objects, sort_keys=False, width=120)


def render_prepare(
    compute: ComputeConfig,
    *,
    run: str,
    key: str,
    completions: int,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    fail_fast: bool,
    attempt: int = 0,
) -> str:
    """The Indexed Job a data preparation creates (plan key `key`, `completions` partitions), as YAML for review or
    `kubectl apply -f -`."""
    work = Workload(run, "prepare", key=key, attempt=attempt)
    job = prepare_job(
        compute.kubernetes, work, completions=completions, argv=list(argv), env=env or {}, fail_fast=fail_fast
    )
    return yaml.safe_dump_all([job], sort_keys=False, width=120)


def _state(kind: str, obj: dict) -> str:
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "Terminating"
    if kind == "Pod":
        for c in status.get("containerStatuses") or []:
            state = c.get("state") or {}
            if "waiting" in state and state["waiting"].get("reason") not in (None, "ContainerCreating"):
                return state["waiting"]["reason"]
            if "terminated" in state:
                return (
                    f"{status.get('phase')} (exit {state['terminated'].get('exitCode')}, "
                    f"{state['terminated'].get('reason', '')})"
                )
        return status.get("phase", "?")
    for ctype in ("Completed", "Complete", "Failed", "Suspended"):
        cond = condition(obj, ctype)
        if cond:
            return f"{ctype} ({cond.get('reason', '')})"
    if kind == "JobSet":
        return f"Running (restarts {status.get('restarts', 0)}, {status.get('restartsCountTowardsMax', 0)} counted)"
    if kind == "Job":
        return f"Running ({status.get('active', 0)} active, {status.get('failed', 0)} failed)"
    return "-"


def run_status(kube: Kube, run: str) -> str:
    """One line per live object tessera created for `run` in the namespace, groups first."""
    selector = selector_string({LABEL_NAME: "tessera", LABEL_RUN: label_value(run)})
    rows = [("KIND", "NAME", "COMPONENT", "STAGE", "ATTEMPT", "STATE", "CREATED")]
    for kind in ("JobSet", "Job", "Pod", "Service", "ConfigMap", "NetworkPolicy"):
        for obj in sorted(kube.list(kind, selector), key=lambda o: o["metadata"]["name"]):
            labels = obj["metadata"].get("labels") or {}
            rows.append(
                (
                    kind,
                    obj["metadata"]["name"],
                    labels.get(LABEL_COMPONENT, ""),
                    labels.get(LABEL_STAGE, ""),
                    labels.get(LABEL_ATTEMPT, ""),
                    _state(kind, obj),
                    obj["metadata"].get("creationTimestamp", ""),
                )
            )
    if len(rows) == 1:
        return f"no live objects of run {run} in namespace {kube.namespace}"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)

"""One pod of a launch, as the API's JSON: the command it runs, its environment (credentials by
reference only), resources, volumes and security settings, and where things are inside it.

Training pods and the evaluation pod differ only in command, container name and resources, so both
groups' manifests (infra/manifests.py) take their pod from here; what is set once per pod stays out
of the JobSet and Job rendering.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from infra.config import KubernetesConfig
from infra.kube_names import AVOID_LABEL
from trainers.contract import CACHE_DIR_ENV as CACHE_ENV
from trainers.contract import MASTER_ADDR_ENV, STORE_BIND_ENV
from trainers.contract import SUPERVISOR_PID_ENV as SUPERVISOR_ENV

# Where things are inside a pod. CODE_DIR is the image's WORKDIR (infra/Dockerfile).
CODE_DIR = "/opt/tessera"
JOB_DIR = "/etc/tessera/job"
JOB_FILE = "job.json"
WORK_DIR = "/var/tessera/work"
POD_SAVE_FOLDER = f"{WORK_DIR}/checkpoints"
CACHE_DIR = "/var/cache/tessera"


@dataclass(frozen=True)
class PodCommand:
    """What runs in a pod: the command line, plus the plain environment the caller adds."""

    argv: list[str]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RankLaunch:
    """How a pod's launcher starts its ranks: restarts in place it may make, and the modules its ranks' forkserver
    imports once (none: fresh interpreters)."""

    restarts_in_place: int = 0
    warm: tuple[str, ...] = ()


def train_command(
    cfg: KubernetesConfig, ranks_per_node: int, module: str, args: Sequence[str], launch: RankLaunch = RankLaunch()
) -> list[str]:
    """torch's elastic agent on one node (infra/launcher.py): `ranks_per_node` ranks, the nodes meeting at pod 0's
    rendezvous store on master_port, restarting in place together.

    `$(VAR)` is expanded by the kubelet from the container's environment: JOB_COMPLETION_INDEX is
    added to every container of an Indexed Job by the Job controller.
    """
    return [
        "python",
        "-m",
        "infra.launcher",
        "--nproc-per-node",
        str(ranks_per_node),
        "--nnodes",
        str(cfg.nodes),
        "--node-rank",
        "$(JOB_COMPLETION_INDEX)",
        "--rdzv-endpoint",
        f"$({MASTER_ADDR_ENV}):{cfg.master_port}",
        # this pod's IP (the downward API): names the node in the rendezvous, and pod 0's is where rank 0's
        # training store listens (trainers/rendezvous.py binds it there) for every pod to reach
        "--local-addr",
        f"$({STORE_BIND_ENV})",
        "--max-restarts",
        str(launch.restarts_in_place),
        "--log-dir",
        f"{WORK_DIR}/logs",
        *(["--warm", ",".join(launch.warm)] if launch.warm else ["--cold"]),
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
    for ref in (cfg.s3_credentials, cfg.mlflow_credentials, *cfg.secrets):
        if ref is None:
            continue
        if ref.key_map:
            env += [
                {"name": var, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": key}}}
                for var, key in ref.key_map.items()
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
    """A pod that runs `command` as a non-root user with nothing it does not need. A pod with `ports` hosts its
    group's rendezvous: its store listens on the pod's own IP only (trainers/rendezvous.py)."""
    env, env_from = _env(cfg, command.env)
    # The node a rank runs on, for heartbeats, the watchdog's and the slow-rank lines, and the preflight's figures.
    env.append({"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    if ports:
        env.append({"name": STORE_BIND_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
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
        "affinity": _affinity(cfg),
        "priorityClassName": cfg.priority_class_name,
        "serviceAccountName": cfg.service_account_name,
        "imagePullSecrets": [{"name": n} for n in cfg.image_pull_secrets] or None,
    }
    spec.update({k: v for k, v in optional.items() if v})
    return spec


def _affinity(cfg: KubernetesConfig) -> dict | None:
    """The recipe's affinity; with avoid_slow_nodes, also a required node without AVOID_LABEL, added to every
    required node selector term (the terms are ORed: each must keep off the node)."""
    affinity = cfg.affinity.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True) if cfg.affinity else {}
    if not cfg.avoid_slow_nodes:
        return affinity or None
    terms = (
        affinity.setdefault("nodeAffinity", {})
        .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
        .setdefault("nodeSelectorTerms", [])
    )
    if not terms:
        terms.append({})
    for term in terms:
        term.setdefault("matchExpressions", []).append({"key": AVOID_LABEL, "operator": "DoesNotExist"})
    return affinity

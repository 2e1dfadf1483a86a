"""The `compute` section of a recipe: where training jobs run."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationInfo, field_validator, model_validator

from infra.placement import Affinity, KubeModel, Toleration

# The backends this build can launch on; the Prefect form renders it as a dropdown.
Backend = Literal["local", "kubernetes"]

# A Kubernetes resource quantity (CPU "8", "500m"; memory "64Gi", "1.5G").
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
# Names of plain `env` entries that look like credentials: those go through a Secret, never a manifest or an
# MLflow param. Broad on purpose: a refused name costs a line in a Secret, a leaked key costs a rotation.
_SECRET_LIKE = re.compile(r"(KEY|AUTH|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|USERNAME|PRIVATE|COOKIE|SESSION)", re.I)
# A value that is a URL with a password in it (postgres://user:pass@host/db, https://user:token@host).
_URL_WITH_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:[^/@\s]+@")


class SecretRef(KubeModel):
    """Credentials held in a Kubernetes Secret of the job's namespace; manifests carry only its name."""

    name: str = Field(..., pattern=_DNS_SUBDOMAIN, description="The Secret's name.")
    # `keys` in a recipe; not the attribute's name, which would shadow what Mapping-like code calls (Prefect calls
    # .keys() on a task's pydantic parameters, and got this dict instead: every task given the config failed)
    key_map: dict[str, str] = Field(
        default_factory=dict,
        alias="keys",
        description="Environment variable -> key in the Secret (secretKeyRef each). Empty: every key of the Secret "
        "becomes a variable of the same name (envFrom).",
    )

    @field_validator("key_map")
    @classmethod
    def _env_names(cls, keys: dict[str, str]) -> dict[str, str]:
        bad = [k for k in keys if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
        if bad:
            raise ValueError(f"not environment variable names: {', '.join(bad)}")
        return keys


class CacheVolume(KubeModel):
    """A volume for Streaming's local shard cache, mounted at infra.pod_spec.CACHE_DIR."""

    size: str = Field("100Gi", pattern=_QUANTITY, description="Size limit of the emptyDir (ignored for a claim).")
    claim_name: str | None = Field(
        None,
        pattern=_DNS_SUBDOMAIN,
        description="An existing PersistentVolumeClaim to use instead of an emptyDir (kept across restarts; "
        "ReadWriteMany if several nodes share it).",
    )


# Multipliers of a CPU quantity's suffix (the decimal and binary SI suffixes a quantity may carry).
_CPU_SUFFIX = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_CPU_SUFFIX |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def cpu_cores(quantity: str) -> float:
    """A CPU quantity ("8", "500m", "1.5") in cores."""
    number, suffix = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity).groups()
    return float(number) * _CPU_SUFFIX[suffix]


class PrepareJobConfig(KubeModel):
    """`compute.kubernetes.prepare`: the CPU pods that tokenize a recipe's data, as one Indexed Job whose
    completion indexes are the partitions to prepare (docs/KUBERNETES.md, "Data preparation on the cluster").

    Nothing here is inherited from the training pods' placement: those ask for GPU nodes, and tokenizing asks for
    none. The image, namespace, credentials, env, service account and image pull secrets are the section's."""

    pods: PositiveInt = Field(
        8, description="Pods running at once (the Job's parallelism), capped at the number of partitions to prepare."
    )
    cpu: str = Field("8", pattern=_QUANTITY, description="CPU each prepare pod requests.")
    memory: str = Field("16Gi", pattern=_QUANTITY, description="Memory each prepare pod requests and is limited to.")
    workers: PositiveInt | None = Field(
        None,
        description="Tokenizer processes per pod; null: the pod's cpu request rounded down (at least 1). The pod "
        "gets it as TESSERA_PREPARE_WORKERS.",
    )
    scratch_size: str = Field(
        "50Gi", pattern=_QUANTITY, description="emptyDir for the pod's working copy of the partition it writes."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels a prepare pod requires (CPU nodes; not the training pods')."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the prepare pods tolerate (not the training pods')."
    )
    priority_class_name: str | None = Field(
        None, description="PriorityClass of the prepare pods; null: the cluster's default (not the training pods')."
    )
    backoff_limit_per_index: int = Field(
        3,
        ge=0,
        description="Failed pods of one partition the Job controller replaces before that partition counts as "
        "failed (the Job's backoffLimitPerIndex). Evictions and preemptions do not count.",
    )

    @property
    def worker_count(self) -> int:
        """Tokenizer processes per pod: `workers`, else the cpu request's whole cores (at least 1)."""
        return self.workers or max(1, int(cpu_cores(self.cpu)))


class KubernetesConfig(KubeModel):
    """`compute.kubernetes`: the pods a stage trains in, and how failures are handled (docs/KUBERNETES.md)."""

    image: str = Field(..., min_length=1, description="Training image built from infra/Dockerfile (tag or digest).")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="Kubelet image pull policy."
    )
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secrets for a private registry.")
    namespace: str = Field("default", pattern=_DNS_LABEL, description="Namespace of every object tessera creates.")
    api: Literal["jobset", "indexed-job"] = Field(
        "jobset",
        description="jobset: a JobSet (needs the JobSet controller), restarts done by the controller. indexed-job: "
        "an Indexed Job plus a headless Service, for clusters without operators; tessera deletes and recreates the "
        "group itself.",
    )
    nodes: PositiveInt = Field(1, description="Pods (one per node) the stage trains on.")
    gpus_per_node: int = Field(
        0, ge=0, description="GPUs each pod requests; one rank per GPU. 0: a CPU pod with compute.procs_per_node ranks."
    )
    gpu_resource: str = Field("nvidia.com/gpu", description="Extended resource name of a GPU.")
    cpu: str | None = Field(None, pattern=_QUANTITY, description="CPU each training pod requests, e.g. '64'.")
    memory: str | None = Field(
        None, pattern=_QUANTITY, description="Memory each training pod requests and is limited to."
    )
    shm_size: str = Field("64Gi", pattern=_QUANTITY, description="Size of the in-memory /dev/shm (dataloaders, NCCL).")
    scratch_size: str = Field(
        "200Gi", pattern=_QUANTITY, description="emptyDir for the trainer's local checkpoint working copy."
    )
    cache: CacheVolume | None = Field(None, description="Volume for Streaming's local cache; null: none mounted.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels a pod requires.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints the pods tolerate.")
    affinity: Affinity | None = Field(None, description="Node and pod (anti-)affinity.")
    priority_class_name: str | None = Field(None, description="PriorityClass of the pods (preemption order).")
    service_account_name: str | None = Field(None, description="Service account of the training and eval pods.")
    queue_name: str | None = Field(
        None,
        pattern=_DNS_SUBDOMAIN,
        description="Kueue LocalQueue: labels the JobSet kueue.x-k8s.io/queue-name, so Kueue admits the whole group "
        "at once (gang admission). Null: no Kueue.",
    )
    avoid_slow_nodes: bool = Field(
        False,
        description="Label the node of a rank the watchdog found hung, or that stayed slower than its peers, "
        "tessera.dev/avoid=true, and require training pods on nodes without that label, so the group's next restart "
        "lands elsewhere. Needs infra/k8s/rbac-nodes.yaml (nodes get, patch); never cordons.",
    )
    master_port: int = Field(29500, ge=1024, le=65535, description="Port of the rendezvous store on pod 0.")
    max_restarts: int = Field(
        3,
        ge=0,
        description="Whole-group restarts in the cluster after an application failure (JobSet "
        "failurePolicy.maxRestarts; the indexed-job launcher counts the same). Evictions and preemptions do not count "
        "here but against compute.max_preemptions. On this backend it replaces compute.max_restarts for application "
        "failures: a group that spent it ends the stage, never retried with a fresh budget.",
    )
    pending_timeout_s: float = Field(
        900.0,
        gt=0,
        description="A pod of an admitted group unscheduled this long fails the stage with the scheduler's reason. "
        "Time the group waits suspended in its Kueue queue does not count (see queue_timeout_s).",
    )
    queue_timeout_s: float | None = Field(
        None,
        gt=0,
        description="A group suspended by Kueue (not admitted) this long fails the stage; null: it waits in its queue "
        "as long as the queue takes, which is what a queue is for.",
    )
    api_lost_s: float = Field(
        300.0,
        gt=0,
        description="How long the launcher keeps trying to reach an API server that does not answer before the "
        "stage ends as retryable 'lost track of the job' (the group is left running; the retry re-attaches to it).",
    )
    image_pull_timeout_s: float = Field(
        600.0, gt=0, description="A pod in ImagePullBackOff/ErrImagePull this long fails the attempt (retryable)."
    )
    s3_credentials: SecretRef | None = Field(
        None, description="Secret with the S3 credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...)."
    )
    mlflow_credentials: SecretRef | None = Field(
        None, description="Secret with the MLflow credentials (MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN)."
    )
    secrets: list[SecretRef] = Field(
        default_factory=list,
        description="Any other credential a pod needs (WANDB_API_KEY, HF_TOKEN ...): Secrets of the namespace, each "
        "with `keys` (environment variable -> key in the Secret), each variable a secretKeyRef in every training, "
        "evaluation and prepare pod. Values never leave the Secret: manifests and MLflow's params name them.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Plain environment of every pod (AWS_ENDPOINT_URL, NCCL_* ...). Credentials are refused here: "
        "use s3_credentials / mlflow_credentials / secrets.",
    )
    eval_gpus: int = Field(1, ge=0, description="GPUs of each checkpoint's evaluation pod.")
    eval_cpu: str | None = Field(None, pattern=_QUANTITY, description="CPU each evaluation pod requests.")
    eval_memory: str | None = Field(None, pattern=_QUANTITY, description="Memory of each evaluation pod.")
    eval_concurrency: PositiveInt = Field(
        2, description="Evaluation pods running at once (a Prefect global concurrency limit)."
    )
    prepare: PrepareJobConfig = Field(
        default_factory=PrepareJobConfig,
        description="The CPU pods that prepare the data (an Indexed Job, one completion index per partition).",
    )

    @field_validator("env")
    @classmethod
    def _no_inline_secrets(cls, env: dict[str, str]) -> dict[str, str]:
        """Never the value in the message: it is the secret."""
        named = sorted(k for k in env if _SECRET_LIKE.search(k))
        if named:
            raise ValueError(
                f"{', '.join(named)}: looks like a credential (its name); credentials go in a Secret "
                "(s3_credentials / mlflow_credentials / secrets), never in env"
            )
        in_urls = sorted(k for k, v in env.items() if _URL_WITH_PASSWORD.search(str(v)))
        if in_urls:
            raise ValueError(
                f"{', '.join(in_urls)}: its value is a URL with a password in it; credentials go in a Secret "
                "(s3_credentials / mlflow_credentials / secrets), never in env"
            )
        return env

    @field_validator("secrets")
    @classmethod
    def _named_keys(cls, secrets: list[SecretRef]) -> list[SecretRef]:
        bare = [ref.name for ref in secrets if not ref.key_map]
        if bare:
            raise ValueError(
                f"{', '.join(bare)}: name the variables this Secret gives, `keys: {{VARIABLE: key-in-secret}}` "
                "(a whole Secret goes through s3_credentials or mlflow_credentials)"
            )
        return secrets

    @model_validator(mode="after")
    def _one_source_per_variable(self) -> KubernetesConfig:
        seen: dict[str, str] = {}
        twice = set()
        for where, names in [
            ("env", list(self.env)),
            *[(f"s3_credentials {r.name}", list(r.key_map)) for r in [self.s3_credentials] if r is not None],
            *[(f"mlflow_credentials {r.name}", list(r.key_map)) for r in [self.mlflow_credentials] if r is not None],
            *[(f"secrets {r.name}", list(r.key_map)) for r in self.secrets],
        ]:
            for name in names:
                if name in seen:
                    twice.add(f"{name} ({seen[name]} and {where})")
                seen.setdefault(name, where)
        if twice:
            raise ValueError(f"each variable comes from one place, and these come from two: {', '.join(sorted(twice))}")
        return self


class ComputeConfig(BaseModel):
    """Compute backend. `local` runs the trainer as processes on this machine via torch's elastic agent
    (infra/launcher.py); `kubernetes` runs it as a JobSet (or an Indexed Job) of pods, described by `kubernetes`,
    each pod with the same launcher."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Backend = Field("local", description="Where training runs.")
    procs_per_node: PositiveInt = Field(
        1, description="Training processes (ranks) per node. On Kubernetes GPU pods the ranks follow gpus_per_node."
    )
    max_restarts: int = Field(
        2,
        ge=0,
        description="Relaunches of a stage after an application failure (the trainer's retryable exit 75, or an "
        "unexpected crash) before the stage fails. Small: the same bug tends to fail the same way. On Kubernetes "
        "the cluster retries application failures (kubernetes.max_restarts) and this counts the launcher's own: "
        "the API lost, an image never pulled, a create refused by an unwell API server.",
    )
    restarts_in_place: int = Field(
        3,
        ge=0,
        description="Restarts of a launch's ranks in place after a rank crashed or hung (the watchdog's verdict): the "
        "same launcher and pods, from the last complete checkpoint, every node together, before the launch ends and "
        "the flow (local) or the cluster (Kubernetes) decides. Each is charged to max_preemptions or max_restarts as "
        "a relaunch would be. A fatal exit (78) never restarts, nor a rank stopped from outside (76: a SIGTERM, "
        "its flow gone, a failed preflight): the flow or the cluster decides where that runs next.",
    )
    max_preemptions: int = Field(
        100,
        ge=0,
        description="Relaunches of a stage after it was stopped from outside (a signal: preemption, eviction, a lost "
        "node, an OOM kill; or the trainer's exit 76 after SIGTERM) before the stage fails. Large: these say "
        "nothing about the run itself.",
    )
    kubernetes: KubernetesConfig | None = Field(
        None, validate_default=True, description="Pods, image and failure policy; required with backend kubernetes."
    )

    @field_validator("kubernetes")
    @classmethod
    def _section_for_backend(cls, section: KubernetesConfig | None, info: ValidationInfo) -> KubernetesConfig | None:
        backend = info.data.get("backend")
        if backend == "kubernetes" and section is None:
            raise ValueError("required with compute.backend: kubernetes (image, nodes, gpus_per_node, ...)")
        if (
            backend == "kubernetes"
            and section.gpus_per_node
            and info.data.get("procs_per_node", 1) not in (1, section.gpus_per_node)
        ):
            raise ValueError(
                f"gpus_per_node ({section.gpus_per_node}) sets the ranks of a GPU pod (one per GPU); "
                f"compute.procs_per_node ({info.data['procs_per_node']}) disagrees"
            )
        return section

    @property
    def ranks_per_node(self) -> int:
        """Processes per node: one per GPU on Kubernetes GPU pods, else procs_per_node."""
        if self.backend == "kubernetes" and self.kubernetes is not None and self.kubernetes.gpus_per_node:
            return self.kubernetes.gpus_per_node
        return self.procs_per_node

"""What tessera's Kubernetes objects are called and how they are found again: the unit of work a group
runs (Workload), its object names, labels and selectors, pod 0's DNS name, the containers' names.

The names are deterministic from (run, stage, attempt) (a data preparation: (run, plan key, attempt)) so
that a relaunched flow finds the group it already created; every object carries the run, stage and
attempt as labels. The manifests
(infra/manifests.py) write these names, and the launcher (infra/kubernetes.py), `tessera k8s status`
and the API calls (infra/kube_api.py) look objects up by them, so they live apart from both.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from infra.config import KubernetesConfig

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
REPLICATED_JOB = "node"  # the one replicated job of a training JobSet: one Indexed Job of N pods
# The launcher reads these containers' state and logs by name.
TRAIN_CONTAINER, EVAL_CONTAINER, PREPARE_CONTAINER = "trainer", "evaluator", "preparer"

LABEL_NAME, LABEL_COMPONENT, LABEL_MANAGED_BY = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
)
LABEL_RUN, LABEL_STAGE, LABEL_ATTEMPT = "tessera.dev/run", "tessera.dev/stage", "tessera.dev/attempt"
ANNOTATION_RUN = "tessera.dev/run-name"  # the run name as written (a label value may be a slug of it)
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"

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


def short_key(key: str) -> str:
    """The first 8 characters of a content key (a plan's hash) as they go into names and labels: the key itself
    when it is lowercase hex or alphanumeric, else a digest of it (so any key gives a valid, stable name)."""
    return key[:8] if re.fullmatch(r"[a-z0-9]{8,}", key) else _digest(key, 8)


@dataclass(frozen=True)
class Workload:
    """Which unit of work a group of objects runs: stage `stage` of `run`, the evaluation of one checkpoint, or
    the preparation of the data a plan (content key `key`) names."""

    run: str
    component: Literal["train", "eval", "prepare"]
    stage: int = 0  # train: the 0-based stage index
    tokens: int = 0  # eval: the checkpoint's tokens
    attempt: int = 0  # launches of this unit so far (a relaunch after a preemption is the next)
    key: str = ""  # prepare: the plan's content key (its hash)

    @property
    def name(self) -> str:
        unit = {"train": f"s{self.stage}", "eval": f"e{self.tokens}", "prepare": f"p{short_key(self.key)}"}
        return f"tessera-{slug(self.run)}-{unit[self.component]}-a{self.attempt}"

    def selector(self, with_attempt: bool = False) -> dict[str, str]:
        """Labels every object of this unit carries (with_attempt: of this very launch)."""
        unit = {"train": str(self.stage), "eval": f"tok-{self.tokens}", "prepare": f"prep-{short_key(self.key)}"}[
            self.component
        ]
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


def pod0_address(cfg: KubernetesConfig, work: Workload) -> str:
    """Stable DNS name of the pod with completion index 0 (the rendezvous host).

    JobSet: `<jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>`, subdomain defaulting to
    the JobSet's name. Indexed Job: `<job>-<index>.<service>`, the pod's hostname and subdomain.
    """
    if cfg.api == "jobset":
        return f"{work.name}-{REPLICATED_JOB}-0-0.{work.name}"
    return f"{work.name}-0.{work.name}"


# compute.kubernetes.avoid_slow_nodes: the label the flow puts on a node whose rank hung or ran slow
# (infra/kube_nodes.py), which the training pods then require absent; the annotation says why.
AVOID_LABEL = "tessera.dev/avoid"
AVOID_REASON = "tessera.dev/avoid-reason"

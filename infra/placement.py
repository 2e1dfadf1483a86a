"""Where a pod may run, typed as Kubernetes spells it: tolerations and core/v1 Affinity (node affinity, pod
(anti-)affinity), and the base every Kubernetes-shaped setting of the `compute` section shares (infra/config.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class KubeModel(BaseModel):
    """Kubernetes-shaped settings: snake_case in recipes, camelCase (as in Kubernetes docs) accepted too."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class Toleration(KubeModel):
    """A pod toleration (core/v1 Toleration), e.g. for the taint GPU node pools carry."""

    key: str | None = Field(None, description="Taint key; empty with operator Exists matches every taint.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Equal compares value; Exists ignores it.")
    value: str | None = Field(None, description="Taint value, for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; null tolerates every effect."
    )
    toleration_seconds: int | None = Field(
        None, ge=0, description="For NoExecute: how long the pod stays bound after the taint appears."
    )


class SelectorRequirement(KubeModel):
    """One label (or node field) requirement: key, operator, values."""

    key: str = Field(..., description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(..., description="How to compare.")
    values: list[str] | None = Field(None, description="Values for In/NotIn (any) and Gt/Lt (one integer).")


class NodeSelectorTerm(KubeModel):
    """Node requirements that must all hold (the terms of a list are ORed)."""

    match_expressions: list[SelectorRequirement] = Field(default_factory=list, description="On node labels.")
    match_fields: list[SelectorRequirement] = Field(default_factory=list, description="On node fields.")


class PreferredNodeTerm(KubeModel):
    """A weighted node preference."""

    weight: int = Field(..., ge=1, le=100, description="Added to a node's score when the term matches.")
    preference: NodeSelectorTerm = Field(..., description="The node requirements preferred.")


class NodeSelector(KubeModel):
    """Hard node requirements: a node must match one of the terms."""

    node_selector_terms: list[NodeSelectorTerm] = Field(..., min_length=1, description="ORed terms.")


class NodeAffinity(KubeModel):
    """Where pods may (required) and would rather (preferred) run."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        None, description="Nodes a pod may be scheduled on."
    )
    preferred_during_scheduling_ignored_during_execution: list[PreferredNodeTerm] = Field(
        default_factory=list, description="Weighted preferences among the allowed nodes."
    )


class LabelSelector(KubeModel):
    """A label selector over pods."""

    match_labels: dict[str, str] = Field(default_factory=dict, description="Exact label matches.")
    match_expressions: list[SelectorRequirement] = Field(default_factory=list, description="Set-based requirements.")


class PodAffinityTerm(KubeModel):
    """Pods matching the selector, within the same topology domain."""

    label_selector: LabelSelector = Field(..., description="Which pods.")
    topology_key: str = Field(..., description="Node label that defines the domain, e.g. topology.kubernetes.io/zone.")
    namespaces: list[str] = Field(default_factory=list, description="Namespaces to look in; empty: the pod's own.")


class WeightedPodAffinityTerm(KubeModel):
    """A weighted pod (anti-)affinity preference."""

    weight: int = Field(..., ge=1, le=100, description="Added to a node's score when the term matches.")
    pod_affinity_term: PodAffinityTerm = Field(..., description="The term preferred.")


class PodAffinity(KubeModel):
    """Co-location (or, as anti-affinity, separation) from other pods."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, description="Terms that must hold."
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, description="Weighted preferences."
    )


class Affinity(KubeModel):
    """core/v1 Affinity, typed: node affinity and pod (anti-)affinity."""

    node_affinity: NodeAffinity | None = Field(None, description="Constraints on the node.")
    pod_affinity: PodAffinity | None = Field(None, description="Run near these pods.")
    pod_anti_affinity: PodAffinity | None = Field(None, description="Run away from these pods.")

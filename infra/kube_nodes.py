"""Keeping a group off a node that hung or ran slow: `compute.kubernetes.avoid_slow_nodes`.

The flow labels the node `tessera.dev/avoid=true` (the reason in the annotation
`tessera.dev/avoid-reason`) when the node's pod exited with the watchdog's hang code, or when a rank
on it stayed slower than its peers (tasks/training/train_progress.py); every training pod tessera renders with
the option on requires nodes without that label, so the group's next restart, and every later
group, is scheduled elsewhere. It never cordons or drains: other workloads keep the node. The flow's
account needs `get` and `patch` on nodes (infra/k8s/rbac-nodes.yaml, a ClusterRole: nodes are not
namespaced); without it the label is skipped with one line saying so. A person takes the label off
once the node is fixed: `kubectl label node NODE tessera.dev/avoid-`.
"""

from __future__ import annotations

from infra.kube_api import Kube, KubeError
from infra.kube_names import AVOID_LABEL, AVOID_REASON


def avoid(kube: Kube, node: str, why: str) -> str:
    """Label `node` to be avoided; the line that says what was done, or why it was not."""
    try:
        kube.patch_node(
            node, {"metadata": {"labels": {AVOID_LABEL: "true"}, "annotations": {AVOID_REASON: why[:1000]}}}
        )
    except KubeError as exc:
        hint = " (the flow's account needs infra/k8s/rbac-nodes.yaml)" if exc.status == 403 else ""
        return f"could not label node {node} {AVOID_LABEL}=true: {exc}{hint}"
    return (
        f"labelled node {node} {AVOID_LABEL}=true ({why[:200]}): the group's next pods keep off it; "
        f"`kubectl label node {node} {AVOID_LABEL}-` takes it back"
    )

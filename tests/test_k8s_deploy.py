"""What the cluster side needs besides the manifests: the flow pod's RBAC and the tessera-k8s work pool."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml

from infra import kube_api
from infra import kubernetes as launcher
from tests.conftest import ROOT
from tests.test_k8s_manifests import K8S_VERSIONS

RBAC = ROOT / "infra" / "k8s" / "rbac.yaml"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rbac_validates(version):
    docs = list(yaml.safe_load_all(RBAC.read_text()))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding"]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_rbac_grants_exactly_what_the_launcher_calls():
    (role,) = [d for d in yaml.safe_load_all(RBAC.read_text()) if d["kind"] == "Role"]
    granted = {(r["apiGroups"][0], res): sorted(r["verbs"]) for r in role["rules"] for res in r["resources"]}
    assert granted == {
        ("jobset.x-k8s.io", "jobsets"): sorted(["create", "get", "list", "watch", "delete"]),
        ("batch", "jobs"): sorted(["create", "get", "list", "watch", "delete"]),
        ("", "pods"): ["list"],
        ("", "pods/log"): ["get"],
        ("", "services"): sorted(["create", "get", "list", "delete", "patch"]),
        ("", "configmaps"): sorted(["create", "get", "list", "delete", "patch"]),
        ("networking.k8s.io", "networkpolicies"): sorted(["create", "get", "list", "delete", "patch"]),
        ("", "events"): ["list"],
    }
    # every client call in the launcher maps to one of these verbs; no call outside them
    source = (ROOT / "infra" / "kube_api.py").read_text()
    calls = set(re.findall(r"(create|read|list|delete|patch)_namespaced_(\w+?)(?:_log)?\b", source))
    used = {("get" if verb == "read" else verb, kind) for verb, kind in calls}
    assert used <= {
        ("create", "config_map"),
        ("patch", "config_map"),
        ("patch", "service"),
        ("patch", "network_policy"),
        ("get", "config_map"),
        ("delete", "config_map"),
        ("list", "config_map"),
        ("create", "service"),
        ("get", "service"),
        ("delete", "service"),
        ("list", "service"),
        ("create", "network_policy"),
        ("get", "network_policy"),
        ("delete", "network_policy"),
        ("list", "network_policy"),
        ("create", "job"),
        ("get", "job"),
        ("delete", "job"),
        ("list", "job"),
        ("list", "pod"),
        ("get", "pod"),
        ("list", "event"),
        ("create", "custom_object"),
        ("get", "custom_object"),
        ("delete", "custom_object"),
        ("list", "custom_object"),
    }, used
    assert ("get", "pod") in used  # read_namespaced_pod_log: pods/log get
    assert launcher and kube_api


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_node_labellers_rbac_validates_and_grants_patch_on_nodes_only(version):
    """compute.kubernetes.avoid_slow_nodes: the one cluster-wide grant, and the one call it covers."""
    docs = list(yaml.safe_load_all((ROOT / "infra" / "k8s" / "rbac-nodes.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ClusterRole", "ClusterRoleBinding"]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    assert docs[0]["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]}]
    assert docs[1]["subjects"] == [{"kind": "ServiceAccount", "name": "tessera-flow", "namespace": "tessera"}]
    source = (ROOT / "infra" / "kube_api.py").read_text()
    assert set(re.findall(r"\b(\w+)_node\b", source)) == {"patch"}


def test_k8s_pool_job_variables_are_the_kubernetes_workers_own():
    worker = pytest.importorskip(
        "prefect_kubernetes.worker", reason="the k8s extra (prefect-kubernetes) is not installed"
    )
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    pool = spec["definitions"]["work_pools"]["tessera_k8s"]
    assert (pool["name"], pool["type"]) == ("tessera-k8s", "kubernetes")
    template = worker.KubernetesWorker.get_default_base_job_template()
    assert set(pool["job_variables"]) <= set(template["variables"]["properties"])
    assert spec["definitions"]["tessera_k8s_pull"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "/opt/tessera"}}
    ]
    assert "WORKDIR /opt/tessera" in (ROOT / "infra" / "Dockerfile").read_text()

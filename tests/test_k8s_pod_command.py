"""The command line a training pod runs, run for real as 2 "nodes" on this machine.

Each node is a process with the command and environment its pod gets from the rendered JobSet,
expanded the way the kubelet expands `$(VAR)`, plus the variable the Job controller adds
(JOB_COMPLETION_INDEX). One substitution: pod 0's DNS name resolves only inside a cluster, so
TESSERA_MASTER_ADDR is 127.0.0.1 here. The module is a probe instead of trainers.train, so the test
checks the wiring (node ranks, world size, rendezvous, exit codes), not training; the trainer's
own two-node run is tests/test_train.py::test_two_nodes_without_a_shared_folder_resume_through_s3.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from infra.kube_names import Workload
from infra.manifests import jobset
from tests.conftest import ROOT, free_port
from tests.k8s.variants import CPU_ONE_NODE, compute
from trainers.contract import MASTER_ADDR_ENV
from trainers.contract import SUPERVISOR_PID_ENV as SUPERVISOR_ENV


def kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """`$(VAR)` becomes VAR's value when the container defines it; `$$(VAR)` stays a literal `$(VAR)`."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), arg)


def _pod_processes(raw: dict, args: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    cfg = compute(raw)
    js = jobset(
        cfg.kubernetes,
        Workload("tiny", "train"),
        cfg.ranks_per_node,
        "tests.k8s.probe",
        args,
        {"TESSERA_HOLDER": "flow run 'test'", SUPERVISOR_ENV: str(os.getpid())},
    )
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    assert container["workingDir"] == "/opt/tessera"  # here: the checkout
    pods = []
    for index in range(job["completions"]):
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert SUPERVISOR_ENV not in env  # no supervisor process in a pod
        env["JOB_COMPLETION_INDEX"] = str(index)
        env[MASTER_ADDR_ENV] = "127.0.0.1"
        argv = [kubelet_expand(a, env) for a in container["command"]]
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        pods.append((argv, env))
    return pods


def _run(pods, timeout=240) -> list[tuple[int, str]]:
    base = {k: v for k, v in os.environ.items() if k != SUPERVISOR_ENV}
    base["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{base['PATH']}"  # `composer`, as in the image
    base["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(argv, cwd=ROOT, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for argv, env in pods
    ]
    return [(p.wait(timeout), p.stdout.read().decode(errors="replace")) for p in procs]


def test_two_nodes_rendezvous_through_pod0_with_their_completion_index():
    port = free_port()
    raw = {
        **CPU_ONE_NODE,
        "procs_per_node": 1,
        "kubernetes": {**CPU_ONE_NODE["kubernetes"], "nodes": 2, "master_port": port},
    }
    pods = _pod_processes(raw, ["allreduce"])
    assert pods[1][0][3:] == [
        "composer",
        "-n",
        "1",
        "--world_size",
        "2",
        "--node_rank",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "-m",
        "tests.k8s.probe",
        "allreduce",
    ]
    results = _run(pods)
    assert [code for code, _ in results] == [0, 0], results
    for node, (_, out) in enumerate(results):
        assert f"allreduce sum=1 rank={node} world=2 node_rank={node} master=127.0.0.1 supervisor=None" in out, out


def test_a_pods_exit_code_is_its_first_failing_ranks():
    """Rank 1 exits 78; Composer's launcher stops rank 0 (76) and itself exits 76. The pod must exit 78,
    or the JobSet's FailJobSet rule on exit code 78 would never fire."""
    raw = {
        **CPU_ONE_NODE,
        "procs_per_node": 2,
        "kubernetes": {**CPU_ONE_NODE["kubernetes"], "master_port": free_port()},
    }
    ((code, out),) = _run(_pod_processes(raw, ["peer", "78"]))
    assert "Rank 1 crashed with exit code 78" in out, out
    assert "tessera.pod: the launcher exited 76; rank that failed first exited 78" in out
    assert code == 78

"""The command line a training pod runs (infra/launcher.py: torch's elastic agent), for real as 2 "nodes" here.

Each node is a process with the command and environment its pod gets from the rendered JobSet,
expanded the way the kubelet expands `$(VAR)`, plus the variable the Job controller adds
(JOB_COMPLETION_INDEX). One substitution: pod 0's DNS name resolves only inside a cluster, so
TESSERA_MASTER_ADDR is 127.0.0.1 here, and so is each pod's IP (TESSERA_STORE_BIND, from the
downward API). The module is a probe instead of trainers.train, so the test
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
from infra.pod_spec import RankLaunch
from tests.conftest import ROOT, free_port
from tests.k8s.variants import CPU_ONE_NODE, compute
from trainers.contract import MASTER_ADDR_ENV, STORE_BIND_ENV, WARM_MODULES
from trainers.contract import SUPERVISOR_PID_ENV as SUPERVISOR_ENV


def kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """`$(VAR)` becomes VAR's value when the container defines it; `$$(VAR)` stays a literal `$(VAR)`."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), arg)


def _pod_processes(raw: dict, args: list[str], env: dict | None = None) -> list[tuple[list[str], dict[str, str]]]:
    cfg = compute(raw)
    js = jobset(
        cfg.kubernetes,
        Workload("tiny", "train"),
        cfg.ranks_per_node,
        "tests.k8s.probe",
        args,
        {"TESSERA_HOLDER": "flow run 'test'", SUPERVISOR_ENV: str(os.getpid()), **(env or {})},
        RankLaunch(cfg.restarts_in_place, WARM_MODULES),  # as KubernetesBackend.launch renders it
    )
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    assert container["workingDir"] == "/opt/tessera"  # here: the checkout
    pods = []
    for index in range(job["completions"]):
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert SUPERVISOR_ENV not in env  # no supervisor process in a pod
        env["JOB_COMPLETION_INDEX"] = str(index)
        env[MASTER_ADDR_ENV] = env[STORE_BIND_ENV] = "127.0.0.1"
        argv = [kubelet_expand(a, env) for a in container["command"]]
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        pods.append((argv, env))
    return pods


def _run(pods, timeout=240, env: dict | None = None) -> list[tuple[int, str]]:
    base = {k: v for k, v in os.environ.items() if k != SUPERVISOR_ENV} | (env or {})
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
    assert pods[1][0][1:] == [
        "-m",
        "infra.launcher",
        "--nproc-per-node",
        "1",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--local-addr",
        "127.0.0.1",
        "--max-restarts",
        "3",
        "--log-dir",
        "/var/tessera/work/logs",
        "--warm",
        ",".join(WARM_MODULES),
        "-m",
        "tests.k8s.probe",
        "allreduce",
    ]
    results = _run(pods)
    assert [code for code, _ in results] == [0, 0], results
    for node, (_, out) in enumerate(results):
        assert f"allreduce sum=1 rank={node} world=2 node_rank={node} master=127.0.0.1 supervisor=None" in out, out


def test_a_rank_killed_on_one_node_restarts_both_nodes_in_place_together(tmp_path):
    """Two "pods" of one rank each; rank 1 (pod 1) SIGKILLs itself once. Pod 1's launcher restarts its rank in place;
    pod 0's sees the new rendezvous round (or its rank's lost peer) and restarts too: one launcher per pod throughout,
    and the restarted ranks meet again and finish. The kill is the recorded cause on the node where it happened."""
    import json

    from infra.launch_outcome import read_records

    raw = {
        **CPU_ONE_NODE,
        "procs_per_node": 1,
        "kubernetes": {**CPU_ONE_NODE["kubernetes"], "nodes": 2, "master_port": free_port()},
    }
    results = _run(_pod_processes(raw, ["crash-once", str(tmp_path / "crashed")]))
    assert [code for code, _ in results] == [0, 0], results
    for node, (_, out) in enumerate(results):
        assert f"allreduce sum=1 rank={node} world=2 node_rank={node} master=127.0.0.1" in out, out
        restarts, end = read_records(out)
        assert len(restarts) == 1 and end == {**end, "code": 0, "restarts": 1}, out
    (killed,), _ = read_records(results[1][1])
    assert (killed.cause, killed.rank, killed.code) == ("crashed", 1, -9), json.dumps(killed.to_json())
    # pod 0's: the new rendezvous round pod 1 opened, or its own rank's lost peer if that came first
    (followed,), _ = read_records(results[0][1])
    assert (followed.cause, followed.rank, followed.code) in (("peer", None, None), ("crashed", 0, 75)), followed


def test_a_pods_exit_code_is_its_first_failing_ranks():
    """Rank 1 exits 78; the agent stops rank 0 (76). The pod must exit 78, or the JobSet's FailJobSet rule on exit
    code 78 would never fire; and a fatal exit is not restarted in place."""
    raw = {
        **CPU_ONE_NODE,
        "procs_per_node": 2,
        "kubernetes": {**CPU_ONE_NODE["kubernetes"], "master_port": free_port()},
    }
    ((code, out),) = _run(_pod_processes(raw, ["peer", "78"]))
    assert "tessera.launcher: rank 1 failed first with exit code 78 (every rank: 0: " in out, out
    assert ", 1: 78); 0 restart(s) in place spent" in out, out
    assert "restart 1 in place" not in out
    assert code == 78


def test_the_pods_watchdog_restarts_a_hung_group_in_place_then_exits_79_with_the_line_as_its_termination_message(
    tmp_path,
):
    """Rank 1 of a 2-rank pod stops itself after three steps (tests/k8s/probe.py freeze), in every attempt; the
    watchdog in the pod's launcher, with the budgets the flow puts in the pod's environment, writes both ranks' stacks
    to the pod's log and kills the ranks; the launcher restarts them in place once (restarts_in_place: 1), then exits
    79, the code the pod failure policy restarts the group on without counting it (infra/manifests.py); the flow
    reads the line from the pod's termination message."""
    import json
    import time

    from infra.kube_outcome import pod_failure
    from infra.launch_outcome import RECORD_PREFIX
    from infra.watchdog import budgets_env, process_state
    from trainers.config import WatchdogConfig
    from trainers.contract import HEARTBEAT_DIR_ENV, HUNG, INTERRUPTED, TERMINATION_LOG_ENV

    raw = {
        **CPU_ONE_NODE,
        "procs_per_node": 2,
        "restarts_in_place": 1,
        "kubernetes": {**CPU_ONE_NODE["kubernetes"], "master_port": free_port()},
    }
    budgets = budgets_env(WatchdogConfig(step_floor_s=3, poll_s=0.5).model_dump())
    (pod,) = _pod_processes(raw, ["freeze"], budgets)
    assert json.loads(pod[1]["TESSERA_WATCHDOG"])["step_floor_s"] == 3  # the flow's budgets reach the pod
    beats, message = tmp_path / "beats", tmp_path / "termination-log"
    started = time.monotonic()
    ((code, out),) = _run([pod], env={HEARTBEAT_DIR_ENV: str(beats), TERMINATION_LOG_ENV: str(message)})
    assert code == HUNG == 79, out
    assert time.monotonic() - started < 90
    (restart,) = [json.loads(line.split(RECORD_PREFIX, 1)[1]) for line in out.splitlines() if RECORD_PREFIX in line][:1]
    assert (restart["kind"], restart["cause"], restart["rank"]) == ("restart", "hung", 1), restart
    said = message.read_text()
    assert said.startswith("the watchdog found rank 1 (") and "hung in phase step for " in said, said
    assert "over its 3 s budget (the step floor" in said and "its process stopped (SIGSTOP)" in said
    assert f"tessera.launcher: {said}; restarts spent (1), exiting 79" in out
    assert "--- rank 0: Python stacks (faulthandler)" in out and "--- rank 1: Python stacks (faulthandler)" in out
    assert 'probe.py", line' in out  # where each rank was
    pids = [json.loads((beats / f"rank{r}.json").read_bytes())["pid"] for r in (0, 1)]
    # the stopped rank too: no process left behind (a zombie is dead, until whichever process adopted it reaps it)
    assert all(process_state(pid) in (None, "Z") for pid in pids)

    # What the flow reads of that pod: the hang, charged as a disruption (the preemption budget), named by its line.
    pod_status = {
        "metadata": {"name": "tiny-train-node-0-0-abc", "uid": "u1"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {"name": "trainer", "state": {"terminated": {"exitCode": 79, "reason": "Error", "message": said}}}
            ],
        },
    }
    failure = pod_failure(pod_status, "trainer")
    assert (failure.cause, failure.code, failure.hung) == ("disruption", INTERRUPTED, True)
    assert failure.message == f"pod tiny-train-node-0-0-abc: {said}"

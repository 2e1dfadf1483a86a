"""Data preparation as one Indexed Job of CPU pods (infra/prepare_job.py), and its launch.

The manifest validates against the official batch/v1 schema and says what the failure policy needs; the launcher
runs unchanged against tests/k8s/fake_apiserver.py, each test playing the Job controller (a failed pod of an index
replaced by a new one, an evicted pod replaced, the Job's own end) and the kubelet. No real cluster runs here.
"""

from __future__ import annotations

import threading
import time

import kubernetes_validate
import pytest
import yaml

from infra import cancel_all
from infra.config import PrepareJobConfig
from infra.k8s_views import render_prepare
from infra.kube_names import _LABEL_VALUE, Workload
from infra.kube_outcome import parse_indexes
from infra.kubernetes import KubernetesBackend
from infra.lifecycle import forget
from infra.prepare_job import WORKERS_ENV, prepare_job
from tests.k8s.variants import CPU_ONE_NODE, GPU_KUEUE, GPU_TWO_NODES, VARIANTS, compute
from tests.test_k8s_launcher import Cluster, _end, settle
from tests.test_k8s_launcher import api as api  # the fake API server fixture, shared
from tests.test_k8s_manifests import K8S_VERSIONS

KEY = "3f9a2c71d0e4b5a6"
NAME = "tessera-tiny-p3f9a2c71-a0"
ARGV = ["python", "-m", "tasks.data.pod", "s3://bucket/tessera/plans/3f9a2c71.json"]
BAD_LINE = "tessera: error: /data/x.jsonl:7: not JSON"
CPU_POOL = {
    "pods": 3,
    "cpu": "16",
    "memory": "32Gi",
    "node_selector": {"cloud.google.com/gke-nodepool": "cpu-pool"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}],
    "backoff_limit_per_index": 2,
}
# Training on two 8-GPU nodes, preparing on CPU nodes of their own.
PREP = {**GPU_TWO_NODES, "kubernetes": {**GPU_TWO_NODES["kubernetes"], "prepare": CPU_POOL}}


def _job(raw: dict = PREP, completions: int = 5, fail_fast: bool = True, key: str = KEY) -> dict:
    cfg = compute(raw).kubernetes
    work = Workload("tiny", "prepare", key=key)
    return prepare_job(cfg, work, completions=completions, argv=ARGV, env={"TESSERA_HOLDER": "x"}, fail_fast=fail_fast)


# -- the manifest ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fail_fast", [True, False])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_prepare_job_validates(version, variant, fail_fast):
    kubernetes_validate.validate(_job(VARIANTS[variant], fail_fast=fail_fast), version, strict=True)


def test_the_prepare_job_is_indexed_with_a_per_index_budget_and_its_failure_policy():
    job = _job(completions=5, fail_fast=True)
    spec = job["spec"]
    assert job["metadata"]["name"] == NAME and job["metadata"]["namespace"] == "training"
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 5, 3)
    assert spec["backoffLimitPerIndex"] == 2 and spec["maxFailedIndexes"] == 0
    assert "backoffLimit" not in spec  # defaulted to max int32 by the API: only the per-index budget counts
    assert spec["podFailurePolicy"] == {
        "rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"containerName": "preparer", "operator": "In", "values": [78]}},
        ]
    }
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # required by podFailurePolicy and backoffLimitPerIndex
    (container,) = pod["containers"]
    assert container["name"] == "preparer" and container["command"] == ARGV
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[WORKERS_ENV] == "16" and env["TESSERA_HOLDER"] == "x" and env["TMPDIR"] == "/var/tessera/work"
    assert env["AWS_ENDPOINT_URL"] == "https://s3.example.com"  # the section's plain env, and credentials by name
    assert {
        "name": "AWS_SECRET_ACCESS_KEY",
        "valueFrom": {"secretKeyRef": {"name": "tessera-s3", "key": "secret-key"}},
    } in container["env"]
    assert container["envFrom"] == [{"secretRef": {"name": "mlflow-auth"}}]
    assert container["resources"] == {"requests": {"cpu": "16", "memory": "32Gi"}, "limits": {"memory": "32Gi"}}
    assert "nvidia.com/gpu" not in yaml.safe_dump(job)  # no GPU anywhere, though the section trains on 8 a pod
    # CPU nodes of its own: none of the training pods' placement, cache volume or priority
    assert pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": "cpu-pool"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}]
    assert "affinity" not in pod and "priorityClassName" not in pod
    assert {v["name"]: v for v in pod["volumes"]}["scratch"] == {"name": "scratch", "emptyDir": {"sizeLimit": "50Gi"}}
    assert "cache" not in {v["name"] for v in pod["volumes"]}
    assert pod["serviceAccountName"] == "tessera-trainer" and pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    labels = job["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "prepare" and labels["tessera.dev/stage"] == "prep-3f9a2c71"
    assert spec["template"]["metadata"]["labels"] == labels
    assert all(len(v) <= 63 and _LABEL_VALUE.match(v) for v in labels.values())


def test_without_fail_fast_no_index_ends_the_others_and_parallelism_is_capped_by_the_partitions():
    spec = _job(completions=2, fail_fast=False)["spec"]
    assert "maxFailedIndexes" not in spec and spec["parallelism"] == 2
    assert spec["podFailurePolicy"]["rules"][1]["action"] == "FailJob"  # exit 78 still ends the Job at once


def test_the_prepare_section_has_defaults_its_own_aliases_and_a_worker_count():
    assert compute(CPU_ONE_NODE).kubernetes.prepare == PrepareJobConfig()  # recipes without it stay valid
    default = PrepareJobConfig()
    assert (default.pods, default.cpu, default.memory, default.backoff_limit_per_index) == (8, "8", "16Gi", 3)
    assert default.worker_count == 8
    assert PrepareJobConfig(cpu="500m").worker_count == 1 and PrepareJobConfig(cpu="2.5").worker_count == 2
    assert PrepareJobConfig(cpu="16", workers=4).worker_count == 4
    camel = PrepareJobConfig.model_validate(
        {"backoffLimitPerIndex": 0, "nodeSelector": {"a": "b"}, "scratchSize": "1Ti"}
    )
    assert (camel.backoff_limit_per_index, camel.node_selector, camel.scratch_size) == (0, {"a": "b"}, "1Ti")
    for field in PrepareJobConfig.model_fields.values():
        assert field.description
    with pytest.raises(ValueError, match="backoff_limit_per_index"):
        PrepareJobConfig(backoff_limit_per_index=-1)
    with pytest.raises(ValueError, match="cpu"):
        PrepareJobConfig(cpu="eight")


def test_names_keys_and_the_kueue_label():
    assert Workload("tiny", "prepare", key=KEY, attempt=2).name == "tessera-tiny-p3f9a2c71-a2"
    odd = Workload("My Run!", "prepare", key="not/a hash")  # any key gives a valid, stable name
    assert odd.name == Workload("My Run!", "prepare", key="not/a hash").name
    assert len(odd.name) <= 52 and _LABEL_VALUE.match(odd.selector()["tessera.dev/stage"])
    assert _job(GPU_KUEUE)["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert parse_indexes("1,3-5") == [1, 3, 4, 5] and parse_indexes("") == [] and parse_indexes(None) == []


def test_render_prepare_prints_the_job_the_launcher_creates():
    text = render_prepare(
        compute(PREP), run="tiny", key=KEY, completions=5, argv=ARGV, env={"TESSERA_HOLDER": "x"}, fail_fast=True
    )
    assert list(yaml.safe_load_all(text)) == [_job()]


# -- the launch, against the fake API server ------------------------------------------------------------


def _prepare(tmp_path, completions=4, fail_fast=True):
    return KubernetesBackend(compute(PREP)).launch_prepare(
        ARGV,
        run="tiny",
        key=KEY,
        completions=completions,
        fail_fast=fail_fast,
        log_dir=tmp_path / "logs",
        env={"TESSERA_HOLDER": "flow run 'test'"},
    )


def _complete(c, pods, indexes="0-3"):
    """The kubelet ends the pods, then the Job controller marks the Job complete."""
    for p in pods:
        c.terminate(p, 0)
    c.set_condition(
        "Job",
        NAME,
        "Complete",
        "CompletionsReached",
        "Reached expected number of succeeded pods",
        completedIndexes=indexes,
        succeeded=len(parse_indexes(indexes)),
    )


def test_every_index_succeeds(api, tmp_path):
    c = api.cluster

    def scenario(c):
        job = c.wait_for("Job", NAME)
        first = c.start_pods(job, indexes=[0, 1, 2])  # parallelism 3 of 4 partitions
        c.log(first[0], "tessera.prepare: partition 0: 120 documents\n")
        for p in first:
            c.terminate(p, 0)
        c.set_status("Job", NAME, completedIndexes="0-2", succeeded=3)
        _complete(c, c.start_pods(job, indexes=[3]))

    sim = Cluster(scenario, c)
    sim.start()
    job = _prepare(tmp_path)
    assert job.wait(timeout=60) == 0
    sim.join()
    assert job.indexes_done() == [0, 1, 2, 3]
    assert job.log_path.name == "prepare.log"
    assert "tessera.prepare: partition 0: 120 documents" in job.new_output()
    assert c.creates == [("Job", NAME)]
    assert _end(job, api) == f"tessera.k8s: Job {NAME} completed"
    assert ("Job", NAME, "Foreground") in c.deletes


def test_pod0_output_is_in_the_log_when_its_stream_opens_slower_than_the_job_ends(api, tmp_path):
    """CI once lost index 0's line here: the relay counted a stream as quiet from the moment it asked for it, so
    the end's drain (quiet for 1 s: caught up) closed the log while a loaded server was still opening the stream of
    a pod that had long finished. Quiet counts from the server's first answer."""
    c = api.cluster
    c.faults.follow_delay_s = 2.0

    def scenario(c):
        job = c.wait_for("Job", NAME)
        pods = c.start_pods(job)
        c.log(pods[0], "tessera.prepare: partition 0: 120 documents\n")
        _complete(c, pods)

    sim = Cluster(scenario, c)
    sim.start()
    job = _prepare(tmp_path)
    assert job.wait(timeout=60) == 0
    sim.join()
    assert "tessera.prepare: partition 0: 120 documents" in job.new_output()
    assert _end(job, api) == f"tessera.k8s: Job {NAME} completed"


def test_pod0_output_is_in_the_log_when_the_job_ends_before_the_relay_has_started(api, tmp_path, monkeypatch):
    """CI lost index 0's line again: the launch started its watcher before its log relay, and on a loaded machine the
    watcher saw the Job complete and closed the log before the relay thread existed to be waited for. Here the
    relay's start is held back a second, as a descheduled launching thread would be."""
    real_start = threading.Thread.start

    def late_relay(thread):
        if thread.name.startswith("k8s-log-"):
            time.sleep(1.0)
        real_start(thread)

    def scenario(c):
        job = c.wait_for("Job", NAME)
        pods = c.start_pods(job)
        c.log(pods[0], "tessera.prepare: partition 0: 120 documents\n")
        _complete(c, pods)

    sim = Cluster(scenario, api.cluster)
    sim.start()
    monkeypatch.setattr(threading.Thread, "start", late_relay)
    job = _prepare(tmp_path)
    assert job.wait(timeout=60) == 0
    sim.join()
    assert "tessera.prepare: partition 0: 120 documents" in job.new_output()
    assert _end(job, api) == f"tessera.k8s: Job {NAME} completed"


def test_an_index_the_controller_retries_does_not_end_the_launch(api, tmp_path):
    c = api.cluster
    seen = []

    def scenario(c):
        job = c.wait_for("Job", NAME)
        pods = c.start_pods(job)
        for _ in range(2):  # index 3 fails twice; the Job controller makes a new pod for it each time
            c.terminate(pods[3], 1)
            settle()
            seen.append(launched.poll())
            pods[3] = c.start_pods(job, indexes=[3])[0]
        _complete(c, pods)

    sim = Cluster(scenario, c)
    launched = None
    sim.start()
    launched = _prepare(tmp_path)
    assert launched.wait(timeout=60) == 0
    sim.join()
    assert seen == [None, None]  # still watching after each failure
    text = launched.tail()
    assert text.count("container preparer exited 1; the Job controller retries the index") == 2
    assert "index 3: pod tessera-tiny-p3f9a2c71-a0-3-" in text
    assert _end(launched, api) == f"tessera.k8s: Job {NAME} completed"


def test_an_evicted_pod_is_replaced_by_the_controller_and_the_launch_goes_on(api, tmp_path):
    c = api.cluster
    seen = []

    def scenario(c):
        job = c.wait_for("Job", NAME)
        pods = c.start_pods(job)
        c.evict(pods[1])  # DisruptionTarget, then SIGTERM: the Ignore rule spends nothing of index 1's budget
        settle()
        seen.append(launched.poll())
        pods[1] = c.start_pods(job, indexes=[1])[0]
        _complete(c, pods)

    sim = Cluster(scenario, c)
    launched = None
    sim.start()
    launched = _prepare(tmp_path)
    assert launched.wait(timeout=60) == 0
    sim.join()
    assert seen == [None] and launched.preemptions == 1
    assert "was disrupted (EvictionByEvictionAPI: Eviction API: evicting); the Job controller replaces it" in (
        launched.tail()
    )
    assert _end(launched, api) == f"tessera.k8s: Job {NAME} completed"


def test_a_watch_reset_mid_stream_is_ridden_through(api, tmp_path):
    c = api.cluster

    def scenario(c):
        pods = c.start_pods(c.wait_for("Job", NAME))
        c.faults.reset_watches = 2
        settle()
        _complete(c, pods)

    sim = Cluster(scenario, c)
    sim.start()
    job = _prepare(tmp_path)
    assert job.wait(timeout=60) == 0
    sim.join()
    assert c.faults.reset_watches == 0 and c.creates == [("Job", NAME)]
    assert _end(job, api) == f"tessera.k8s: Job {NAME} completed"


def test_bad_input_fails_the_job_at_once_naming_the_index_with_its_pods_last_lines(api, tmp_path):
    c = api.cluster

    def scenario(c):
        pods = c.start_pods(c.wait_for("Job", NAME))
        c.log(pods[2], f"tessera.prepare: partition 2\n{BAD_LINE}\n")
        c.terminate(pods[2], 78)
        c.set_condition(  # the FailJob rule, as the Job controller words it
            "Job",
            NAME,
            "Failed",
            "PodFailurePolicy",
            f"Container preparer for pod training/{pods[2]} failed with exit code 78 matching FailJob rule at index 1",
            failedIndexes="2",
        )

    sim = Cluster(scenario, c)
    sim.start()
    job = _prepare(tmp_path)
    assert job.wait(timeout=60) == 78
    sim.join()
    message = job.outcome.message
    assert message.startswith(f"Job {NAME}: index 2 failed: pod {NAME}-2-"), message
    assert message.endswith(": container preparer exited 78 (fatal)")
    text = job.tail()
    assert f"tessera.k8s: last lines of pod {NAME}-2-" in text and BAD_LINE in text
    assert _end(job, api) == f"tessera.k8s: {message}"


def test_an_index_out_of_budget_fails_the_job_and_is_named_first(api, tmp_path):
    """Without fail_fast the other indexes finish; the Job fails for its failed index (exit 1, three tries), not
    for an OOM kill of another index the controller retried with success (an OOM is no longer the end at once)."""
    c = api.cluster

    def scenario(c):
        job = c.wait_for("Job", NAME)
        pods = c.start_pods(job)
        c.terminate(pods[2], 137, reason="OOMKilled")
        c.start_pods(job, indexes=[2])  # retried: a smaller batch on a quieter node, say
        for _ in range(3):  # backoff_limit_per_index 2: three tries, then the index has failed
            c.log(pods[1], "Traceback ... OSError: connection reset\n")
            c.terminate(pods[1], 1)
            pods[1] = c.start_pods(job, indexes=[1])[0]
        c.remove("Pod", pods[1], "training")  # the controller made no fourth
        for p in c.items("Pod"):
            if p["status"]["phase"] == "Running":
                c.terminate(p["metadata"]["name"], 0)
        c.set_condition(
            "Job",
            NAME,
            "Failed",
            "FailedIndexes",
            "Job has failed indexes",
            failedIndexes="1",
            completedIndexes="0,2-3",
            succeeded=3,
            failed=4,
        )

    sim = Cluster(scenario, c)
    sim.start()
    job = _prepare(tmp_path, fail_fast=False)
    assert job.wait(timeout=60) == 1
    sim.join()
    message = job.outcome.message
    assert message.startswith(f"Job {NAME}: index 1 failed: pod {NAME}-1-") and message.endswith("exited 1"), message
    assert job.restarts_spent and job.indexes_done() == [0, 2, 3]
    text = job.tail()
    assert "OOMKilled (memory limit 32Gi); raise compute.kubernetes.prepare.memory" in text  # said, not the end
    assert "OSError: connection reset" in text  # the failing pod's last lines
    assert _end(job, api) == f"tessera.k8s: {message}"


def test_a_pod_waiting_for_room_ends_the_launch_only_once_none_runs(api, tmp_path, monkeypatch):
    c = api.cluster
    seen = []
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}

    def scenario(c):
        job = c.wait_for("Job", NAME)
        (running,) = c.start_pods(job, indexes=[0])
        (waiting,) = c.start_pods(job, phase="Pending", indexes=[1])
        c.set_pod_status(waiting, conditions=[unschedulable])
        c.event(waiting, "FailedScheduling", "0/3 nodes are available: 3 Insufficient cpu.")
        settle()  # past pending_timeout_s, but pod 0 runs: the Job goes on with the room it has
        seen.append(launched.poll())
        c.terminate(running, 0)

    sim = Cluster(scenario, c)
    launched = None
    monkeypatch.setitem(PREP["kubernetes"], "pending_timeout_s", 1)
    sim.start()
    launched = _prepare(tmp_path)
    assert launched.wait(timeout=60) == 78
    sim.join()
    assert seen == [None]
    assert (
        "unschedulable for 1s (compute.kubernetes.pending_timeout_s): 0/3 nodes are available: 3 Insufficient cpu."
        in (launched.outcome.message)
    )
    _end(launched, api)


def test_cancel_leaves_no_job_and_no_pod(api, tmp_path):
    c = api.cluster
    started = threading.Event()

    def scenario(c):
        c.log(c.start_pods(c.wait_for("Job", NAME))[0], "tokenizing\n")
        started.set()

    sim = Cluster(scenario, c)
    sim.start()
    job = _prepare(tmp_path)
    assert started.wait(30)
    sim.join()
    assert job.poll() is None
    assert cancel_all(grace_s=1) == 1
    assert job.poll() == 76 and c.names() == [] and c.items("Pod") == []
    assert c.deletes == [("Job", NAME, "Foreground")]


def test_a_second_launch_of_the_same_plan_reattaches_to_the_live_job(api, tmp_path):
    c = api.cluster
    running, finish = threading.Event(), threading.Event()

    def scenario(c):
        pods = c.start_pods(c.wait_for("Job", NAME))
        c.log(pods[0], "before the flow pod was evicted\n")
        running.set()
        assert finish.wait(30)
        c.log(pods[0], "after\n")
        _complete(c, pods)

    sim = Cluster(scenario, c)
    sim.start()
    first = _prepare(tmp_path / "flow-1")
    assert running.wait(30)
    first._stop.set()  # the first flow process dies without cleaning up
    second = _prepare(tmp_path / "flow-2")
    assert not second.created
    finish.set()
    assert second.wait(timeout=60) == 0
    sim.join()
    assert c.creates == [("Job", NAME)]
    text = second.tail()
    assert f"tessera.k8s: re-attached to the live Job {NAME} (attempt 0) instead of creating another" in text
    assert "after" in text
    assert _end(second, api) == f"tessera.k8s: Job {NAME} completed"
    forget(first)

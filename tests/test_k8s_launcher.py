"""The Kubernetes launcher's control logic, against a local server that speaks the API's JSON.

The launcher runs unchanged: the official client, configured by a kubeconfig, talks HTTP to
tests/k8s/fake_apiserver.py. Each test plays the cluster's part (the JobSet/Job controllers, the
scheduler, the kubelet) in a thread and checks what the launcher reported and left behind.
No real cluster runs here.
"""

from __future__ import annotations

import threading
import time

import pytest

from infra import allow_launches, cancel_all
from infra.kube_job import KubernetesJob
from infra.kube_relay import LogRelay
from infra.kubernetes import KubernetesBackend
from infra.lifecycle import forget
from tests.k8s.fake_apiserver import FakeApiServer
from tests.k8s.variants import CPU_ONE_NODE, GPU_TWO_NODES, INDEXED_JOB, compute, job_json
from trainers.contract import SUPERVISOR_PID_ENV as SUPERVISOR_ENV

PROGRESS = (
    'tessera.progress {"stage":"s0","stage_index":0,"step":4,"tokens":4096,"stage_start":0,'
    '"stage_end":8192,"loss":3.5,"tokens_per_sec":1000.0,"elapsed_s":4.0}\n'
)


@pytest.fixture()
def api(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(KubernetesJob, "watch_s", 1)
    monkeypatch.setattr(KubernetesJob, "delete_wait_s", 15.0)
    with FakeApiServer() as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig")))
        yield server
        cancel_all(grace_s=0)  # a test that failed half-way leaves no job to the next one
    allow_launches()


def settle() -> None:
    """Give the launcher time to look (a watch round is 1 s here); a real cluster moves slower than a test."""
    time.sleep(2.5)


class Cluster(threading.Thread):
    """Runs a scenario (the cluster's side) beside the launcher; re-raises its assertion in join()."""

    def __init__(self, scenario, cluster):
        super().__init__(daemon=True)
        self.scenario, self.cluster, self.error = scenario, cluster, None

    def run(self):
        try:
            self.scenario(self.cluster)
        except BaseException as exc:  # noqa: BLE001
            self.error = exc

    def join(self, timeout=30):
        super().join(timeout)
        if self.error:
            raise self.error


def _launch(tmp_path, raw, stage=0, run="tiny"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    job_file = tmp_path / f"job-{run}.json"
    job_file.write_text(job_json(run))
    backend = KubernetesBackend(compute(raw))
    return backend.launch(
        "trainers.train",
        ["--job", str(job_file), "--stage", str(stage)],
        log_dir=tmp_path / "logs",
        env={"TESSERA_HOLDER": "flow run 'test'", SUPERVISOR_ENV: "1"},
    )


def _end(job, api) -> str:
    """Cleanup as the training task does (cancel after the end); returns the log's last line."""
    job.cancel(grace_s=1)
    assert api.cluster.names() == []  # nothing left behind
    return job.tail().splitlines()[-1]


def test_success_streams_pod0_and_deletes_everything(api, tmp_path):
    c = api.cluster

    def scenario(c):
        js = c.wait_for("JobSet", "tessera-tiny-s0-a0")
        pods = c.start_pods(js)
        c.log(pods[0], "starting\n" + PROGRESS)
        for p in pods:
            c.terminate(p, 0)
        c.set_condition(
            "JobSet", js["metadata"]["name"], "Completed", "AllJobsCompleted", "jobset completed successfully"
        )

    sim = Cluster(scenario, c)
    sim.start()
    job = _launch(tmp_path, CPU_ONE_NODE)
    assert job.wait(timeout=60) == 0
    sim.join()
    lines = job.new_output()
    assert PROGRESS.strip() in lines and "starting" in lines
    assert _end(job, api) == "tessera.k8s: JobSet tessera-tiny-s0-a0 completed"
    assert ("JobSet", "tessera-tiny-s0-a0", "Foreground") in c.deletes
    assert ("ConfigMap", "tessera-tiny-s0-a0", "Foreground") in c.deletes
    assert ("NetworkPolicy", "tessera-tiny-s0-a0", "Foreground") in c.deletes
    # the policy first (no pod is reachable from outside its group); the ConfigMap carried the job file to the
    # pods, with the pod's own checkpoint folder
    assert c.creates == [
        ("NetworkPolicy", "tessera-tiny-s0-a0"),
        ("ConfigMap", "tessera-tiny-s0-a0"),
        ("JobSet", "tessera-tiny-s0-a0"),
    ]


def test_pod0_output_reaches_the_log_when_the_api_misses_lists_just_after_the_end(api, tmp_path):
    """The relay's round after the end: an unanswered pod list (a busy API server) is asked again, not taken as
    "no pod 0", which once left a completed group's whole output out of its log on a loaded CI machine."""
    c = api.cluster

    def scenario(c):
        js = c.wait_for("JobSet", "tessera-tiny-s0-a0")
        pods = c.start_pods(js, phase="Pending")  # not followed before the end
        c.log(pods[0], "starting\n" + PROGRESS)
        for p in pods:
            c.terminate(p, 0)
        c.set_condition("JobSet", js["metadata"]["name"], "Completed", "AllJobsCompleted", "done")

    sim = Cluster(scenario, c)
    sim.start()
    job = _launch(tmp_path, CPU_ONE_NODE)
    assert job.wait(timeout=60) == 0
    sim.join()
    # the same end again, with the API refusing the first two requests of the relay's last round
    relay = job._relay
    replay = tmp_path / "replay.log"
    ended, stop = threading.Event(), threading.Event()
    ended.set()
    c.faults.errors = 2
    LogRelay(relay.kube, relay.work, relay.container, replay, ended=ended, stop=stop).run()
    assert c.faults.errors == 0
    text = replay.read_text()
    assert "output of pod tessera-tiny-s0-a0-" in text and PROGRESS in text and "starting\n" in text
    _end(job, api)


def test_eviction_restarts_the_group_then_succeeds(api, tmp_path):
    c = api.cluster
    name = "tessera-tiny-s0-a0"

    def scenario(c):
        js = c.wait_for("JobSet", name)
        pods = c.start_pods(js)
        c.log(pods[0], "first attempt\n")
        c.evict(pods[1])  # DisruptionTarget, then the trainer's 76 on SIGTERM
        settle()
        c.terminate(pods[0], 76)  # the JobSet controller tears the rest of the group down
        for p in pods:
            c.remove("Pod", p, "training")
        c.set_status("JobSet", name, restarts=1, restartsCountTowardsMax=0)  # RestartJobSetAndIgnoreMaxRestarts
        pods = c.start_pods(c.get("JobSet", name))
        c.log(pods[0], "second attempt\n" + PROGRESS)
        for p in pods:
            c.terminate(p, 0)
        c.set_condition("JobSet", name, "Completed", "AllJobsCompleted", "jobset completed successfully")

    sim = Cluster(scenario, c)
    sim.start()
    job = _launch(tmp_path, GPU_TWO_NODES)
    assert job.wait(timeout=60) == 0
    sim.join()
    assert job.preemptions == 1 and job.restarts == 0
    text = job.tail()
    assert "first attempt" in text and "second attempt" in text
    assert (
        f"tessera.k8s: JobSet {name} restarted the whole group (restart 1: 0 of max_restarts=4 counted, "
        "1 disruptions); pod tessera-tiny-s0-a0-node-0-1-"
    ) in text
    assert "was disrupted (EvictionByEvictionAPI: Eviction API: evicting)" in text
    assert _end(job, api) == f"tessera.k8s: JobSet {name} completed"
    assert [k for k, _ in c.creates] == ["NetworkPolicy", "ConfigMap", "JobSet"]  # the controller restarted it


def test_a_hang_the_pods_watchdog_killed_restarts_the_group_uncounted_and_is_named(api, tmp_path):
    """Pod 1's watchdog kills its hung ranks and exits 79 with the hang as its termination message
    (infra/pod_launch.py); pod 0's ranks then fail in their collective (75). The JobSet's Hang rule restarts the
    group without counting it against maxRestarts; the launcher names the hang, not the peer's 75."""
    c = api.cluster
    name = "tessera-tiny-s0-a0"
    hang = (
        "the watchdog found rank 3 (tessera-tiny-s0-a0-node-0-1 on node gpu-7, pid 41) hung in phase step for "
        "183 s, over its 180 s budget (10 x the recent steps' p99 of 18.00 s)"
    )

    def scenario(c):
        js = c.wait_for("JobSet", name)
        c.set_condition("JobSet", name, "Suspended", "WorkloadInadmissible", "waiting for quota")  # Kueue holds it
        settle()
        js = c.get("JobSet", name)
        js["status"]["conditions"] = []  # admitted
        c.put("JobSet", js)
        pods = c.start_pods(js)
        c.terminate(pods[1], 79, message=hang)
        settle()
        c.terminate(pods[0], 75)
        for p in pods:
            c.remove("Pod", p, "training")
        c.set_status("JobSet", name, restarts=1, restartsCountTowardsMax=0)  # RestartJobSetAndIgnoreMaxRestarts
        pods = c.start_pods(c.get("JobSet", name))
        c.log(pods[0], PROGRESS)
        for p in pods:
            c.terminate(p, 0)
        c.set_condition("JobSet", name, "Completed", "AllJobsCompleted", "jobset completed successfully")

    for node in ("gpu-0", "gpu-1"):
        c.put("Node", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {"pool": "a"}}}, "")
    sim = Cluster(scenario, c)
    sim.start()
    job = _launch(tmp_path, {**GPU_TWO_NODES, "kubernetes": {**GPU_TWO_NODES["kubernetes"], "avoid_slow_nodes": True}})
    assert job.wait(timeout=60) == 0
    sim.join()
    # avoid_slow_nodes: the hung pod's node is labelled (never cordoned) before the restart; its peer's is not
    hung_node = c.get("Node", "gpu-1", "")
    assert hung_node["metadata"]["labels"] == {"pool": "a", "tessera.dev/avoid": "true"}
    assert hung_node["metadata"]["annotations"]["tessera.dev/avoid-reason"].endswith(hang)
    assert "unschedulable" not in hung_node.get("spec", {})
    assert c.get("Node", "gpu-0", "")["metadata"]["labels"] == {"pool": "a"}
    assert "tessera.k8s: labelled node gpu-1 tessera.dev/avoid=true (pod " in job.tail(50)
    assert job.preemptions == 1 and job.restarts == 0
    assert 1.5 <= job.pending_s <= 4.5  # the goodput ledger's `pending`: the time Kueue held the group
    said = [line for line in job.tail(50).splitlines() if "restarted the whole group" in line]
    assert said == [
        f"tessera.k8s: JobSet {name} restarted the whole group (restart 1: 0 of max_restarts=4 counted, "
        f"1 disruptions); pod {said[0].split('; pod ', 1)[1].split(':', 1)[0]}: {hang}"
    ]
    assert _end(job, api) == f"tessera.k8s: JobSet {name} completed"


def test_fatal_exit_78_ends_at_once_with_the_failing_pods_lines(api, tmp_path):
    c = api.cluster

    def scenario(c):
        pods = c.start_pods(c.wait_for("JobSet"))
        c.log(pods[1], "tessera.train: fatal: stage 'literary' was edited after training on it\n")
        c.terminate(pods[1], 78)

    sim = Cluster(scenario, c)
    sim.start()
    job = _launch(tmp_path, GPU_TWO_NODES)
    assert job.wait(timeout=60) == 78
    sim.join()
    text = job.tail()
    assert "tessera.k8s: last lines of pod tessera-tiny-s0-a0-node-0-1-" in text
    assert "tessera.train: fatal: stage 'literary' was edited after training on it" in text
    last = _end(job, api)
    assert last.startswith("tessera.k8s: JobSet tessera-tiny-s0-a0 failed: pod tessera-tiny-s0-a0-node-0-1-")
    assert last.endswith(": the trainer exited 78 (fatal)")


def test_oomkilled_is_fatal_and_names_the_memory_limit(api, tmp_path):
    def scenario(c):
        pods = c.start_pods(c.wait_for("JobSet"))
        c.terminate(pods[0], 137, reason="OOMKilled")

    sim = Cluster(scenario, api.cluster)
    sim.start()
    job = _launch(tmp_path, CPU_ONE_NODE)
    assert job.wait(timeout=60) == 78
    sim.join()
    assert "container trainer was OOMKilled (memory limit 16Gi); raise compute.kubernetes.memory" in _end(job, api)


def test_stuck_pending_fails_with_the_schedulers_reason(api, tmp_path):
    raw = {**GPU_TWO_NODES, "kubernetes": {**GPU_TWO_NODES["kubernetes"], "pending_timeout_s": 2}}
    message = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available."

    def scenario(c):
        pods = c.start_pods(c.wait_for("JobSet"), phase="Pending")
        for p in pods:
            c.set_pod_status(
                p,
                conditions=[
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/4 nodes are available",
                    }
                ],
            )
            c.event(p, "FailedScheduling", message)

    sim = Cluster(scenario, api.cluster)
    sim.start()
    job = _launch(tmp_path, raw)
    assert job.wait(timeout=60) == 78
    sim.join()
    last = _end(job, api)
    assert "unschedulable for 2s (compute.kubernetes.pending_timeout_s): " + message in last


def test_cancellation_mid_run_deletes_everything(api, tmp_path):
    c = api.cluster
    started = threading.Event()

    def scenario(c):
        pods = c.start_pods(c.wait_for("JobSet"))
        c.log(pods[0], PROGRESS)
        started.set()

    sim = Cluster(scenario, c)
    sim.start()
    job = _launch(tmp_path, GPU_TWO_NODES)
    assert started.wait(30)
    sim.join()
    assert job.poll() is None
    assert cancel_all(grace_s=1) == 1  # what a failing or cancelled flow calls
    assert job.stopped and job.poll() == 76
    assert c.names() == []
    assert {(k, p) for k, _, p in c.deletes} == {
        ("JobSet", "Foreground"),
        ("ConfigMap", "Foreground"),
        ("NetworkPolicy", "Foreground"),
    }


def test_relaunched_task_reattaches_instead_of_creating_a_second_jobset(api, tmp_path):
    c = api.cluster
    name = "tessera-tiny-s0-a0"
    running = threading.Event()
    finish = threading.Event()

    def scenario(c):
        pods = c.start_pods(c.wait_for("JobSet", name))
        c.log(pods[0], "before the flow pod was evicted\n")
        running.set()
        assert finish.wait(30)
        c.log(pods[0], "after\n" + PROGRESS)
        for p in pods:
            c.terminate(p, 0)
        c.set_condition("JobSet", name, "Completed", "AllJobsCompleted", "jobset completed successfully")

    sim = Cluster(scenario, c)
    sim.start()
    first = _launch(tmp_path / "flow-1", GPU_TWO_NODES)
    assert running.wait(30)
    first._stop.set()  # the first flow process dies: it never cleans up
    second = _launch(tmp_path / "flow-2", GPU_TWO_NODES)  # the rescheduled flow run's task
    assert not second.created
    finish.set()
    assert second.wait(timeout=60) == 0
    sim.join()
    assert [k for k, _ in c.creates].count("JobSet") == 1
    text = second.tail()
    assert f"tessera.k8s: re-attached to the live JobSet {name} (attempt 0) instead of creating another" in text
    assert "before the flow pod was evicted" in text and "after" in text
    assert _end(second, api) == f"tessera.k8s: JobSet {name} completed"
    forget(first)  # its process is gone; nothing of it is left to cancel


def test_a_job_its_disruption_rule_failed_is_a_disruption_even_with_the_pod_gone():
    """The Job controller's own condition names the DisruptionTarget rule: a launcher that looks only after the
    evicted pod is gone (a lost node; a launcher slow to poll under load, as the suite once was) still counts a
    disruption, not an application failure that spends max_restarts; any other Job failure stays a failure."""
    from infra.kube_outcome import explain_end
    from trainers.contract import INTERRUPTED, RETRYABLE

    rule = {
        "reason": "PodFailurePolicy",
        "message": "Pod training/p-0 has condition DisruptionTarget matching FailJob rule at index 1",
    }
    outcome = explain_end([], "Job j", rule)
    assert (outcome.code, outcome.cause) == (INTERRUPTED, "disruption") and rule["message"] in outcome.message
    other = {"reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}
    assert (explain_end([], "Job j", other).code, explain_end([], "Job j", other).cause) == (RETRYABLE, "failure")
    fatal_rule = {**rule, "message": "Container trainer for pod training/p-0 failed with exit code 78 matching FailJob"}
    assert explain_end([], "Job j", fatal_rule).cause == "failure"


def test_indexed_job_fallback_deletes_and_recreates_the_group(api, tmp_path):
    c = api.cluster
    name = "tessera-tiny-s0-a0"
    raw = {**INDEXED_JOB, "kubernetes": {**INDEXED_JOB["kubernetes"], "max_restarts": 1}}

    def scenario(c):
        job = c.wait_for("Job", name)
        assert c.get("Service", name) is not None
        pods = c.start_pods(job)
        c.evict(pods[0])
        settle()
        c.set_condition(
            "Job",
            name,
            "Failed",
            "PodFailurePolicy",
            f"Pod training/{pods[0]} has condition DisruptionTarget matching FailJob rule at index 1",
        )
        c.wait_gone("Job", name)
        pods = c.start_pods(c.wait_for("Job", name, new_after=3))  # recreated by the launcher
        c.log(pods[1], "Traceback ... RuntimeError: NCCL error\n")
        c.terminate(pods[1], 75)
        c.set_condition("Job", name, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
        c.wait_gone("Job", name)
        pods = c.start_pods(c.wait_for("Job", name, new_after=4))
        c.log(pods[0], PROGRESS)
        for p in pods:
            c.terminate(p, 0)
        c.set_condition("Job", name, "Complete", "CompletionsReached", "Reached expected number of succeeded pods")

    sim = Cluster(scenario, c)
    sim.start()
    job = _launch(tmp_path, raw)
    assert job.wait(timeout=90) == 0
    sim.join()
    assert (job.preemptions, job.restarts) == (1, 1)
    assert [k for k, _ in c.creates] == ["NetworkPolicy", "ConfigMap", "Service", "Job", "Job", "Job"]
    assert [d for d in c.deletes if d[0] == "Job"] == [("Job", name, "Foreground")] * 2
    text = job.tail()
    assert (
        "was disrupted (EvictionByEvictionAPI: Eviction API: evicting); deleting and recreating the whole group "
        "(restart 0 of max_restarts=1, 1 disruptions)"
    ) in text
    assert "exited 75; deleting and recreating the whole group (restart 1 of max_restarts=1, 1 disruptions)" in text
    assert _end(job, api) == f"tessera.k8s: Job {name} completed"


def test_a_job_recreated_on_a_read_is_watched_afresh_and_its_failure_counted_once(api):
    """The launcher judges a Job on three occasions: a watch event, its first read, and the read after a quiet watch
    round. CI once ended the fallback above with 75 under max_restarts=1: the Job's failure landed on a read, the
    Job was recreated, and the next watch started from the old incarnation's resourceVersion, replayed its deletion
    (still Failed) and counted the one failure twice. Here the Job has failed before the first read."""
    from infra.kube_api import Kube
    from infra.kube_names import TRAIN_CONTAINER, Workload
    from infra.kube_watch import GroupWatch
    from infra.manifests import stage_manifests

    c = api.cluster
    cfg = compute({**INDEXED_JOB, "kubernetes": {**INDEXED_JOB["kubernetes"], "max_restarts": 1}})
    work = Workload("tiny", "train", stage=0)
    objects = stage_manifests(
        cfg.kubernetes, work, cfg.ranks_per_node, "trainers.train", ["--stage", "0"], job_json("tiny"), {}
    )
    kube = Kube(cfg.kubernetes.namespace)
    for obj in objects:
        kube.create(obj)
    name = objects[-1]["metadata"]["name"]
    pods = c.start_pods(c.wait_for("Job", name))
    c.terminate(pods[1], 75)
    c.set_condition("Job", name, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
    first = len(c.creates)

    def scenario(c):
        for p in c.start_pods(c.wait_for("Job", name, new_after=first)):  # the recreated Job
            c.terminate(p, 0)
        c.set_condition("Job", name, "Complete", "CompletionsReached", "Reached expected number of succeeded pods")

    sim = Cluster(scenario, c)
    sim.start()
    said: list[str] = []
    group = GroupWatch(
        kube,
        cfg,
        work,
        objects[-1],
        TRAIN_CONTAINER,
        recreate=True,
        created=True,
        stop=threading.Event(),
        report=said.append,
        delete_wait_s=15.0,
    )
    outcome = group.until_end(1)
    sim.join()
    assert (outcome.code, outcome.cause) == (0, "done"), outcome.message
    assert (group.restarts, group.preemptions) == (1, 0)
    assert [k for k, _ in c.creates].count("Job") == 2
    assert len([line for line in said if "deleting and recreating the whole group" in line]) == 1, said


def test_indexed_job_gives_up_after_max_restarts(api, tmp_path):
    name = "tessera-tiny-s0-a0"
    raw = {**INDEXED_JOB, "kubernetes": {**INDEXED_JOB["kubernetes"], "max_restarts": 0}}

    def scenario(c):
        pods = c.start_pods(c.wait_for("Job", name))
        c.terminate(pods[1], 75)
        c.set_condition("Job", name, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")

    sim = Cluster(scenario, api.cluster)
    sim.start()
    job = _launch(tmp_path, raw)
    assert job.wait(timeout=60) == 75
    assert job.restarts_spent  # max_restarts recreations counted these failures: no task retry on top
    sim.join()
    assert _end(job, api).endswith("container trainer exited 75")


def test_jobset_restarts_exhausted_on_application_failures(api, tmp_path):
    name = "tessera-tiny-s0-a0"

    def scenario(c):
        c.set_status("JobSet", c.wait_for("JobSet", name)["metadata"]["name"], restarts=4, restartsCountTowardsMax=4)
        settle()
        pods = c.start_pods(c.get("JobSet", name))  # the last attempt maxRestarts allows
        c.terminate(pods[0], 1)
        settle()
        c.set_condition(
            "JobSet", name, "Failed", "ReachedMaxRestarts", "jobset failed due to reaching max number of restarts"
        )

    sim = Cluster(scenario, api.cluster)
    sim.start()
    job = _launch(tmp_path, GPU_TWO_NODES)
    assert job.wait(timeout=60) == 1
    sim.join()
    assert job.restarts == 4
    assert job.restarts_spent  # the cluster's budget counted these: the task raises RestartsSpent, no retry
    assert "restarted the whole group (restart 4: 4 of max_restarts=4 counted, 0 disruptions)" in job.tail()
    assert _end(job, api).endswith("container trainer exited 1")


def test_evictions_past_max_preemptions_end_as_preempted(api, tmp_path):
    name = "tessera-tiny-s0-a0"  # GPU_TWO_NODES allows compute.max_preemptions=5

    def scenario(c):
        c.start_pods(c.wait_for("JobSet", name))
        c.set_status("JobSet", name, restarts=6, restartsCountTowardsMax=0)

    sim = Cluster(scenario, api.cluster)
    sim.start()
    job = _launch(tmp_path, GPU_TWO_NODES)
    assert job.wait(timeout=60) == 76
    sim.join()
    assert job.preemptions == 6
    assert _end(job, api).endswith("restarts exhausted on evictions (6 > compute.max_preemptions=5)")


def test_image_pull_backoff_past_its_timeout_is_retryable(api, tmp_path):
    raw = {**CPU_ONE_NODE, "kubernetes": {**CPU_ONE_NODE["kubernetes"], "image_pull_timeout_s": 2}}

    def scenario(c):
        (pod,) = c.start_pods(c.wait_for("JobSet"), phase="Pending")
        c.set_waiting(pod, "ImagePullBackOff", 'Back-off pulling image "registry.example.com/tessera/train:0.1.0"')

    sim = Cluster(scenario, api.cluster)
    sim.start()
    job = _launch(tmp_path, raw)
    assert job.wait(timeout=60) == 75
    assert not job.restarts_spent  # not an application failure: the task's retry is what relaunches it
    sim.join()
    assert "not pulled in 2s: ImagePullBackOff: Back-off pulling image" in _end(job, api)


def test_a_refused_spec_or_a_missing_jobset_api_is_fatal_in_one_line(api, tmp_path):
    c = api.cluster
    c.refuse["JobSet"] = (404, "NotFound", "the server could not find the requested resource")
    job = _launch(tmp_path, CPU_ONE_NODE)
    assert job.wait(timeout=5) == 78
    assert "the JobSet API (jobset.x-k8s.io/v1alpha2) is not installed in this cluster" in _end(job, api)
    c.refuse["JobSet"] = (
        422,
        "Invalid",
        'JobSet.jobset.x-k8s.io "x" is invalid: spec.replicatedJobs[0].name: Invalid value',
    )
    job = _launch(tmp_path, CPU_ONE_NODE, run="other")
    assert job.wait(timeout=5) == 78
    assert _end(job, api).endswith("invalid spec: " + c.refuse["JobSet"][2])


def test_a_rank_slow_three_comparisons_in_a_row_has_its_node_labelled_once_and_a_refusal_is_one_line(api, tmp_path):
    """The flow's relay (tasks/training/train_progress.py) hands the slow rank's node to the launch's job, which
    labels it; without the ClusterRole of infra/k8s/rbac-nodes.yaml the API answers 403 and the flow says so in one
    line."""
    import logging

    from infra.kube_api import Kube
    from infra.kube_nodes import avoid
    from tasks.training.train_progress import ProgressRelay
    from trainers.progress import format_ranks

    c = api.cluster
    c.put("Node", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-7"}}, "")
    kube = Kube("default")
    calls: list[tuple[str, str]] = []

    def avoid_node(node: str, why: str) -> str:
        calls.append((node, why))
        return avoid(kube, node, why)

    said: list[str] = []
    logger = logging.getLogger("test.relay")
    logger.warning = lambda msg, *args: said.append(msg % args if args else msg)  # type: ignore[method-assign]
    relay = ProgressRelay(logger, "tiny", "s", artifacts=False, avoid_node=avoid_node)

    def report(step: int, slow: bool) -> str:
        ranks = [{"rank": 0, "host": "p0", "node": "gpu-3", "compute_s": 0.1}, {"rank": 1, "host": "p1",
                 "node": "gpu-7", "compute_s": 0.3 if slow else 0.1}]  # fmt: skip
        slowest = {"rank": 1, "host": "p1", "node": "gpu-7"}
        return format_ranks({"step": step, "tokens": step * 256, "steps": 50, "ranks": ranks, "slowest": slowest,
                             "slowest_over_median": 1.5 if slow else 1.0, "factor": 1.5, "slow": slow})  # fmt: skip

    relay.feed([report(50, True), report(100, True), report(150, False), report(200, True), report(250, True)])
    assert calls == []  # slow, even again, but never three comparisons in a row
    relay.feed([report(300, True), report(350, True), report(400, True)])
    assert calls == [("gpu-7", "rank 1 of run tiny computed 1.50x the median rank's steps, 3 comparisons in a row "
                               "up to step 300")]  # fmt: skip
    assert c.get("Node", "gpu-7", "")["metadata"]["labels"] == {"tessera.dev/avoid": "true"}
    assert said[-1].startswith("stage s: labelled node gpu-7 tessera.dev/avoid=true (rank 1 of run tiny")
    c.refuse["Node"] = (403, "Forbidden", 'nodes "gpu-7" is forbidden: User cannot patch resource "nodes"')
    assert avoid(kube, "gpu-7", "slow") == (
        'could not label node gpu-7 tessera.dev/avoid=true: 403 Forbidden: nodes "gpu-7" is forbidden: User cannot '
        'patch resource "nodes" (the flow\'s account needs infra/k8s/rbac-nodes.yaml)'
    )

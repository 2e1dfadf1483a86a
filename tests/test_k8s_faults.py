"""The launcher against a control plane that misbehaves the way real ones do (tests/k8s/fake_apiserver.py's
faults): a watch reset mid-stream, 500s, answers slower than the client's timeout, 410 Gone on a watch, an API
server that restarts with its objects. For each: the stage ends in the right state within a bounded time, and
no object is left behind or deleted by mistake. No real cluster runs here.
"""

from __future__ import annotations

import threading
import time

import pytest

from infra import LaunchRefused, allow_launches, cancel_all, kube_api
from infra.kubernetes import KubernetesBackend
from tests.k8s.variants import CPU_ONE_NODE, GPU_TWO_NODES, compute
from tests.test_k8s_launcher import PROGRESS, Cluster, _end, _launch, settle
from tests.test_k8s_launcher import api as api  # the fake API server fixture, shared

NAME = "tessera-tiny-s0-a0"


def _complete(c, pods):
    for p in pods:
        c.terminate(p, 0)
    c.set_condition("JobSet", NAME, "Completed", "AllJobsCompleted", "jobset completed successfully")


def _with(raw, **kube):
    return {**raw, "kubernetes": {**raw["kubernetes"], **kube}}


@pytest.fixture()
def short_timeouts(monkeypatch):
    """Client timeouts a test can outwait: 1 s to connect and to read, a watch's silence 1 s past its end."""
    monkeypatch.setattr(kube_api, "REQUEST_TIMEOUT", (1.0, 1.0))
    monkeypatch.setattr(kube_api, "WATCH_SLACK_S", 1.0)
    monkeypatch.setattr(kube_api, "FOLLOW_READ_S", 2.0)


def test_resets_mid_watch_and_500s_are_ridden_through_with_one_group_and_every_line(api, tmp_path):
    c = api.cluster

    def scenario(c):
        pods = c.start_pods(c.wait_for("JobSet", NAME))
        c.log(pods[0], "before\n")
        c.faults.reset_watches = 3  # the next three watches drop their connection after their first events
        settle()
        c.faults.errors = 6  # then six answers of 500, whatever they answer
        settle()
        c.log(pods[0], "after\n" + PROGRESS)
        _complete(c, pods)

    sim = Cluster(scenario, c)
    sim.start()
    t0 = time.monotonic()
    job = _launch(tmp_path, CPU_ONE_NODE)
    assert job.wait(timeout=60) == 0
    sim.join()
    assert time.monotonic() - t0 < 30
    assert c.faults.reset_watches == 0 and c.faults.errors == 0  # every fault was met
    lines = job.new_output()
    assert "before" in lines and "after" in lines and PROGRESS.strip() in lines
    assert [k for k, _ in c.creates].count("JobSet") == 1  # nothing recreated on the way
    assert "the Kubernetes API is not answering" in job.tail()
    assert _end(job, api) == f"tessera.k8s: JobSet {NAME} completed"


def test_a_watch_from_a_compacted_version_gets_410_and_relists_without_missing_the_end(api, tmp_path):
    c = api.cluster

    def scenario(c):
        pods = c.start_pods(c.wait_for("JobSet", NAME))
        settle()
        # changes the launcher does not watch move the version on; compaction then drops what it last saw
        for i in range(3):
            c.put("ConfigMap", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"other-{i}"}}, "tessera")
        c.compact()
        settle()
        _complete(c, pods)

    sim = Cluster(scenario, c)
    sim.start()
    job = _launch(tmp_path, CPU_ONE_NODE)
    assert job.wait(timeout=60) == 0
    sim.join()
    assert c.expired >= 1  # the 410 was sent, and the launcher read the group again instead of dying
    for i in range(3):
        api.cluster.remove("ConfigMap", f"other-{i}", "tessera")
    assert _end(job, api) == f"tessera.k8s: JobSet {NAME} completed"


def test_an_api_server_restart_that_keeps_its_objects_loses_neither_the_group_nor_its_output(api, tmp_path):
    c = api.cluster
    restarted = threading.Event()

    def scenario(c):
        pods = c.start_pods(c.wait_for("JobSet", NAME))
        c.log(pods[0], "before the restart\n")
        settle()
        api.restart(down_s=3.0)
        restarted.set()
        c.log(pods[0], "after the restart\n" + PROGRESS)
        settle()
        _complete(c, pods)

    sim = Cluster(scenario, c)
    sim.start()
    job = _launch(tmp_path, CPU_ONE_NODE)
    assert job.wait(timeout=60) == 0
    sim.join()
    assert restarted.is_set()
    lines = job.new_output()
    assert "before the restart" in lines and "after the restart" in lines and PROGRESS.strip() in lines
    assert [k for k, _ in c.creates].count("JobSet") == 1
    assert "the Kubernetes API answers again after" in job.tail()
    assert _end(job, api) == f"tessera.k8s: JobSet {NAME} completed"


def test_an_api_lost_past_its_bound_ends_retryable_leaves_the_group_and_the_retry_adopts_it(
    api, tmp_path, short_timeouts
):
    """Slower than the client's timeout for longer than api_lost_s: "lost track", retryable, in bounded time; the
    cleanup after it deletes nothing, and the task's retry re-attaches to the group that trained on meanwhile."""
    c = api.cluster
    raw = _with(CPU_ONE_NODE, api_lost_s=3)
    lost = threading.Event()

    def scenario(c):
        pods = c.start_pods(c.wait_for("JobSet", NAME))
        c.log(pods[0], "training\n")
        settle()
        c.faults.delay_s = 2.5  # every answer now comes after the client gave up on it
        assert lost.wait(30)
        c.faults.delay_s = 0.0
        c.log(pods[0], "still training\n" + PROGRESS)
        settle()
        _complete(c, pods)

    sim = Cluster(scenario, c)
    sim.start()
    first = _launch(tmp_path / "try-1", raw)
    t0 = time.monotonic()
    code = first.wait(timeout=60)
    took = time.monotonic() - t0
    assert code == 75 and first.lost  # RETRYABLE: the task's retry condition lets it run again
    assert took < 3 + 2 * 4 + 5 + 5  # api_lost_s, plus the last attempt's timeouts and backoff: bounded
    last = first.tail().splitlines()[-1]
    assert last.startswith(f"tessera.k8s: lost track of JobSet {NAME}: the Kubernetes API did not answer for ")
    assert "(compute.kubernetes.api_lost_s=3)" in last and "re-attaches to it if it still runs" in last
    first.cancel(grace_s=0)  # what the training task does after every launch
    assert c.deletes == [] and c.get("JobSet", NAME) is not None  # not deleted blind
    lost.set()
    second = _launch(tmp_path / "try-2", raw)  # the task's retry
    assert not second.created
    assert second.wait(timeout=60) == 0
    sim.join()
    assert [k for k, _ in c.creates].count("JobSet") == 1
    assert "still training" in second.new_output()
    assert _end(second, api) == f"tessera.k8s: JobSet {NAME} completed"


def test_a_cancel_never_waits_behind_a_slow_api_and_the_launch_it_overtook_leaves_nothing(api, tmp_path):
    c = api.cluster
    c.faults.delay_s = 1.0  # every call of the launch takes a second
    outcome: dict = {}

    def launch():
        try:
            outcome["job"] = _launch(tmp_path, CPU_ONE_NODE)
        except LaunchRefused as exc:
            outcome["refused"] = str(exc)

    thread = threading.Thread(target=launch)
    thread.start()
    time.sleep(1.5)  # the launch is listing and creating: the lock used to be held all that time
    t0 = time.monotonic()
    cancel_all(grace_s=0)
    assert time.monotonic() - t0 < 0.5
    thread.join(60)
    c.faults.delay_s = 0.0
    assert "not launching JobSet tessera-tiny-s0-a0: this process is stopping its jobs" in outcome.get("refused", "")
    deadline = time.monotonic() + 20
    while c.names() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert c.names() == []  # what it had created was deleted by the launch itself
    allow_launches()


def test_the_objects_beside_a_jobset_are_owned_by_it(api, tmp_path):
    c = api.cluster
    job = _launch(tmp_path, CPU_ONE_NODE)
    js = c.wait_for("JobSet", NAME)
    for kind in ("ConfigMap", "NetworkPolicy"):
        refs = c.get(kind, NAME)["metadata"]["ownerReferences"]
        assert refs == [
            {
                "apiVersion": "jobset.x-k8s.io/v1alpha2",
                "kind": "JobSet",
                "name": NAME,
                "uid": js["metadata"]["uid"],
                "blockOwnerDeletion": False,
            }
        ]
    job.cancel(grace_s=0)
    assert c.names() == []


def test_time_suspended_in_a_kueue_queue_is_not_pending_time(api, tmp_path):
    """pending_timeout_s is for an admitted group's unschedulable pods; a queue is waited in as long as it takes,
    unless queue_timeout_s says otherwise."""
    c = api.cluster

    def scenario(c):
        c.wait_for("JobSet", NAME)
        c.set_condition("JobSet", NAME, "Suspended", "WorkloadInadmissible", "waiting for quota")
        time.sleep(4)  # twice pending_timeout_s
        js = c.get("JobSet", NAME)
        js["status"]["conditions"] = []  # admitted
        c.put("JobSet", js)
        _complete(c, c.start_pods(js))

    sim = Cluster(scenario, c)
    sim.start()
    job = _launch(tmp_path, _with(GPU_TWO_NODES, pending_timeout_s=2))
    assert job.wait(timeout=60) == 0
    sim.join()
    assert 3.0 <= job.pending_s <= 7.0  # still the goodput ledger's `pending`
    assert job.tail().splitlines()[-1] == f"tessera.k8s: JobSet {NAME} completed"
    job.cancel(grace_s=0)

    # a queue with a limit: the group fails once past it, fatal, naming the queue
    sim = Cluster(
        lambda c: c.set_condition(
            "JobSet",
            c.wait_for("JobSet", "tessera-queued-s0-a0")["metadata"]["name"],
            "Suspended",
            "WorkloadInadmissible",
            "waiting for quota",
        ),
        c,
    )
    sim.start()
    job = _launch(tmp_path / "2", _with(GPU_TWO_NODES, queue_timeout_s=2, queue_name="team-a"), run="queued")
    assert job.wait(timeout=60) == 78
    sim.join()
    assert job.tail().splitlines()[-1] == (
        "tessera.k8s: JobSet tessera-queued-s0-a0 suspended for 2s (compute.kubernetes.queue_timeout_s), not admitted "
        "in queue team-a: waiting for quota"
    )
    assert _end(job, api)


def test_an_evaluation_pod_rides_through_resets_and_500s(api, tmp_path):
    c = api.cluster

    def scenario(c):
        job = c.wait_for("Job")
        pods = c.start_pods(job)
        c.faults.reset_watches, c.faults.errors = 2, 4
        settle()
        c.log(pods[0], 'tessera.eval {"average": 0.5}\n')
        c.terminate(pods[0], 0)
        c.set_condition("Job", job["metadata"]["name"], "Complete", "CompletionsReached", "done")

    sim = Cluster(scenario, c)
    sim.start()
    job = KubernetesBackend(compute(CPU_ONE_NODE)).launch_one(
        "evaluation", ["--checkpoint", "s3://b/ckpt.pt"], run="tiny", tokens=4096, log_dir=tmp_path / "eval"
    )
    assert job.wait(timeout=60) == 0
    sim.join()
    assert 'tessera.eval {"average": 0.5}' in job.new_output()
    assert [k for k, _ in c.creates].count("Job") == 1
    job.cancel(grace_s=0)
    assert c.names() == []


def _stage_task(tmp_path, raw, retries: int):
    """tasks.training.train.train_stage in a Prefect flow, with the retries the pipeline gives it
    (compute.max_restarts)."""
    from prefect import flow

    from tasks.training.train import train_stage
    from tests.support.training import tiny_job, write_job
    from trainers.config import StageConfig

    tmp_path.mkdir(parents=True, exist_ok=True)
    job = tiny_job(tmp_path, {"src": "s3://data/src"}, [StageConfig(name="s0", tokens=4096, mixture={"src": 1.0})])
    job_path = write_job(job, tmp_path / "job.json")

    @flow(name="k8s-stage")
    def one_stage():
        task = train_stage.with_options(retries=retries, retry_delay_seconds=0)
        return task(str(job_path), 0, "s0", compute(raw), str(tmp_path / "logs"), run_name="tiny")

    try:
        return one_stage()
    except Exception as exc:  # noqa: BLE001 - the test looks at what it was
        return exc


def test_retry_budgets_do_not_multiply_the_cluster_counts_application_failures_the_task_the_launchers(
    api, tmp_path, prefect_harness
):
    """compute.kubernetes.max_restarts counts a group's application failures, in the cluster; the task's retries
    (compute.max_restarts) count only what the cluster cannot retry (here an image never pulled)."""
    c = api.cluster
    raw = _with(CPU_ONE_NODE, max_restarts=2, image_pull_timeout_s=1)

    def spent(c):  # the group fails after its two in-cluster restarts
        c.set_status("JobSet", c.wait_for("JobSet", NAME)["metadata"]["name"], restarts=2, restartsCountTowardsMax=2)
        pods = c.start_pods(c.get("JobSet", NAME))
        c.terminate(pods[0], 75)
        settle()
        c.set_condition("JobSet", NAME, "Failed", "ReachedMaxRestarts", "jobset failed due to reaching max restarts")

    sim = Cluster(spent, c)
    sim.start()
    outcome = _stage_task(tmp_path / "spent", raw, retries=2)
    sim.join()
    assert type(outcome).__name__ == "RestartsSpent"
    assert "after 2 restarts of the group in the cluster, compute.kubernetes.max_restarts spent" in str(outcome)
    assert [k for k, _ in c.creates].count("JobSet") == 1  # not 3 groups of 3 attempts each
    assert c.names() == []

    c.creates.clear()

    def pull_then_run(c):  # the launcher's own failure: the task's retry starts a new group, which succeeds
        (pod,) = c.start_pods(c.wait_for("JobSet", NAME), phase="Pending")
        c.set_waiting(pod, "ImagePullBackOff", "Back-off pulling image")
        js = c.wait_for("JobSet", NAME, new_after=3, timeout=60)  # created again once the first was deleted
        pods = c.start_pods(js)
        c.log(pods[0], PROGRESS)
        for p in pods:
            c.terminate(p, 0)
        c.set_condition("JobSet", NAME, "Completed", "AllJobsCompleted", "done")

    sim = Cluster(pull_then_run, c)
    sim.start()
    outcome = _stage_task(tmp_path / "pull", raw, retries=2)
    sim.join(timeout=90)
    assert outcome == 0
    assert [n for k, n in c.creates if k == "JobSet"] == [NAME, NAME]  # the first deleted before the second
    assert c.names() == []


def test_a_blip_during_cleanup_neither_fails_the_stage_nor_leaves_an_object(api, tmp_path):
    c = api.cluster
    sim = Cluster(lambda c: _complete(c, c.start_pods(c.wait_for("JobSet", NAME))), c)
    sim.start()
    job = _launch(tmp_path, CPU_ONE_NODE)
    assert job.wait(timeout=60) == 0
    sim.join()
    c.faults.errors = 5  # the deletes and the looks that wait for them get 500s first
    assert _end(job, api) == f"tessera.k8s: JobSet {NAME} completed"  # no exception, and nothing left
    assert c.faults.errors == 0

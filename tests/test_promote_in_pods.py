"""Promotion's scoring with the kubernetes backend: champion and challenger each scored in an evaluation pod.

The launcher runs unchanged against tests/k8s/fake_apiserver.py; the test plays the kubelet by running each
pod's own command (`python -m evaluation --report-only ...`) as a local process, so the reports the flow
decides on really come from the pod's entrypoint scoring a real tiny model from a real (sqlite) registry.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import threading

import pytest
import transformers

from evaluation.config import EvalConfig
from evaluation.errors import GauntletError
from infra import allow_launches, cancel_all
from infra.kube_job import KubernetesJob
from tasks.registry.aliases import record_started
from tasks.registry.promote_config import PromoteConfig
from tasks.registry.register import CHAMPION_ALIAS
from tasks.tracking_config import TrackingConfig
from tests.conftest import ROOT
from tests.k8s.fake_apiserver import FakeApiServer
from tests.k8s.variants import CPU_ONE_NODE, compute
from tests.support.gauntlet import tiny_llama
from tests.support.mlflow_store import sqlite_store

pytestmark = pytest.mark.usefixtures("prefect_harness")

TOKENIZER = ROOT / "data" / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"
LOCAL_DATA = ROOT / "data" / "gauntlet" / "eval" / "local_data"
# with s3_credentials, as a real recipe has them (a SecretRef once broke every task given the config)
K8S = compute(CPU_ONE_NODE)


class Kubelet(threading.Thread):
    """The Job controller and kubelet of the fake cluster: each Job the launcher creates gets its pod, which runs
    the container's command here, logs what it prints, ends with its exit code, and the Job's condition follows.
    `crash_first`: that many pods end with exit 1 without running, as on a node that died under them."""

    def __init__(self, cluster, crash_first: int = 0):
        super().__init__(daemon=True)
        self.cluster, self.crash_first = cluster, crash_first
        self.commands: list[list[str]] = []
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        seen = 0
        try:
            while not self._halt.is_set():
                with self.cluster.cond:
                    created = len(self.cluster.creates)
                if created == seen:
                    self._halt.wait(0.1)
                    continue
                kind, name = self.cluster.creates[seen]
                seen += 1
                if kind == "Job":
                    self._run(self.cluster.get("Job", name))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test by stop()
            self.error = exc

    def _run(self, job: dict) -> None:
        c = self.cluster
        (pod,) = c.start_pods(job)
        container = job["spec"]["template"]["spec"]["containers"][0]
        argv = container["command"]
        self.commands.append(argv)
        if self.crash_first > 0:
            self.crash_first -= 1
            c.log(pod, "Fatal Python error: Bus error\n")
            code = 1
        else:
            env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
            assert argv[:3] == ["python", "-m", "evaluation"], argv
            proc = subprocess.run(
                [sys.executable, *argv[1:]],
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=600,
            )
            c.log(pod, proc.stdout)
            code = proc.returncode
        c.terminate(pod, code)
        name = job["metadata"]["name"]
        if code == 0:
            c.set_condition("Job", name, "Complete", "", "", succeeded=1)
        else:
            c.set_condition(
                "Job", name, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
            )

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
        if self.error:
            raise self.error


@pytest.fixture()
def cluster(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(KubernetesJob, "watch_s", 1)
    monkeypatch.setattr(KubernetesJob, "delete_wait_s", 15.0)
    # the pods' local logs (under the temp dir) of this test only: another session may score the same names
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with FakeApiServer() as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig")))
        yield server.cluster
        cancel_all(grace_s=0)
    allow_launches()


@pytest.fixture()
def gauntlet(tmp_path) -> EvalConfig:
    """The demo's tiny gauntlet over the first 12 records of each file, as promotion configures it."""
    from tests.support.gauntlet import cut_demo_tasks

    root = cut_demo_tasks(LOCAL_DATA, tmp_path / "gauntlet", records=12)
    return EvalConfig(
        every=1,
        tasks=str(ROOT / "configs" / "gauntlet" / "tiny_tasks.yaml"),
        gauntlet=str(ROOT / "configs" / "gauntlet" / "tiny_gauntlet.yaml"),
        data_root=str(root),
        strict=True,
        max_seq_len=64,
    )


@pytest.fixture()
def registry(tmp_path):
    """Model `m`: v1 (the champion) and v2, each a different tiny Llama saved as an HF directory in its run."""
    from mlflow.tracking import MlflowClient

    from tasks.registry.promote import bootstrap
    from tasks.registry.version_record import write_version_record

    tracking = TrackingConfig(
        tracking_uri=sqlite_store(tmp_path / "m.db"), artifact_location=str(tmp_path / "art"), registered_model="m"
    )
    client = MlflowClient(tracking.tracking_uri, tracking.tracking_uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    client.create_registered_model("m", tags=record_started())
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>", pad_token="<|padding|>"
    )
    for seed in (1, 2):
        model = tiny_llama(len(tok), seed)
        hf = tmp_path / f"hf{seed}"
        model.save_pretrained(hf)
        tok.save_pretrained(hf)
        run = client.create_run(experiment).info.run_id
        client.log_artifacts(run, str(hf), "model")
        mv = client.create_model_version(
            "m", f"{client.get_run(run).info.artifact_uri}/model", run, tags={"tokens": str(1024 * seed)}
        )
        write_version_record(client, "m", mv.version, {"storage": "copy"})
    assert bootstrap(client, "m", "1", "base")
    return client, tracking, client.create_run(experiment).info.run_id


def _in_process(model: str, cfg: EvalConfig, tracking: TrackingConfig):
    from tasks.gauntlet.score import score_model

    return score_model.fn(model, cfg, tracking.tracking_uri)


def _without_time(report):
    return dataclasses.replace(report, seconds=0.0)


@pytest.fixture()
def no_model_here(monkeypatch):
    """From here on, loading or scoring a model in this (the flow's) process fails the test."""
    import evaluation.models
    import evaluation.runner

    def never(*args, **kwargs):
        raise AssertionError("the flow process loaded or scored a model itself")

    monkeypatch.setattr(evaluation.models, "load_model", never)
    monkeypatch.setattr(evaluation.runner, "run_gauntlet", never)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", never)


def test_promotion_scores_both_models_in_pods_as_the_flow_would_in_process(
    cluster, registry, gauntlet, monkeypatch, request
):
    from prefect import flow

    import tasks.registry.promote
    from evaluation.spec import load_gauntlet
    from tasks.registry.promote_rule import decide

    client, tracking, run_id = registry
    rule = PromoteConfig(min_gain=-1.0, max_category_drop=1.0)
    local = {v: _in_process(f"models:/m/{v}", gauntlet, tracking) for v in ("1", "2")}
    expected = decide(local["1"], local["2"], rule, load_gauntlet(gauntlet.gauntlet))
    assert local["1"].average != local["2"].average  # two different models: a mix-up could not pass

    request.getfixturevalue("no_model_here")
    decided = []
    real_decide = tasks.registry.promote.decide
    monkeypatch.setattr(
        tasks.registry.promote, "decide", lambda a, b, *rest: decided.append((a, b)) or real_decide(a, b, *rest)
    )
    kubelet = Kubelet(cluster)
    kubelet.start()

    @flow(name="promote-in-pods")
    def promote():
        # eval.max_seq_len is set: max_seq_len (the recipe's seq_len) is what a recipe without it would use
        return tasks.registry.promote.promote_challenger(gauntlet, tracking, rule, "cpt-pods", run_id, 2, 128, K8S)

    decision, champion = promote()
    kubelet.stop()

    # each model in its own pod, through the report-only entrypoint
    assert [argv[argv.index("--checkpoint") + 1] for argv in kubelet.commands] == ["models:/m/1", "models:/m/2"]
    assert all("--report-only" in argv and "--run-id" not in argv for argv in kubelet.commands)
    (champion_report, challenger_report) = decided[0]
    # the whole report came back from the pod: per-task results and each example's outcome, as in-process
    assert _without_time(champion_report) == _without_time(local["1"])
    assert _without_time(challenger_report) == _without_time(local["2"])
    assert champion_report.tasks[0].hits
    assert decision == expected and decision.gain_interval is not None and decision.accepted
    assert champion == 2 and str(client.get_registered_model("m").aliases[CHAMPION_ALIAS]) == "2"
    assert cluster.names() == []  # every pod's Job deleted once read


def test_a_bad_input_pod_is_a_one_line_gauntlet_error_and_is_not_retried(cluster, registry, gauntlet, no_model_here):
    from prefect import flow

    from tasks.gauntlet.score import score_in_pod

    _, tracking, _ = registry
    kubelet = Kubelet(cluster)
    kubelet.start()

    @flow(name="score-bad-input-in-pod")
    def score():
        return score_in_pod("models:/m/9", gauntlet, tracking.tracking_uri, K8S, "cpt-pods-promote-v9")

    with pytest.raises(GauntletError) as info:
        score()
    kubelet.stop()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("scoring models:/m/9 exited 78: models:/m/9: cannot download from MLflow: "), message
    assert len(kubelet.commands) == 1  # the same input fails the same way: no second pod


def test_a_pod_that_crashed_is_retried_in_a_new_pod(cluster, registry, gauntlet, no_model_here):
    from prefect import flow

    from tasks.gauntlet.score import score_in_pod

    _, tracking, _ = registry
    kubelet = Kubelet(cluster, crash_first=1)
    kubelet.start()

    @flow(name="score-retried-in-pod")
    def score():
        return score_in_pod("models:/m/1", gauntlet, tracking.tracking_uri, K8S, "cpt-pods-promote-v1")

    report = score()
    kubelet.stop()
    assert len(kubelet.commands) == 2
    assert report.tasks and report.examples > 0
    # the crashed pod's Job deleted, then the same unit's Job created again for the retry
    assert [n for k, n in cluster.creates if k == "Job"] == ["tessera-cpt-pods-promote-v1-e0-a0"] * 2
    assert ("Job", "tessera-cpt-pods-promote-v1-e0-a0", "Foreground") in cluster.deletes
    assert cluster.names() == []

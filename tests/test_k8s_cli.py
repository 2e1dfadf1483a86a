"""`tessera k8s render` prints the manifests the launcher would create; `tessera k8s status` lists a run's objects."""

from __future__ import annotations

import json

import kubernetes_validate
import yaml

from cli.main import main
from infra.kubernetes import KubernetesBackend
from tests.conftest import ROOT
from tests.k8s.fake_apiserver import FakeApiServer
from tests.k8s.variants import GPU_KUEUE, compute, job_json


def _recipe(tmp_path, compute_section: dict) -> str:
    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    raw["work_dir"] = str(tmp_path / "work")
    raw["data"]["root"] = "s3://tessera-data/prepared"
    for src in raw["data"]["sources"]:  # the prepare Job's pods read the sources themselves
        src["paths"] = [f"s3://tessera-data/corpora/{src['name']}/"]
    raw["train"]["save_folder"] = "s3://tessera-ckpt/runs"
    raw["tracking"]["tracking_uri"] = "http://mlflow.tessera.svc:5000"
    raw["compute"] = compute_section
    raw["train"]["global_batch_size"] = 16  # one sequence per rank of the 2 x 8 GPU variants
    path = tmp_path / "k8s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_render_prints_valid_manifests_of_the_stage(tmp_path, capsys):
    recipe = _recipe(tmp_path, GPU_KUEUE)
    # a fresh checkout: no job file yet, the objects come from the recipe alone and the first line says so
    assert main(["k8s", "render", recipe, "--stage", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# tessera: from {recipe} alone (no job file at ")
    docs = list(yaml.safe_load_all(out))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("NetworkPolicy", "tessera-tiny-s1-a0"),
        ("ConfigMap", "tessera-tiny-s1-a0"),
        ("JobSet", "tessera-tiny-s1-a0"),
    ]
    planned = json.loads(docs[1]["data"]["job.json"])
    assert (planned["vocab_size"], planned["eos_token_id"], planned["seq_len"]) == (50277, 0, 128)
    assert planned["streams"] == {
        "literary": "s3://tessera-data/prepared/literary-{prepare-hash}/train",
        "stories": "s3://tessera-data/prepared/stories-{prepare-hash}/train",
    }
    assert planned["tokenizer_dir"] == "s3://tessera-data/prepared/tokenizer-{prepare-hash}"
    assert planned["mlflow"]["run_id"] == "{mlflow-run-id}"
    for doc in docs[:2]:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)

    # once `tessera run` has written the run's job file, that is what is rendered, and said
    job = tmp_path / "work" / "runs" / "tiny" / "job.json"
    job.parent.mkdir(parents=True)
    job.write_text(job_json("tiny"))
    assert main(["k8s", "render", recipe, "--stage", "1", "--attempt", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"# tessera: from the job file {job}"
    docs = list(yaml.safe_load_all(out))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("NetworkPolicy", "tessera-tiny-s1-a2"),
        ("ConfigMap", "tessera-tiny-s1-a2"),
        ("JobSet", "tessera-tiny-s1-a2"),
    ]
    assert docs[2]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert json.loads(docs[1]["data"]["job.json"])["save_folder"] == "/var/tessera/work/checkpoints"
    for doc in docs[:2]:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    assert main(["k8s", "render", recipe, "--stage", "7"]) == 2
    assert "--stage: 7 is not a stage of" in capsys.readouterr().err


def test_render_refuses_the_job_file_of_another_run_in_one_line(tmp_path, capsys):
    """The demo's job file under the 1B recipe would render the tiny model and local paths as if they were its."""
    demo = json.loads(job_json("k8s-1b"))
    demo["model"] = {"n_layers": 2, "d_model": 64, "n_heads": 4}
    other = tmp_path / "job.json"
    other.write_text(json.dumps(demo))
    recipe = str(ROOT / "configs" / "k8s-1b.yaml")
    assert main(["k8s", "render", recipe, "--stage", "0", "--job", str(other)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"tessera: error: {other}: seq_len is 128 where {recipe} says 2048: the job file of another run; pass "
        "this recipe's run's job file, or no --job to render from the recipe alone"
    )
    demo["seq_len"] = 2048
    other.write_text(json.dumps(demo))
    assert main(["k8s", "render", recipe, "--stage", "0", "--job", str(other)]) == 2
    assert f"{other}: model.n_layers is 2 where {recipe} says 24" in capsys.readouterr().err
    assert main(["k8s", "render", recipe, "--stage", "0", "--job", str(tmp_path / "none.json")]) == 2
    assert f"--job: {tmp_path / 'none.json'}: no such file" in capsys.readouterr().err


def test_render_refuses_a_local_recipe(capsys):
    assert main(["k8s", "render", str(ROOT / "configs" / "tiny.yaml"), "--stage", "0"]) == 2
    assert "compute.backend: is 'local'; `tessera k8s` needs kubernetes" in capsys.readouterr().err


def test_status_lists_the_live_objects_of_a_run(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with FakeApiServer() as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig")))
        (tmp_path / "job.json").write_text(job_json("tiny"))
        job = KubernetesBackend(compute(GPU_KUEUE)).launch(
            "trainers.train", ["--job", str(tmp_path / "job.json"), "--stage", "0"], log_dir=tmp_path / "logs"
        )
        server.cluster.start_pods(server.cluster.wait_for("JobSet"))
        assert main(["k8s", "status", "tiny", "--namespace", "training"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].split() == ["KIND", "NAME", "COMPONENT", "STAGE", "ATTEMPT", "STATE", "CREATED"]
        assert out[1].split()[:6] == ["JobSet", "tessera-tiny-s0-a0", "train", "0", "0", "Running"]
        assert [line.split()[0] for line in out[1:]] == ["JobSet", "Pod", "Pod", "ConfigMap", "NetworkPolicy"]
        assert "Running" in out[2]
        job.cancel(grace_s=1)
        assert main(["k8s", "status", "tiny", "--namespace", "training"]) == 0
        assert capsys.readouterr().out.strip() == "no live objects of run tiny in namespace training"
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    assert main(["k8s", "status", "tiny"]) == 1
    assert "no Kubernetes API to talk to" in capsys.readouterr().err

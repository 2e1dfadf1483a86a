"""The gauntlet on real checkpoints: Composer .pt, HF directory, MLflow model URI; Prefect and MLflow outputs."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import transformers

from evaluation.config import EvalConfig
from evaluation.errors import GauntletError
from evaluation.runner import run_gauntlet
from tasks.tracking_config import TrackingConfig
from tests.support.gauntlet import tiny_llama
from trainers.format.checkpoints import CheckpointInfo

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"
LOCAL_DATA = ROOT / "data" / "gauntlet" / "eval" / "local_data"


def _tokenizer():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>", pad_token="<|padding|>"
    )


@pytest.fixture(scope="module")
def small_gauntlet(tmp_path_factory) -> EvalConfig:
    """The demo's tiny YAMLs over the first 12 records of each file, so every test scores in a second."""
    from tests.support.gauntlet import cut_demo_tasks

    root = cut_demo_tasks(LOCAL_DATA, tmp_path_factory.mktemp("gauntlet"), records=12)
    return EvalConfig(
        every=1,
        tasks=str(ROOT / "configs" / "gauntlet" / "tiny_tasks.yaml"),
        gauntlet=str(ROOT / "configs" / "gauntlet" / "tiny_gauntlet.yaml"),
        data_root=str(root),
    )


@pytest.fixture(scope="module")
def composer_checkpoint(tmp_path_factory):
    """A checkpoint written by Composer's Trainer around HuggingFaceModel, tokenizer embedded; and its model."""
    from composer import Trainer
    from composer.models import HuggingFaceModel

    tok = _tokenizer()
    model = tiny_llama(len(tok), seed=3)
    ids = torch.randint(2, 1000, (4, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    folder = tmp_path_factory.mktemp("ckpt")
    trainer = Trainer(
        model=HuggingFaceModel(model, tokenizer=tok, use_logits=True),
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=4),
        max_duration="1ba",
        save_folder=str(folder),
        save_filename="ba{batch}.pt",
        save_interval="1ba",
        device="cpu",
        progress_bar=False,
        loggers=[],
    )
    trainer.fit()
    trainer.close()
    return folder / "ba1.pt", model.eval(), tok


def _prefect_artifact(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, TaskRunFilter
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            flow_run_filter=FlowRunFilter(),
            task_run_filter=TaskRunFilter(),
            offset=0,
            limit=1,
            sort=ArtifactSort.CREATED_DESC,
        )
    assert found, f"no Prefect artifact {key}"
    return found[0]


@pytest.fixture()
def mlflow_run(mlflow_uri, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    exp = client.create_experiment("eval-test", artifact_location=str(tmp_path / "artifacts"))
    return client, client.create_run(exp).info.run_id


def test_a_damaged_checkpoint_is_not_scored(
    prefect_harness, mlflow_run, mlflow_uri, composer_checkpoint, small_gauntlet, tmp_path
):
    """Bytes flipped in a tensor load silently with torch.load; the evaluation refuses them in one line."""
    from prefect import flow

    from tasks.gauntlet.evaluate import evaluate_checkpoint

    path, _, _ = composer_checkpoint
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(bytes(data))
    torch.load(damaged, map_location="cpu", weights_only=False)  # what used to happen: no complaint
    _, run_id = mlflow_run
    info = CheckpointInfo(path=str(damaged), tokens=4096, batch=1, stage="s0", stage_index=0)

    @flow(name="eval-damaged")
    def one():
        tracking = TrackingConfig(tracking_uri=mlflow_uri, registered_model="m")
        return evaluate_checkpoint(info, small_gauntlet, tracking, run_id, 128, "tiny")

    with pytest.raises(GauntletError, match=rf"^{damaged}: damaged checkpoint, not evaluated: CRC-32 mismatch in "):
        one()

    # `tessera eval/compare --model FILE` of a run's checkpoint: verified against the manifest beside it
    from evaluation.models import load_model
    from trainers.format.checkpoints import file_sha256, publish

    save = tmp_path / "save"
    save.mkdir()
    copy = save / "ckpt.pt"
    copy.write_bytes(path.read_bytes())
    publish(save, CheckpointInfo(path=str(copy), tokens=4096, batch=1, stage="s0", stage_index=0))
    published = file_sha256(copy)
    copy.write_bytes(bytes(data))
    with pytest.raises(GauntletError) as refused:
        load_model(str(copy))
    assert str(refused.value) == (
        f"{copy}: damaged checkpoint, not evaluated: SHA-256 {file_sha256(copy)} is not the {published} published"
    )


def test_the_evaluation_pod_refuses_what_the_in_process_task_refuses(
    composer_checkpoint, small_gauntlet, tmp_path, capsys
):
    """With the kubernetes backend the gauntlet runs in `python -m evaluation`; it checks the manifest's SHA-256
    (given by the flow) or the zip CRCs itself, and exits 78, a bad input that a retry would not mend."""
    from evaluation.__main__ import _verified, main, parse_args
    from evaluation.protocol import EXIT_FATAL
    from tasks.gauntlet.evaluate import pod_args
    from trainers.format.checkpoints import file_sha256

    path, _, _ = composer_checkpoint
    published = file_sha256(path)
    info = CheckpointInfo(path=str(path), tokens=4096, batch=1, stage="s0", stage_index=0, sha256=published)
    tracking = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", registered_model="m")
    args = pod_args(info, small_gauntlet, tracking, "run", 128)
    assert parse_args(args).sha256 == published  # the flow hands the pod the manifest's hash
    assert _verified(str(path), parse_args(args)) == str(path)

    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(bytes(data))
    common = [
        "--tasks",
        small_gauntlet.tasks,
        "--data-root",
        small_gauntlet.data_root,
        "--tracking-uri",
        tracking.tracking_uri,
        "--run-id",
        "run",
        "--step",
        "4096",
    ]
    assert main(["--checkpoint", str(damaged), *common]) == EXIT_FATAL
    assert capsys.readouterr().err.startswith(
        f"tessera.eval: bad input: {damaged}: damaged checkpoint, not evaluated: CRC-32 mismatch in "
    )
    assert main(["--checkpoint", str(damaged), "--sha256", published, *common]) == EXIT_FATAL
    err = capsys.readouterr().err
    assert err.startswith(f"tessera.eval: bad input: {damaged}: damaged checkpoint, not evaluated: SHA-256 "), err
    assert err.rstrip().endswith(f"is not the {published} published")
    # a valid checkpoint that is not the one published (its CRCs pass): refused by the hash alone
    assert main(["--checkpoint", str(path), "--sha256", "0" * 64, *common]) == EXIT_FATAL
    assert "not evaluated: SHA-256 " in capsys.readouterr().err
    assert not (tmp_path / "m.db").exists()  # refused before anything was logged


def test_evaluate_checkpoint_logs_to_mlflow_and_prefect(
    prefect_harness, mlflow_run, mlflow_uri, composer_checkpoint, small_gauntlet
):
    from prefect import flow

    from tasks.artifacts import artifact_key
    from tasks.gauntlet.evaluate import evaluate_checkpoint

    path, trained, tok = composer_checkpoint
    client, run_id = mlflow_run
    info = CheckpointInfo(path=str(path), tokens=4096, batch=1, stage="s0", stage_index=0)
    tracking = TrackingConfig(tracking_uri=mlflow_uri, registered_model="m")
    later = info.model_copy(update={"tokens": 8192})

    # Inside a flow, as the pipeline runs it: Prefect keeps artifacts of flow runs only.
    @flow(name="eval-test")
    def two_checkpoints():
        return [evaluate_checkpoint(c, small_gauntlet, tracking, run_id, 128, "tiny") for c in (info, later)]

    summary, second = two_checkpoints()

    # The checkpoint's weights were loaded: same scores as the in-memory model that trained.
    expected = run_gauntlet(trained, tok, small_gauntlet, 128)
    assert summary.metrics == pytest.approx(expected.metrics())
    assert summary.average == pytest.approx(expected.averages["core_average"])
    assert set(summary.metrics) == {
        "icl/lambada_openai_small/0-shot",
        "icl/copa/0-shot",
        "icl/winograd/0-shot",
        "gauntlet/commonsense_reasoning",
        "gauntlet/language_understanding",
        "gauntlet/core_average",
    }

    history = client.get_metric_history(run_id, "gauntlet/core_average")
    assert sorted((m.step, m.value) for m in history) == [
        (4096, pytest.approx(summary.average)),
        (8192, pytest.approx(second.average)),
    ]
    files = {f.path for f in client.list_artifacts(run_id, "eval")}
    assert {summary.report_html, summary.report_json, summary.table} <= files

    # A rerun of the run (a cancel came between scoring and registering): the same bytes on the same gauntlet
    # are read from Prefect's cache, not scored again; the MLflow run gains no point
    @flow(name="eval-test-rerun")
    def again():
        return evaluate_checkpoint(info, small_gauntlet, tracking, run_id, 128, "tiny", return_state=True)

    state = again()
    assert state.name == "Cached" and state.result() == summary
    assert len(client.get_metric_history(run_id, "gauntlet/core_average")) == 2
    from tasks.gauntlet.evaluate import scored_key

    params = {"checkpoint": info, "cfg": small_gauntlet, "run_id": run_id, "max_seq_len": 128}
    keys = {  # other bytes at the same tokens, another gauntlet, another run: each scored anew
        scored_key(None, params),
        scored_key(None, params | {"checkpoint": info.model_copy(update={"sha256": "0" * 64})}),
        scored_key(None, params | {"cfg": small_gauntlet.model_copy(update={"seed": 7})}),
        scored_key(None, params | {"run_id": "another"}),
    }
    assert len(keys) == 4
    table = json.loads(Path(client.download_artifacts(run_id, summary.table)).read_text())
    assert table["columns"][:2] == ["task", "shots"] and len(table["data"]) == 3
    html = Path(client.download_artifacts(run_id, second.report_html)).read_text()
    # the later report plots and tabulates both checkpoints
    assert "data:image/png;base64," in html and "<td>4096</td>" in html and "<td>8192</td>" in html

    assert summary.headline == "core_average" and len(summary.gauntlet_hash) == 16
    artifact = _prefect_artifact(artifact_key("tiny", "gauntlet", "tok-000000004096"))  # scoped to the run
    assert "| copa | 0 | multiple_choice |" in artifact.data


def test_eval_command_scores_mlflow_uri_against_hf_dir(
    prefect_harness, mlflow_run, mlflow_uri, small_gauntlet, tmp_path, monkeypatch
):
    from cli.models import eval_command

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # nothing may fall back to a default ./mlflow.db

    client, run_id = mlflow_run
    tok = _tokenizer()
    hf_a, hf_b = tmp_path / "a", tmp_path / "b"
    for seed, out in ((1, hf_a), (2, hf_b)):
        tiny_llama(len(tok), seed).save_pretrained(out)
        tok.save_pretrained(out)
    client.log_artifacts(run_id, str(hf_a), "checkpoints/tok-1")
    client.create_registered_model("tiny")
    mv = client.create_model_version("tiny", f"{client.get_run(run_id).info.artifact_uri}/checkpoints/tok-1", run_id)
    client.set_registered_model_alias("tiny", "best", mv.version)

    # This process's own temp dir: another xdist worker's eval downloads into the shared /tmp at the same time
    # (CI, stop 37, saw one of theirs here).
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    downloads = lambda: set(scratch.glob("tessera-eval-model-*"))  # noqa: E731
    before = downloads()
    out = eval_command(
        "models:/tiny@best",
        small_gauntlet.tasks,
        small_gauntlet.gauntlet,
        small_gauntlet.data_root,
        tracking_uri=mlflow_uri,
        compare_to=str(hf_b),
        output_dir=str(tmp_path / "report"),
    )
    direct = eval_command(str(hf_a), small_gauntlet.tasks, small_gauntlet.gauntlet, small_gauntlet.data_root)
    assert out.metrics == pytest.approx(direct.metrics)  # the registered version is model a
    assert out.baseline_average is not None
    assert f"({out.average - out.baseline_average:+.4f})" in out.markdown
    assert sorted(Path(f).name for f in out.files) == [
        "comparison.html",
        "comparison.md",
        "comparison.png",
        "report.html",
        "report.json",
        "report.md",
    ]
    assert "data:image/png;base64," in (tmp_path / "report" / "comparison.html").read_text()  # the plot travels inline
    assert list(cwd.iterdir()) == []
    assert before == set() and downloads() == set()  # the model's download is gone once it is loaded


def test_eval_command_raises_one_line_gauntlet_errors(prefect_harness, tmp_path):
    from cli.models import eval_command
    from evaluation.errors import GauntletError

    with pytest.raises(
        GauntletError, match=r"nowhere\.pt: no such checkpoint file, HF model directory or MLflow model URI"
    ):
        eval_command(str(tmp_path / "nowhere.pt"), str(ROOT / "configs" / "gauntlet" / "tiny_tasks.yaml"))


def test_bad_input_is_not_retried():
    from prefect.states import Failed

    from evaluation.errors import GauntletError
    from tasks.gauntlet.evaluate import retry_unless_bad_input

    assert not retry_unless_bad_input(None, None, Failed(data=GauntletError("t.jsonl:3: malformed JSON")))
    assert retry_unless_bad_input(None, None, Failed(data=OSError("disk hiccup")))
    # a full disk is not freed by retrying in a few seconds: evaluation, registration and prepare fail at once
    import errno

    from tasks.registry.register import register_checkpoint

    full = Failed(data=OSError(errno.ENOSPC, "No space left on device", "/work/runs/tiny/pins/c.pt"))
    assert not retry_unless_bad_input(None, None, full)
    assert not register_checkpoint.retry_condition_fn(None, None, full)
    assert register_checkpoint.retry_condition_fn(None, None, Failed(data=ConnectionResetError("mlflow went away")))


class _OpensAFile:
    """A pickled value that creates a file when it is unpickled: what a checkpoint from a stranger can carry."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _with_payload(checkpoint: Path, out: Path, marker: Path) -> Path:
    """`checkpoint` with one more metadata value whose unpickling creates `marker`: weights and tokenizer intact."""
    from trainers.format.safe_load import load

    state = load(checkpoint)
    state["state"]["metadata"]["note"] = _OpensAFile(marker)
    torch.save(state, out)
    return out


def test_a_checkpoint_that_would_run_code_is_refused_by_eval_compare_the_flow_and_the_pod(
    prefect_harness, composer_checkpoint, small_gauntlet, tmp_path, capsys
):
    """`tessera eval`, `tessera compare`, the eval deployment's flow and the evaluation pod read a user's file with
    the weights-only unpickler: one line naming the file and what it needs, and the payload never runs."""
    import yaml

    from cli.main import main
    from evaluation.__main__ import main as pod_main
    from evaluation.protocol import EXIT_FATAL
    from flows.evaluate import EvalParams, eval_flow
    from tests.conftest import tiny_recipe

    path, _, _ = composer_checkpoint
    marker = tmp_path / "payload-ran"
    evil = _with_payload(path, tmp_path / "evil.pt", marker)
    torch.load(evil, map_location="cpu", weights_only=False)  # what a plain load does: the payload runs
    assert marker.exists()
    marker.unlink()
    refused = (
        f"{evil}: refused to load: unpickling it needs `io.open`, which can run code when loaded; pass "
        "--trust-checkpoint only for a file you made or trust (a checkpoint tessera wrote never needs it)"
    )
    gauntlet = ["--tasks", small_gauntlet.tasks, "--data-root", small_gauntlet.data_root]

    def said() -> list[str]:
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return [line for line in err.splitlines() if line.startswith("tessera: error: ")]

    capsys.readouterr()
    assert main(["eval", "--model", str(evil), *gauntlet, "--work-dir", str(tmp_path / "w")]) == 2
    assert said() == [f"tessera: error: {refused}"]

    recipe = tiny_recipe(tmp_path)
    raw = yaml.safe_load(recipe.read_text())
    raw["eval"] |= {
        "tasks": small_gauntlet.tasks,
        "gauntlet": small_gauntlet.gauntlet,
        "data_root": small_gauntlet.data_root,
    }
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["compare", str(path), str(evil), "--recipe", str(recipe)]) == 2
    assert said() == [f"tessera: error: {refused}"]

    with pytest.raises(GauntletError) as flow_error:
        eval_flow(EvalParams(model=str(evil), tasks=small_gauntlet.tasks, data_root=small_gauntlet.data_root))
    assert str(flow_error.value) == refused

    capsys.readouterr()
    pod = ["--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}", "--run-id", "run", "--step", "4096"]
    assert pod_main(["--checkpoint", str(evil), *gauntlet, *pod]) == EXIT_FATAL
    assert capsys.readouterr().err.strip() == f"tessera.eval: bad input: {refused}"
    assert not marker.exists()

    # the explicit opt-in loads it (and so runs what it carries), and scores the same weights
    out = tmp_path / "trusted"
    assert main(["eval", "--model", str(evil), *gauntlet, "--trust-checkpoint", "--output-dir", str(out)]) == 0
    assert marker.exists()
    assert (out / "report.json").is_file()


def test_a_sharded_checkpoint_in_s3_is_downloaded_verified_and_scored_by_the_pod(
    composer_checkpoint, small_gauntlet, tmp_path, moto_s3, capsys
):
    """The flow hands the pod a sharded checkpoint's file list (its manifest); the pod downloads each file of the
    folder from s3, checks each against its SHA-256, and loads the model from the shards; a flipped byte in one
    shard is a bad input naming the file."""
    import torch.distributed.checkpoint as dcp

    from evaluation.__main__ import _local_checkpoint, _verified, main, parse_args
    from evaluation.models import load_model
    from evaluation.protocol import EXIT_FATAL
    from tasks.gauntlet.evaluate import pod_args
    from trainers.format.checkpoints import shard_files

    path, trained, _ = composer_checkpoint
    # The same state as a DCP folder, Composer's sharded layout (state.model..., state.integrations...)
    folder = tmp_path / "tiny-s0-tok4096"
    state = torch.load(path, map_location="cpu", weights_only=False)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    files = shard_files(folder, sorted(p.name for p in folder.iterdir()))
    moto_s3.create_bucket(Bucket="ckpts")
    for f in files:
        moto_s3.upload_file(str(folder / f.name), "ckpts", f"runs/tiny/{folder.name}/{f.name}")
    uri = f"s3://ckpts/runs/tiny/{folder.name}"
    info = CheckpointInfo(path=uri, tokens=4096, batch=1, stage="s0", stage_index=0, files=files)
    tracking = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", registered_model="m")
    args = parse_args(pod_args(info, small_gauntlet, tracking, "run", 128))
    assert json.loads(args.files) == [f.model_dump() for f in files]

    local = _local_checkpoint(uri, tmp_path / "pod", json.loads(args.files))
    assert _verified(local, args) == local
    loaded = load_model(local)
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(), trained.state_dict().values()))

    shard = next(folder.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    moto_s3.put_object(Bucket="ckpts", Key=f"runs/tiny/{folder.name}/{shard.name}", Body=bytes(data))
    common = ["--tasks", small_gauntlet.tasks, "--data-root", small_gauntlet.data_root]
    common += ["--tracking-uri", tracking.tracking_uri, "--run-id", "run", "--step", "4096", "--files", args.files]
    assert main(["--checkpoint", uri, *common]) == EXIT_FATAL
    err = capsys.readouterr().err
    assert f"{uri}: damaged checkpoint, not evaluated: {shard.name}: SHA-256 " in err, err
    assert not (tmp_path / "m.db").exists()

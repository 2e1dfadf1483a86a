"""Registration against a real sqlite MLflow registry: idempotent, aliases, loadable versions, dead server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tasks.gauntlet.evaluate import EvalSummary
from tasks.mlflow_run import TrackingError, client_for, close_run, model_ui_url, open_run, run_ui_url
from tasks.registry.register import BEST_ALIAS, LATEST_ALIAS, checkpoint_of, register_checkpoint
from tasks.registry.version_record import version_record
from tasks.tracking_config import TrackingConfig
from tests.conftest import ROOT
from tests.support.mlflow_store import sqlite_store
from trainers.format.checkpoints import CheckpointInfo
from trainers.format.store import S3Checkpoints


@pytest.fixture(scope="module")
def composer_checkpoint(tmp_path_factory) -> str:
    """One real Composer HuggingFaceModel checkpoint of a tiny Llama, tokenizer embedded."""
    from composer import Trainer
    from composer.models import HuggingFaceModel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = tmp_path_factory.mktemp("ckpt")
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(ROOT / "data/tokenizers/gpt-neox-20b/tokenizer.json"), eos_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    model = HuggingFaceModel(LlamaForCausalLM(config), tokenizer=tok, use_logits=True)
    batch = {"input_ids": torch.randint(0, 1000, (2, 16)), "labels": torch.randint(0, 1000, (2, 16))}
    trainer = Trainer(
        model=model,
        train_dataloader=[batch],
        max_duration="1ba",
        device="cpu",
        progress_bar=False,
        device_train_microbatch_size=2,
        save_folder=str(tmp),
        save_filename="ckpt.pt",
        save_interval="1ba",
    )
    trainer.fit()
    trainer.close()
    return str(tmp / "ckpt.pt")


def assert_same_weights(model, composer_checkpoint: str) -> None:
    """The model's weights equal the checkpoint's, bit for bit."""
    from trainers.format.export import load_hf

    original, _ = load_hf(composer_checkpoint)
    for (name, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(original.state_dict().items())):
        assert torch.equal(a, b), name


def summary(tokens: int, average: float, gauntlet: str = "g1") -> EvalSummary:
    return EvalSummary(
        tokens=tokens,
        stage="s",
        checkpoint="c",
        average=average,
        headline="core_average",
        gauntlet_hash=gauntlet,
        metrics={"gauntlet/core_average": average, "icl/copa/0-shot": 0.5},
    )


def test_register_is_idempotent_and_moves_aliases(tmp_path, composer_checkpoint):
    tracking = TrackingConfig(
        tracking_uri=sqlite_store(tmp_path / "m.db"),
        artifact_location=str(tmp_path / "art"),
        experiment="e",
        registered_model="tiny",
    )
    run_id = open_run.fn(tracking, "run-a", tags={})
    assert open_run.fn(tracking, "run-a", tags={}) == run_id  # a rerun reuses the run

    def register(tokens: int, average: float, gauntlet: str = "g1"):
        ckpt = CheckpointInfo(path=composer_checkpoint, tokens=tokens, batch=tokens // 64, stage="s", stage_index=0)
        return register_checkpoint.fn(ckpt, summary(tokens, average, gauntlet), tracking, run_id, "abc")

    first = [register(64, 0.2), register(128, 0.5), register(192, 0.3)]
    assert [(r.version, r.created) for r in first] == [(1, True), (2, True), (3, True)]
    # a retried task after success finds its version instead of making a fourth
    again = register(128, 0.5)
    assert (again.version, again.created) == (2, False)

    client = client_for(tracking)
    assert len(client.search_model_versions("name = 'tiny'")) == 3
    assert int(client.get_model_version_by_alias("tiny", LATEST_ALIAS).version) == 3
    assert int(client.get_model_version_by_alias("tiny", BEST_ALIAS).version) == 2
    v2 = client.get_model_version("tiny", "2")
    # the tags are the few people filter and sort on; the rest is in the version's record
    assert v2.tags == {
        "run": "run-a",
        "stage": "s",
        "tokens": "128",
        "gauntlet_average": "0.500000",
        "headline": "core_average",
        "gauntlet_hash": "g1",
    }
    record = version_record(client, "tiny", "2")
    stored = f"{client.get_run(run_id).info.artifact_uri}/checkpoints/tok-000000000128"
    facts = ("checkpoint", "storage", "model_uri", "batch", "recipe_hash", "scores", "run_id")
    assert {k: record[k] for k in facts} == {
        "checkpoint": composer_checkpoint,
        "storage": "copy",
        "model_uri": stored,
        "batch": 2,
        "recipe_hash": "abc",
        "scores": {"gauntlet/core_average": 0.5},
        "run_id": run_id,
    }
    assert checkpoint_of(client, "tiny", "2") == composer_checkpoint
    assert client.list_artifacts(run_id, "registry/tiny/v2")[0].path == "registry/tiny/v2/version.json"
    # killed between the version and its record: the retry finds the version and writes the record
    from urllib.parse import urlparse

    (Path(urlparse(client.get_run(run_id).info.artifact_uri).path) / "registry/tiny/v2/version.json").unlink()
    assert checkpoint_of(client, "tiny", "2") is None
    assert (register(128, 0.5).created, checkpoint_of(client, "tiny", "2")) == (False, composer_checkpoint)
    assert version_record(client, "tiny", "2")["storage"] == "copy"
    # each version says what it is, where it is, and why it holds its aliases
    assert v2.description.startswith(
        "Run run-a, stage s, 128 tokens.\ncore_average 0.5000 on gauntlet g1.\n"
        f"Stored in the run at {stored}.\n"
        f"Training checkpoint (weights and optimizer state): {composer_checkpoint}.\n"
    )
    assert "best: the highest core_average among versions scored on gauntlet g1" in v2.description
    assert (
        "latest-checkpoint: the furthest checkpoint of run run-a" in client.get_model_version("tiny", "3").description
    )
    assert "Aliases" not in client.get_model_version("tiny", "1").description

    # a higher score on another gauntlet does not compare: best stays among this gauntlet's versions
    register(256, 0.9, gauntlet="g2")
    assert int(client.get_model_version_by_alias("tiny", BEST_ALIAS).version) == 4  # the run's own gauntlet is g2 now
    register(320, 0.4, gauntlet="g1")  # back on g1: v2 (0.5) is the best g1 version, v4's 0.9 is not comparable
    assert int(client.get_model_version_by_alias("tiny", BEST_ALIAS).version) == 2

    # the registered version is an MLflow Model (transformers flavor) with the checkpoint's exact weights
    import mlflow.pyfunc
    import mlflow.transformers

    mlflow.set_tracking_uri(tracking.tracking_uri)
    mlflow.set_registry_uri(tracking.tracking_uri)
    parts = mlflow.transformers.load_model("models:/tiny@best", return_type="components")
    assert_same_weights(parts["model"], composer_checkpoint)
    text = mlflow.pyfunc.load_model("models:/tiny@best").predict(["Once upon a time"], params={"max_new_tokens": 4})
    assert isinstance(text[0], str) and text[0]  # pyfunc generates text


def test_dead_tracking_server_is_one_line_and_fast():
    tracking = TrackingConfig(tracking_uri="http://127.0.0.1:9", registered_model="x")
    start = time.monotonic()
    with pytest.raises(TrackingError) as info:
        client_for(tracking)
    assert time.monotonic() - start < 60
    message = str(info.value)
    assert message.startswith("tracking.tracking_uri: cannot use MLflow at http://127.0.0.1:9: ")
    assert "\n" not in message


def test_cli_reports_dead_tracking_server(tmp_path):
    import yaml

    raw = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    raw["work_dir"] = str(tmp_path / "w")
    raw["data"]["root"] = str(tmp_path / "w" / "data")
    raw["tracking"]["tracking_uri"] = "http://127.0.0.1:9"
    recipe = tmp_path / "dead.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "run", str(recipe)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tessera: error:")]
    assert len(errors) == 1
    assert errors[0].startswith("tessera: error: tracking.tracking_uri: cannot use MLflow at http://127.0.0.1:9: ")
    assert "Traceback" not in proc.stderr


def test_a_large_model_is_registered_by_reference_and_loads_from_s3(
    tmp_path, composer_checkpoint, moto_s3, monkeypatch
):
    """Over the size threshold, the weights stay with the run's checkpoints in object storage."""
    import mlflow.transformers

    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", moto_s3.meta.endpoint_url)
    moto_s3.create_bucket(Bucket="ckpts")
    tracking = TrackingConfig(
        tracking_uri=sqlite_store(tmp_path / "m.db"),
        artifact_location=str(tmp_path / "art"),
        experiment="e",
        registered_model="big",
        register_by_reference_above_mb=0,
    )
    run_id = open_run.fn(tracking, "run-b", tags={})
    ckpt = CheckpointInfo(path=composer_checkpoint, tokens=64, batch=1, stage="s", stage_index=0)
    home = S3Checkpoints("s3://ckpts/runs/run-b").model_home(64)  # what the gauntlet queue's store says
    reg = register_checkpoint.fn(ckpt, summary(64, 0.3), tracking, run_id, "abc", home)
    client = client_for(tracking)
    version = client.get_model_version("big", str(reg.version))
    assert version.source == "s3://ckpts/runs/run-b/models/tok-000000000064"
    assert version_record(client, "big", "1")["storage"] == "reference"
    assert "Stored by reference at s3://ckpts/runs/run-b/models/tok-000000000064.\n" in version.description
    keys = {o["Key"] for o in moto_s3.list_objects_v2(Bucket="ckpts")["Contents"]}
    assert "runs/run-b/models/tok-000000000064/MLmodel" in keys
    assert not client.list_artifacts(run_id, "checkpoints")  # nothing copied into the artifact store

    mlflow.set_tracking_uri(tracking.tracking_uri)
    mlflow.set_registry_uri(tracking.tracking_uri)
    parts = mlflow.transformers.load_model("models:/big/1", return_type="components")
    assert_same_weights(parts["model"], composer_checkpoint)


def test_an_evaluation_pod_packages_the_model_and_registration_never_loads_it(
    tmp_path, composer_checkpoint, moto_s3, monkeypatch
):
    """What a cluster run does: `python -m evaluation` scores an s3:// checkpoint, logs to the run and writes the
    MLflow Model beside it; the register task registers that URI without exporting anything itself."""
    import json

    import mlflow.transformers

    from evaluation.protocol import parse_summary
    from trainers.format.mlflow_model import model_uri_for

    moto_s3.create_bucket(Bucket="ckpts")
    moto_s3.upload_file(composer_checkpoint, "ckpts", "runs/run-c/run-c-s0-tok64-rank0.pt")
    tracking = TrackingConfig(
        tracking_uri=sqlite_store(tmp_path / "m.db"),
        artifact_location=str(tmp_path / "art"),
        experiment="e",
        registered_model="pod",
    )
    run_id = open_run.fn(tracking, "run-c", tags={})
    checkpoint_uri = "s3://ckpts/runs/run-c/run-c-s0-tok64-rank0.pt"
    target = model_uri_for("s3://ckpts/runs/run-c", 64)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "evaluation",
            "--checkpoint",
            checkpoint_uri,
            "--tasks",
            str(ROOT / "configs/gauntlet/tiny_tasks.yaml"),
            "--gauntlet",
            str(ROOT / "configs/gauntlet/tiny_gauntlet.yaml"),
            "--data-root",
            str(ROOT / "data/gauntlet"),
            "--context-len",
            "32",
            "--strict",
            "--tracking-uri",
            tracking.tracking_uri,
            "--run-id",
            run_id,
            "--step",
            "64",
            "--stage",
            "s",
            "--package-to",
            target,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MLFLOW_S3_ENDPOINT_URL": moto_s3.meta.endpoint_url},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = next(s for s in map(parse_summary, reversed(proc.stdout.splitlines())) if s)
    assert summary["model_uri"] == target and summary["headline"] == "core_average"
    client = client_for(tracking)
    assert [m.step for m in client.get_metric_history(run_id, "gauntlet/core_average")] == [64]

    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", moto_s3.meta.endpoint_url)
    import trainers.format.export

    def never(*args, **kwargs):
        raise AssertionError("registration loaded the checkpoint")

    monkeypatch.setattr(trainers.format.export, "export_hf", never)  # the flow pod must not touch the weights
    result = EvalSummary(
        tokens=64,
        stage="s",
        checkpoint=checkpoint_uri,
        **{k: summary[k] for k in ("average", "headline", "gauntlet_hash", "metrics", "model_uri")},
    )
    info = CheckpointInfo(path=checkpoint_uri, tokens=64, batch=1, stage="s", stage_index=0)
    reg = register_checkpoint.fn(info, result, tracking, run_id, "abc", target)
    version = client.get_model_version("pod", str(reg.version))
    assert version.source == target and version_record(client, "pod", "1")["storage"] == "reference"
    mlflow.set_tracking_uri(tracking.tracking_uri)
    mlflow.set_registry_uri(tracking.tracking_uri)
    parts = mlflow.transformers.load_model("models:/pod/1", return_type="components")
    assert_same_weights(parts["model"], composer_checkpoint)
    assert json.loads(json.dumps(summary))  # the summary line is plain JSON


def test_the_experiment_opens_as_model_training_and_a_reopened_run_forgets_its_last_end(tmp_path, monkeypatch):
    monkeypatch.delenv("TESSERA_MLFLOW_UI_URL", raising=False)
    tracking = TrackingConfig(
        tracking_uri=sqlite_store(tmp_path / "m.db"),
        artifact_location=str(tmp_path / "art"),
        experiment="e",
        registered_model="x",
    )
    run_id = open_run.fn(tracking, "run-k", tags={})
    client = client_for(tracking)
    assert client.get_experiment_by_name("e").tags["mlflow.experimentKind"] == "custom_model_development"

    close_run.fn(tracking, run_id, "KILLED", "Cancelling: stopped from the UI")
    assert client.get_run(run_id).data.tags["tessera.end"] == "Cancelling: stopped from the UI"
    assert open_run.fn(tracking, "run-k", tags={}) == run_id
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and "tessera.end" not in run.data.tags
    close_run.fn(tracking, run_id, "FINISHED")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["tessera.end"] == "FINISHED"

    # an experiment made before (no kind) gets one; a kind a person chose is kept
    older = TrackingConfig(
        tracking_uri=tracking.tracking_uri,
        artifact_location=str(tmp_path / "art"),
        experiment="older",
        registered_model="x",
    )
    chosen = TrackingConfig(
        tracking_uri=tracking.tracking_uri,
        artifact_location=str(tmp_path / "art"),
        experiment="chosen",
        registered_model="x",
    )
    client.create_experiment("older", artifact_location=(tmp_path / "art").as_uri())
    client.create_experiment(
        "chosen", artifact_location=(tmp_path / "art").as_uri(), tags={"mlflow.experimentKind": "finetuning"}
    )
    open_run.fn(older, "run-o", tags={})
    open_run.fn(chosen, "run-c", tags={})
    assert client.get_experiment_by_name("older").tags["mlflow.experimentKind"] == "custom_model_development"
    assert client.get_experiment_by_name("chosen").tags["mlflow.experimentKind"] == "finetuning"
    # a flow's first look at the registry: an alias moved in MLflow's UI is found, once
    from tasks.registry.aliases import reconcile_registry

    assert reconcile_registry(tracking, "flow run a") == []  # no registered model yet
    client.create_registered_model("x")
    client.create_model_version("x", source="file:///tmp/x", run_id=run_id)
    assert reconcile_registry(tracking, "flow run a") == []  # made before the record: adopted, nothing invented
    client.set_registered_model_alias("x", "champion", "1")
    found = reconcile_registry(tracking, "flow run b")
    assert len(found) == 1 and found[0].startswith("x: alias champion set on v1 outside tessera (detected ")
    assert found[0].endswith(" by flow run b)") and reconcile_registry(tracking, "flow run c") == []
    # links open the model-training view, where the 3.17 UI also shows the Model registry
    assert run_ui_url(tracking, run_id, "1") == (
        f"http://127.0.0.1:5000/#/experiments/1/runs/{run_id}?workflowType=machine_learning"
    )
    assert model_ui_url(tracking, "tessera tiny") == (
        "http://127.0.0.1:5000/#/models/tessera%20tiny?workflowType=machine_learning"
    )


def test_a_version_registered_before_the_record_still_resolves_and_describes(tmp_path):
    """Versions made before the record existed keep everything in tags: read as they are, never migrated."""
    from tasks.registry.aliases import refresh_descriptions
    from tasks.registry.version_record import decision_history

    uri = sqlite_store(tmp_path / "m.db")
    client = client_for(TrackingConfig(tracking_uri=uri, registered_model="old"))
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(experiment).info.run_id
    client.create_registered_model("old")
    client.create_model_version(
        "old",
        source="file:///tmp/old-model",
        run_id=run_id,
        tags={
            "tokens": "64",
            "stage": "s",
            "batch": "1",
            "run": "run-old",
            "recipe_hash": "abc",
            "gauntlet_hash": "g1",
            "headline": "core_average",
            "gauntlet_average": "0.250000",
            "checkpoint": "/ckpts/run-old-tok64.pt",
            "storage": "copy",
            "model_uri": "file:///tmp/old-model",
            "score/gauntlet/core_average": "0.250000",
            "promotion": "bootstrap",
            "promotion.summary": "first champion, no rule applied",
            "champion.why": "champion since 2025-01-02: the first champion (bootstrap)",
            "promotion.history.20250102T030405Z": "bootstrap: champion since 2025-01-02: the first champion "
            "(bootstrap)",
        },
    )
    client.set_registered_model_alias("old", "champion", "1")

    assert checkpoint_of(client, "old", "1") == "/ckpts/run-old-tok64.pt"
    record = version_record(client, "old", "1")
    assert (record["storage"], record["batch"], record["recipe_hash"], record["scores"]) == (
        "copy",
        1,
        "abc",
        {"gauntlet/core_average": 0.25},
    )
    assert decision_history(client, "old", "1") == [
        {
            "stamp": "20250102T030405.000000000Z",
            "at": "2025-01-02T03:04:05Z",
            "kind": "bootstrap",
            "legacy": True,
            "text": "bootstrap: champion since 2025-01-02: the first champion (bootstrap)",
        }
    ]
    refresh_descriptions(client, "old")
    assert client.get_model_version("old", "1").description == (
        "Run run-old, stage s, 64 tokens.\n"
        "core_average 0.2500 on gauntlet g1.\n"
        "Stored in the run at file:///tmp/old-model.\n"
        "Training checkpoint (weights and optimizer state): /ckpts/run-old-tok64.pt.\n"
        "Aliases: champion: champion since 2025-01-02: the first champion (bootstrap).\n"
        "Last promotion decision (2025-01-02): bootstrap: champion since 2025-01-02: the first champion (bootstrap)."
    )


def test_a_checkpoint_damaged_after_its_manifest_is_not_exported_or_registered(tmp_path, composer_checkpoint):
    """Registration exports what it reads now: a byte flipped since the manifest's SHA-256 was taken is one line
    naming the file and both hashes, no retry, and no version."""
    import shutil

    from prefect.states import Failed

    from tasks.registry.register import NotRegistered
    from trainers.format.checkpoints import file_sha256

    tracking = TrackingConfig(
        tracking_uri=sqlite_store(tmp_path / "m.db"),
        artifact_location=str(tmp_path / "art"),
        experiment="e",
        registered_model="tiny",
    )
    run_id = open_run.fn(tracking, "run-d", tags={})
    copy = tmp_path / "ckpt.pt"
    shutil.copyfile(composer_checkpoint, copy)
    published = file_sha256(copy)
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0x01
    copy.write_bytes(bytes(data))
    ckpt = CheckpointInfo(path=str(copy), tokens=64, batch=1, stage="s", stage_index=0, sha256=published)
    with pytest.raises(NotRegistered) as refused:
        register_checkpoint.fn(ckpt, summary(64, 0.3), tracking, run_id, "abc")
    line = str(refused.value)
    assert line.startswith(f"{copy}: damaged checkpoint, not loaded: SHA-256 {file_sha256(copy)} "), line
    assert line.endswith(f"is not the {published} published; not registered")
    assert not register_checkpoint.retry_condition_fn(None, None, Failed(data=refused.value))
    assert client_for(tracking).search_model_versions("name='tiny'") == []

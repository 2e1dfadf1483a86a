"""The consumed-files record is append-only: one record per flow run, consumed = the union of every record."""

from __future__ import annotations

import json

import pytest

from tests.support.mlflow_store import sqlite_store


@pytest.fixture()
def tracking(tmp_path):
    from mlflow.tracking import MlflowClient

    from tasks.tracking_config import TrackingConfig

    cfg = TrackingConfig(
        tracking_uri=sqlite_store(tmp_path / "m.db"),
        artifact_location=(tmp_path / "art").as_uri(),
        experiment="e",
        registered_model="m",
    )
    client = MlflowClient(cfg.tracking_uri, cfg.tracking_uri)
    client.create_experiment("e", artifact_location=cfg.artifact_location)
    return cfg, client


def _run(client, name: str, model: str = "m") -> str:
    from tasks.consumed_files import MODEL_TAG

    experiment = client.get_experiment_by_name("e").experiment_id
    return client.create_run(experiment, run_name=name, tags={MODEL_TAG: model, "tessera.run_name": name}).info.run_id


def _file(path: str, version: str = "1") -> object:
    from tasks.consumed_files import Consumed

    return Consumed(path=path, size=10, version=version)


def test_records_accumulate_on_one_run_and_across_runs_whatever_their_status(tracking, tmp_path):
    from tasks.consumed_files import consumed, new_inputs, record

    cfg, client = tracking
    weekly = _run(client, "weekly")
    assert record(cfg, weekly, [_file("/in/a.txt")], "flow-1") == "ledger/consumed-flow-1.json"
    # the same MLflow run reused by a later flow run: a second record beside the first, nothing rewritten
    record(cfg, weekly, [_file("/in/b.txt")], "flow-2")
    # a later attempt of the run failed: its records still count
    client.set_terminated(weekly, "FAILED")
    other = _run(client, "other")
    record(cfg, other, [_file("/in/c.txt"), _file("/in/a.txt", version="2")], None)  # outside Prefect: a fresh name
    # a record written before records were per flow run is read too
    legacy = tmp_path / "consumed.json"
    legacy.write_text(json.dumps([_file("/in/d.txt").model_dump()]))
    client.log_artifact(other, str(legacy), "ledger")
    _run(client, "elsewhere", model="another-model")

    seen, latest = consumed(cfg, "m")
    assert sorted((c.path, c.version) for c in seen) == [
        ("/in/a.txt", "1"),
        ("/in/a.txt", "2"),  # an edited file is new data: both fingerprints were trained on
        ("/in/b.txt", "1"),
        ("/in/c.txt", "1"),
        ("/in/d.txt", "1"),
    ]
    assert latest == "other"
    assert [f.path for f in client.list_artifacts(weekly, "ledger")] == [
        "ledger/consumed-flow-1.json",
        "ledger/consumed-flow-2.json",
    ]
    inputs = [_file("/in/a.txt", "3"), _file("/in/b.txt"), _file("/in/e.txt")]
    assert [f.path for f in new_inputs(inputs, seen)] == ["/in/a.txt", "/in/e.txt"]


def test_a_model_with_no_records_has_consumed_nothing(tracking):
    from tasks.consumed_files import consumed

    cfg, client = tracking
    _run(client, "trained-nothing")  # a run that stopped before recording
    assert consumed(cfg, "m") == ([], None)

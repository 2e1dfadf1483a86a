"""The tiny recipe end to end on the real engine: Prefect, Streaming, Composer, the gauntlet, MLflow."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, tiny_raw
from tests.support.mlflow_store import sqlite_store
from tests.support.training import rank_pids

pytestmark = pytest.mark.slow


def tiny_recipe_in(tmp_path) -> str:
    raw = tiny_raw()
    raw["work_dir"] = str(tmp_path / "work")
    raw["data"]["root"] = str(tmp_path / "work" / "data")
    raw["tracking"]["tracking_uri"] = sqlite_store(tmp_path / "mlflow.db")
    raw["tracking"]["artifact_location"] = str(tmp_path / "mlartifacts")
    raw["train"]["stages"][1]["seq_len"] = 256  # a longer-context final stage: 8 steps of 8 x 256 tokens
    # The tests' tokenizer has 4,096 ids, already a multiple of 128: 100 pads it to 4,100 rows, so the padded
    # vocabulary goes through training, checkpoints, the gauntlet, export and the registry here.
    raw["model"]["vocab_multiple"] = 100
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def _task_names(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        TaskRunFilter,
    )
    from prefect.client.schemas.sorting import FlowRunSort, TaskRunSort

    async def fetch():
        async with get_client() as client:
            # task runs of the flow itself and of its subflows
            subflows = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])),
                sort=FlowRunSort.ID_DESC,
                limit=100,
            )
            ids = [flow_run_id] + [f.id for f in subflows]
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id={"any_": ids}),
                task_run_filter=TaskRunFilter(),
                sort=TaskRunSort.ID_DESC,
                limit=200,
            )
            # task_key is "<function name>-<hash>", whatever task_run_name the run got
            return [r.task_key.rsplit("-", 1)[0] for r in runs]

    return asyncio.run(fetch())


def kill_trainer_after_first_checkpoint(run_dir, timeout_s: float = 600) -> threading.Thread:
    """SIGKILL the rank process (not the launcher) once the first checkpoint is published: a lost node."""
    from trainers.format.checkpoints import list_complete

    save_folder, job_path = run_dir / "checkpoints", run_dir / "job.json"

    def run():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not list_complete(save_folder):
            time.sleep(0.1)
        # this run's rank processes only, never the launcher or anybody else's trainer
        pids = rank_pids(job_path)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed.extend(pids)

    killed: list[str] = []
    thread = threading.Thread(target=run, daemon=True)
    thread.killed = killed
    thread.start()
    return thread


def test_tiny_pipeline_end_to_end(tmp_path, monkeypatch, prefect_harness):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import PipelineParams, pretrain_pipeline

    monkeypatch.chdir(ROOT)  # the recipe's data paths are relative to the project root
    recipe = tiny_recipe_in(tmp_path)
    killer = kill_trainer_after_first_checkpoint(tmp_path / "work" / "runs" / "tiny")
    state = pretrain_pipeline(PipelineParams(recipe=recipe), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    killer.join(timeout=5)
    # the one rank died mid-stage (SIGKILL); its launcher restarted it in place from the last checkpoint (no new
    # launch, no Prefect retry) and it resumed
    assert len(killer.killed) == 1

    # 32 steps of 1024 tokens then 8 of 2048, a checkpoint every 16384 tokens -> 3 evaluated, registered versions
    tokens = [r.tokens for r in result.registrations]
    assert tokens == [16384, 32768, 49152]
    assert all(r.created for r in result.registrations)

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    versions = sorted(client.search_model_versions("name = 'tessera-tiny'"), key=lambda v: int(v.version))
    assert [v.tags["tokens"] for v in versions] == ["16384", "32768", "49152"]
    assert [v.tags["stage"] for v in versions] == ["literary", "literary", "stories"]
    from tasks.registry.version_record import version_record

    assert len({version_record(client, "tessera-tiny", v.version)["recipe_hash"] for v in versions}) == 1
    averages = {v.version: float(v.tags["gauntlet_average"]) for v in versions}
    assert client.get_model_version_by_alias("tessera-tiny", "latest-checkpoint").tags["tokens"] == "49152"
    best = client.get_model_version_by_alias("tessera-tiny", "best")
    assert float(best.tags["gauntlet_average"]) == max(averages.values())

    # training and gauntlet metrics on the one run, with step = tokens seen
    run_id = result.mlflow_run_id
    loss = client.get_metric_history(run_id, "train/loss")
    assert loss and max(m.step for m in loss) == 49152
    assert all(m.step % 1024 == 0 for m in loss)
    assert sorted({m.step for m in loss if m.step > 32768}) == [32768 + 2048 * k for k in range(1, 9)]
    job = json.loads((tmp_path / "work" / "runs" / "tiny" / "job.json").read_text())
    long_stories = job["seq_len_streams"]["256"]["stories"]  # prepared at 256 by the flow, beside the 128 packing
    assert long_stories != job["streams"]["stories"]
    assert json.loads((Path(long_stories).parent / "provenance.json").read_text())["seq_len"] == 256
    assert client.get_metric_history(run_id, "throughput/tokens_per_sec")
    for source in ("literary", "stories"):  # held-out loss of each source, scored as each checkpoint is saved
        assert [m.step for m in client.get_metric_history(run_id, f"val/{source}/loss")] == [16384, 32768, 49152]
    gauntlet_keys = [k for k in client.get_run(run_id).data.metrics if k.startswith("icl/")]
    assert gauntlet_keys
    assert sorted(m.step for m in client.get_metric_history(run_id, gauntlet_keys[0])) == [16384, 32768, 49152]

    # where the wall time went, at each stage's end: goodput/* at the tokens reached, the table, the chart, and a
    # Prefect artifact; the killed launch's steps after its checkpoint are lost, and the buckets add up
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    ratio = client.get_metric_history(run_id, "goodput/ratio")
    assert sorted(m.step for m in ratio) == [32768, 49152] and all(0 < m.value < 1 for m in ratio)
    assert sorted(a.path for a in client.list_artifacts(run_id, "goodput")) == [
        "goodput/goodput.json",
        "goodput/goodput.md",
        "goodput/goodput.png",
    ]
    ledger = json.loads(Path(client.download_artifacts(run_id, "goodput/goodput.json")).read_text())
    assert abs(sum(ledger["buckets"].values()) - ledger["wall_s"]) <= 0.01 * ledger["wall_s"]
    assert ledger["buckets"]["lost"] > 0 and set(ledger["stages"]) == {"literary", "stories"}
    with get_client(sync_client=True) as prefect:
        shown = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["tiny-goodput"])))
    assert shown and shown[0].data.startswith("### Goodput of run tiny: ")

    # Prefect saw the stages, one evaluate and one register per checkpoint
    names = _task_names(state.state_details.flow_run_id)
    assert sum(n == "train_stage" for n in names) == 2  # the killed stage was retried, not re-created
    logs = (tmp_path / "work" / "runs" / "tiny" / "logs" / "literary" / "rank0.log").read_text()
    assert logs.count("fresh at 0 tokens") == 1 and "resume at 16384 tokens" in logs
    assert "restart 1 in place: rank 0 exited with code -9" in logs
    assert sum(n == "evaluate_checkpoint" for n in names) == 3
    assert sum(n == "register_checkpoint" for n in names) == 3

    # the padded vocabulary all the way: 4,100 rows in every checkpoint and registered model, the 4 padded ids
    # suppressed for every loader of the registered version, which MLflow loads and generates from
    import mlflow.pyfunc
    import mlflow.transformers

    from trainers.format.checkpoints import list_complete
    from trainers.format.export import embedding_rows

    saved = list_complete(tmp_path / "work" / "runs" / "tiny" / "checkpoints")
    assert saved and all(embedding_rows(c.path) == 4100 for c in saved)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parts = mlflow.transformers.load_model("models:/tessera-tiny@best", return_type="components")
    assert parts["model"].config.vocab_size == 4100 and len(parts["tokenizer"]) == 4096
    assert parts["model"].generation_config.suppress_tokens == [4096, 4097, 4098, 4099]
    text = mlflow.pyfunc.load_model("models:/tessera-tiny@best").predict(["Once upon a time"], {"max_new_tokens": 4})
    assert isinstance(text[0], str)

    # a rerun resumes everything: nothing is trained or registered twice, and no trainer is launched to learn that
    from tasks.training import launch_records

    run_dir = tmp_path / "work" / "runs" / "tiny"
    launches = len(launch_records.read(run_dir))
    again = pretrain_pipeline(PipelineParams(recipe=recipe))
    assert [r.tokens for r in again.registrations] == [16384, 32768, 49152]
    assert not any(r.created for r in again.registrations)
    assert len(launch_records.read(run_dir)) == launches
    assert len(client.search_model_versions("name = 'tessera-tiny'")) == 3

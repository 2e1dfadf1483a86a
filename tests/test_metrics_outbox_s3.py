"""The metrics outbox with an s3:// save folder: its journal and marker outlive the pod's disk.

A real S3-compatible server (moto's server mode) holds the save folder; the local folder is wiped between
launches, as a new pod's scratch disk would be. The fast tests drive the outbox in process against a sqlite
MLflow store; the slow one kills real trainers across a real `mlflow server` outage.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainers.config import MlflowTarget, StageConfig

SEQ, BATCH = 32, 8
STEP = SEQ * BATCH  # tokens per optimizer step
BUCKET = "ckpts"
DEAD = "http://127.0.0.1:9"  # nothing listens there


def _job(root: Path, target: MlflowTarget | None, steps: int = 40, every_steps: int = 8, save="s3://ckpts/runs"):
    from tests.support.training import tiny_job

    stages = [StageConfig(name="warm", tokens=steps * STEP, mixture={"a": 1.0})]
    return tiny_job(
        root,
        {"a": str(root / "data")},
        stages,
        seq_len=SEQ,
        global_batch_size=BATCH,
        checkpoint_every_tokens=every_steps * STEP,
        mlflow=target,
        save_folder=save,
    )


def _copy_object(s3) -> dict:
    body = s3.get_object(Bucket=BUCKET, Key="runs/tiny/metrics/tiny-metrics-outbox.json")["Body"].read()
    return json.loads(body)


def _steps(journal: str) -> list[int]:
    return [json.loads(line)["tokens"] for line in journal.splitlines() if json.loads(line).get("tokens")]


def _state(tokens: int, loss: float = 2.0):
    return SimpleNamespace(
        timestamp=SimpleNamespace(token=tokens, batch=tokens // STEP), total_loss_dict={"loss/train/total": loss}
    )


def _run(uri: str) -> tuple:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return client, client.create_run(client.create_experiment("s3")).info.run_id


def test_a_local_save_folder_keeps_no_remote_copy(tmp_path):
    from trainers.metrics_journal import remote_copy

    target = MlflowTarget(tracking_uri=DEAD, run_id="r")
    assert remote_copy(_job(tmp_path, target, save=str(tmp_path / "saves"))) is None
    assert remote_copy(_job(tmp_path, None)) is None  # no metrics, nothing to keep


def test_the_flow_delivers_what_a_gone_pod_held_back_from_the_s3_copy(tmp_path, moto_s3, mlflow_uri, monkeypatch):
    """A pod journals through an outage and is gone; the flow, whose disk never saw that journal, delivers it from
    s3 once each, with the times the rows were recorded at, and leaves the copy empty. A second delivery adds
    nothing."""
    from tasks.training.train import deliver_metrics
    from trainers.callbacks import MlflowMetrics
    from trainers.metrics_journal import journal_path, remote_copy

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("TESSERA_METRICS_CLOSE_WAIT_S", "0")
    moto_s3.create_bucket(Bucket=BUCKET)
    client, run_id = _run(mlflow_uri)
    pod = _job(tmp_path / "pod", MlflowTarget(tracking_uri=DEAD, run_id=run_id))
    pod_disk = Path(pod.save_folder)
    pod_disk.mkdir(parents=True)

    metrics = MlflowMetrics(
        pod.mlflow,
        SimpleNamespace(lr=1e-3),
        1,
        "warm",
        0,
        4 * STEP,
        STEP,
        flush_every_s=0,
        state_folder=pod_disk,
        run_name="tiny",
        copy=remote_copy(pod),
    )
    metrics.fit_start(_state(0), None)
    for k in range(1, 11):
        metrics.batch_start(_state((k - 1) * STEP), None)
        metrics.batch_end(_state(k * STEP, loss=2.0 + k / 100), None)
    metrics.fit_end(_state(10 * STEP), None)
    recorded_by = time.time() * 1000
    held = _copy_object(moto_s3)
    assert held["marker"] == {"mlflow_run_id": run_id, "tokens": 10 * STEP}
    assert _steps(held["journal"]) == [k * STEP for k in range(1, 11)]
    shutil.rmtree(pod_disk)  # the pod is gone

    flow = _job(tmp_path / "flow", MlflowTarget(tracking_uri=mlflow_uri, run_id=run_id))
    assert not Path(flow.save_folder).exists()
    monkeypatch.setenv("TESSERA_METRICS_CLOSE_WAIT_S", "60")
    assert deliver_metrics.fn(flow) == 0
    history = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == [k * STEP for k in range(1, 11)]
    assert {m.step: m.value for m in history} == {k * STEP: 2.0 + k / 100 for k in range(1, 11)}
    assert all(m.timestamp <= recorded_by for m in history)  # stamped when trained, not when delivered
    assert client.get_run(run_id).data.tags["stage/warm/end_tokens"] == str(10 * STEP)
    emptied = _copy_object(moto_s3)
    assert emptied == {"marker": {"mlflow_run_id": run_id, "tokens": 10 * STEP}, "journal": ""}
    assert not journal_path(flow.save_folder, "tiny").exists()

    assert deliver_metrics.fn(flow) == 0
    assert len(client.get_metric_history(run_id, "train/loss")) == 10


def test_a_step_sent_to_mlflow_is_in_the_s3_marker_first(tmp_path, moto_s3, mlflow_uri):
    """Rows between checkpoints go out without a persist: the copy's marker covers them before they are sent, so
    a relaunch on a fresh disk that re-trains them from the last checkpoint does not record them twice."""
    from trainers.callbacks import MlflowMetrics
    from trainers.metrics_journal import remote_copy
    from trainers.metrics_outbox import Outbox

    moto_s3.create_bucket(Bucket=BUCKET)
    client, run_id = _run(mlflow_uri)
    job = _job(tmp_path, MlflowTarget(tracking_uri=mlflow_uri, run_id=run_id))
    disk = Path(job.save_folder)
    disk.mkdir(parents=True)
    outbox = Outbox(job.mlflow, disk, "tiny", 0, remote_copy(job))
    for k in range(1, 4):  # no checkpoint among them
        outbox.put(k * STEP, {"train/loss": 2.0 + k})
    outbox.flush()
    deadline = time.monotonic() + 60
    while len(client.get_metric_history(run_id, "train/loss")) < 3:
        assert time.monotonic() < deadline, "rows never delivered"
        time.sleep(0.05)
    # Killed here, before any checkpoint persisted or closed the outbox; the relaunch is on a new disk.
    assert _copy_object(moto_s3)["marker"]["tokens"] == 3 * STEP
    shutil.rmtree(disk)
    disk.mkdir()
    copy = remote_copy(job)
    assert copy.restore(disk, "tiny")
    relaunch = MlflowMetrics(
        job.mlflow, SimpleNamespace(lr=1e-3), 1, "warm", 0, 8 * STEP, STEP, state_folder=disk, run_name="tiny"
    )
    assert relaunch.logged_until == 3 * STEP
    outbox.close(5)


def test_a_disk_that_knows_more_than_the_copy_keeps_its_own(tmp_path, moto_s3):
    """The copy is written from some disk's journal: a disk ahead of it (the same node relaunching) is not set back,
    a fresh one and one behind it are brought up to it."""
    from trainers.format.atomic import atomic_write_json
    from trainers.metrics_journal import marker_path, read_marker, remote_copy

    moto_s3.create_bucket(Bucket=BUCKET)
    job = _job(tmp_path, MlflowTarget(tracking_uri=DEAD, run_id="r"))
    copy = remote_copy(job)
    copy.write({"mlflow_run_id": "r", "tokens": 4 * STEP}, "")
    fresh, ahead, behind = (tmp_path / name for name in ("fresh", "ahead", "behind"))
    atomic_write_json(marker_path(ahead, "tiny"), {"mlflow_run_id": "r", "tokens": 6 * STEP})
    atomic_write_json(marker_path(behind, "tiny"), {"mlflow_run_id": "r", "tokens": 2 * STEP})
    assert [copy.restore(disk, "tiny") for disk in (fresh, ahead, behind)] == [True, False, True]
    assert [read_marker(marker_path(d, "tiny"), "r") for d in (fresh, ahead, behind)] == [4 * STEP, 6 * STEP, 4 * STEP]


def test_a_copy_that_cannot_be_written_stops_the_launch_before_its_checkpoint(tmp_path, moto_s3, caplog):
    """A checkpoint whose rows are not in s3 must not become a fresh disk's resume point: the persist before it
    fails as retryable (the relaunch resumes from the checkpoint before). A close only says so."""
    from trainers.exit_codes import RetryableError
    from trainers.metrics_journal import remote_copy
    from trainers.metrics_outbox import Outbox

    job = _job(tmp_path, MlflowTarget(tracking_uri=DEAD, run_id="r"), save="s3://nowhere/runs")
    disk = Path(job.save_folder)
    disk.mkdir(parents=True)
    outbox = Outbox(job.mlflow, disk, "tiny", 0, remote_copy(job))
    outbox.put(STEP, {"train/loss": 2.0})
    with pytest.raises(RetryableError, match=r"^metrics: cannot write s3://nowhere/runs/tiny/metrics/tiny-metrics"):
        outbox.persist()
    assert outbox.close(0) == 1
    assert any("cannot write s3://nowhere" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_every_step_reaches_mlflow_once_across_an_outage_and_group_restarts_on_fresh_disks(tmp_path, moto_s3):
    """A real trainer with an s3 save folder and a scratch disk wiped before every relaunch (a new pod each time):
    killed -9 with MLflow up after steps past its newest checkpoint were delivered; relaunched with MLflow down and
    killed -9 again; then MLflow comes back and the last relaunch finishes the stage. MLflow ends with every step's
    loss once, in step order, each stamped when it was first trained: none lost with a disk, none recorded twice by
    a re-trained step."""
    from mlflow.tracking import MlflowClient

    from tests.support.training import MlflowServer, run_stage, start_stage, write_job, write_mds

    steps, every = 40, 8
    moto_s3.create_bucket(Bucket=BUCKET)
    write_mds(tmp_path / "data", 2 * steps * BATCH, SEQ, 512, seed=1)
    env = {
        "TESSERA_METRICS_FLUSH_S": "0",
        "TESSERA_METRICS_CLOSE_WAIT_S": "60",
        # what the flow sets for the trainer: few, short HTTP retries inside MLflow itself
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    }
    with MlflowServer(tmp_path / "mlflow") as server:
        client = MlflowClient(server.uri)
        run_id = client.create_run(client.create_experiment("outage")).info.run_id
        job = _job(tmp_path, MlflowTarget(tracking_uri=server.uri, run_id=run_id), steps, every)
        job_path = write_job(job, tmp_path / "job.json")
        scratch = Path(job.save_folder)

        # Every save hangs a while before it writes: killed in the one at step 16, after its steps reached
        # MLflow, the launch leaves steps 9-16 delivered and its newest checkpoint at step 8.
        log = tmp_path / "first.log"
        first = start_stage(job_path, 0, env={**env, "TESSERA_FAULT": "stall-save:20"}, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 240
            while 16 * STEP not in {m.step for m in client.get_metric_history(run_id, "train/loss")}:
                assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
                assert time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
                time.sleep(0.2)
        finally:
            first.kill()
            first.wait()
        before_outage = [m.step for m in client.get_metric_history(run_id, "train/loss")]
        assert before_outage == [k * STEP for k in range(1, 17)]
        shutil.rmtree(scratch)

        server.stop()
        second = run_stage(job_path, 0, env={**env, "TESSERA_FAULT": f"step:{29 * STEP}"})
        assert second.returncode == -9, second.stderr[-3000:]
        held = _copy_object(moto_s3)  # what the outage held back, in s3 only: the disk goes next
        assert held["journal"] and held["marker"]["tokens"] >= 24 * STEP
        assert max(_steps(held["journal"])) == held["marker"]["tokens"]
        shutil.rmtree(scratch)

        server.start()
        last = run_stage(job_path, 0, env=env)
        assert last.returncode == 0, last.stderr[-3000:]
        assert "journaled by an earlier launch go to MLflow first" in last.stderr

        history = client.get_metric_history(run_id, "train/loss")
        by_step = sorted(history, key=lambda m: m.step)
        assert [m.step for m in by_step] == [k * STEP for k in range(1, steps + 1)], (before_outage, held)
        assert all(a.timestamp <= b.timestamp for a, b in zip(by_step, by_step[1:]))  # first-trained times, in order
        assert client.get_run(run_id).data.tags["stage/warm/end_tokens"] == str(steps * STEP)
        assert _copy_object(moto_s3)["journal"] == ""


def test_a_journal_with_every_row_acked_leaves_an_empty_s3_copy(tmp_path, moto_s3):
    """Rows delivered since the copy was written (acked on this disk): the delivery drops the journal and writes the
    copy empty, or a fresh disk would restore those rows and send them again."""
    from trainers.format.atomic import append_record, atomic_write_json
    from trainers.format.store import S3Checkpoints
    from trainers.metrics_journal import RemoteCopy, Row, deliver, journal_path, lines, marker_path

    moto_s3.create_bucket(Bucket=BUCKET)
    copy = RemoteCopy(S3Checkpoints(f"s3://{BUCKET}/runs/tiny"), "tiny")
    row = Row("r", STEP, [("loss/train/total", 2.0, 1000, STEP)], [], seq=1)
    marker = {"mlflow_run_id": "r", "tokens": STEP}
    copy.write(marker, lines([row]))  # written at the checkpoint, before the row went out
    disk = tmp_path / "disk"
    disk.mkdir()
    journal = journal_path(disk, "tiny")
    journal.write_text(lines([row]))
    append_record(journal, {"ack": 1})  # delivered since, from this disk
    atomic_write_json(marker_path(disk, "tiny"), marker)
    assert deliver(MlflowTarget(tracking_uri=DEAD, run_id="r"), disk, "tiny", 0, copy) == 0
    assert not journal.exists()
    assert _copy_object(moto_s3) == {"marker": marker, "journal": ""}

"""State files after a power loss: written whole and durably, and repaired (never FATAL) when an older
write left one empty or cut short.

A rename that reached the disk before the bytes did leaves an empty file (delayed allocation), or
half of one. Each test cuts a file as a clean run wrote it, runs the real reader (the trainer's
start plan, the rollback reader, the flow's job writer) and compares with what the clean run wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.training import tiny_job
from trainers.config import StageConfig
from trainers.exit_codes import ExitCode, FatalError, LossAnomaly
from trainers.format.atomic import TEMP_PREFIX, atomic_write, atomic_write_json

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH = 32, 8
STEP = SEQ * BATCH
STAGES = [
    StageConfig(name="warm", tokens=10 * STEP, mixture={"a": 1.0}),
    StageConfig(name="mix", tokens=6 * STEP, mixture={"a": 0.5, "b": 0.5}, global_batch_size=16),
]
CUTS = {"empty": lambda data: b"", "half": lambda data: data[: len(data) // 2]}


def _cut(path: Path, how: str) -> None:
    """What a power loss leaves of a file whose bytes never reached the disk."""
    path.write_bytes(CUTS[how](path.read_bytes()))


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(f"{TEMP_PREFIX}*"))


def _job(root: Path, stages=STAGES, **kw):
    return tiny_job(root, {"a": "unused", "b": "unused"}, stages, seq_len=SEQ, global_batch_size=BATCH, **kw)


def _stage0_checkpoints(job) -> None:
    """Stage 0's published checkpoints as a training run leaves them (real zip files, real manifests)."""
    import torch

    from trainers.format.checkpoints import CheckpointInfo, publish

    folder = Path(job.save_folder)
    folder.mkdir(parents=True, exist_ok=True)
    for tokens in (1024, 2048, 2560):
        path = folder / f"{job.run_name}-s0-tok{tokens}-rank0.pt"
        torch.save({"w": torch.full((4,), float(tokens))}, path)
        info = CheckpointInfo(
            path=str(path.resolve()), tokens=tokens, batch=tokens // STEP, stage="warm", stage_index=0
        )
        publish(folder, info)


# ---------------------------------------------------------------- atomic_write


def test_atomic_write_leaves_the_whole_content_and_no_temp_file(tmp_path):
    target = tmp_path / "sub" / "state.json"
    assert atomic_write(target, "first") == target
    assert target.read_text() == "first"
    atomic_write(target, b"\x00second")
    atomic_write_json(target, {"a": [1, 2]}, indent=1)
    assert json.loads(target.read_text()) == {"a": [1, 2]}
    assert _temps(tmp_path) == []


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    synced: list[tuple[str, bool]] = []  # (what was fsynced, did the target exist yet)
    real = os.fsync

    def recording(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), target.exists()))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    atomic_write(target, "x")
    assert [Path(p).name.startswith(TEMP_PREFIX) for p, _ in synced[:1]] == [True] and synced[0][1] is False
    assert synced[-1] == (str(tmp_path), True)


def test_a_write_that_fails_midway_keeps_the_old_content_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    atomic_write(target, "old")

    def broken(src, dst):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        atomic_write(target, "new, never seen")
    assert target.read_text() == "old"
    assert _temps(tmp_path) == []


# ---------------------------------------------------------------- trained-stages record


@pytest.mark.parametrize("how", CUTS)
def test_a_cut_short_stages_record_of_a_fresh_run_is_rewritten_as_a_clean_launch_would(tmp_path, how):
    from trainers.layout import RunFolder
    from trainers.plan import plan_start

    job = _job(tmp_path)
    plan_start(job, 0)
    stages = RunFolder.of(job).stages_record
    clean = stages.read_bytes()
    _cut(stages, how)
    assert plan_start(job, 0).kind == "fresh"  # no FatalError
    assert stages.read_bytes() == clean
    assert _temps(Path(job.save_folder)) == []


@pytest.mark.parametrize("how", CUTS)
def test_a_cut_short_stages_record_is_rederived_from_the_checkpoints_and_the_stage_launched(tmp_path, how):
    from trainers.layout import RunFolder
    from trainers.plan import plan_start

    job = _job(tmp_path)
    _stage0_checkpoints(job)
    plan_start(job, 0)  # stage 0 was trained (its last launch found it done)
    first = plan_start(job, 1)  # then stage 1 was entered: the record lists both
    stages = RunFolder.of(job).stages_record
    clean = stages.read_bytes()
    assert [s["name"] for s in json.loads(clean)] == ["warm", "mix"]

    _cut(stages, how)
    again = plan_start(job, 1)
    assert (again.kind, again.tokens) == (first.kind, first.tokens) == ("enter", 2560)
    assert stages.read_bytes() == clean


def test_a_rederived_stages_record_still_refuses_a_trained_stage_the_job_renamed(tmp_path):
    """What the re-derivation can check, it does: the manifests name the stages that were trained."""
    from trainers.layout import RunFolder
    from trainers.plan import plan_start

    job = _job(tmp_path)
    _stage0_checkpoints(job)
    plan_start(job, 1)
    RunFolder.of(job).stages_record.write_bytes(b"")
    renamed = _job(tmp_path, stages=[STAGES[0].model_copy(update={"name": "other"}), STAGES[1]])
    with pytest.raises(FatalError, match=r"train\.stages\[0\]: stage 'warm' was already trained on"):
        plan_start(renamed, 1)


@pytest.mark.parametrize("how", CUTS)
def test_a_cut_short_local_stages_record_takes_the_mirrors_whole_copy(tmp_path, how):
    from trainers.layout import RunFolder
    from trainers.remote import RemoteFolder

    job = _job(tmp_path)
    stages = RunFolder.of(job).stages_record
    whole = [s.model_dump(mode="json") for s in STAGES]
    atomic_write_json(stages, whole, indent=1)
    clean = stages.read_bytes()
    _cut(stages, how)
    mirror = RemoteFolder.__new__(RemoteFolder)  # the object store is not what this test is about
    mirror.uri = "s3://bucket/run"
    mirror.names = lambda sub="": {stages.name}
    mirror.read_text = lambda name: json.dumps(whole)
    mirror.pull_json_list(stages)
    assert stages.read_bytes() == clean


def test_the_records_alone_say_a_stage_is_finished_and_what_they_do_not_settle_is_left_to_a_launch(tmp_path):
    """What a rerun with nothing to do decides from, without launching a trainer (tasks/training/train.train_stage)."""
    from trainers.plan import plan_start
    from trainers.trained_stages import finished

    job = _job(tmp_path)
    _stage0_checkpoints(job)
    assert finished(job, 0) is None  # no launch recorded stage 0 in the trained-stages record
    plan_start(job, 0)
    end = finished(job, 0)
    assert (end.tokens, end.stage_index) == (2560, 0) and Path(end.path).name == "tiny-s0-tok2560-rank0.pt"
    assert finished(job, 1) is None  # stage 1 was never trained
    other = _job(tmp_path, run_name="other")  # another run sharing the folder finds nothing of its own
    assert finished(other, 0) is None
    remixed = _job(tmp_path, stages=[STAGES[0].model_copy(update={"mixture": {"a": 0.5, "b": 0.5}}), STAGES[1]])
    assert finished(remixed, 0) is None  # an edited trained stage: the launch refuses it, in its own words
    Path(end.path).write_bytes(Path(end.path).read_bytes()[:100])  # the file cut short after its publication
    assert finished(job, 0) is None


def test_with_an_s3_mirror_a_stage_is_finished_only_once_its_end_checkpoint_is_in_the_mirror(tmp_path, moto_s3):
    from trainers.layout import RunFolder
    from trainers.plan import plan_start
    from trainers.remote import RemoteFolder
    from trainers.trained_stages import finished

    moto_s3.create_bucket(Bucket="ckpt")
    job = _job(tmp_path, save_folder="s3://ckpt/runs")
    _stage0_checkpoints(job)
    plan_start(job, 0)  # records the stage and reconciles: the mirror gets the stages and the checkpoints
    listed = moto_s3.list_objects_v2(Bucket="ckpt", Prefix="runs/tiny/manifests/")["Contents"]
    manifest = next(o["Key"] for o in listed if "2560" in o["Key"])
    moto_s3.delete_object(Bucket="ckpt", Key=manifest)
    assert finished(job, 0) is None  # complete on this disk, not in the mirror a pod or a fresh node reads
    end_info = next(c for c in RunFolder.of(job).complete() if c.tokens == 2560)
    RemoteFolder.for_job(job).publish(end_info)
    RunFolder.of(job).stages_record.unlink()  # a fresh flow's working copy: the record comes from the mirror
    end = finished(job, 0)
    assert end is not None and end.tokens == 2560


# ---------------------------------------------------------------- rollback records


def _anomaly() -> LossAnomaly:
    return LossAnomaly("loss is nan at 1792 tokens", tokens=1792, resume_tokens=1024, already_skipped=0, stage_index=0)


@pytest.mark.parametrize("how", CUTS)
def test_cut_short_rollback_records_read_as_none_and_the_next_anomaly_records_as_a_clean_run(tmp_path, how):
    from trainers.layout import RunFolder
    from trainers.rollback import pending_skip, record_anomaly

    clean_job, job = _job(tmp_path / "clean"), _job(tmp_path / "cut")
    for each in (clean_job, job):
        Path(each.save_folder).mkdir(parents=True)
    assert record_anomaly(clean_job, _anomaly()) == ExitCode.RETRYABLE
    clean = RunFolder.of(clean_job).rollbacks.read_bytes()

    records = RunFolder.of(job).rollbacks
    records.write_bytes(clean)
    _cut(records, how)
    assert pending_skip(RunFolder.of(job), 0, 1024) == 0  # the next plan's read: none, no error
    assert json.loads(records.read_text()) == []  # repaired once
    # The anomaly recurs on the relaunch (same checkpoint, same data) and is recorded again, as the first time.
    assert record_anomaly(job, _anomaly()) == ExitCode.RETRYABLE
    assert records.read_bytes() == clean
    assert pending_skip(RunFolder.of(job), 0, 1024) == json.loads(clean)[0]["skip_samples"] > 0


# ---------------------------------------------------------------- manifests, metrics marker


@pytest.mark.parametrize("how", CUTS)
def test_a_cut_short_manifest_is_rederived_by_the_next_plan(tmp_path, how):
    from trainers.format.checkpoints import list_complete, manifest_path
    from trainers.plan import plan_start

    job = _job(tmp_path)
    _stage0_checkpoints(job)
    manifest = manifest_path(job.save_folder, 2048)
    clean = json.loads(manifest.read_text())
    _cut(manifest, how)
    assert [c.tokens for c in list_complete(job.save_folder)] == [1024, 2560]  # a watcher skips it, no error
    plan_start(job, 0)
    assert json.loads(manifest.read_text()) == clean
    assert [c.tokens for c in list_complete(job.save_folder)] == [1024, 2048, 2560]


@pytest.mark.parametrize("how", CUTS)
def test_a_cut_short_metrics_marker_reads_as_nothing_logged(tmp_path, how):
    from trainers.metrics_journal import marker_path, read_marker

    marker = marker_path(tmp_path, "tiny")
    atomic_write_json(marker, {"mlflow_run_id": "r1", "tokens": 2048})
    assert read_marker(marker, "r1") == 2048
    _cut(marker, how)
    assert read_marker(marker, "r1") == 0


# ---------------------------------------------------------------- job file


@pytest.mark.parametrize("how", CUTS)
def test_a_cut_short_job_file_is_rewritten_by_the_flow_and_the_launch_plans(tmp_path, how):
    """The trainer cannot know the job a cut-short file held, so it refuses it (one line saying so); the
    flow, which writes the file as it starts and before any launch, puts it back whole."""
    from tasks.training.train_job import write_job
    from trainers.jobfile import load_job
    from trainers.plan import plan_start

    job = _job(tmp_path)
    path = write_job(job, tmp_path / "run" / "job.json")
    clean = path.read_bytes()
    _cut(path, how)
    with pytest.raises(FatalError, match="empty or cut short.*a rerun of the flow writes it again"):
        load_job(path)

    assert write_job(job, path) == path
    assert path.read_bytes() == clean and _temps(path.parent) == []
    assert load_job(path) == job
    assert plan_start(load_job(path), 0).kind == "fresh"


def test_the_trainer_says_a_cut_short_job_file_in_one_line(tmp_path):
    from tasks.training.train_job import write_job

    path = write_job(_job(tmp_path), tmp_path / "job.json")
    _cut(path, "half")
    proc = subprocess.run(
        [sys.executable, "-m", "trainers.train", "--job", str(path), "--stage", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == ExitCode.FATAL
    assert proc.stderr.strip().count("\n") == 0 and "empty or cut short" in proc.stderr, proc.stderr

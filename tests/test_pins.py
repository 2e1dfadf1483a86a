"""Checkpoints held for the gauntlet: pins across filesystems, vanished checkpoints, a bounded queue; the local
face of the checkpoint store (trainers/format/store.py) and how the flow picks a face."""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

import pytest

from tasks.training.gauntlet_queue import Backlog
from trainers.format.checkpoints import CheckpointInfo
from trainers.format.store import LocalCheckpoints, S3Checkpoints, open_store


def _info(path: Path, tokens: int = 1024) -> CheckpointInfo:
    return CheckpointInfo(path=str(path), tokens=tokens, batch=1, stage="s", stage_index=0)


def _pin(path: Path, pins: Path) -> Path | None:
    """The local store's pin of the checkpoint at `path`: the path the evaluation reads, or None."""
    held = LocalCheckpoints(path.parent, pins).pin(_info(path))
    return None if held is None else Path(held.path)


def _unpin(held: Path) -> None:
    LocalCheckpoints(held.parent.parent, held.parent).unpin(_info(held))


@pytest.fixture()
def other_filesystem(tmp_path):
    """A folder on /dev/shm (tmpfs), which is never the filesystem pytest's tmp_path lives on here."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    folder = shm / f"tessera-pins-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()


def test_a_save_folder_on_another_filesystem_is_pinned_by_copy(tmp_path, other_filesystem):
    ckpt = other_filesystem / "tiny-s0-tok1024-rank0.pt"
    ckpt.write_bytes(os.urandom(1 << 16))
    with pytest.raises(OSError):  # what pinning used to do, and failed the same way on every rerun
        os.link(ckpt, tmp_path / "probe")

    held = _pin(ckpt, tmp_path / "pins")
    assert held == tmp_path / "pins" / ckpt.name and held.read_bytes() == ckpt.read_bytes()
    assert [p.name for p in (tmp_path / "pins").iterdir()] == [ckpt.name]  # no staging copy left
    ckpt.unlink()  # keep-last-K rotates the original away: the pin still holds the bytes
    assert held.stat().st_size == 1 << 16
    assert _pin(ckpt, tmp_path / "pins") == held  # pinned once; a rerun finds it


def test_a_checkpoint_gone_before_its_pin_is_named_in_the_log(tmp_path, caplog):
    gone = tmp_path / "save" / "tiny-s0-tok2048-rank0.pt"
    with caplog.at_level(logging.WARNING, logger="tessera.store"):
        assert _pin(gone, tmp_path / "pins") is None
    assert f"checkpoint {gone} was deleted before it could be pinned" in caplog.text


def test_same_filesystem_pins_are_hard_links(tmp_path):
    ckpt = tmp_path / "c.pt"
    ckpt.write_bytes(b"x" * 100)
    held = _pin(ckpt, tmp_path / "pins")
    assert held.stat().st_ino == ckpt.stat().st_ino  # no second copy on disk
    _unpin(held)
    assert not held.exists() and ckpt.exists()


def test_the_backlog_keeps_the_newest_and_names_what_it_skips():
    backlog: Backlog[int] = Backlog(limit=2)
    assert backlog.add(1) == [] and backlog.add(2) == []
    assert backlog.add(3) == [1]  # the gauntlet is behind: the oldest waiting checkpoint gives way
    assert backlog.add(4) == [2]
    assert len(backlog) == 2 and backlog.take() == 3 and backlog.take() == 4 and backlog.take() is None


def test_stale_pins_of_a_crashed_flow_are_dropped(tmp_path):
    folder = tmp_path / "pins"
    folder.mkdir()
    for name in ("a.pt", "b.pt"):
        (folder / name).write_bytes(b"1")
    assert LocalCheckpoints(tmp_path / "save", folder).drop_pins() == ["a.pt", "b.pt"]
    assert list(folder.iterdir()) == []
    assert LocalCheckpoints(tmp_path / "save", tmp_path / "none").drop_pins() == []


def test_a_sharded_checkpoint_is_pinned_as_a_folder_of_links_and_survives_its_rotation(tmp_path):
    from trainers.layout import RunFolder

    folder = tmp_path / "save" / "tiny-s0-tok1024"
    folder.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (folder / name).write_bytes(os.urandom(1 << 12))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    held = _pin(folder, tmp_path / "pins")
    assert held == tmp_path / "pins" / folder.name and held.is_dir()
    assert all((held / n).stat().st_ino == (folder / n).stat().st_ino for n in before)  # links, not copies
    assert [p.name for p in (tmp_path / "pins").iterdir()] == [folder.name]  # no staging folder left
    (tmp_path / "save" / "tiny-s0-tok2048").mkdir()  # a newer checkpoint
    RunFolder(tmp_path / "save", "tiny").keep_newest_shards(1)  # rotation removes the older folder whole
    assert not folder.exists() and {p.name: p.read_bytes() for p in held.iterdir()} == before
    _unpin(held)
    assert not held.exists()


def test_the_flow_reads_the_mirror_only_when_the_trainers_folder_is_elsewhere(tmp_path, moto_s3):
    """open_store picks the face: pods' folders are on their disks (the mirror), a local trainer's is here, a working
    copy of its mirror whose checkpoints last in the mirror and whose missing run files are read from it."""
    moto_s3.create_bucket(Bucket="ckpts")
    moto_s3.put_object(Bucket="ckpts", Key="runs/tiny/tiny-time.jsonl", Body=b'{"at": 1}\n')
    pods = open_store(tmp_path, "s3://ckpts/runs/tiny", folder_elsewhere=True)
    here = open_store(tmp_path, "s3://ckpts/runs/tiny")
    assert isinstance(pods, S3Checkpoints) and isinstance(here, LocalCheckpoints)
    ckpt = _info(tmp_path / "tiny-s0-tok1024-rank0.pt")
    assert here.where(ckpt) == pods.where(ckpt) == "s3://ckpts/runs/tiny/tiny-s0-tok1024-rank0.pt"
    assert LocalCheckpoints(tmp_path).where(ckpt) == ckpt.path
    assert here.read_text("tiny-time.jsonl") == pods.read_text("tiny-time.jsonl") == '{"at": 1}\n'
    (tmp_path / "tiny-time.jsonl").write_text("local\n")
    assert here.read_text("tiny-time.jsonl") == "local\n"  # the working copy's own, when it has one
    with pytest.raises(FileNotFoundError):
        LocalCheckpoints(tmp_path / "none").read_text("tiny-time.jsonl")


def test_a_bucket_that_does_not_exist_is_a_lasting_store_error(moto_s3):
    from trainers.format.s3 import StoreError

    with pytest.raises(StoreError, match=r"^s3://nowhere/runs: bucket 'nowhere' does not exist$") as caught:
        S3Checkpoints("s3://nowhere/runs").complete()
    assert caught.value.lasting


class _Folder:
    """The checkpoint store's face the queue uses, over names only: what is pinned is what this test is about."""

    def __init__(self, tokens: list[int]):
        self.infos = [_info(Path(f"/ckpt/tiny-s0-tok{t}-rank0.pt"), t) for t in tokens]
        self.pinned: set[int] = set()

    def complete(self):
        return self.infos

    def pin(self, info):
        self.pinned.add(info.tokens)
        return info

    def unpin(self, info):
        self.pinned.discard(info.tokens)

    def drop_pins(self):
        return []

    def where(self, info):
        return info.path

    def model_home(self, tokens):
        return None


class Stopped(Exception):
    pass


def _queue_flow(monkeypatch, folder: _Folder, slow_s: float, stop: bool = False, later: tuple[int, ...] = ()):
    """A flow that runs the real queue on Prefect's real engine and task runner, with evaluation and registration
    stand-ins (a sleep, a failure for 256 tokens) in place of the gauntlet and MLflow."""
    from types import SimpleNamespace

    from prefect import flow, task

    from evaluation.config import EvalConfig
    from infra.config import ComputeConfig
    from tasks.tracking_config import TrackingConfig
    from tasks.training import gauntlet_queue
    from tasks.training.gauntlet_queue import GauntletQueue, QueueTarget

    registered: list[int] = []
    evaluated: list[int] = []  # as each evaluation starts

    @task(name="evaluate_checkpoint")
    def evaluate(ckpt, *_):
        evaluated.append(ckpt.tokens)
        time.sleep(slow_s)
        if ckpt.tokens == 256:
            raise RuntimeError("the gauntlet's task file lambada.jsonl is missing")
        return {"tokens": ckpt.tokens}

    @task(name="register_checkpoint")
    def register(ckpt, summary, *_):
        assert summary == {"tokens": ckpt.tokens}  # its own evaluation's score, resolved
        registered.append(ckpt.tokens)
        return SimpleNamespace(tokens=ckpt.tokens)

    monkeypatch.setattr(gauntlet_queue, "evaluate_checkpoint", evaluate)
    monkeypatch.setattr(gauntlet_queue, "register_checkpoint", register)
    monkeypatch.setattr(gauntlet_queue, "existing_registrations", lambda *_: {})
    target = QueueTarget(
        run_name="tiny",
        run_id="r",
        eval=EvalConfig.model_validate({"every": 256, "tasks": "unused.yaml"}),
        tracking=TrackingConfig.model_validate({"registered_model": "tiny"}),
        compute=ComputeConfig(),
        seq_len=32,
        recipe_hash="h",
    )
    ids: list = []
    during: list[int] = []  # what was evaluated before results(), while the "stage" still ran

    @flow
    def train_and_queue():
        from prefect.runtime import flow_run

        ids.append(flow_run.id)
        queue = GauntletQueue(target, folder)
        queue.sweep()
        for tokens in later:  # the stage saves another checkpoint: the flow's next sweeps find it
            folder.infos.append(_info(Path(f"/ckpt/tiny-s0-tok{tokens}-rank0.pt"), tokens))
            deadline = time.monotonic() + 60
            while tokens not in evaluated and time.monotonic() < deadline:
                queue.sweep()
                time.sleep(0.2)
        during.extend(evaluated)
        if stop:  # the flow body ends while the evaluation runs, as a cancel ends it (TerminationSignal, which in
            # a test's own process Prefect would answer by signalling the process again)
            raise Stopped("cancelled")
        return sorted(r.tokens for r in queue.results())

    return train_and_queue, registered, ids, during


def _task_states(flow_run_id) -> dict[str, list[str]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    states: dict[str, list[str]] = {}
    for run in runs:
        states.setdefault(run.name.rsplit("-", 1)[0], []).append(run.state.type.value)  # "evaluate_checkpoint-ad0"
    return states


def test_a_failed_evaluation_skips_only_its_registration_and_the_others_register_in_order(prefect_harness, monkeypatch):
    folder = _Folder([256, 512, 768])
    train_and_queue, registered, ids, _ = _queue_flow(monkeypatch, folder, slow_s=0.2)
    with pytest.raises(RuntimeError, match="lambada.jsonl is missing"):  # results() surfaces it, after the others
        train_and_queue()
    assert registered == [512, 768]
    assert folder.pinned == set()  # each pin released: registered, or its evaluation failed
    states = _task_states(ids[0])
    assert sorted(states["evaluate_checkpoint"]) == ["COMPLETED", "COMPLETED", "FAILED"]
    assert states["register_checkpoint"] == ["COMPLETED", "COMPLETED"]


def test_a_flow_stopped_while_a_checkpoint_is_scored_leaves_no_task_crashed(prefect_harness, monkeypatch):
    """The cancel of issue 42: a registration chained on a running evaluation waited in a task thread, and Prefect's
    task runner, cancelling as the flow ended, left it orange Crashed. The queue submits a registration only once
    its evaluation has ended: the evaluation runs to its end, and no registration starts."""
    folder = _Folder([1024])
    train_and_queue, registered, ids, _ = _queue_flow(monkeypatch, folder, slow_s=3.0, stop=True)
    with pytest.raises(Stopped):
        train_and_queue()
    states = _task_states(ids[0])
    assert states == {"evaluate_checkpoint": ["COMPLETED"]}, states
    assert registered == []


def test_checkpoints_are_scored_while_the_stage_trains_once_the_evaluation_before_is_done(prefect_harness, monkeypatch):
    """Each new checkpoint is scored as soon as the one before is, while the stage trains, not when it ends: with no
    registration waiting on an evaluation, `prefect.futures.wait(fs, timeout=0)` alone would take an ended
    evaluation for running (gauntlet_queue._ended), and checkpoints would be skipped as "behind training"."""
    folder = _Folder([512])
    train_and_queue, registered, _, during = _queue_flow(monkeypatch, folder, slow_s=0.2, later=(768, 1024))
    assert train_and_queue() == [512, 768, 1024]
    assert during == [512, 768, 1024]
    assert registered == [512, 768, 1024]

"""Checkpoints held for the gauntlet: pins across filesystems, vanished checkpoints, a bounded queue; the local
face of the checkpoint store (trainers/format/store.py) and how the flow picks a face."""

from __future__ import annotations

import logging
import os
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

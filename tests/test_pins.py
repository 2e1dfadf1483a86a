"""Checkpoints held for the gauntlet: pins across filesystems, vanished checkpoints, a bounded queue."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import pytest

from tasks import pins


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

    held = pins.pin(ckpt, tmp_path / "pins")
    assert held == tmp_path / "pins" / ckpt.name and held.read_bytes() == ckpt.read_bytes()
    assert [p.name for p in (tmp_path / "pins").iterdir()] == [ckpt.name]  # no staging copy left
    ckpt.unlink()  # keep-last-K rotates the original away: the pin still holds the bytes
    assert held.stat().st_size == 1 << 16
    assert pins.pin(ckpt, tmp_path / "pins") == held  # pinned once; a rerun finds it


def test_a_checkpoint_gone_before_its_pin_is_named_in_the_log(tmp_path, caplog):
    gone = tmp_path / "save" / "tiny-s0-tok2048-rank0.pt"
    with caplog.at_level(logging.WARNING, logger="tessera.pins"):
        assert pins.pin(gone, tmp_path / "pins") is None
    assert f"checkpoint {gone} was deleted before it could be pinned" in caplog.text


def test_same_filesystem_pins_are_hard_links(tmp_path):
    ckpt = tmp_path / "c.pt"
    ckpt.write_bytes(b"x" * 100)
    held = pins.pin(ckpt, tmp_path / "pins")
    assert held.stat().st_ino == ckpt.stat().st_ino  # no second copy on disk
    pins.unpin(held)
    assert not held.exists() and ckpt.exists()


def test_the_backlog_keeps_the_newest_and_names_what_it_skips():
    backlog: pins.Backlog[int] = pins.Backlog(limit=2)
    assert backlog.add(1) == [] and backlog.add(2) == []
    assert backlog.add(3) == [1]  # the gauntlet is behind: the oldest waiting checkpoint gives way
    assert backlog.add(4) == [2]
    assert len(backlog) == 2 and backlog.take() == 3 and backlog.take() == 4 and backlog.take() is None


def test_stale_pins_of_a_crashed_flow_are_dropped(tmp_path):
    folder = tmp_path / "pins"
    folder.mkdir()
    for name in ("a.pt", "b.pt"):
        (folder / name).write_bytes(b"1")
    assert pins.drop_stale(folder) == ["a.pt", "b.pt"]
    assert list(folder.iterdir()) == []
    assert pins.drop_stale(tmp_path / "none") == []


def test_a_sharded_checkpoint_is_pinned_as_a_folder_of_links_and_survives_its_rotation(tmp_path):
    from trainers.layout import RunFolder

    folder = tmp_path / "save" / "tiny-s0-tok1024"
    folder.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (folder / name).write_bytes(os.urandom(1 << 12))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    held = pins.pin(folder, tmp_path / "pins")
    assert held == tmp_path / "pins" / folder.name and held.is_dir()
    assert all((held / n).stat().st_ino == (folder / n).stat().st_ino for n in before)  # links, not copies
    assert [p.name for p in (tmp_path / "pins").iterdir()] == [folder.name]  # no staging folder left
    (tmp_path / "save" / "tiny-s0-tok2048").mkdir()  # a newer checkpoint
    RunFolder(tmp_path / "save", "tiny").keep_newest_shards(1)  # rotation removes the older folder whole
    assert not folder.exists() and {p.name: p.read_bytes() for p in held.iterdir()} == before
    pins.unpin(held)
    assert not held.exists()

"""The trainer reads s3:// prepared data through Streaming's cache: on the cache volume, bounded by the recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

SEQ = 32


def _cached_bytes(root: Path) -> int:
    # Streaming evicts shards from other threads while this walks the folder: a file listed and then
    # evicted before its stat is no longer cached, so it counts nothing.
    total = 0
    for f in root.rglob("*.mds"):
        try:
            total += f.stat().st_size
        except FileNotFoundError:
            pass
    return total


def test_remote_data_is_cached_on_the_cache_volume_within_the_limit(tmp_path, moto_s3, monkeypatch):
    from streaming.base.util import bytes_to_int

    from tests.support.training import tiny_job, write_mds
    from trainers.config import StageConfig
    from trainers.contract import CACHE_DIR_ENV as CACHE_ENV
    from trainers.data import build_stage_data, build_val_evaluators

    local = write_mds(tmp_path / "a", 8000, SEQ, 512, seed=1)  # 64 KiB shards: 8 of them
    shards = sorted(local.glob("*.mds"))
    assert len(shards) >= 6
    moto_s3.create_bucket(Bucket="data")
    for f in local.iterdir():
        for split in ("train", "val"):
            moto_s3.upload_file(str(f), "data", f"prepared/a/{split}/{f.name}")
    volume = tmp_path / "cache-volume"
    monkeypatch.setenv(CACHE_ENV, str(volume))
    limit = "256kb"  # Streaming's minimum (4 shards), well short of all of them
    assert (
        4 * max(f.stat().st_size for f in shards) <= bytes_to_int(limit) < sum(f.stat().st_size for f in shards) / 1.5
    )

    stage = StageConfig(name="s", tokens=8000 * SEQ, mixture={"a": 1.0})
    job = tiny_job(
        tmp_path / "run",
        {"a": "s3://data/prepared/a/train"},
        [stage],
        seq_len=SEQ,
        stream_cache_limit=limit,
        val_streams={"a": "s3://data/prepared/a/val"},
        val_batches=1000,
    )
    train = build_stage_data(job.stage(0), job.train, 1).dataloader
    assert train.dataset.cache_limit == bytes_to_int(limit)
    assert Path(train.dataset.streams[0].local).parent == volume  # cached on the volume, not in /tmp

    # A held-out split is read in order, so the bound shows: shards read longest ago are evicted.
    # (A shuffled stage reads across its whole shuffle block, here every shard: with a limit below
    # that, Streaming waits for space that never frees. The recipe field says so.)
    val = build_val_evaluators(job.val_streams, job.seq_len, job.train, 1, due=lambda state, event: True)[
        0
    ].dataloader.dataloader
    seen, peak = [], 0
    for batch in val:
        seen += batch["sample_idx"].tolist()
        peak = max(peak, _cached_bytes(volume))
    assert seen == list(range(8000))  # every sample once, in order, read through the cache
    assert 0 < peak <= bytes_to_int(limit) < sum(f.stat().st_size for f in shards)

    # local data is read in place: no limit, so Streaming never evicts (deletes) prepared shards
    in_place = tiny_job(tmp_path / "run2", {"a": str(local)}, [stage], seq_len=SEQ, stream_cache_limit=limit)
    assert build_stage_data(in_place.stage(0), in_place.train, 1).dataloader.dataset.cache_limit is None
    assert sorted(local.glob("*.mds")) == shards


def test_an_unpublished_folder_is_refused_in_one_line(tmp_path, moto_s3):
    from trainers.exit_codes import FatalError
    from trainers.remote import fetch_folder

    moto_s3.create_bucket(Bucket="data")
    moto_s3.put_object(Bucket="data", Key="prepared/tok/tokenizer.json", Body=b"{}")  # an upload cut short
    with pytest.raises(FatalError, match=r"^s3://data/prepared/tok: not a published folder \(no _DONE\)"):
        fetch_folder("s3://data/prepared/tok", tmp_path / "tok")
    assert not (tmp_path / "tok").exists()

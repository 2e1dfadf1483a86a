"""Remote data is cached per run: two runs on one host reading one s3 prefix never share a Streaming cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainers.config import StageConfig

SEQ, SAMPLES = 32, 600
URI = "s3://data/prepared/a/train"


@pytest.fixture()
def bucket(tmp_path, moto_s3, monkeypatch):
    """One prepared MDS split in a real S3 server (moto), and a cache volume of its own."""
    from tests.support.training import write_mds
    from trainers.contract import CACHE_DIR_ENV

    local = write_mds(tmp_path / "a", SAMPLES, SEQ, 512, seed=1)
    moto_s3.create_bucket(Bucket="data")
    for f in local.iterdir():
        moto_s3.upload_file(str(f), "data", f"prepared/a/train/{f.name}")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _job(root: Path, run_name: str):
    from tests.support.training import tiny_job

    stage = StageConfig(name="s", tokens=SAMPLES * SEQ, mixture={"a": 1.0})
    return tiny_job(root, {"a": URI}, [stage], seq_len=SEQ, run_name=run_name, val_streams={"a": URI}, val_batches=1)


def test_two_runs_reading_one_prefix_get_their_own_cache_and_a_relaunch_its_old_one(tmp_path, bucket):
    from trainers.config import TrainJob
    from trainers.data import build_stage_data, cache_dir_for

    one, other = _job(tmp_path / "one", "run-one"), _job(tmp_path / "other", "run-other")
    local = {
        job.run_name: build_stage_data(job.stage(0), job.train, 1, run=job.run_name).dataloader.dataset.streams[0].local
        for job in (one, other)
    }
    assert local["run-one"] != local["run-other"]
    assert {Path(p).parent for p in local.values()} == {bucket}  # both on the cache volume
    # A relaunch reads the same job file: the same run finds the cache it filled.
    relaunch = TrainJob.model_validate_json(one.model_dump_json())
    assert str(cache_dir_for(URI, relaunch.run_name)) == local["run-one"]
    assert cache_dir_for(URI, "run-one") != cache_dir_for("s3://data/prepared/b/train", "run-one")


def test_two_runs_read_every_sample_of_one_prefix_at_once(tmp_path, bucket):
    """Both readers alive together in one process, as two trainers on one host are: Streaming would refuse the
    second with "Reused local directory" if they shared a cache."""
    from trainers.data import build_val_evaluators

    loaders = []
    for name in ("run-one", "run-other"):
        job = _job(tmp_path / name, name)
        [evaluator] = build_val_evaluators(job.val_streams, SEQ, job.train, 1, lambda state, event: True, run=name)
        loaders.append(evaluator.dataloader.dataloader)
    seen: list[list[int]] = [[], []]
    for first, second in zip(*loaders, strict=True):
        seen[0] += first["sample_idx"].tolist()
        seen[1] += second["sample_idx"].tolist()
    assert seen == [list(range(SAMPLES)), list(range(SAMPLES))]

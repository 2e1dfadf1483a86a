"""Prepared data is verified before a launch trains on it: flipped ids, a truncated shard and a deleted one are
each one fatal record naming the source, the shard and its samples; a damaged cached copy of remote data is
fetched again, and damage in the bucket is named when Streaming validates the download."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainers.data_check import DamagedData, verify_stream, verify_streams

SEQ = 32


def _prepared(folder: Path, samples: int = 600) -> Path:
    """An MDS folder as tessera's prepare writes it: `tokens` columns, xxh64 recorded per shard, several shards."""
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    with MDSWriter(
        out=str(folder), columns={"tokens": "ndarray:uint16"}, size_limit=1 << 13, hashes=["xxh64"]
    ) as writer:
        for _ in range(samples):
            writer.write({"tokens": rng.integers(0, 512, size=SEQ, dtype=np.uint16)})
    return folder


def _shards(folder: Path) -> list[dict]:
    return json.loads((folder / "index.json").read_text())["shards"]


def _damage(folder: Path, source: str = "books") -> dict:
    with pytest.raises(DamagedData) as found:
        verify_stream(source, folder)
    return found.value.record


def test_intact_data_passes_and_each_kind_of_damage_names_the_shard_and_its_samples(tmp_path):
    folder = _prepared(tmp_path / "books-0123" / "train")
    shards = _shards(folder)
    assert len(shards) >= 4 and all("xxh64" in s["raw_data"]["hashes"] for s in shards)
    verify_stream("books", folder)
    first = sum(s["samples"] for s in shards[:2])  # samples of shard 2 begin after those of shards 0 and 1
    third = folder / shards[2]["raw_data"]["basename"]
    original = third.read_bytes()

    # ids off by one: same size, other bytes
    data = bytearray(original)
    data[-SEQ * 2 : -SEQ * 2 + 8] = bytes((b + 1) % 256 for b in data[-SEQ * 2 : -SEQ * 2 + 8])
    third.write_bytes(bytes(data))
    record = _damage(folder)
    assert record["source"] == "books" and record["path"] == str(folder) and record["shard"] == third.name
    assert record["samples"] == [first, first + shards[2]["samples"] - 1]
    assert record["why"].startswith("has xxh64 ") and record["why"].endswith(
        f", the index records {shards[2]['raw_data']['hashes']['xxh64']} (bytes changed since it was prepared)"
    )
    assert str(DamagedData(record)) == (
        f"prepared data of source books is damaged: shard {third.name} (samples {first:,}-"
        f"{first + shards[2]['samples'] - 1:,}) in {folder} {record['why']}; prepare the source again"
    )

    # cut short
    third.write_bytes(original[:-100])
    assert _damage(folder)["why"] == (
        f"is {len(original) - 100:,} bytes, the index records {len(original):,} (cut short or overwritten)"
    )

    # deleted
    third.unlink()
    record = _damage(folder)
    assert (record["shard"], record["why"]) == (third.name, "is missing")

    third.write_bytes(original)
    verify_stream("books", folder)
    (folder / "index.json").unlink()
    record = _damage(folder)
    assert (record["shard"], record["samples"], record["why"]) == (None, None, "has no index.json")


def test_a_damaged_cached_copy_is_removed_to_be_fetched_again_and_a_missing_one_is_fine(tmp_path):
    cache = _prepared(tmp_path / "cache")
    shards = _shards(cache)
    first, second = (cache / s["raw_data"]["basename"] for s in shards[:2])
    first.write_bytes(first.read_bytes()[:-1])
    second.unlink()  # evicted, or never fetched
    verify_streams({"books": "s3://bucket/prepared/books/train"}, lambda uri: cache)
    assert not first.exists()  # Streaming downloads (and validates) it again when it is read


def test_withdraw_and_intact_on_a_prepared_output(tmp_path):
    from tasks.data import outputs

    out = tmp_path / "books-0123"
    train = _prepared(out / "train")
    (out / outputs.DONE).write_text("{}")
    assert outputs.intact(str(out))
    shard = train / _shards(train)[0]["raw_data"]["basename"]
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])
    assert not outputs.intact(str(out))
    assert outputs.withdraw(str(out)) is True and not outputs.is_done(str(out))
    assert outputs.withdraw(str(out)) is False


def test_an_outputs_home_on_a_local_and_an_s3_root_publishes_withdraws_and_resumes_alike(tmp_path, moto_s3):
    """The two faces of tasks/data/home.py on a real (moto) S3 server: the bucket's copy is the truth under an s3
    root, an upload cut short is finished from the working copy unless that is damaged too, and a damaged output's
    done-marker is withdrawn where training reads it (the stage task's path, `home_at(folder).withdraw()`)."""
    from tasks.data import outputs, remote_root
    from tasks.data.home import LocalHome, S3Home, home_at

    local = tmp_path / "books-0123"
    _prepared(local / "train")
    outputs.write_json(str(local / outputs.PROVENANCE), {"counts": {"train": {"samples": 600}}})
    (local / outputs.DONE).write_text("{}")
    moto_s3.create_bucket(Bucket="data")
    uri = "s3://data/prepared/books-0123/"

    here = home_at(str(local))
    assert isinstance(here, LocalHome) and here.where == str(local) and here.is_done()
    assert here.publish(str(local)) is False and here.resume_publish(str(local)) is None  # nothing ever to move
    home = home_at(uri)
    assert isinstance(home, S3Home) and home.where == uri.rstrip("/") and not home.is_done()

    # finished in the working copy, never uploaded: published now, done-marker last
    assert home.resume_publish(str(local)) == {"counts": {"train": {"samples": 600}}}
    assert home.is_done() and home.provenance() == {"counts": {"train": {"samples": 600}}}
    keys = {o["Key"] for o in moto_s3.list_objects_v2(Bucket="data")["Contents"]}
    assert {"prepared/books-0123/_DONE", "prepared/books-0123/train/index.json"} <= keys

    # damaged: withdrawn where training reads it, once
    assert home_at(uri).withdraw() is True and not home.is_done() and home.withdraw() is False
    # its working copy damaged too: never published again, withdrawn here to be prepared afresh
    shard = local / "train" / _shards(local / "train")[0]["raw_data"]["basename"]
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])
    assert home.resume_publish(str(local)) is None and not home.is_done() and not here.is_done()
    assert here.withdraw() is False  # already withdrawn by the resume

    # partitioned: the damaged shard's partition loses its marker with the output, on both faces
    for part in ("00002", "00003"):
        (local / "parts" / part).mkdir(parents=True)
        (local / "parts" / part / outputs.DONE).write_text("{}")
        moto_s3.put_object(Bucket="data", Key=f"prepared/books-0123/parts/{part}/_DONE", Body=b"{}")
    (local / outputs.DONE).write_text("{}")
    moto_s3.put_object(Bucket="data", Key="prepared/books-0123/_DONE", Body=b"{}")
    assert here.withdraw("00003/shard.00000.mds") and home.withdraw("00003/shard.00000.mds")
    assert sorted(p.parent.name for p in local.glob("parts/*/_DONE")) == ["00002"]
    assert remote_root.partitions_done(uri.rstrip("/")) == {2} and not home.is_done() and not here.is_done()


def test_damage_in_the_bucket_is_named_when_streaming_validates_the_download(tmp_path, moto_s3, monkeypatch):
    """Remote shards are validated as they are downloaded; the mismatch, raised in Streaming's thread, is kept
    for the entrypoint (which the training loop would only see as "Background thread failed")."""
    from tests.support.training import tiny_job
    from trainers import data_check
    from trainers.config import StageConfig
    from trainers.contract import CACHE_DIR_ENV
    from trainers.data import build_stage_data

    local = _prepared(tmp_path / "books")
    shards = _shards(local)
    moto_s3.create_bucket(Bucket="data")
    damaged = shards[1]["raw_data"]["basename"]
    for f in local.iterdir():
        body = f.read_bytes()
        if f.name == damaged:
            body = body[:50] + bytes([body[50] ^ 1]) + body[51:]
        moto_s3.put_object(Bucket="data", Key=f"prepared/books/train/{f.name}", Body=body)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(data_check, "_SEEN", [])
    stage = StageConfig(name="s", tokens=600 * SEQ, mixture={"books": 1.0})
    job = tiny_job(tmp_path / "run", {"books": "s3://data/prepared/books/train"}, [stage], seq_len=SEQ)
    loader = build_stage_data(job.stage(0), job.train, 1).dataloader
    seen = [i for batch in loader for i in batch["sample_idx"].tolist()]
    # Streaming 0.13 ends the epoch early, without an error, when its download thread fails; the next epoch
    # raises. Composer starts that next epoch at once, so the launch fails, and the entrypoint names the damage.
    assert len(seen) < 600
    with pytest.raises(RuntimeError, match="Background thread failed"):
        next(iter(loader))
    record = data_check.first_damage().record
    assert record["source"] == "books" and record["path"] == "s3://data/prepared/books/train"
    assert record["shard"] == damaged and record["samples"] == [
        shards[0]["samples"],
        sum(shards[i]["samples"] for i in (0, 1)) - 1,
    ]
    assert record["why"] == "failed its xxh64 check when downloaded"


@pytest.mark.slow
def test_a_damaged_shard_stops_the_run_in_one_line_and_a_rerun_prepares_it_again(prefect_harness, tmp_path, capsys):
    """`tessera run` on data whose ids were flipped after `tessera prepare`: every rank of the 2-rank launch stops
    before a step, the run fails in one line naming the source, shard, samples and the command that fixes it,
    the output's done-marker is withdrawn; the rerun prepares the source again (the same bytes) and trains."""
    import yaml

    from cli.main import main
    from tests.conftest import ROOT, tiny_recipe
    from tests.support.gauntlet import cut_demo_tasks
    from trainers.format.checkpoints import list_complete

    recipe = tiny_recipe(tmp_path)
    raw = yaml.safe_load(recipe.read_text())
    raw["train"]["stages"] = [{"name": "literary", "tokens": 2048, "mixture": {"literary": 1.0}}]
    raw["eval"] |= {
        "every": 2048,
        "data_root": str(cut_demo_tasks(ROOT / "data/gauntlet/eval/local_data", tmp_path / "g")),
    }
    raw["compute"]["procs_per_node"] = 2
    recipe.write_text(yaml.safe_dump(raw))

    def run(*args: str) -> tuple[int, list[str]]:
        capsys.readouterr()
        code = main(list(args))
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return code, [line for line in err.splitlines() if line.startswith("tessera: error: ")]

    assert run("prepare", str(recipe))[0] == 0
    out = next((tmp_path / "work" / "data").glob("literary-*"))
    train = out / "train"
    shard = train / _shards(train)[0]["raw_data"]["basename"]
    original = shard.read_bytes()
    data = bytearray(original)
    data[len(data) // 2 : len(data) // 2 + 8] = bytes((b + 1) % 256 for b in data[len(data) // 2 : len(data) // 2 + 8])
    shard.write_bytes(bytes(data))

    code, said = run("run", str(recipe))
    samples = _shards(train)[0]["samples"]
    assert code == 2 and len(said) == 1, said
    assert said[0].startswith(
        f"tessera: error: stage literary: prepared data of source literary is damaged: shard "
        f"{_shards(train)[0]['raw_data']['basename']} "
        f"(samples 0-{samples - 1:,}) in {train} has xxh64 "
    )
    assert said[0].endswith(
        "(bytes changed since it was prepared); its done-marker is withdrawn, so "
        f"`tessera prepare {recipe}` prepares it again (and a rerun of this run does, before it resumes)"
    )
    assert not (out / "_DONE").exists()
    assert not (out / "parts" / "00000" / "_DONE").exists()  # the damaged partition's too: the rerun rewrites it
    checkpoints = tmp_path / "work" / "runs" / "tiny" / "checkpoints"
    assert list_complete(checkpoints) == []  # stopped before a step

    code, said = run("run", str(recipe))
    assert code == 0, said
    assert shard.read_bytes() == original and (out / "_DONE").is_file()
    assert [c.tokens for c in list_complete(checkpoints)] == [2048]

"""Partitions: cut from the data alone, packed and published each on its own, resumed after kill -9 byte for byte."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from tasks.data import outputs, partitions, pipeline, tokenizer
from tests.test_data_helpers import SHAKESPEARE, expected_tokens, make_config, prov, read_tokens, spawn_prepare

SEQ = 128
SIZES = dict(chunk_bytes=64 << 10, partition_bytes=200 << 10)  # tinyshakespeare (1.1 MB): 5 partitions
N = 5


def _config(root, src, **kw):
    return make_config(
        root, [{"name": "s", "paths": [str(src)], "separator": "\n\n", "val_fraction": 0.1}], seq_len=SEQ, **SIZES, **kw
    )


def _prepare(data):
    tok = tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
    return pipeline.prepare_source(data.sources[0], data, tok)


def shards_and_indexes(out: str) -> dict[str, bytes]:
    """Every file training reads of an output: the splits' shards and indexes, by path within the output."""
    found = {}
    for split in ("train", "val"):
        for folder, _, files in os.walk(os.path.join(out, split)):
            for name in files:
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    found[os.path.relpath(path, out)] = f.read()
    return found


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    work = tmp_path_factory.mktemp("corpus")
    (work / "in.txt").write_text(SHAKESPEARE.read_text())
    return work / "in.txt"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """An uninterrupted prepare on one process: what every other path must write byte for byte."""
    res = _prepare(_config(tmp_path_factory.mktemp("ref"), corpus, workers=1))
    return res, shards_and_indexes(res.root)


def test_a_source_is_cut_into_partitions_each_packed_alone_and_the_output_is_the_same_on_any_worker_count(
    tmp_path, corpus, reference
):
    ref, ref_files = reference
    p = prov(ref.root)
    n = p["format"]["partitions"]
    assert n == N and [r["index"] for r in p["partitions"]] == list(range(n))
    assert all(r["writer"].endswith(f"pid {os.getpid()}") for r in p["partitions"])  # this process wrote them
    # Each partition's shards are a folder of their own, and the merged index names every one of them, in order.
    index = json.loads(ref_files["train/index.json"])
    assert sorted({s["raw_data"]["basename"].split("/")[0] for s in index["shards"]}) == [
        partitions.folder(k) for k in range(n)
    ]
    # No document missing or twice: every one counted once, every token of each partition packed but its last
    # fewer-than-seq_len ids per split.
    docs = [d for d in corpus.read_text().split("\n\n") if d.strip()]
    c = p["counts"]
    assert c["documents"] == len(docs) and c["tokens"] == expected_tokens(docs)
    recs = [partitions.read_record(ref.root, k) for k in range(n)]
    for split in ("train", "val"):
        assert c[split]["samples"] == sum(r["counts"][split]["tokens"] // SEQ for r in recs)
        assert all(0 <= r["counts"][split]["tokens_dropped"] < SEQ for r in recs)
    assert read_tokens(ref.path).shape == (c["train"]["samples"], SEQ)
    assert read_tokens(ref.val_path).shape == (c["val"]["samples"], SEQ)
    # Two workers (the pool, its window across partition edges) write the very same bytes.
    two = _prepare(_config(tmp_path / "two", corpus, workers=2))
    assert shards_and_indexes(two.root) == ref_files and two.hash == ref.hash


def test_the_merged_index_is_the_one_streamings_merge_index_writes(tmp_path, reference):
    from streaming.base.util import merge_index

    ref, ref_files = reference
    for split in ("train", "val"):
        copy = tmp_path / split
        shutil.copytree(os.path.join(ref.root, split), copy)
        os.unlink(copy / "index.json")
        merge_index(str(copy), keep_local=True)
        assert (copy / "index.json").read_bytes() == ref_files[f"{split}/index.json"]


@pytest.mark.slow  # child interpreters importing the stack
@pytest.mark.parametrize("fault,reused", [("partition-00001-done", 2), ("partition-00003-done", 4)])
def test_a_prepare_killed_after_some_partitions_redoes_only_the_rest_byte_for_byte(
    tmp_path, corpus, reference, caplog, fault, reused
):
    _, ref_files = reference
    data = _config(tmp_path / "data", corpus)
    tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
    cfg = tmp_path / "data.json"
    cfg.write_text(data.model_dump_json())
    proc = spawn_prepare(cfg, TESSERA_FAULT=fault)
    assert proc.wait(timeout=300) == 137, proc.stderr.read()[-2000:]
    (out,) = [str(p) for p in (tmp_path / "data").glob("s-*")]
    assert [partitions.is_done(out, k) for k in range(N)] == [k < reused for k in range(N)]
    assert not outputs.is_done(out)
    kept = {k: os.stat(partitions.split_dir(out, "train", k)).st_ino for k in range(reused)}
    # `tessera status` says it, from the files alone
    assert pipeline.output_states(data) == [
        f"source s: not prepared yet: {reused} of {N} partitions done at {out}; a rerun skips those {reused}"
    ]
    with caplog.at_level(logging.INFO, logger="tessera.data"):
        res = _prepare(data)
    assert f"source s: {reused} of {N} partitions already prepared" in caplog.text
    assert shards_and_indexes(res.root) == ref_files
    assert {k: os.stat(partitions.split_dir(out, "train", k)).st_ino for k in range(reused)} == kept
    assert prov(res.root)["partitions_reused"] == reused
    (said,) = pipeline.output_states(data)
    assert said.startswith(f"source s: prepared at {out}: {N} partitions ({reused} reused from an earlier prepare), ")


def test_a_partition_whose_marker_is_missing_is_written_again(tmp_path, corpus, reference):
    _, ref_files = reference
    data = _config(tmp_path / "data", corpus)
    res = _prepare(data)
    out = res.root
    # What a run killed between partition 3's rename and its marker leaves, with its shard cut short too.
    os.unlink(os.path.join(out, "_DONE"))
    os.unlink(os.path.join(partitions.record_dir(out, 3), "_DONE"))
    shard = os.path.join(partitions.split_dir(out, "train", 3), "shard.00000.mds")
    with open(shard, "r+b") as f:
        f.truncate(100)
    others = {k: os.stat(partitions.split_dir(out, "train", k)).st_ino for k in range(N) if k != 3}
    again = _prepare(data)
    assert not again.cached and shards_and_indexes(out) == ref_files
    assert {k: os.stat(partitions.split_dir(out, "train", k)).st_ino for k in others} == others
    assert prov(out)["partitions_reused"] == N - 1

"""Every source kind, read back through a plain StreamingDataset with exact token counts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.data import pipeline
from tests.test_data_helpers import (
    EOS,
    SHAKESPEARE,
    STORIES_SAMPLE,
    expected_tokens,
    make_config,
    neox,
    neox_info,
    prov,
    read_tokens,
    write_jsonl,
)


@pytest.fixture(scope="module")
def tok_info(tmp_path_factory):
    return neox_info(tmp_path_factory)


def _prepare(tmp_path, tok, source, seq_len=64, **kw):
    data = make_config(tmp_path / "out", [source], seq_len=seq_len, **kw)
    return pipeline.prepare_source(data.sources[0], data, tok)


def _concat(docs):
    ids = []
    for e in neox().encode_batch(docs, add_special_tokens=False):
        ids += e.ids + [EOS]
    return np.array(ids)


def test_text_blank_line_split_packs_exact_windows(tmp_path, tok_info):
    text = SHAKESPEARE.read_text()
    docs = [d for d in text.split("\n\n") if d.strip()]
    res = _prepare(
        tmp_path, tok_info, {"name": "shakespeare", "paths": [str(SHAKESPEARE)], "separator": "\n\n"}, seq_len=128
    )
    total = expected_tokens(docs)
    assert res.documents == len(docs) == 7222
    assert res.samples == total // 128
    assert res.tokens == res.samples * 128
    p = prov(res.root)
    assert p["counts"]["train"]["tokens"] == total
    assert p["counts"]["train"]["tokens_dropped"] == total % 128
    rows = read_tokens(res.path)
    assert rows.shape == (total // 128, 128) and rows.dtype == np.uint16
    assert np.array_equal(rows.reshape(-1), _concat(docs)[: rows.size])


def test_text_whole_files_from_glob(tmp_path, tok_info):
    d = tmp_path / "txt"
    d.mkdir()
    docs = ["The first file.\nIt has two lines.", "Second file, one line.", "Third: ünïcode ✓ text."]
    for i, doc in enumerate(docs):
        (d / f"{i}.txt").write_text(doc)
    res = _prepare(tmp_path, tok_info, {"name": "files", "kind": "text", "paths": [str(d / "*.txt")]}, seq_len=4)
    total = expected_tokens(docs)
    assert res.documents == 3
    assert np.array_equal(read_tokens(res.path).reshape(-1), _concat(docs)[: total // 4 * 4])


def test_text_split_on_endoftext_marker(tmp_path, tok_info):
    docs = [d for d in STORIES_SAMPLE.read_text().split("<|endoftext|>") if d.strip()]
    res = _prepare(
        tmp_path,
        tok_info,
        {"name": "stories", "paths": [str(STORIES_SAMPLE)], "separator": "<|endoftext|>"},
        seq_len=32,
    )
    assert res.documents == len(docs) == 5
    assert prov(res.root)["counts"]["train"]["tokens"] == expected_tokens(docs)
    # The marker text never reaches the tokenizer: each EOS in the output comes from packing.
    rows = read_tokens(res.path).reshape(-1)
    assert np.array_equal(rows, _concat(docs)[: rows.size])
    assert (rows == EOS).sum() == (_concat(docs)[: rows.size] == EOS).sum() >= 4


def test_jsonl_text_field_and_template(tmp_path, tok_info):
    recs = [{"question": f"What is {i}+{i}?", "answer": str(2 * i), "text": f"doc {i}"} for i in range(40)]
    path = write_jsonl(tmp_path / "qa.jsonl", recs)
    res = _prepare(tmp_path, tok_info, {"name": "plain", "kind": "jsonl", "paths": [str(path)]}, seq_len=8)
    total = expected_tokens([r["text"] for r in recs])
    assert (res.documents, res.samples) == (40, total // 8)

    res = _prepare(
        tmp_path,
        tok_info,
        {"name": "qa", "kind": "jsonl", "paths": [str(path)], "template": "{question}\n{answer}"},
        seq_len=8,
        compression="zstd",
        hashes=["sha1", "xxh64"],
    )
    docs = [f"{r['question']}\n{r['answer']}" for r in recs]
    assert np.array_equal(read_tokens(res.path).reshape(-1), _concat(docs)[: expected_tokens(docs) // 8 * 8])
    (shard,) = json.loads((Path(res.path) / "index.json").read_text())["shards"]
    assert shard["compression"] == "zstd" and set(shard["zip_data"]["hashes"]) == {"sha1", "xxh64"}


def test_parquet_row_groups(tmp_path, tok_info):
    texts = [f"Parquet row number {i} says hello." for i in range(100)]
    pq.write_table(pa.table({"body": texts, "id": list(range(100))}), tmp_path / "a.parquet", row_group_size=30)
    src = {"name": "pq", "kind": "parquet", "paths": [str(tmp_path / "*.parquet")], "text_field": "body"}
    total = expected_tokens(texts)
    res = _prepare(tmp_path, tok_info, src, seq_len=16)
    assert res.documents == 100
    assert np.array_equal(read_tokens(res.path).reshape(-1), _concat(texts)[: total // 16 * 16])

    # Small chunks: one part per row group, and still the same samples.
    res = _prepare(tmp_path / "rg", tok_info, src, seq_len=16, chunk_bytes=100, workers=2)
    assert prov(res.root)["format"]["parts"] == 4
    assert np.array_equal(read_tokens(res.path).reshape(-1), _concat(texts)[: total // 16 * 16])


@pytest.mark.parametrize("builder", ["json", "parquet", "text", "folder", "json-streaming"])
def test_hf_load_dataset_sources(tmp_path, tok_info, builder):
    texts = [f"Hugging Face record {i} of the local dataset." for i in range(30)]
    folder = tmp_path / "ds"
    folder.mkdir()
    if builder == "parquet":
        pq.write_table(pa.table({"text": texts}), folder / "train.parquet")
        spec = {"path": "parquet", "data_files": [str(folder / "train.parquet")]}
    elif builder == "text":
        (folder / "train.txt").write_text("\n".join(texts) + "\n")
        spec = {"path": "text", "data_files": [str(folder / "train.txt")]}
    else:
        write_jsonl(folder / "train.jsonl", [{"text": t} for t in texts])
        spec = (
            {"path": str(folder)}
            if builder == "folder"
            else {"path": "json", "data_files": [str(folder / "train.jsonl")], "streaming": builder == "json-streaming"}
        )
    res = _prepare(tmp_path, tok_info, {"name": "hf", "kind": "hf", **spec}, seq_len=16)
    assert res.documents == 30
    assert np.array_equal(read_tokens(res.path).reshape(-1), _concat(texts)[: expected_tokens(texts) // 16 * 16])


def test_filters_caps_and_validation_split(tmp_path, tok_info):
    recs = [{"text": ("short" if i % 5 == 0 else f"A longer document number {i}.")} for i in range(200)]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    base = {"kind": "jsonl", "paths": [str(path)], "min_chars": 10}
    res = _prepare(tmp_path, tok_info, {"name": "f", **base}, seq_len=8)
    assert res.documents == 160 and prov(res.root)["counts"]["filtered"] == 40

    res = _prepare(tmp_path, tok_info, {"name": "docs", **base, "max_documents": 7}, seq_len=8)
    assert res.documents == 7 and prov(res.root)["counts"]["capped"] is True

    res = _prepare(tmp_path, tok_info, {"name": "toks", **base, "max_tokens": 100}, seq_len=8)
    c = prov(res.root)["counts"]
    assert c["train"]["tokens"] == 100 and c["truncated"] == 1 and res.samples == 12

    res = _prepare(tmp_path, tok_info, {"name": "split", **base, "val_fraction": 0.25}, seq_len=8)
    c = prov(res.root)["counts"]
    assert c["train"]["documents"] + c["val"]["documents"] == 160
    assert 20 <= c["val"]["documents"] <= 60
    assert read_tokens(res.val_path).shape == (c["val"]["samples"], 8)
    again = _prepare(tmp_path / "again", tok_info, {"name": "split", **base, "val_fraction": 0.25}, seq_len=8)
    assert (again.val_documents, again.documents) == (res.val_documents, res.documents)


def test_parallel_chunks_match_serial_and_report_progress(tmp_path, tok_info):
    text = SHAKESPEARE.read_text()[:200_000]
    (tmp_path / "in.txt").write_text(text)
    data = {
        n: make_config(
            tmp_path / n,
            [{"name": "s", "paths": [str(tmp_path / "in.txt")], "separator": "\n\n"}],
            seq_len=128,
            workers=w,
            chunk_bytes=40_000,
        )
        for n, w in (("one", 1), ("two", 2))
    }
    seen = {n: [0, 0] for n in data}
    parts = {n: [] for n in data}

    class progress:  # tasks.data.pipeline.Progress
        def __init__(self, name):
            self.name = name

        def begin(self, source, partitions, reused):
            parts[self.name].append((source, partitions, reused))

        def __call__(self, docs, tokens):
            seen[self.name][0] += docs
            seen[self.name][1] += tokens

        def partition(self, record):
            parts[self.name].append(record["index"])

    serial, par = (pipeline.prepare_source(d.sources[0], d, tok_info, progress=progress(n)) for n, d in data.items())
    assert prov(par.root)["format"]["parts"] == 5
    a, b = read_tokens(serial.path), read_tokens(par.path)
    assert np.array_equal(a, b)
    docs = [d for d in text.split("\n\n") if d.strip()]
    total = expected_tokens(docs)
    assert par.documents == len(docs) and prov(par.root)["counts"]["train"]["tokens"] == total
    assert par.samples == total // 128  # packed in document order: only one final remainder is dropped
    assert np.array_equal(b.reshape(-1), _concat(docs)[: b.size])
    assert seen == {"one": [len(docs), total], "two": [len(docs), total]}
    assert parts == {"one": [("s", 1, 0), 0], "two": [("s", 1, 0), 0]}  # one partition (1 GiB each by default)

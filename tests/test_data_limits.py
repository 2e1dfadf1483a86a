"""Memory is bounded by default: an over-long document fails (or is skipped, or cut) without being held."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from tasks.data import pipeline
from tasks.data.config import DEFAULT_MAX_DOC_CHARS
from tasks.data.errors import DataError
from tests.test_data_helpers import ROOT, make_config, neox, neox_info, prov, read_tokens

SCRIPT = """
import sys
from tasks.data.config import DataConfig
from tasks.data import pipeline, tokenizer
from tasks.data.errors import DataError
data = DataConfig.model_validate_json(open(sys.argv[1]).read())
tok = tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
try:
    res = pipeline.prepare_source(data.sources[0], data, tok)
    print("prepared", res.documents, res.tokens)
except DataError as exc:
    print("error", exc)
"""


@pytest.fixture(scope="module")
def tok_info(tmp_path_factory):
    return neox_info(tmp_path_factory)


def _peak_rss_mb(cmd: list[str], timeout_s: float = 300) -> tuple[float, str]:
    """Peak RSS of a process and its children, sampled every 20 ms, and its stdout."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ps, peak, deadline = psutil.Process(proc.pid), 0, time.time() + timeout_s
    while proc.poll() is None and time.time() < deadline:
        total = 0
        try:
            for p in [ps, *ps.children(recursive=True)]:
                total += p.memory_info().rss
        except psutil.Error:
            pass
        peak = max(peak, total)
        time.sleep(0.02)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    return peak / (1 << 20), out.strip().splitlines()[-1]


@pytest.mark.slow  # a child interpreter and a 20 MB file
def test_a_20mb_line_fails_by_default_with_bounded_memory(tmp_path):
    line = tmp_path / "line.txt"
    line.write_text(("word " * 4_000_000).rstrip() + "\n")  # 20 MB, one line, no separator
    data = make_config(tmp_path / "out", [{"name": "line", "paths": [str(line)], "separator": "\n\n"}], seq_len=128)
    assert data.sources[0].max_doc_chars == DEFAULT_MAX_DOC_CHARS == 1_000_000
    cfg = tmp_path / "data.json"
    cfg.write_text(data.model_dump_json())
    peak_mb, last = _peak_rss_mb([sys.executable, "-c", SCRIPT, str(cfg)])
    assert last == (
        f"error {line}:1: document of 20,000,000 bytes exceeds max_doc_chars=1000000; "
        "the separator '\\n\\n' never occurs in the file"
    )
    # The interpreter with tokenizers, numpy and pydantic is ~150 MB; the 20 MB line is never held.
    assert peak_mb < 400, peak_mb
    print(f"peak RSS {peak_mb:.0f} MB")


def test_over_long_documents_are_streamed_past_skipped_or_cut(tmp_path, tok_info):
    text = "x y z " * 500_000  # 3 MB: above the 1 MiB read block, so it is never held whole
    f = tmp_path / "long.txt"
    f.write_text(f"A short first document.\n\n{text}\n\nA short last document.")
    src = {"name": "l", "paths": [str(f)], "separator": "\n\n", "max_doc_chars": 10_000}

    data = make_config(tmp_path / "fail", [src], seq_len=4)
    with pytest.raises(DataError, match=rf"^{f}:3: document of 3,000,000 bytes exceeds max_doc_chars=10000$"):
        pipeline.prepare_source(data.sources[0], data, tok_info)

    data = make_config(tmp_path / "skip", [{**src, "on_error": "skip"}], seq_len=4)
    c = prov(pipeline.prepare_source(data.sources[0], data, tok_info).root)["counts"]
    assert (c["documents"], c["skipped"]) == (2, {"too_long": 1})

    data = make_config(tmp_path / "cut", [{**src, "truncate_long": True}], seq_len=4)
    res = pipeline.prepare_source(data.sources[0], data, tok_info)
    docs = ["A short first document.", text[:10_000], "A short last document."]
    ids = [t for e in neox().encode_batch(docs, add_special_tokens=False) for t in [*e.ids, 0]]
    assert prov(res.root)["counts"]["truncated"] == 1
    assert np.array_equal(read_tokens(res.path).reshape(-1), np.array(ids[: len(ids) // 4 * 4]))


def test_whole_file_and_jsonl_records_are_bounded_too(tmp_path, tok_info):
    big = tmp_path / "whole.txt"
    big.write_text("é" * 600_000)  # 1.2 MB of 2-byte characters, one document
    data = make_config(
        tmp_path / "w", [{"name": "w", "paths": [str(big)], "max_doc_chars": 1000, "truncate_long": True}], seq_len=4
    )
    res = pipeline.prepare_source(data.sources[0], data, tok_info)
    assert res.documents == 1 and prov(res.root)["counts"]["truncated"] == 1
    ids = neox().encode("é" * 1000, add_special_tokens=False).ids + [0]
    assert np.array_equal(read_tokens(res.path).reshape(-1), np.array(ids[: len(ids) // 4 * 4]))

    j = tmp_path / "d.jsonl"
    j.write_text(json.dumps({"text": "fine record"}) + "\n" + json.dumps({"text": "q" * 2_000_000}) + "\n")
    data = make_config(
        tmp_path / "j", [{"name": "j", "kind": "jsonl", "paths": [str(j)], "max_doc_chars": 1000}], seq_len=2
    )
    with pytest.raises(
        DataError,
        match=rf"^{j}:2: line of 2,000,012 bytes exceeds max_doc_chars=1000; lines over "
        r"1,048,576 bytes are not parsed$",
    ):
        pipeline.prepare_source(data.sources[0], data, tok_info)

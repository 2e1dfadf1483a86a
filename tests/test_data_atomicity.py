"""A run killed mid-way leaves nothing that looks complete, and the next run finishes the work: only what was left."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest

from tasks.data import outputs, partitions, pipeline, tokenizer
from tests.test_data_helpers import SHAKESPEARE, expected_tokens, make_config, prov, read_tokens, spawn_prepare


def _setup(tmp_path, copies: int, **kw):
    text = SHAKESPEARE.read_text() * copies
    (tmp_path / "in.txt").write_text(text)
    data = make_config(
        tmp_path / "data", [{"name": "s", "paths": [str(tmp_path / "in.txt")], "separator": "\n\n"}], seq_len=128, **kw
    )
    # Resolved here so the child's only staged output is the source (the fault hook is not selective).
    tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
    cfg = tmp_path / "data.json"
    cfg.write_text(data.model_dump_json())
    docs = [d for d in text.split("\n\n") if d.strip()]
    return data, cfg, docs


def _plan(data):
    return pipeline.plan(data.sources[0], data, tokenizer.resolve(data.tokenizer, data.root, [], data.chunk_bytes))


def _finish_and_check(data, docs):
    tok = tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
    res = pipeline.prepare_source(data.sources[0], data, tok)
    total = expected_tokens(docs)
    assert not res.cached
    assert prov(res.root)["counts"]["train"]["tokens"] == total
    assert read_tokens(res.path).shape == (total // 128, 128)
    assert glob.glob(os.path.join(res.root, ".tmp-*")) == []  # the dead run's staging is cleared
    assert glob.glob(os.path.join(data.root, ".s-*")) == []  # and its lease
    return res


@pytest.mark.slow  # a child interpreter importing the stack
def test_sigkill_while_writing_leaves_no_output(tmp_path):
    data, cfg, docs = _setup(tmp_path, copies=1)
    proc = spawn_prepare(cfg)
    deadline = time.time() + 120
    while not glob.glob(os.path.join(data.root, "s-*", ".tmp-*", "train")):  # the writer has started
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    plan = _plan(data)
    assert not outputs.is_done(plan.out) and not partitions.is_done(plan.out, 0)
    assert len(glob.glob(os.path.join(plan.out, ".tmp-00000-*"))) == 1
    assert len(glob.glob(os.path.join(data.root, ".s-*.lease"))) == 1  # a dead pid on this host: stale at once
    assert pipeline.cached_result(plan) is None
    _finish_and_check(data, docs)


@pytest.mark.slow
def test_killed_after_a_partitions_rename_before_its_done_marker_is_redone(tmp_path):
    data, cfg, docs = _setup(tmp_path, copies=1)
    proc = spawn_prepare(cfg, TESSERA_FAULT="partition-renamed")
    assert proc.wait(timeout=300) == 137, proc.stderr.read()[-2000:]
    (out,) = glob.glob(os.path.join(data.root, "s-*"))
    assert os.path.isdir(partitions.split_dir(out, "train", 0)) and not partitions.is_done(out, 0)
    res = _finish_and_check(data, docs)
    assert res.root == out and outputs.is_done(out) and prov(out)["partitions_reused"] == 0


@pytest.mark.slow
def test_killed_after_the_merge_before_done_marker_redoes_no_partition(tmp_path):
    data, cfg, docs = _setup(tmp_path, copies=1)
    proc = spawn_prepare(cfg, TESSERA_FAULT="merged")
    assert proc.wait(timeout=300) == 137, proc.stderr.read()[-2000:]
    (out,) = glob.glob(os.path.join(data.root, "s-*"))
    assert os.path.isfile(os.path.join(out, "provenance.json")) and not outputs.is_done(out)
    shards = {p: os.stat(p).st_mtime_ns for p in glob.glob(os.path.join(out, "train", "*", "*.mds"))}
    res = _finish_and_check(data, docs)
    assert res.root == out and outputs.is_done(out) and prov(out)["partitions_reused"] == 1
    assert {p: os.stat(p).st_mtime_ns for p in shards} == shards  # the finished partition was not written again

"""s3:// sources against a real local S3 server (moto's server mode)."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.data import pipeline, storage
from tasks.data.errors import DataError
from tests.test_data_helpers import expected_tokens, make_config, neox, neox_info, prov, read_tokens


@pytest.fixture(scope="module")
def tok_info(tmp_path_factory):
    return neox_info(tmp_path_factory)


@pytest.fixture()
def s3(moto_s3):
    moto_s3.create_bucket(Bucket="corpus")
    return moto_s3


def _run(tmp_path, tok, source, **kw):
    data = make_config(tmp_path / "out", [source], seq_len=8, **kw)
    return pipeline.prepare_source(data.sources[0], data, tok)


def test_s3_text_jsonl_and_parquet(tmp_path, tok_info, s3):
    paras = [f"Paragraph {i} stored in an object store, with some words." for i in range(120)]
    s3.put_object(Bucket="corpus", Key="text/a.txt", Body="\n\n".join(paras[:60]).encode())
    s3.put_object(Bucket="corpus", Key="text/b.txt", Body="\n\n".join(paras[60:]).encode())
    s3.put_object(Bucket="corpus", Key="text-other/c.txt", Body=b"must not be listed")
    total = expected_tokens(paras)

    # A plain prefix lists the "folder"; small chunks force ranged reads inside each object.
    res = _run(tmp_path, tok_info, {"name": "t", "paths": ["s3://corpus/text"], "separator": "\n\n"}, chunk_bytes=1000)
    p = prov(res.root)
    assert res.documents == 120 and p["counts"]["train"]["tokens"] == total
    assert [f[0] for f in p["inputs"]] == ["s3://corpus/text/a.txt", "s3://corpus/text/b.txt"]
    assert all(len(f[2]) == 32 for f in p["inputs"])  # the ETag, not an mtime
    assert read_tokens(res.path).shape == (total // 8, 8)

    s3.put_object(
        Bucket="corpus", Key="j/part-1.jsonl", Body="".join(json.dumps({"text": t}) + "\n" for t in paras).encode()
    )
    res = _run(tmp_path, tok_info, {"name": "j", "kind": "jsonl", "paths": ["s3://corpus/j/*.jsonl"]})
    assert res.documents == 120 and prov(res.root)["counts"]["train"]["tokens"] == total

    buf = io.BytesIO()
    pq.write_table(pa.table({"text": paras}), buf)
    s3.put_object(Bucket="corpus", Key="p/a.parquet", Body=buf.getvalue())
    res = _run(tmp_path, tok_info, {"name": "p", "kind": "parquet", "paths": ["s3://corpus/p/a.parquet"]})
    expected = np.concatenate([np.array(e.ids + [0]) for e in neox().encode_batch(paras)])
    assert np.array_equal(read_tokens(res.path).reshape(-1), expected[: total // 8 * 8])


def test_s3_change_redoes_and_bad_patterns_fail(tmp_path, tok_info, s3):
    s3.put_object(Bucket="corpus", Key="x/a.txt", Body=b"first version of the document, long enough for one sample")
    src = {"name": "x", "paths": ["s3://corpus/x/a.txt"]}
    first = _run(tmp_path, tok_info, src)
    assert _run(tmp_path, tok_info, src).cached
    s3.put_object(Bucket="corpus", Key="x/a.txt", Body=b"second version, with different words entirely and a few more")
    second = _run(tmp_path, tok_info, src)
    assert not second.cached and second.root != first.root

    with pytest.raises(DataError, match=r"^s3://corpus/none/\*\.txt: no S3 objects match$"):
        _run(tmp_path, tok_info, {"name": "n", "paths": ["s3://corpus/none/*.txt"]})
    s3.put_object(Bucket="corpus", Key="bad/a.jsonl", Body=b'{"text": "ok"}\n{"text": 1}\n')
    with pytest.raises(DataError, match=r"^s3://corpus/bad/a.jsonl:2: field 'text' is int, not a string$"):
        _run(tmp_path, tok_info, {"name": "b", "kind": "jsonl", "paths": ["s3://corpus/bad/a.jsonl"]})


def test_the_s3_client_follows_the_endpoint_the_environment_names(monkeypatch):
    """One client kept per endpoint, never one made for an endpoint the environment no longer names: a client cached
    regardless of it sent a later test's reads to an earlier test's stopped S3 server (CI at d6fc90a)."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:1")
    first = storage._s3_client()
    assert storage._s3_client() is first and first.meta.endpoint_url == "http://127.0.0.1:1"
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:2")
    assert storage._s3_client().meta.endpoint_url == "http://127.0.0.1:2"
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:1")
    assert storage._s3_client() is first

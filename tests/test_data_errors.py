"""Bad input: a one-line error naming the file and line (fail fast), or a counted skip."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.data import pipeline
from tasks.data.errors import DataError
from tests.test_data_helpers import make_config, neox_info, prov, write_jsonl


@pytest.fixture(scope="module")
def tok_info(tmp_path_factory):
    return neox_info(tmp_path_factory)


def _run(tmp_path, tok, source, **kw):
    data = make_config(tmp_path / "out", [source], seq_len=4, **kw)
    return pipeline.prepare_source(data.sources[0], data, tok)


def _listing(out) -> list[str]:
    return sorted(os.listdir(out)) if out.exists() else []


def _fail(tmp_path, tok, source, **kw) -> str:
    before = _listing(tmp_path / "out")
    with pytest.raises(DataError) as ei:
        _run(tmp_path, tok, source, **kw)
    msg = str(ei.value)
    assert "\n" not in msg
    # Never half-written: no new output and no staging directory left behind.
    assert _listing(tmp_path / "out") == before
    return msg


def _skipped(tmp_path, tok, source, **kw) -> dict:
    res = _run(tmp_path, tok, {**source, "on_error": "skip"}, **kw)
    return prov(res.root)["counts"]


GOOD = "A perfectly good paragraph of text.\nWith a second line."


def test_invalid_utf8_in_text_names_the_line(tmp_path, tok_info):
    f = tmp_path / "bad.txt"
    f.write_bytes(f"{GOOD}\n\nline three\nline four \xff here\n\n{GOOD}".encode("latin-1"))
    src = {"name": "t", "paths": [str(f)], "separator": "\n\n"}
    assert _fail(tmp_path, tok_info, src) == f"{f}:5: invalid UTF-8 (byte 0xff)"
    c = _skipped(tmp_path, tok_info, src)
    assert c["skipped"] == {"invalid_utf8": 1} and c["documents"] == 2


def test_invalid_utf8_line_is_absolute_in_a_chunked_file(tmp_path, tok_info):
    f = tmp_path / "big.txt"
    body = "".join(f"paragraph {i}\nsecond line\n\n" for i in range(300))
    f.write_bytes(body.encode() + b"bad \xfe byte\n\n" + body.encode())
    expected_line = 300 * 3 + 1
    src = {"name": "t", "paths": [str(f)], "separator": "\n\n"}
    # Raised in a pool process, inside the part that starts mid-file, and still names the file's line.
    msg = _fail(tmp_path, tok_info, src, chunk_bytes=2000, workers=2)
    assert msg == f"{f}:{expected_line}: invalid UTF-8 (byte 0xfe)"


def test_jsonl_bad_lines(tmp_path, tok_info):
    f = tmp_path / "d.jsonl"
    write_jsonl(f, [{"text": GOOD}, '{"text": "unterminated', {"text": GOOD}])
    src = {"name": "j", "kind": "jsonl", "paths": [str(f)]}
    assert _fail(tmp_path, tok_info, src).startswith(f"{f}:2: malformed JSON (")
    assert _skipped(tmp_path, tok_info, src)["skipped"] == {"malformed_json": 1}

    write_jsonl(f, [{"text": GOOD}, {"text": GOOD}, {"body": "no text here"}])
    assert _fail(tmp_path, tok_info, src) == f"{f}:3: missing text field 'text'"
    assert _skipped(tmp_path, tok_info, src)["skipped"] == {"missing_field": 1}

    src_t = {**src, "name": "jt", "template": "{text}\n{answer}"}
    assert _fail(tmp_path, tok_info, src_t) == f"{f}:1: missing template field 'answer'"

    f.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert _fail(tmp_path, tok_info, src) == f"{f}:2: invalid UTF-8 (byte 0xe9)"


def test_parquet_missing_column_names_the_columns(tmp_path, tok_info):
    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"body": ["x"], "id": [1]}), f)
    src = {"name": "p", "kind": "parquet", "paths": [str(f)]}
    assert _fail(tmp_path, tok_info, src) == f"{f}: no column 'text' (columns: body, id)"


def test_empty_file_and_empty_source(tmp_path, tok_info):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    good = tmp_path / "good.txt"
    good.write_text(GOOD)
    src = {"name": "e", "paths": [str(empty), str(good)]}
    assert _fail(tmp_path, tok_info, src) == f"{empty}: empty file"
    assert _skipped(tmp_path, tok_info, src)["skipped"] == {"empty_file": 1}

    only = {"name": "e2", "paths": [str(empty)], "on_error": "skip"}
    assert _fail(tmp_path, tok_info, only) == "source 'e2': no documents (1 skipped, 0 filtered, 1 files)"
    filtered = {"name": "e3", "paths": [str(good)], "min_chars": 10_000}
    assert _fail(tmp_path, tok_info, filtered) == "source 'e3': no documents (0 skipped, 1 filtered, 1 files)"


def test_unreadable_paths_and_empty_glob(tmp_path, tok_info):
    good = tmp_path / "good.txt"
    good.write_text(GOOD)
    missing = tmp_path / "missing.txt"
    assert _fail(tmp_path, tok_info, {"name": "u", "paths": [str(missing)]}) == f"{missing}: no such file"
    assert _fail(tmp_path, tok_info, {"name": "u", "paths": [str(tmp_path)]}).startswith(f"{tmp_path}: is a directory")
    pattern = str(tmp_path / "nothing" / "*.txt")
    assert _fail(tmp_path, tok_info, {"name": "g", "paths": [pattern]}) == f"{pattern}: glob matches no files"
    c = _skipped(tmp_path, tok_info, {"name": "g", "paths": [pattern, str(missing), str(good)]})
    assert c["skipped"] == {"unreadable_path": 2} and c["documents"] == 1


def test_document_longer_than_limit(tmp_path, tok_info):
    f = tmp_path / "long.txt"
    f.write_text(f"{GOOD}\n\n{'x' * 500}\n\n{GOOD}")
    src = {"name": "l", "paths": [str(f)], "separator": "\n\n", "max_doc_chars": 100}
    assert _fail(tmp_path, tok_info, src) == f"{f}:4: document of 500 characters exceeds max_doc_chars=100"
    assert _skipped(tmp_path, tok_info, src)["skipped"] == {"too_long": 1}
    res = _run(tmp_path, tok_info, {**src, "name": "lt", "truncate_long": True})
    assert prov(res.root)["counts"]["truncated"] == 1 and res.documents == 3


def test_failure_keeps_what_was_prepared(tmp_path, tok_info):
    good = tmp_path / "good.txt"
    good.write_text(GOOD)
    first = _run(tmp_path, tok_info, {"name": "keep", "paths": [str(good)]})
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff")
    _fail(tmp_path, tok_info, {"name": "broken", "paths": [str(bad)]})
    assert sorted(os.listdir(tmp_path / "out")) == [os.path.basename(first.root)]
    assert prov(first.root)["counts"]["documents"] == 1


def test_read_failure_names_the_file():
    from tasks.data import storage

    # Readable by stat and open even as root, but every read fails: a real I/O error.
    with pytest.raises(DataError, match=r"^/proc/self/mem: cannot read file at byte 0 \(Input/output error\)$"):
        list(storage.read_blocks("/proc/self/mem", 0, 10))

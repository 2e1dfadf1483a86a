"""What used to pass silently: a separator that never occurs, an empty validation split, a relative path."""

from __future__ import annotations

import os

import pytest

from tasks.data import pipeline
from tasks.data.errors import DataError
from tests.test_data_helpers import SHAKESPEARE, make_config, neox_info, prov


@pytest.fixture(scope="module")
def tok_info(tmp_path_factory):
    return neox_info(tmp_path_factory)


def test_a_large_file_the_separator_never_splits_is_warned_about(tmp_path, tok_info):
    one = tmp_path / "one.txt"
    one.write_text("\n".join(line for line in SHAKESPEARE.read_text()[:600_000].splitlines() if line))  # no blank line
    src = {"name": "s", "paths": [str(one)], "separator": "\n\n"}
    res = pipeline.prepare_source(
        make_config(tmp_path / "out", [src]).sources[0], make_config(tmp_path / "out", [src]), tok_info
    )
    size = os.path.getsize(one)
    want = f"source 's': {one} ({size:,} bytes) is one document: the separator '\\n\\n' never occurs in it"
    assert res.documents == 1 and res.warnings == [want]
    assert prov(res.root)["warnings"] == [want]

    # Small files, files that do split, and one large document followed by its separator are not
    # worth a word.
    small = tmp_path / "small.txt"
    small.write_text("A single short document.")
    ended = tmp_path / "ended.txt"
    ended.write_text(one.read_text() + "\n\n")
    data = make_config(tmp_path / "out2", [{**src, "paths": [str(small), str(SHAKESPEARE), str(ended)]}])
    assert pipeline.prepare_source(data.sources[0], data, tok_info).warnings == []


def test_val_fraction_that_holds_out_nothing_fails_naming_the_source(tmp_path, tok_info):
    f = tmp_path / "few.txt"
    f.write_text("\n\n".join(f"Document number {i} with a handful of words in it." for i in range(6)))
    data = make_config(
        tmp_path / "out", [{"name": "few", "paths": [str(f)], "separator": "\n\n", "val_fraction": 0.01}], seq_len=16
    )
    with pytest.raises(
        DataError,
        match=r"^source 'few': val_fraction=0.01 held out no validation sample "
        r"\(0 documents, 0 tokens; one sample is seq_len=16 tokens\)",
    ):
        pipeline.prepare_source(data.sources[0], data, tok_info)
    assert [n for n in os.listdir(tmp_path / "out") if n.startswith("few-")] == []  # nothing published


def test_a_missing_relative_path_names_the_directory_it_was_resolved_against(tmp_path, tok_info, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = make_config(tmp_path / "out", [{"name": "r", "paths": ["corpus/missing.txt"]}])
    with pytest.raises(DataError, match=rf"^corpus/missing.txt: no such file \(relative to {tmp_path}\)$"):
        pipeline.prepare_source(data.sources[0], data, tok_info)
    data = make_config(tmp_path / "out", [{"name": "g", "paths": ["corpus/*.txt"]}])
    with pytest.raises(DataError, match=rf"^corpus/\*.txt: glob matches no files \(relative to {tmp_path}\)$"):
        pipeline.prepare_source(data.sources[0], data, tok_info)

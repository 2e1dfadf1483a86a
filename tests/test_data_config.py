"""The `data` recipe section: source kinds, defaults and what it refuses."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from tasks.data.config import DataConfig, HFSource, JsonlSource, TextSource

BASE = {"seq_len": 8, "tokenizer": {"path": "tok.json"}}


def test_skeleton_sources_default_to_text_and_kinds_dispatch():
    cfg = DataConfig.model_validate(
        {
            **BASE,
            "sources": [
                {"name": "a", "paths": ["a.txt"], "separator": "\n\n"},
                {"name": "b", "kind": "jsonl", "paths": ["b.jsonl"], "template": "{question}\n{answer}"},
                {"name": "c", "kind": "hf", "path": "json", "data_files": ["c.jsonl"], "streaming": True},
            ],
        }
    )
    assert [type(s) for s in cfg.sources] == [TextSource, JsonlSource, HFSource]
    assert cfg.sources[0].on_error == "fail" and cfg.sources[1].text_field == "text"


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"sources": [{"name": "a", "paths": ["x"], "colour": "red"}]}, "Extra inputs are not permitted"),
        ({"sources": [{"name": "a", "kind": "csv", "paths": ["x"]}]}, "does not match any of the expected tags"),
        ({"sources": [{"name": "a b", "paths": ["x"]}]}, "String should match pattern"),
        ({"sources": [{"name": "a", "paths": ["x"]}, {"name": "a", "paths": ["y"]}]}, "source names must be unique"),
        ({"sources": [{"name": "a", "kind": "jsonl", "paths": ["x"], "template": "{}"}]}, "template must name fields"),
        ({"sources": [{"name": "a", "paths": ["x"], "val_fraction": 1.0}]}, "less than 1"),
        ({"tokenizer": {"path": "t.json", "train": {}}, "sources": [{"name": "a", "paths": ["x"]}]}, "exactly one"),
        (
            {"tokenizer": {"train": {"special_tokens": ["<pad>"]}}, "sources": [{"name": "a", "paths": ["x"]}]},
            "must include '<|endoftext|>'",
        ),
    ],
)
def test_refuses_bad_sections(bad, needle):
    with pytest.raises(ValidationError, match="(?s).*" + re.escape(needle)):
        DataConfig.model_validate({**BASE, **bad})

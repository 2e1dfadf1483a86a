"""Both tokenizer paths: a pretrained tokenizer.json/directory, and a BPE trained on the sources."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tasks.data import pipeline, tokenizer
from tasks.data.errors import DataError
from tests.test_data_helpers import NEOX, STORIES_SAMPLE, make_config, read_tokens


def test_pretrained_file_and_directory(tmp_path):
    from transformers import AutoTokenizer

    cfg = make_config(tmp_path, [{"name": "x", "paths": ["x"]}]).tokenizer
    info = tokenizer.resolve(cfg, str(tmp_path / "a"), [], 1 << 20)
    assert (info.vocab_size, info.eos_token_id, info.dtype) == (50277, 0, "uint16")
    hf = AutoTokenizer.from_pretrained(info.hf_dir)
    assert hf("Hello world")["input_ids"] == [12092, 1533] and hf.eos_token_id == 0

    from_dir = tokenizer.resolve(cfg.model_copy(update={"path": info.hf_dir}), str(tmp_path / "b"), [], 1 << 20)
    assert (from_dir.vocab_size, from_dir.eos_token_id) == (50277, 0)
    assert tokenizer.resolve(cfg, str(tmp_path / "a"), [], 1 << 20) == info  # reused, same hash

    bad = cfg.model_copy(update={"eos_token": "</s>"})
    with pytest.raises(DataError, match=r"^tokenizer.eos_token='</s>': not in the tokenizer's vocabulary$"):
        tokenizer.resolve(bad, str(tmp_path / "c"), [], 1 << 20)


def test_trained_bpe_is_saved_and_reused(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    data = make_config(
        tmp_path / "out",
        [{"name": "stories", "paths": [str(STORIES_SAMPLE)], "separator": "<|endoftext|>"}],
        tokenizer={"train": {"vocab_size": 400, "special_tokens": ["<|endoftext|>", "<|pad|>"]}},
        seq_len=16,
    )
    info = tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
    assert (info.vocab_size, info.eos_token_id, info.dtype, info.trained) == (400, 0, "uint16", True)
    hf = AutoTokenizer.from_pretrained(info.hf_dir)
    text = "Once upon a time there was a little boy named Ben."
    assert hf.decode(hf(text)["input_ids"]) == text

    monkeypatch.setattr(tokenizer, "_train", lambda *a: pytest.fail("retrained"))
    assert tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes) == info

    res = pipeline.prepare_source(data.sources[0], data, info)
    assert res.dtype == "uint16" and read_tokens(res.path).max() < 400


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(NEOX))
    tok.add_tokens([f"<extra_{i}>" for i in range(16_000)])
    path = tmp_path / "big.json"
    tok.save(str(path))
    doc = tmp_path / "d.txt"
    doc.write_text("Plain words and <extra_15999> at the end.")
    data = make_config(tmp_path / "out", [{"name": "d", "paths": [str(doc)]}], seq_len=4, tokenizer={"path": str(path)})
    info = tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
    assert info.vocab_size == 66277 and info.dtype == "uint32"
    res = pipeline.prepare_source(data.sources[0], data, info)
    rows = read_tokens(res.path)
    assert rows.dtype == np.uint32 and 66276 in rows
    index = json.loads((tmp_path / "out" / f"d-{res.hash}" / "train" / "index.json").read_text())
    assert index["shards"][0]["column_encodings"] == ["ndarray:uint32:4"]


def test_bos_and_eos_wrap_every_document(tmp_path):
    from tests.test_data_helpers import neox

    docs = ["First document here.", "Second one, a bit longer than the first."]
    f = tmp_path / "d.txt"
    f.write_text("\n\n".join(docs))
    data = make_config(
        tmp_path / "out",
        [{"name": "d", "paths": [str(f)], "separator": "\n\n"}],
        seq_len=2,
        tokenizer={"path": str(NEOX), "bos_token": "<|padding|>"},
    )
    info = tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
    assert (info.bos_token_id, info.eos_token_id) == (1, 0)
    res = pipeline.prepare_source(data.sources[0], data, info)
    expected = [t for e in neox().encode_batch(docs, add_special_tokens=False) for t in [1, *e.ids, 0]]
    assert read_tokens(res.path).reshape(-1).tolist() == expected[: len(expected) // 2 * 2]
    plain = make_config(tmp_path / "out", [{"name": "d", "paths": [str(f)], "separator": "\n\n"}], seq_len=2)
    assert tokenizer.output_dir(plain.tokenizer, plain.root, [], 1) != info.hf_dir  # the EOS/BOS policy is hashed

"""A separator splits a file exactly as `text.split(separator)` does, however the file is cut.

Files are cut into units at separators (to tokenize in parallel) and read in blocks; neither cut
may change a document, including when runs of a self-overlapping separator straddle a cut.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tasks.data import pipeline, readers, storage
from tasks.data.config import TextSource
from tasks.data.tally import Tally
from tasks.data.units import plan_units
from tests.test_data_helpers import expected_tokens, make_config, neox, neox_info, read_tokens

SEPARATORS = ["\n\n", "\n", "\n\n\n", "aa", "aba", "<|endoftext|>", "é\n"]
ALPHABET = ["\n", "\n", "\n", "a", "b", "a", " ", "é", "x"]


def _documents(path, sep: str, chunk_bytes: int) -> list[str]:
    src = TextSource(name="t", paths=[str(path)], separator=sep)
    tally = Tally()
    refs = storage.expand([str(path)])
    return [d for u in plan_units(src, refs, chunk_bytes, tally) for d in readers.documents(src, u, tally)]


def _expected(text: str, sep: str) -> list[str]:
    # The documented filtering: empty and whitespace-only documents are dropped.
    return [d for d in text.split(sep) if d and not d.isspace()]


def _random_text(rng: random.Random, sep: str) -> str:
    out = []
    for _ in range(rng.randrange(1, 60)):
        if rng.random() < 0.4:
            out.append(sep * rng.randrange(1, 4) + "\n" * rng.randrange(0, 3))  # runs of separator characters
        out.append("".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 12))))
    return "".join(out)


@pytest.mark.parametrize("sep", SEPARATORS)
def test_split_equals_plain_split_for_any_chunk_and_block_size(tmp_path, monkeypatch, sep):
    rng = random.Random(sep)
    path = tmp_path / "t.txt"
    for case in range(40):
        text = _random_text(rng, sep)
        path.write_bytes(text.encode())
        want = _expected(text, sep)
        for chunk in (1, 2, 3, 5, 8, 13, 64, 1 << 20):
            for block in (1, 3, storage.BLOCK):
                monkeypatch.setattr(storage, "BLOCK", block)
                got = _documents(path, sep, chunk)
                assert got == want, (case, chunk, block, text)


@pytest.fixture(scope="module")
def tok_info(tmp_path_factory):
    return neox_info(tmp_path_factory)


def test_three_newlines_across_the_chunk_boundary_keep_their_token(tmp_path, tok_info):
    """The reported case: a run of three newlines straddles the 1 MiB cut, end to end."""
    filler = "A paragraph of filler text.\n\n"
    head = (filler * (storage.BLOCK // len(filler) + 1))[: storage.BLOCK - 2] + "."
    assert len(head) == storage.BLOCK - 1  # the run of newlines starts one byte before the 1 MiB cut
    text = head + "\n\n\nYfirst words of the second document.\n\nA third one."
    (tmp_path / "in.txt").write_text(text)
    docs = _expected(text, "\n\n")
    assert docs[-2] == "\nYfirst words of the second document."
    data = make_config(
        tmp_path / "out",
        [{"name": "s", "paths": [str(tmp_path / "in.txt")], "separator": "\n\n"}],
        seq_len=8,
        chunk_bytes=1 << 20,
        workers=1,
    )
    res = pipeline.prepare_source(data.sources[0], data, tok_info)
    assert res.documents == len(docs)
    ids = []
    for e in neox().encode_batch(docs, add_special_tokens=False):
        ids += e.ids + [0]
    rows = read_tokens(res.path).reshape(-1)
    assert expected_tokens(docs) == len(ids)
    assert np.array_equal(rows, np.array(ids[: len(ids) // 8 * 8]))

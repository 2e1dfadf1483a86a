"""Tokenize one job (one or more units, in order) into flat token arrays, one per split.

This runs in pool processes, so it imports neither Prefect nor Streaming (Streaming pulls in torch,
~700 MB per process); the parent packs and writes MDS. It holds one batch of documents and the
job's token ids, which `chunk_bytes` bounds.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

from tasks.data import readers
from tasks.data.config import SourceConfig
from tasks.data.tally import Tally
from tasks.data.units import Unit

_BATCH_DOCS = 1024
_BATCH_CHARS = 1 << 20
_TOKENIZERS: dict = {}

Sink = Callable[[str, np.ndarray], None]


def init_worker() -> None:
    # One process per core already; tokenizers' own threads would only contend with the others.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # A terminal's Ctrl-C reaches the whole process group. The parent decides what a stop means
    # (tasks/data/interrupt.py) and terminates this process; a KeyboardInterrupt here would only
    # come back to it as a job's result while the pool lived on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass(frozen=True)
class Job:
    """What one process tokenizes."""

    source: SourceConfig
    units: tuple[Unit, ...]
    tokenizer_json: str
    eos_id: int
    bos_id: int | None
    dtype: str


@dataclass
class SplitCounts:
    documents: int = 0
    tokens: int = 0


@dataclass
class JobResult:
    train: SplitCounts
    val: SplitCounts
    tally: Tally
    ids: dict[str, np.ndarray] | None  # None when a sink took the ids as they came
    capped: bool = False
    units: int = 0


def _tokenizer(path: str):
    tok = _TOKENIZERS.get(path)
    if tok is None:
        from tokenizers import Tokenizer

        tok = _TOKENIZERS[path] = Tokenizer.from_file(path)
    return tok


def _is_val(text: str, fraction: float) -> bool:
    # By content, so duplicated documents land in the same split and cannot leak into validation.
    return xxhash.xxh64_intdigest(text) < fraction * 2.0**64


def run_job(job: Job, sink: Sink | None = None, progress: Callable[[int, int], None] | None = None) -> JobResult:
    """Tokenize the job's documents; ids go to `sink(split, ids)` per batch, else come back whole."""
    src = job.source
    tok = _tokenizer(job.tokenizer_json)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    dtype = np.dtype(job.dtype)
    bos, eos = job.bos_id, job.eos_id
    counts = {"train": SplitCounts(), "val": SplitCounts()}
    kept: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    emit = sink or (lambda split, ids: kept[split].append(ids))
    tally = Tally(src.on_error)
    docs_left, tokens_left = src.max_documents, src.max_tokens
    capped = False

    def flush(batch: list[str]) -> None:
        nonlocal tokens_left, capped
        flat: dict[str, list[int]] = {"train": [], "val": []}
        ndocs = ntoks = 0
        for text, enc in zip(batch, encode(batch, add_special_tokens=False), strict=True):
            ids = enc.ids
            if bos is not None:
                ids.insert(0, bos)
            ids.append(eos)
            if tokens_left is not None:
                if len(ids) >= tokens_left:
                    if len(ids) > tokens_left:
                        tally.truncated += 1
                        ids = ids[:tokens_left]
                    capped = True
                tokens_left -= len(ids)
            split = "val" if src.val_fraction and _is_val(text, src.val_fraction) else "train"
            flat[split] += ids
            c = counts[split]
            c.documents += 1
            c.tokens += len(ids)
            ndocs += 1
            ntoks += len(ids)
            if capped:
                break
        for split, ids in flat.items():
            if ids:
                emit(split, np.array(ids, dtype=dtype))
        if progress is not None:
            progress(ndocs, ntoks)

    batch: list[str] = []
    chars = done_units = 0
    for unit in job.units:
        for text in readers.documents(src, unit, tally):
            batch.append(text)
            chars += len(text)
            if docs_left is not None:
                docs_left -= 1
            if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS or docs_left == 0:
                flush(batch)
                batch, chars = [], 0
            if capped or docs_left == 0:
                capped = True
                break
        done_units += 1
        if capped:
            break
    if batch:
        flush(batch)
    ids = None
    if sink is None:
        ids = {s: np.concatenate(v) if v else np.zeros(0, dtype) for s, v in kept.items()}
    return JobResult(counts["train"], counts["val"], tally, ids, capped=capped, units=done_units)

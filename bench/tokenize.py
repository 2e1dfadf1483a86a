"""Tokenizer throughput: raw `Tokenizer.encode_batch` (the anchor) against tessera's prepare stage.

Builds a corpus of at least --mb MB by repeating and varying ../shared/data text, then in one run:
  1. the anchor: `Tokenizer.encode_batch` over the corpus's documents, on all cores (tokenizers'
     own thread pool), in ~1 MB batches so the Encodings do not pile up in memory; run before and
     after (2) and averaged, since other load on a shared machine drifts;
  2. the `prepare_data` Prefect flow end to end (reading, tokenizing in a process pool, packing,
     MDS writing, merging, provenance), timed after a warm-up run on a tiny corpus that pays the
     fixed start-up (Prefect's temporary API server, imports, spawning the pool), reported apart.
Prints `ratio` = (2)/(1) and the peak RSS of the prepare stage (parent plus its children, sampled).
The last line printed is one JSON object.

    .venv/bin/python bench/tokenize.py [--mb 52] [--seq-len 2048] [--workers N]
"""
# ruff: noqa: E402  (stdlib imports must follow the sys.path fix below)

from __future__ import annotations

import sys
from pathlib import Path

# This file is named tokenize.py: drop its folder from the path so it cannot shadow the stdlib module.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import random
import resource
import shutil
import tempfile
import threading
import time

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data" / "corpora"
TOKENIZER = ROOT / "data" / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"
FILES = 4


def build_corpus(out: Path, mb: float) -> list[Path]:
    """Paragraphs of the shared corpora, shuffled afresh and lightly varied on every repetition."""
    paras = []
    for name in ("tinyshakespeare/input.txt", "tinystories/tinystories_val.txt"):
        paras += [p for p in (SHARED / name).read_text().split("\n\n") if p.strip()]
    target = int(mb * (1 << 20))
    paths = [out / f"corpus-{i}.txt" for i in range(FILES)]
    handles = [open(p, "w") for p in paths]
    written, rep = 0, 0
    while written < target:
        rng = random.Random(rep)
        order = paras[:]
        rng.shuffle(order)
        for i, p in enumerate(order):
            if rng.random() < 0.3:  # vary words so repetitions are not byte-identical
                words = p.split(" ")
                j = rng.randrange(len(words))
                words[j] = words[j].upper() if rng.random() < 0.5 else words[j][::-1]
                p = " ".join(words)
            chunk = p + "\n\n"
            handles[(rep + i) % FILES].write(chunk)
            written += len(chunk.encode())
        rep += 1
    for h in handles:
        h.close()
    return paths


def documents(paths: list[Path]):
    for p in paths:
        for d in p.read_text().split("\n\n"):
            if d.strip():
                yield d


def anchor(paths: list[Path]) -> tuple[float, int, int]:
    """encode_batch over ~1 MB batches on all cores: (seconds, tokens, documents)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    batches, batch, size = [], [], 0
    for d in documents(paths):
        batch.append(d)
        size += len(d)
        if size >= 1 << 20:
            batches.append(batch)
            batch, size = [], 0
    if batch:
        batches.append(batch)
    tokens = docs = 0
    start = time.perf_counter()
    for b in batches:
        for e in tok.encode_batch(b, add_special_tokens=False):
            tokens += len(e.ids)
        docs += len(b)
    seconds = time.perf_counter() - start
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return seconds, tokens, docs


class RssSampler:
    """Peak of (this process + all descendants) RSS, sampled every 50 ms."""

    def __init__(self):
        import psutil

        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        while not self._stop.is_set():
            total = 0
            for p in [self.proc, *self.proc.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def config(root: Path, paths: list[str], seq_len: int, workers: int | None):
    from tasks.data.config import DataConfig

    return DataConfig.model_validate({
        "root": str(root), "seq_len": seq_len, "workers": workers,
        "tokenizer": {"path": str(TOKENIZER)},
        "sources": [{"name": "bench", "paths": paths, "separator": "\n\n"}],
    })


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=52.0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

    work = Path(tempfile.mkdtemp(prefix="tessera-bench-"))
    try:
        (work / "corpus").mkdir()
        corpus = build_corpus(work / "corpus", args.mb)
        corpus_bytes = sum(p.stat().st_size for p in corpus)
        a_before, a_tokens, a_docs = anchor(corpus)

        from flows.prepare import prepare_data
        from tasks.data import outputs, parallel

        workers = args.workers or parallel.default_workers()
        (work / "tiny").mkdir()
        tiny = work / "tiny" / "t.txt"
        tiny.write_text("A warm-up document that pays the fixed start-up.\n\n" * 200)
        t0 = time.perf_counter()
        prepare_data(config(work / "warm", [str(tiny)], args.seq_len // 16, workers))
        startup = time.perf_counter() - t0

        with RssSampler() as rss:
            t0 = time.perf_counter()
            prepared = prepare_data(config(work / "data", [str(p) for p in corpus], args.seq_len, workers))
            p_seconds = time.perf_counter() - t0
        # Measured again after, and averaged: on a shared machine the load drifts during the run.
        a_after = anchor(corpus)[0]
        a_seconds = (a_before + a_after) / 2
        src = prepared.sources["bench"]
        prov = outputs.read_provenance(src.root)
        counts = prov["counts"]
        # Compare like with like: tokenizer output only, without the EOS ids packing adds.
        p_tokens = counts["tokens"] - counts["documents"]
        assert p_tokens == a_tokens and counts["documents"] == a_docs, (p_tokens, a_tokens)
        a_rate, p_rate = a_tokens / a_seconds, p_tokens / p_seconds
        children_max = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        result = {
            "bench": "tokenize",
            "ratio": round(p_rate / a_rate, 3),
            "anchor_tokens_per_s": round(a_rate),
            "prepare_tokens_per_s": round(p_rate),
            "prepare_s": round(p_seconds, 2),
            "source_task_s": prov["seconds"],
            "anchor_s": round(a_seconds, 2),
            "anchor_s_before_after": [round(a_before, 2), round(a_after, 2)],
            "startup_s": round(startup, 2),
            "corpus_mb": round(corpus_bytes / (1 << 20), 1),
            "documents": counts["documents"],
            "tokens": p_tokens,
            "parts": prov["format"]["parts"],
            "seq_len": args.seq_len,
            "workers": workers,
            "cpus": os.cpu_count(),
            "peak_rss_mb": round(rss.peak / (1 << 20)),
            "peak_rss_parent_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "peak_rss_worker_mb": round(children_max),
        }
        print(f"anchor   encode_batch: {a_rate:,.0f} tokens/s ({a_seconds:.1f}s)")
        print(f"tessera  prepare_data: {p_rate:,.0f} tokens/s ({p_seconds:.1f}s; start-up {startup:.1f}s apart)")
        print(json.dumps(result))
    finally:
        from tasks.data import parallel

        parallel.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

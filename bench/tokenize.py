"""Tokenizer throughput: raw `Tokenizer.encode_batch` (the anchor) against tessera's prepare stage, and the
partitioned prepare against the whole-source pool (one partition: the prepare before partitions) in the same run.

Builds a corpus of at least --mb MB by repeating and varying ../shared/data text, then in one run:
  1. the anchor: `Tokenizer.encode_batch` over the corpus's documents, on all cores (tokenizers'
     own thread pool), in ~1 MB batches so the Encodings do not pile up in memory; run before and
     after (2) and averaged, since other load on a shared machine drifts;
  2. the `prepare_sources` Prefect flow end to end (reading, tokenizing in a process pool, packing,
     MDS writing, merging, provenance), timed after a warm-up run on a tiny corpus that pays the
     fixed start-up (Prefect's temporary API server, imports, spawning the pool), reported apart.
  3. the same flow with the source cut into PARTITIONS partitions (data.partition_bytes), against (2) with one
     partition, the whole source through the pool as before partitions existed: `partition_ratio` =
     partitioned rate / whole-source rate (goal >= 0.95: partitions cost nothing), each run REPEAT_LARGE times,
     interleaved, fastest kept; and `tokens_per_s_per_core` of the partitioned prepare, the rate the recipes'
     time figures come from.
Prints `ratio` = (2)/(1) and the peak RSS of the prepare stage (parent plus its children, sampled).

The small-corpus case (`--case small`, also part of the default `all`) is what a user of
`tessera prepare` pays on a few small sources, where fixed costs dwarf the work: the real CLI runs
twice in fresh processes, on 1 and on 4 sources of ~150 kB (after an untimed warm-up run that
creates Prefect's database), and a probe times Prefect's temporary server start-up alone (a
per-process cost, reported apart). Its anchor is raw
`encode_batch` over the same documents, in the same run:
  first_source_overhead_s = wall(1 source) - wall(a rerun with nothing to do) - tokenizing it
  per_source_overhead_s   = (wall(4) - wall(1) - tokenizing the 3 more) / 3
The rerun with nothing to do is the per-process cost (interpreter, imports, Prefect's server and
flow engine), not a per-source one.
The last line printed is one JSON object.

    .venv/bin/python bench/tokenize.py [--case all|large|small] [--mb 52] [--seq-len 2048] [--workers N]
"""

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
import subprocess
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


def config(root: Path, paths: list[str], seq_len: int, workers: int | None, partition_bytes: int = 1 << 30):
    from tasks.data.config import DataConfig

    return DataConfig.model_validate(
        {
            "root": str(root),
            "seq_len": seq_len,
            "workers": workers,
            "partition_bytes": partition_bytes,
            "tokenizer": {"path": str(TOKENIZER)},
            "sources": [{"name": "bench", "paths": paths, "separator": "\n\n"}],
        }
    )


PARTITIONS = 8
REPEAT_LARGE = 2


SMALL_SOURCES = 4
SMALL_BYTES = 150_000
REPEAT = 3
SERVER_PROBE = """
import time
from tasks.runs.runtime import quiet_environment
quiet_environment()
from prefect.server.api.server import SubprocessASGIServer
server = SubprocessASGIServer()
t0 = time.perf_counter()
server.start(timeout=180)
print(time.perf_counter() - t0)
server.stop()
"""


def small_recipe(work: Path, paths: list[Path], name: str) -> Path:
    import yaml

    recipe = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    recipe["name"] = name
    recipe["work_dir"] = str(work / "tessera")  # shared by every run: one migrated Prefect database
    recipe["data"]["root"] = str(work / f"data-{name}")
    recipe["data"]["tokenizer"]["path"] = str(TOKENIZER)
    recipe["data"]["sources"] = [{"name": p.stem, "paths": [str(p)], "separator": "\n\n"} for p in paths]
    recipe["train"]["stages"] = [{"name": "all", "tokens": 32768, "mixture": {paths[0].stem: 1.0}}]
    for key in ("tasks", "gauntlet", "data_root"):
        recipe["eval"][key] = str(ROOT / recipe["eval"][key])
    recipe["tracking"]["tracking_uri"] = f"sqlite:///{work / 'mlflow.db'}"
    recipe["tracking"].pop("artifact_location", None)
    out = work / f"{name}.yaml"
    out.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return out


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, done.stdout


def small_case(work: Path) -> dict:
    """Per-source overhead of the real `tessera prepare` on small sources, against raw tokenization."""
    text = "".join((SHARED / n).read_text() for n in ("tinyshakespeare/input.txt", "tinystories/tinystories_val.txt"))
    paths = []
    for i in range(SMALL_SOURCES):
        piece = text[i * SMALL_BYTES : (i + 1) * SMALL_BYTES]
        piece = piece[: piece.rfind("\n\n")]  # whole paragraphs only
        paths.append(work / f"small{i}.txt")
        paths[-1].write_text(piece)
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_HOME", None)  # the CLI keeps Prefect's database in the recipe's work_dir
    cli = [sys.executable, "-m", "cli.main", "prepare"]
    # Untimed: creates and migrates Prefect's database and warms the page cache, once per machine.
    warmup = small_recipe(work, paths[:1], "warmup")
    timed([*cli, str(warmup)], env)
    env_probe = {**env, "PREFECT_HOME": str(work / "tessera" / "prefect")}
    server_s = float(timed([sys.executable, "-c", SERVER_PROBE], env_probe)[1].strip().splitlines()[-1])
    # Each run REPEAT times (fresh runs into fresh data roots), interleaved, keeping the fastest: on
    # a shared machine the load of others only ever adds time.
    walls: dict[str, list[float]] = {"cached": [], "one": [], "four": []}
    for i in range(REPEAT):
        walls["cached"].append(timed([*cli, str(warmup)], env)[0])  # all prepared: the process alone
        walls["one"].append(timed([*cli, str(small_recipe(work, paths[:1], f"one{i}"))], env)[0])
        walls["four"].append(timed([*cli, str(small_recipe(work, paths, f"four{i}"))], env)[0])
    wall_cached, wall_one, wall_four = (min(walls[k]) for k in ("cached", "one", "four"))
    tok = [anchor([p])[0] for p in paths]
    first = wall_one - wall_cached - tok[0]
    per_source = (wall_four - wall_one - sum(tok[1:])) / (SMALL_SOURCES - 1)
    print(
        f"small    {SMALL_SOURCES} x {SMALL_BYTES // 1000} kB: tessera prepare {wall_one:.1f}s (1 source), "
        f"{wall_four:.1f}s ({SMALL_SOURCES}), {wall_cached:.1f}s (nothing to do; Prefect server start-up "
        f"{server_s:.1f}s of it); raw tokenizing {sum(tok):.2f}s; first source +{first:.1f}s, each further "
        f"source +{per_source:.1f}s"
    )
    return {
        "small_sources": SMALL_SOURCES,
        "small_source_kb": SMALL_BYTES // 1000,
        "small_prepare_1_s": round(wall_one, 2),
        "small_prepare_4_s": round(wall_four, 2),
        "small_prepare_cached_s": round(wall_cached, 2),
        "small_prefect_startup_s": round(server_s, 2),
        "small_anchor_tokenize_s": round(sum(tok), 3),
        "first_source_overhead_s": round(first, 2),
        "per_source_overhead_s": round(per_source, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=["all", "large", "small"], default="all")
    ap.add_argument("--mb", type=float, default=52.0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

    work = Path(tempfile.mkdtemp(prefix="tessera-bench-"))
    try:
        small = {}
        if args.case in ("all", "small"):
            (work / "small").mkdir()
            small = small_case(work / "small")
            if args.case == "small":
                print(json.dumps({"bench": "tokenize", **small}))
                return
        (work / "corpus").mkdir()
        corpus = build_corpus(work / "corpus", args.mb)
        corpus_bytes = sum(p.stat().st_size for p in corpus)
        a_before, a_tokens, a_docs = anchor(corpus)

        from flows.prepare import prepare_sources
        from tasks.data import outputs, parallel

        workers = args.workers or parallel.default_workers()
        (work / "tiny").mkdir()
        tiny = work / "tiny" / "t.txt"
        tiny.write_text("A warm-up document that pays the fixed start-up.\n\n" * 200)
        t0 = time.perf_counter()
        prepare_sources(config(work / "warm", [str(tiny)], args.seq_len // 16, workers))
        # A source this small is tokenized in-process, so the pool is spawned here, as part of the
        # start-up, not inside the timed run.
        for ready in parallel.warm(workers):
            ready.result()
        startup = time.perf_counter() - t0

        whole_bytes = 2 * corpus_bytes  # one partition: the whole source through the pool
        part_bytes = -(-corpus_bytes // PARTITIONS)
        runs: dict[str, list[float]] = {"whole": [], "partitioned": []}
        with RssSampler() as rss:
            for i in range(REPEAT_LARGE):
                for kind, size in (("whole", whole_bytes), ("partitioned", part_bytes)):
                    cfg = config(work / f"data-{kind}-{i}", [str(p) for p in corpus], args.seq_len, workers, size)
                    t0 = time.perf_counter()
                    out = prepare_sources(cfg)
                    runs[kind].append(time.perf_counter() - t0)
                    if kind == "whole":
                        prepared = out
                    else:
                        parted = out
        p_seconds, q_seconds = min(runs["whole"]), min(runs["partitioned"])
        # Measured again after, and averaged: on a shared machine the load drifts during the run.
        a_after = anchor(corpus)[0]
        a_seconds = (a_before + a_after) / 2
        src = prepared.sources["bench"]
        prov = outputs.read_provenance(src.root)
        counts = prov["counts"]
        # Compare like with like: tokenizer output only, without the EOS ids packing adds.
        p_tokens = counts["tokens"] - counts["documents"]
        assert p_tokens == a_tokens and counts["documents"] == a_docs, (p_tokens, a_tokens)
        q_prov = outputs.read_provenance(parted.sources["bench"].root)
        assert q_prov["counts"]["documents"] == counts["documents"]
        assert q_prov["format"]["partitions"] == PARTITIONS, q_prov["format"]
        a_rate, p_rate = a_tokens / a_seconds, p_tokens / p_seconds
        q_rate = (q_prov["counts"]["tokens"] - q_prov["counts"]["documents"]) / q_seconds
        children_max = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        result = {
            "bench": "tokenize",
            "partition_ratio": round(q_rate / p_rate, 3),
            "partitioned_tokens_per_s": round(q_rate),
            "tokens_per_s_per_core": round(q_rate / workers),
            "partitions": PARTITIONS,
            "partitioned_s": round(q_seconds, 2),
            "whole_source_s": round(p_seconds, 2),
            "runs_s": {k: [round(x, 2) for x in v] for k, v in runs.items()},
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
            **small,
        }
        print(f"anchor   encode_batch: {a_rate:,.0f} tokens/s ({a_seconds:.1f}s)")
        print(f"tessera  prepare_sources: {p_rate:,.0f} tokens/s ({p_seconds:.1f}s; start-up {startup:.1f}s apart)")
        print(f"tessera  in {PARTITIONS} partitions: {q_rate:,.0f} tokens/s ({q_seconds:.1f}s): x{q_rate / p_rate:.3f}")
        print(json.dumps(result))
    finally:
        from tasks.data import parallel

        parallel.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

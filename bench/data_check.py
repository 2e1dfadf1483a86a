"""What verifying prepared data costs a launch: trainers/data_check.py against a plain read of the same bytes.

Every launch hashes each shard of the stage's streams (xxh64, what `data.hashes` records by default) before it
trains. The anchor is the cheapest thing that touches every byte once: reading the same files in the same
chunks, with the same threads, and doing nothing with them. Both run on warm files (just written, in the page
cache), which isolates the hashing; a cold disk makes both slower by the same reads.
`ratio` = check time / read time, here hashing against copying from memory; `gb_per_s` is the check's throughput,
from which the cost of a launch over a corpus of any size follows (at 2 GB/s, a 1 TB stage mixture adds about 8
minutes to every launch). Goal: gb_per_s >= 2, as fast as a local NVMe disk delivers, so that on a real disk the
check costs about one read of the data.
Timings are the fastest of --repeats interleaved rounds, because the machine may be shared.

Prints one JSON line last: {"bench": "data_check", "gb_per_s": ..., "ratio": ..., ...}.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/data_check.py`: bench/ must not shadow stdlib modules (bench/tokenize.py exists).
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from trainers.data_check import CHUNK, verify_stream


def write_shards(folder: Path, megabytes: int, seq_len: int) -> int:
    """An MDS folder of random token windows as prepare writes them (64 MB shards, xxh64 recorded)."""
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    samples = megabytes * (1 << 20) // (2 * seq_len)
    block = rng.integers(0, 50_000, size=(4096, seq_len), dtype=np.uint16)
    with MDSWriter(
        out=str(folder), columns={"tokens": "ndarray:uint16"}, size_limit=64 << 20, hashes=["xxh64"]
    ) as writer:
        for i in range(samples):
            writer.write({"tokens": block[i % 4096]})
    return sum(f.stat().st_size for f in folder.glob("*.mds"))


def plain_read(folder: Path) -> None:
    def read(path: Path) -> None:
        buffer = bytearray(CHUNK)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(read, sorted(folder.glob("*.mds"))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=512, help="Size of the prepared source to verify.")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tessera-bench-check-") as tmp:
        folder = Path(tmp) / "books" / "train"
        size = write_shards(folder, args.megabytes, args.seq_len)
        check, read = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            plain_read(folder)
            read.append(time.perf_counter() - t)
            t = time.perf_counter()
            verify_stream("books", folder)
            check.append(time.perf_counter() - t)
        shards = len(list(folder.glob("*.mds")))
    best_check, best_read = min(check), min(read)
    print(
        json.dumps(
            {
                "bench": "data_check",
                "gb_per_s": round(size / best_check / 1e9, 2),
                "ratio": round(best_check / best_read, 3),
                "read_gb_per_s": round(size / best_read / 1e9, 2),
                "check_s": round(best_check, 3),
                "read_s": round(best_read, 3),
                "bytes": size,
                "shards": shards,
                "threads": min(8, os.cpu_count() or 1),
                "goal": "gb_per_s >= 2",
            }
        )
    )


if __name__ == "__main__":
    main()

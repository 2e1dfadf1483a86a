"""Prepared data is verified before a launch trains on it: every shard's bytes against the hash its index records.

MDSWriter records each shard's size and hashes (`data.hashes`, xxh64 by default) in index.json, and
Streaming checks them only when it downloads a shard (`validate_hash`). A local MDS directory is read
in place, so bit rot or a truncated or deleted shard would train silently (ids off by one, rc 0) or fail
mid-stage as a retryable crash. Each launch therefore reads every shard of its streams once, on the
first rank of every node, before it trains: about 10 GB/s from the page cache here, so on a real disk about one
read of the data (bench/data_check.py).

A damaged shard raises DamagedData, a FatalError (a relaunch reads the same bytes) whose record names
the source, the folder, the shard and its samples; the entrypoint prints that record as one
`tessera.damaged {json}` line, from which the flow withdraws the output's done-marker so that the
next prepare writes it again.

Remote streams (s3://) are cached under the node's cache folder: Streaming validates each download
(`validate_hash`), and here a cached copy that no longer matches is removed, to be downloaded and
validated again.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trainers.exit_codes import FatalError
from trainers.progress import format_damage

# The fastest algorithm the index records is used: xxh64 is what `data.hashes` records by default.
PREFERRED = ("xxh3_64", "xxh64", "xxh128", "sha1", "sha256", "md5")
CHUNK = 8 << 20


class DamagedData(FatalError):
    """A prepared output whose bytes are not what its index records. `record` says which, for the flow."""

    def __init__(self, record: dict):
        self.record = record
        shard = f"shard {record['shard']}" if record.get("shard") else "its index"
        samples = f" (samples {record['samples'][0]:,}-{record['samples'][1]:,})" if record.get("samples") else ""
        super().__init__(
            f"prepared data of source {record['source']} is damaged: {shard}{samples} in {record['path']} "
            f"{record['why']}; prepare the source again"
        )


_SEEN: list[DamagedData] = []  # damage found in a thread whose error the training loop only sees as a failure


def remember(damage: DamagedData) -> None:
    _SEEN.append(damage)


def first_damage() -> DamagedData | None:
    """Damage a download thread found in this process, which surfaced elsewhere as another error."""
    return _SEEN[0] if _SEEN else None


def announce(damage: DamagedData) -> None:
    """Name the damage on this rank's stdout as one `tessera.damaged {json}` line (trainers/progress.py): the
    flow reads it from the job log (a non-zero rank's output is in its own file beside it)."""
    print(format_damage(damage.record), file=sys.stdout, flush=True)


def _hasher(algo: str):
    if algo.startswith("xxh"):
        import xxhash

        return getattr(xxhash, algo)()
    return hashlib.new(algo)


def _digest(path: Path, algo: str) -> str:
    h = _hasher(algo)
    buffer = bytearray(CHUNK)  # one buffer, read into: no allocation per chunk
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def _mismatch(path: Path, info: dict) -> str | None:
    """Why the file is not the one `info` (a raw_data or zip_data entry) describes, or None."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "is missing"
    if size != info["bytes"]:
        return f"is {size:,} bytes, the index records {info['bytes']:,} (cut short or overwritten)"
    hashes = info.get("hashes") or {}
    algo = next((a for a in PREFERRED if a in hashes), next(iter(hashes), None))
    if algo is None:
        return None  # an index without hashes: the size is all there is to check
    actual = _digest(path, algo)
    if actual != hashes[algo]:
        return f"has {algo} {actual}, the index records {hashes[algo]} (bytes changed since it was prepared)"
    return None


def _index(source: str, folder: Path) -> list[dict]:
    try:
        return json.loads((folder / "index.json").read_text())["shards"]
    except FileNotFoundError:
        why = "has no index.json"
    except (ValueError, KeyError, TypeError) as exc:
        why = f"has an unreadable index.json ({type(exc).__name__})"
    raise DamagedData({"source": source, "path": str(folder), "shard": None, "samples": None, "why": why})


def _shard_damage(shard: dict, folder: Path, cached: bool) -> str | None:
    """Why the shard cannot be read intact from `folder`: its raw file is read if present (so a damaged one is
    damage even beside a good compressed copy), else its compressed one. In a cache (`cached`) a damaged copy is
    removed instead, and a missing one is fine: Streaming fetches and validates it when it is needed."""
    for info in (shard.get("raw_data"), shard.get("zip_data")):
        if not info:
            continue
        path = folder / info["basename"]
        why = _mismatch(path, info)
        if why is None:
            return None
        if why == "is missing":
            continue
        if not cached:
            return f"{info['basename']} {why}"
        path.unlink(missing_ok=True)
    return None if cached else f"{shard['raw_data']['basename']} is missing"


def verify_stream(source: str, folder: str | Path, cached: bool = False) -> None:
    """Every shard of one MDS directory against its index; DamagedData on the first damaged one."""
    folder = Path(folder)
    shards = _index(source, folder)
    starts = [0]
    for shard in shards:
        starts.append(starts[-1] + int(shard.get("samples", 0)))
    threads = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool:  # hashing reads files: overlap the reads
        found = list(pool.map(lambda shard: _shard_damage(shard, folder, cached), shards))
    for i, why in enumerate(found):
        if why is not None:
            basename = why.split(" ", 1)[0]
            raise DamagedData(
                {
                    "source": source,
                    "path": str(folder),
                    "shard": basename,
                    "samples": [starts[i], starts[i + 1] - 1],
                    "why": why.split(" ", 1)[1],
                }
            )


def verify_streams(streams: dict[str, str], cache_dir_for) -> None:
    """Every local stream of a launch, and the cached copies of its remote ones (`cache_dir_for(uri)`)."""
    for source, path in sorted(streams.items()):
        if "://" not in path:
            verify_stream(source, path)
            continue
        cache = cache_dir_for(path)
        if (cache / "index.json").is_file():
            verify_stream(source, cache, cached=True)

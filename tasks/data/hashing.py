"""What an output's hash covers: the source spec, its files' fingerprints, the tokenizer,
seq_len, the EOS policy, the output format and the code version."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from functools import lru_cache

from tasks.data import storage
from tasks.data.config import DataConfig, HFSource, SourceConfig

# Bump when a change to reading, tokenizing or packing changes the bytes written for the same inputs.
# 2: files split exactly where bytes.split cuts them (self-overlapping separators); 3: partitions, each packed alone
CODE_VERSION = "prepare-3"


def digest(obj: object, n: int = 16) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


def fingerprints(src: SourceConfig) -> list[list]:
    """(path, size, mtime_ns or ETag) of every input file; hub datasets are pinned by `revision`."""
    if not isinstance(src, HFSource):
        return [[r.path, r.size, r.version] for r in storage.expand(src.paths)]
    refs = []
    if src.data_files:
        refs = storage.expand(src.data_files)
    elif os.path.isdir(src.path):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(src.path) for f in fs)
        refs = storage.expand(files)
    return [[r.path, r.size, r.version] for r in refs]


def source_key(src: SourceConfig, files: list[list], tokenizer_fp: str, data: DataConfig) -> str:
    return digest(
        {
            "source": src.model_dump(mode="json"),
            "files": files,
            "tokenizer": tokenizer_fp,
            "seq_len": data.seq_len,
            "format": {
                "compression": data.compression,
                "hashes": data.hashes,
                "shard_size": data.shard_size,
                "chunk_bytes": data.chunk_bytes,
                "partition_bytes": data.partition_bytes,
            },
            "code": CODE_VERSION,
        }
    )


@lru_cache(maxsize=1)
def git_sha() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None

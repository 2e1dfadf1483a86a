"""Finish an output once every partition is done: the splits' merged indexes, provenance, then the done-marker.

The same on every path: the flow merges a local output in place, and an output the prepare Job's pods wrote
into a bucket through `RemoteFolder`; the merged files are byte-identical either way, because they are made from
the partitions' own index.json files and records and nothing else.

The merged `index.json` is what Streaming's `merge_index` writes (each partition's shards in partition order, each
basename prefixed with the partition's folder), so Streaming reads a split as one dataset unchanged.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable

from tasks.data import hashing, outputs
from tasks.data.config import DataConfig
from tasks.data.errors import DataError
from tasks.data.mds import columns
from tasks.data.partitions import PARTS, RECORD, SPLITS, folder
from tasks.data.tally import Tally
from tasks.data.tokenizer import TokenizerInfo
from trainers.format.s3 import DONE

INDEX = "index.json"
# Files of an output a reader gets by relative path: a local folder's or a bucket prefix's.
Read = Callable[[str], bytes | None]


def merge_indexes(indexes: list[tuple[str, bytes]]) -> bytes:
    """One Streaming index over the partitions' indexes, given as (partition folder, its index.json) in order: the
    bytes `streaming.base.util.merge_index` writes for the same folders (a test holds the two together), made here
    from bytes already read, so the bucket's partitions need no download to a temporary folder first."""
    shards = []
    for name, raw in indexes:
        for shard in json.loads(raw)["shards"]:
            for key in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
                if shard.get(key):
                    shard[key]["basename"] = f"{name}/{shard[key]['basename']}"
            shards.append(shard)
    return json.dumps({"version": 2, "shards": shards}).encode()


def records(read: Read, partitions: int) -> list[dict]:
    return [json.loads(read(f"{PARTS}/{folder(k)}/{RECORD}")) for k in range(partitions)]


def split_indexes(read: Read, partitions: int) -> dict[str, bytes]:
    """split -> its merged index, for each split that some partition wrote samples into."""
    merged = {}
    for split in SPLITS:
        found = [(folder(k), read(f"{split}/{folder(k)}/{INDEX}")) for k in range(partitions)]
        found = [(name, raw) for name, raw in found if raw is not None]
        if found:
            merged[split] = merge_indexes(found)
    return merged


_SPLIT_COUNTS = ("documents", "tokens", "samples", "tokens_written", "tokens_dropped")


def counts(recs: list[dict], planned: Tally) -> dict:
    """The output's counts: every partition's summed, with what planning itself skipped (empty files, missing
    patterns)."""
    total = {split: {k: sum(r["counts"][split][k] for r in recs) for k in _SPLIT_COUNTS} for split in SPLITS}
    skipped = Counter(planned.skipped)
    for r in recs:
        skipped.update(r["skipped"])
    return {
        **total,
        "documents": total["train"]["documents"] + total["val"]["documents"],
        "tokens": total["train"]["tokens"] + total["val"]["tokens"],
        "skipped_total": sum(skipped.values()),
        "skipped": dict(sorted(skipped.items())),
        "filtered": planned.filtered + sum(r["filtered"] for r in recs),
        "truncated": sum(r["truncated"] for r in recs),
        "capped": any(r["capped"] for r in recs),
    }


def refuse_empty(name: str, n_files: int, c: dict, data: DataConfig, val_fraction: float) -> None:
    """An output that would train on nothing, or report no validation loss, is refused in one line."""
    where = f"source '{name}'"
    if c["documents"] == 0:
        raise DataError(
            where, f"no documents ({c['skipped_total']} skipped, {c['filtered']} filtered, {n_files} files)"
        )
    if c["train"]["samples"] == 0:
        raise DataError(
            where, f"{c['train']['tokens']} train tokens is less than one seq_len ({data.seq_len}) sample per partition"
        )
    if val_fraction > 0 and c["val"]["samples"] == 0:
        # Training would silently report no validation loss for this source.
        raise DataError(
            where,
            f"val_fraction={val_fraction} held out no validation sample "
            f"({c['val']['documents']} documents, {c['val']['tokens']} tokens; "
            f"one sample is seq_len={data.seq_len} tokens): add documents, lower "
            "seq_len, or set val_fraction: 0",
        )


PACKING = (
    "each partition packed on its own: its documents concatenated in file order, each followed by EOS (BOS first "
    "when set), cut into seq_len windows with no padding; the last fewer than seq_len ids of each split of each "
    "partition are dropped (tokens_dropped); no window spans two partitions"
)


def provenance(
    *,
    source: dict,
    key: str,
    inputs: list,
    data: DataConfig,
    tok: TokenizerInfo,
    recs: list[dict],
    counts: dict,
    warnings: list[str],
    started: float,
    reused: int,
) -> dict:
    """What an output records of how it was made: inputs, tokenizer, packing, counts, partitions, format, times."""
    return {
        "source": source,
        "hash": key,
        "inputs": inputs,
        "tokenizer": tok.model_dump(mode="json"),
        "seq_len": data.seq_len,
        "packing": PACKING,
        "counts": counts,
        "warnings": warnings,
        "partitions": [
            {
                "index": r["index"],
                "tokens": r["counts"]["train"]["tokens_written"] + r["counts"]["val"]["tokens_written"],
                "documents": r["counts"]["train"]["documents"] + r["counts"]["val"]["documents"],
                "skipped": sum(r["skipped"].values()),
                "writer": r["writer"],
                "seconds": r["seconds"],
            }
            for r in recs
        ],
        "partitions_reused": reused,
        "format": {
            "columns": columns(tok.dtype, data.seq_len),
            "compression": data.compression,
            "hashes": list(data.hashes),
            "units": sum(r["units"] for r in recs),
            "parts": sum(r["jobs"] for r in recs),
            "partitions": len(recs),
            "partition_bytes": data.partition_bytes,
        },
        "code_version": hashing.CODE_VERSION,
        "git_sha": hashing.git_sha(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.time() - started, 3),
    }


def unsplit_warnings(name: str, separator: str | None, recs: list[dict], warn_bytes: int) -> list[str]:
    """A file at least `warn_bytes` large that the separator never split is almost surely a wrong separator."""
    return [
        f"source '{name}': {path} ({size:,} bytes) is one document: the separator {separator!r} never occurs in it"
        for r in recs
        for path, size in r["unsplit"]
        if size >= warn_bytes
    ]


def local_reader(out: str) -> Read:
    def read(rel: str) -> bytes | None:
        try:
            with open(os.path.join(out, rel), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    return read


def finish_local(out: str, indexes: dict[str, bytes], prov: dict) -> None:
    """Write a local output's merged indexes and provenance, then its done-marker."""
    from trainers.format.atomic import atomic_write

    with outputs.permanent_errors("cannot publish prepared data"):
        for split, raw in indexes.items():
            atomic_write(os.path.join(out, split, INDEX), raw)
        outputs.write_json(os.path.join(out, outputs.PROVENANCE), prov)
    outputs.mark_done(out)


__all__ = ["DONE", "INDEX", "counts", "finish_local", "merge_indexes", "provenance", "records", "split_indexes"]

"""A source's partitions: consecutive work units grouped by size, each prepared, packed and marked done alone.

Partitions are cut from the data alone (the units' byte sizes and `data.partition_bytes`), never from the core or
pod count, so one process, one pod or forty pods write the same output. Each partition is the unit of resumption
and of distribution: a killed prepare redoes only the partitions without a done-marker, and on Kubernetes each
index of the prepare Job writes one partition.

An output's layout (`<data root>/<source>-<hash>/`):

    train/<k>/index.json, shard.*.mds    partition k's packed train samples (a Streaming dataset of its own)
    val/<k>/...                          its validation samples, when it held any out
    parts/<k>/partition.json             what partition k holds and who wrote it, then
    parts/<k>/_DONE                      its done-marker, written last
    train/index.json, val/index.json     every partition's index merged (Streaming's merge_index), then
    provenance.json, _DONE               the output's record and its done-marker, last of all

Packing at a partition's edge: each partition is packed on its own. Its documents are concatenated in file order
(EOS after each) and cut into seq_len windows; the last fewer-than-seq_len ids of each split of each partition
are dropped and counted as `tokens_dropped`. No window ever spans two partitions, on any path, which is what
lets partitions be written apart and in any order: at the default 1 GiB per partition that is under one
window in 100,000.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tasks.data.config import HFSource, SourceConfig
from tasks.data.units import Unit, group_units
from trainers.format.s3 import DONE

PARTS = "parts"
RECORD = "partition.json"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class Partition:
    """Consecutive work units of one source, prepared as one piece: index `index` of the source's partitions."""

    index: int
    units: tuple[Unit, ...]

    @property
    def name(self) -> str:
        return folder(self.index)

    @property
    def size(self) -> int:
        return sum(u.size for u in self.units)


def folder(index: int) -> str:
    """A partition's folder name: zero-padded, so a listing sorts in partition order."""
    return f"{index:05d}"


def in_order(src: SourceConfig) -> bool:
    """A source read as one piece: a cap must stop at the same document however the source is cut, and a Hugging
    Face dataset is one unit."""
    return src.max_documents is not None or src.max_tokens is not None or isinstance(src, HFSource)


def cut(src: SourceConfig, units: list[Unit], partition_bytes: int) -> list[Partition]:
    """The source's units grouped into partitions of about `partition_bytes` each, in file order."""
    if not units:
        return []
    if in_order(src):
        return [Partition(0, tuple(units))]
    return [Partition(i, tuple(g)) for i, g in enumerate(group_units(units, partition_bytes))]


def split_dir(out: str, split: str, index: int) -> str:
    return os.path.join(out, split, folder(index))


def record_dir(out: str, index: int) -> str:
    return os.path.join(out, PARTS, folder(index))


def is_done(out: str, index: int) -> bool:
    return os.path.isfile(os.path.join(record_dir(out, index), DONE))


def read_record(out: str, index: int) -> dict:
    with open(os.path.join(record_dir(out, index), RECORD)) as f:
        return json.load(f)


def unit_to_json(u: Unit) -> dict:
    return {"path": u.path, "start": u.start, "end": u.end, "row_groups": u.row_groups, "size": u.size}


def unit_from_json(d: dict) -> Unit:
    groups = d.get("row_groups")
    return Unit(d["path"], d["start"], d["end"], tuple(groups) if groups is not None else None, d["size"])


__all__ = ["Partition", "cut", "folder", "in_order", "is_done", "read_record", "record_dir", "split_dir"]

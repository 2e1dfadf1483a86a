"""An output's plan file (`<output>/plan.json`): everything one process needs to prepare one of its partitions.

The flow writes it before any partition is prepared, where the output lives: in the local folder for a local
prepare, in the bucket for the prepare Job, whose pods read it and nothing else of the recipe (so the pod's
command runs anywhere given `JOB_COMPLETION_INDEX` and the s3 settings). It also says how many partitions the
output has, which `tessera status` reports against the done-markers.

A prepare Job's index file (`<data root>/.prepare/<key>.json`) maps each index of the Job to one (output,
partition) pair: the partitions still to prepare across every source of the prepare.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import TypeAdapter

from tasks.data import hashing
from tasks.data.config import SourceConfig
from tasks.data.partition_run import Packing
from tasks.data.partitions import Partition, unit_from_json, unit_to_json
from tasks.data.tally import Tally
from tasks.data.tokenizer import TokenizerInfo

PLAN = "plan.json"
JOBS = ".prepare"  # under the data root: one index file per prepare Job
_SOURCE = TypeAdapter(SourceConfig)


@dataclass(frozen=True, kw_only=True)
class Spec:
    """A planned output: its source, packing, tokenizer, pool job size and partitions."""

    source: SourceConfig
    key: str
    packing: Packing
    tokenizer: TokenizerInfo
    chunk: int
    partitions: list[Partition]
    planned: Tally  # what planning itself skipped: empty files, patterns that matched nothing

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "source": self.source.model_dump(mode="json"),
                "key": self.key,
                "packing": self.packing.__dict__,
                "tokenizer": self.tokenizer.model_dump(mode="json"),
                "chunk": self.chunk,
                "partitions": [[unit_to_json(u) for u in p.units] for p in self.partitions],
                "planned": {"filtered": self.planned.filtered, "skipped": dict(sorted(self.planned.skipped.items()))},
                "code_version": hashing.CODE_VERSION,
            },
            indent=1,
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Spec:
        d = json.loads(raw)
        source = _SOURCE.validate_python(d["source"])
        planned = Tally(source.on_error, filtered=d["planned"]["filtered"])
        planned.skipped.update(d["planned"]["skipped"])
        return cls(
            source=source,
            key=d["key"],
            packing=Packing(**d["packing"]),
            tokenizer=TokenizerInfo.model_validate(d["tokenizer"]),
            chunk=d["chunk"],
            partitions=[
                Partition(i, tuple(unit_from_json(u) for u in units)) for i, units in enumerate(d["partitions"])
            ],
            planned=planned,
        )


def index_file(entries: list[tuple[str, int]]) -> tuple[str, bytes]:
    """(its key, its bytes): a prepare Job's indexes, each (output URI, partition), in index order."""
    body = json.dumps({"indexes": [[out, k] for out, k in entries]}, indent=1).encode()
    return hashing.digest({"indexes": entries}, 12), body


def entry(raw: bytes, index: int) -> tuple[str, int]:
    entries = json.loads(raw)["indexes"]
    if not 0 <= index < len(entries):
        raise IndexError(f"JOB_COMPLETION_INDEX={index}: the prepare Job has indexes 0..{len(entries) - 1}")
    out, k = entries[index]
    return out, int(k)


__all__ = ["JOBS", "PLAN", "Spec", "entry", "index_file"]

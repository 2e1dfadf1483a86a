"""How a source is cut into work units, and units grouped into the jobs a pool process tokenizes.

A work unit is a file, a byte range of a large text/JSONL file, some row groups of a Parquet
file, or a whole Hugging Face dataset. Units are cut from the data alone (never from the worker
count), so the output is the same however many processes tokenize it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.data import storage
from tasks.data.config import HFSource, JsonlSource, ParquetSource, SourceConfig
from tasks.data.errors import DataError
from tasks.data.tally import Tally


@dataclass(frozen=True)
class Unit:
    """A piece of a source that one process reads from start to end."""

    path: str
    start: int = 0
    end: int | None = None
    row_groups: tuple[int, ...] | None = None
    size: int = 0  # bytes, or an estimate; used to group small units into jobs


MIN_CHUNK = 1 << 20
MIN_PARTS = 64


def chunk_size(total_bytes: int, chunk_bytes: int) -> int:
    """Bytes per unit: at most chunk_bytes, but small enough for MIN_PARTS parts so the last
    parts do not leave cores idle. A function of the data alone, never of the core count, so the
    output does not depend on the machine."""
    return min(chunk_bytes, max(MIN_CHUNK, -(-total_bytes // MIN_PARTS)))


def plan_units(src: SourceConfig, refs: list[storage.FileRef], chunk_bytes: int, tally: Tally) -> list[Unit]:
    """Split a source's files into units; empty files are bad input found here."""
    if isinstance(src, HFSource):
        return [Unit(path=src.path)]
    chunk_bytes = chunk_size(sum(r.size for r in refs), chunk_bytes)
    units = []
    for ref in refs:
        if ref.size == 0:
            tally.bad(ref.path, "empty file", "empty_file")
            continue
        if isinstance(src, ParquetSource):
            units.extend(_parquet_units(ref, chunk_bytes))
            continue
        sep = b"\n" if isinstance(src, JsonlSource) else (src.separator or "").encode()
        if not sep:
            units.append(Unit(ref.path, 0, ref.size, size=ref.size))
        else:
            units.extend(Unit(ref.path, a, b, size=b - a) for a, b in storage.find_boundaries(ref, sep, chunk_bytes))
    return units


def _parquet_units(ref: storage.FileRef, chunk_bytes: int) -> list[Unit]:
    if storage.is_s3(ref.path):
        return [Unit(ref.path, size=ref.size)]
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(ref.path).metadata
    except Exception as exc:
        raise DataError(ref.path, f"not a readable Parquet file ({exc})") from exc
    if meta.num_row_groups <= 1 or ref.size <= chunk_bytes:
        return [Unit(ref.path, size=ref.size)]
    # Uncompressed text is what costs tokenizer time, so size row groups by that.
    return [Unit(ref.path, row_groups=(i,), size=meta.row_group(i).total_byte_size) for i in range(meta.num_row_groups)]


def group_units(units: list[Unit], target: int) -> list[list[Unit]]:
    """Consecutive units of about `target` bytes per group: many small files make few parts."""
    groups: list[list[Unit]] = []
    size = target
    for u in units:
        if size >= target or not groups:
            groups.append([])
            size = 0
        groups[-1].append(u)
        size += u.size
    return groups

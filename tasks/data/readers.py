"""Turn a source into a stream of document strings, one work unit at a time.

A work unit is a file, a byte range of a large text/JSONL file, some row groups of a Parquet
file, or a whole Hugging Face dataset. Units are cut from the data alone (never from the worker
count), so the output is the same however many processes tokenize it.

Bad input goes through `Tally.bad`: under `on_error: fail` it raises a one-line `DataError`
naming the file and line (or row, or field); under `skip` it is counted by reason.
"""

from __future__ import annotations

import string
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import orjson

from tasks.data import storage
from tasks.data.config import HFSource, JsonlSource, ParquetSource, SourceConfig, TextSource
from tasks.data.errors import DataError


@dataclass(frozen=True)
class Unit:
    """A piece of a source that one process reads from start to end."""

    path: str
    start: int = 0
    end: int | None = None
    row_groups: tuple[int, ...] | None = None
    size: int = 0  # bytes, or an estimate; used to group small units into jobs


@dataclass
class Tally:
    """Per-unit counts of what was dropped and why; summed into provenance."""

    policy: str = "fail"
    filtered: int = 0  # by design: empty or shorter than min_chars
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)

    def bad(self, where: str, what: str, reason: str) -> None:
        if self.policy == "fail":
            raise DataError(where, what)
        self.skipped[reason] += 1

    def add(self, other: Tally) -> None:
        self.filtered += other.filtered
        self.truncated += other.truncated
        self.skipped.update(other.skipped)


# --- planning -------------------------------------------------------------------------------


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
    return [Unit(ref.path, row_groups=(i,), size=meta.row_group(i).total_byte_size)
            for i in range(meta.num_row_groups)]


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


# --- reading --------------------------------------------------------------------------------


def documents(src: SourceConfig, unit: Unit, tally: Tally) -> Iterator[str]:
    """The unit's documents after filtering, in file order."""
    if isinstance(src, TextSource):
        raw = _text_docs(src, unit, tally)
    elif isinstance(src, JsonlSource):
        raw = _jsonl_docs(src, unit, tally)
    elif isinstance(src, ParquetSource):
        raw = _parquet_docs(src, unit, tally)
    else:
        raw = _hf_docs(src, tally)
    for text, where in raw:
        if len(text) < src.min_chars or not text or text.isspace():
            tally.filtered += 1
            continue
        if src.max_doc_chars is not None and len(text) > src.max_doc_chars:
            if src.truncate_long:
                tally.truncated += 1
                text = text[: src.max_doc_chars]
            else:
                tally.bad(where(), f"document of {len(text)} characters exceeds max_doc_chars={src.max_doc_chars}",
                          "too_long")
                continue
        yield text


class _Where:
    """Lazily worded location: the absolute line is only computed when an error needs it."""

    __slots__ = ("path", "start", "line")

    def __init__(self, path: str, start: int, line: int):
        self.path, self.start, self.line = path, start, line

    def __call__(self) -> str:
        base = storage.line_of(self.path, self.start) if self.start else 1
        return f"{self.path}:{base + self.line - 1}"


def _split(blocks: Iterator[bytes], sep: bytes) -> Iterator[bytes]:
    buf = b""
    for block in blocks:
        buf += block
        parts = buf.split(sep)
        buf = parts.pop()
        yield from parts
    if buf:
        yield buf


def _decode(data: bytes, where: _Where, tally: Tally) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Point at the line inside the document where the bad byte sits.
        where = _Where(where.path, where.start, where.line + data.count(b"\n", 0, exc.start))
        tally.bad(where(), f"invalid UTF-8 (byte 0x{data[exc.start]:02x})", "invalid_utf8")
        return None


def _text_docs(src: TextSource, unit: Unit, tally: Tally) -> Iterator[tuple[str, _Where]]:
    blocks = storage.read_blocks(unit.path, unit.start, unit.end)
    if src.separator is None:
        where = _Where(unit.path, 0, 1)
        text = _decode(b"".join(blocks), where, tally)
        if text is not None:
            yield text, where
        return
    sep = src.separator.encode()
    sep_lines = sep.count(b"\n")
    line = 1
    for chunk in _split(blocks, sep):
        where = _Where(unit.path, unit.start, line)
        line += chunk.count(b"\n") + sep_lines
        text = _decode(chunk, where, tally)
        if text is not None:
            yield text, where


def _fields_of(template: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(template) if f]


def _extract(src: JsonlSource | ParquetSource | HFSource, record: dict, where, tally: Tally) -> str | None:
    if src.template is None:
        value = record.get(src.text_field)
        if value is None:
            tally.bad(where(), f"missing text field '{src.text_field}'", "missing_field")
            return None
        if not isinstance(value, str):
            tally.bad(where(), f"field '{src.text_field}' is {type(value).__name__}, not a string", "missing_field")
            return None
        return value
    for name in _fields_of(src.template):
        if record.get(name) is None:
            tally.bad(where(), f"missing template field '{name}'", "missing_field")
            return None
    return src.template.format_map(record)


def _jsonl_docs(src: JsonlSource, unit: Unit, tally: Tally) -> Iterator[tuple[str, _Where]]:
    for i, raw in enumerate(_split(storage.read_blocks(unit.path, unit.start, unit.end), b"\n")):
        where = _Where(unit.path, unit.start, i + 1)
        if not raw.strip():
            continue
        line = _decode(raw, where, tally)
        if line is None:
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            tally.bad(where(), f"malformed JSON ({exc})", "malformed_json")
            continue
        if not isinstance(record, dict):
            tally.bad(where(), f"expected a JSON object, got {type(record).__name__}", "malformed_json")
            continue
        text = _extract(src, record, where, tally)
        if text is not None:
            yield text, where


def _parquet_docs(src: ParquetSource, unit: Unit, tally: Tally) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        pf = pq.ParquetFile(storage.local_copy(unit.path, tmp))
        wanted = _fields_of(src.template) if src.template else [src.text_field]
        missing = [c for c in wanted if c not in pf.schema_arrow.names]
        if missing:
            n = sum(pf.metadata.row_group(g).num_rows for g in (unit.row_groups or range(pf.num_row_groups)))
            if src.on_error == "fail":
                raise DataError(unit.path, f"no column '{missing[0]}' (columns: {', '.join(pf.schema_arrow.names)})")
            tally.skipped["missing_field"] += n
            return
        groups = list(unit.row_groups) if unit.row_groups is not None else list(range(pf.num_row_groups))
        row = sum(pf.metadata.row_group(g).num_rows for g in range(groups[0])) if groups else 0
        for batch in pf.iter_batches(batch_size=4096, row_groups=groups, columns=wanted):
            cols = {name: batch.column(name).to_pylist() for name in wanted}
            for j in range(batch.num_rows):
                record = {name: cols[name][j] for name in wanted}
                where = _RowWhere(unit.path, row + j)
                text = _extract(src, record, where, tally)
                if text is not None:
                    yield text, where
            row += batch.num_rows


class _RowWhere:
    __slots__ = ("path", "row")

    def __init__(self, path: str, row: int):
        self.path, self.row = path, row

    def __call__(self) -> str:
        return f"{self.path}: row {self.row}"


def _hf_docs(src: HFSource, tally: Tally) -> Iterator[tuple[str, object]]:
    from datasets import load_dataset

    label = f"{src.path}[{src.split}]"
    try:
        ds = load_dataset(src.path, name=src.config, split=src.split, data_files=src.data_files,
                          revision=src.revision, streaming=src.streaming)
    except Exception as exc:
        raise DataError(label, f"load_dataset failed ({type(exc).__name__}: {exc})") from exc
    wanted = _fields_of(src.template) if src.template else [src.text_field]
    columns = getattr(ds, "column_names", None)
    if columns is not None:
        missing = [c for c in wanted if c not in columns]
        if missing and src.on_error == "fail":
            raise DataError(label, f"no field '{missing[0]}' (fields: {', '.join(columns)})")
    for i, record in enumerate(ds):
        where = _RowWhere(label, i)
        text = _extract(src, record, where, tally)
        if text is not None:
            yield text, where

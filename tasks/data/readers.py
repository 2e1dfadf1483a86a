"""Turn a source into a stream of document strings, one work unit at a time.

A work unit is a file, a byte range of a large text/JSONL file, some row groups of a Parquet
file, or a whole Hugging Face dataset. Units are cut from the data alone (never from the worker
count), so the output is the same however many processes tokenize it.

Bad input goes through `Tally.bad`: under `on_error: fail` it raises a one-line `DataError`
naming the file and line (or row, or field); under `skip` it is counted by reason.

Memory is bounded by `max_doc_chars`, not by the input: text and JSONL readers never hold more
than a few times that many bytes of one document or line. What runs past it is counted and
dropped as it streams by, and only its first bytes are kept (for `truncate_long`).
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
    # (path, bytes) of files a separator was meant to split but that hold no separator at all
    unsplit: list = field(default_factory=list)

    def bad(self, where: str, what: str, reason: str) -> None:
        if self.policy == "fail":
            raise DataError(where, what)
        self.skipped[reason] += 1

    def add(self, other: Tally) -> None:
        self.filtered += other.filtered
        self.truncated += other.truncated
        self.skipped.update(other.skipped)
        self.unsplit.extend(other.unsplit)


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
    limit = src.max_doc_chars
    for text, where in raw:
        if isinstance(text, Long):
            if src.truncate_long and text.head is not None:
                tally.truncated += 1
                yield text.head[:limit]  # a head of 4 x limit bytes holds at least limit characters
            else:
                tally.bad(where(), f"{text.what} exceeds max_doc_chars={limit}{text.why}", "too_long")
            continue
        if len(text) < src.min_chars or not text or text.isspace():
            tally.filtered += 1
            continue
        if limit is not None and len(text) > limit:
            if src.truncate_long:
                tally.truncated += 1
                text = text[:limit]
            else:
                tally.bad(where(), f"document of {len(text):,} characters exceeds max_doc_chars={limit}", "too_long")
                continue
        yield text


class Long:
    """A document (or JSONL line) too long to hold: its size, and its start when it can be cut."""

    __slots__ = ("head", "what", "why")

    def __init__(self, head: str | None, what: str, why: str = ""):
        self.head, self.what, self.why = head, what, why


def byte_cap(max_chars: int | None, per_char: int = 4) -> int | None:
    """Bytes past which a piece surely holds more than max_chars characters (UTF-8 spends at
    most 4 bytes on one, a JSON escape 12); never below one read block, so the cap costs nothing
    on ordinary input."""
    return None if max_chars is None else max(per_char * max_chars, storage.BLOCK)


def _head(data: bytes) -> str | None:
    """The text of a prefix cut at an arbitrary byte (a character the cut split is dropped), or
    None when the prefix is not UTF-8."""
    for cut in range(4):  # a split character leaves at most 3 of its bytes before the cut
        try:
            return data[: len(data) - cut].decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.start < len(data) - 4:
                return None  # a bad byte well before the cut: not a split character
    return None


class _Where:
    """Lazily worded location: the absolute line is only computed when an error needs it."""

    __slots__ = ("path", "start", "line")

    def __init__(self, path: str, start: int, line: int):
        self.path, self.start, self.line = path, start, line

    def __call__(self) -> str:
        base = storage.line_of(self.path, self.start) if self.start else 1
        return f"{self.path}:{base + self.line - 1}"


class _Over:
    """A piece of the stream that ran past the cap: its first `cap` bytes, total size and newlines."""

    __slots__ = ("head", "size", "lines")

    def __init__(self, head: bytes, size: int, lines: int):
        self.head, self.size, self.lines = head, size, lines


def _split(blocks: Iterator[bytes], sep: bytes, cap: int | None = None) -> Iterator[bytes | _Over]:
    """The pieces between separators, as `whole.split(sep)` would cut them, block by block.

    A piece longer than `cap` bytes comes out as an `_Over` and is never held whole: once the
    buffer passes the cap, all but its last len(sep)-1 bytes (where a separator may begin) are
    counted and dropped.
    """
    buf = b""
    over: _Over | None = None
    for block in blocks:
        buf += block
        parts = buf.split(sep)
        buf = parts.pop()
        for piece in parts:
            if over is not None:
                over.size += len(piece)
                over.lines += piece.count(b"\n")
                yield over
                over = None
            elif cap is not None and len(piece) > cap:
                yield _Over(piece[:cap], len(piece), piece.count(b"\n"))
            else:
                yield piece
        if cap is not None and len(buf) > cap:
            cut = len(buf) - (len(sep) - 1)
            if over is None:
                over = _Over(buf[:cap], 0, 0)
            over.size += cut
            over.lines += buf.count(b"\n", 0, cut)
            buf = buf[cut:]
    if over is not None:
        over.size += len(buf)
        over.lines += buf.count(b"\n")
        yield over
    elif cap is not None and len(buf) > cap:
        yield _Over(buf[:cap], len(buf), buf.count(b"\n"))
    elif buf:
        yield buf


def _decode(data: bytes, where: _Where, tally: Tally) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Point at the line inside the document where the bad byte sits.
        where = _Where(where.path, where.start, where.line + data.count(b"\n", 0, exc.start))
        tally.bad(where(), f"invalid UTF-8 (byte 0x{data[exc.start]:02x})", "invalid_utf8")
        return None


def _text_docs(src: TextSource, unit: Unit, tally: Tally) -> Iterator[tuple[str | Long, _Where]]:
    cap = byte_cap(src.max_doc_chars)
    if src.separator is None:
        where = _Where(unit.path, 0, 1)
        size = unit.end - unit.start if unit.end is not None else None
        if cap is not None and size is not None and size > cap:
            # Known too long from its size alone: read no more of it than a truncation keeps.
            head = _head(storage.read_range(unit.path, unit.start, cap)) if src.truncate_long else None
            yield Long(head, f"document of {size:,} bytes (the whole file)"), where
            return
        text = _decode(b"".join(storage.read_blocks(unit.path, unit.start, unit.end)), where, tally)
        if text is not None:
            yield text, where
        return
    sep = src.separator.encode()
    sep_lines = sep.count(b"\n")
    line = 1
    pieces, first = 0, 0
    for chunk in _split(storage.read_blocks(unit.path, unit.start, unit.end), sep, cap):
        where = _Where(unit.path, unit.start, line)
        pieces += 1
        first = first or (chunk.size if isinstance(chunk, _Over) else len(chunk))
        if isinstance(chunk, _Over):
            line += chunk.lines + sep_lines
            whole = unit.start == 0 and unit.end is not None and chunk.size == unit.end
            why = f"; the separator {src.separator!r} never occurs in the file" if whole else ""
            head = _head(chunk.head) if src.truncate_long else None
            yield Long(head, f"document of {chunk.size:,} bytes", why), where
            continue
        line += chunk.count(b"\n") + sep_lines
        text = _decode(chunk, where, tally)
        if text is not None:
            yield text, where
    # One piece spanning a unit that starts the file: the separator never occurs in it (a unit
    # without one is never cut short of the file's end).
    if pieces == 1 and unit.start == 0 and unit.end is not None and first == unit.end:
        tally.unsplit.append((unit.path, unit.end))


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


def _jsonl_docs(src: JsonlSource, unit: Unit, tally: Tally) -> Iterator[tuple[str | Long, _Where]]:
    cap = byte_cap(src.max_doc_chars, per_char=12)
    for i, raw in enumerate(_split(storage.read_blocks(unit.path, unit.start, unit.end), b"\n", cap)):
        where = _Where(unit.path, unit.start, i + 1)
        if isinstance(raw, _Over):
            # A record cannot be parsed from part of its line, so this is never truncated.
            yield Long(None, f"line of {raw.size:,} bytes", f"; lines over {cap:,} bytes are not parsed"), where
            continue
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
        ds = load_dataset(
            src.path,
            name=src.config,
            split=src.split,
            data_files=src.data_files,
            revision=src.revision,
            streaming=src.streaming,
        )
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

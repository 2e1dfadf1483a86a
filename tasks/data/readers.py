"""Turn one work unit of a source into its document strings: text, JSONL, Parquet or a Hugging Face dataset.

Every format yields (document, location) pairs; `documents` applies the filters they share
(`min_chars`, empty documents, `max_doc_chars` with `truncate_long`) and sends bad input to the
unit's `Tally`. Text and JSONL stream through `pieces`, so one over-long document or line is
never held whole: it arrives as a `Long`.
"""

from __future__ import annotations

import string
import tempfile
from collections.abc import Iterator

import orjson

from tasks.data import storage
from tasks.data.config import HFSource, JsonlSource, ParquetSource, SourceConfig, TextSource
from tasks.data.errors import DataError
from tasks.data.pieces import LineWhere, Over, byte_cap, decode, head_text, split_pieces
from tasks.data.tally import Tally
from tasks.data.units import Unit


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


def _text_docs(src: TextSource, unit: Unit, tally: Tally) -> Iterator[tuple[str | Long, LineWhere]]:
    cap = byte_cap(src.max_doc_chars)
    if src.separator is None:
        where = LineWhere(unit.path, 0, 1)
        size = unit.end - unit.start if unit.end is not None else None
        if cap is not None and size is not None and size > cap:
            # Known too long from its size alone: read no more of it than a truncation keeps.
            head = head_text(storage.read_range(unit.path, unit.start, cap)) if src.truncate_long else None
            yield Long(head, f"document of {size:,} bytes (the whole file)"), where
            return
        text = decode(b"".join(storage.read_blocks(unit.path, unit.start, unit.end)), where, tally)
        if text is not None:
            yield text, where
        return
    sep = src.separator.encode()
    sep_lines = sep.count(b"\n")
    line = 1
    pieces, first = 0, 0
    for chunk in split_pieces(storage.read_blocks(unit.path, unit.start, unit.end), sep, cap):
        where = LineWhere(unit.path, unit.start, line)
        pieces += 1
        first = first or (chunk.size if isinstance(chunk, Over) else len(chunk))
        if isinstance(chunk, Over):
            line += chunk.lines + sep_lines
            whole = unit.start == 0 and unit.end is not None and chunk.size == unit.end
            why = f"; the separator {src.separator!r} never occurs in the file" if whole else ""
            head = head_text(chunk.head) if src.truncate_long else None
            yield Long(head, f"document of {chunk.size:,} bytes", why), where
            continue
        line += chunk.count(b"\n") + sep_lines
        text = decode(chunk, where, tally)
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


def _jsonl_docs(src: JsonlSource, unit: Unit, tally: Tally) -> Iterator[tuple[str | Long, LineWhere]]:
    cap = byte_cap(src.max_doc_chars, per_char=12)
    for i, raw in enumerate(split_pieces(storage.read_blocks(unit.path, unit.start, unit.end), b"\n", cap)):
        where = LineWhere(unit.path, unit.start, i + 1)
        if isinstance(raw, Over):
            # A record cannot be parsed from part of its line, so this is never truncated.
            yield Long(None, f"line of {raw.size:,} bytes", f"; lines over {cap:,} bytes are not parsed"), where
            continue
        if not raw.strip():
            continue
        line = decode(raw, where, tally)
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

"""A byte range of a file as the pieces between separators, decoded, never holding more than a cap.

Memory is bounded by `max_doc_chars`, not by the input: text and JSONL readers never hold more
than a few times that many bytes of one document or line. What runs past the cap is counted and
dropped as it streams by, and only its first bytes are kept (for `truncate_long`). Each piece
knows its line in the file, worded only when an error names it.
"""

from __future__ import annotations

from collections.abc import Iterator

from tasks.data import storage
from tasks.data.tally import Tally


def byte_cap(max_chars: int | None, per_char: int = 4) -> int | None:
    """Bytes past which a piece surely holds more than max_chars characters (UTF-8 spends at
    most 4 bytes on one, a JSON escape 12); never below one read block, so the cap costs nothing
    on ordinary input."""
    return None if max_chars is None else max(per_char * max_chars, storage.BLOCK)


def head_text(data: bytes) -> str | None:
    """The text of a prefix cut at an arbitrary byte (a character the cut split is dropped), or
    None when the prefix is not UTF-8."""
    for cut in range(4):  # a split character leaves at most 3 of its bytes before the cut
        try:
            return data[: len(data) - cut].decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.start < len(data) - 4:
                return None  # a bad byte well before the cut: not a split character
    return None


class LineWhere:
    """Lazily worded location: the absolute line is only computed when an error needs it."""

    __slots__ = ("path", "start", "line")

    def __init__(self, path: str, start: int, line: int):
        self.path, self.start, self.line = path, start, line

    def __call__(self) -> str:
        base = storage.line_of(self.path, self.start) if self.start else 1
        return f"{self.path}:{base + self.line - 1}"


class Over:
    """A piece of the stream that ran past the cap: its first `cap` bytes, total size and newlines."""

    __slots__ = ("head", "size", "lines")

    def __init__(self, head: bytes, size: int, lines: int):
        self.head, self.size, self.lines = head, size, lines


def split_pieces(blocks: Iterator[bytes], sep: bytes, cap: int | None = None) -> Iterator[bytes | Over]:
    """The pieces between separators, as `whole.split(sep)` would cut them, block by block.

    A piece longer than `cap` bytes comes out as an `Over` and is never held whole: once the
    buffer passes the cap, all but its last len(sep)-1 bytes (where a separator may begin) are
    counted and dropped.
    """
    buf = b""
    over: Over | None = None
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
                yield Over(piece[:cap], len(piece), piece.count(b"\n"))
            else:
                yield piece
        if cap is not None and len(buf) > cap:
            cut = len(buf) - (len(sep) - 1)
            if over is None:
                over = Over(buf[:cap], 0, 0)
            over.size += cut
            over.lines += buf.count(b"\n", 0, cut)
            buf = buf[cut:]
    if over is not None:
        over.size += len(buf)
        over.lines += buf.count(b"\n")
        yield over
    elif cap is not None and len(buf) > cap:
        yield Over(buf[:cap], len(buf), buf.count(b"\n"))
    elif buf:
        yield buf


def decode(data: bytes, where: LineWhere, tally: Tally) -> str | None:
    """The piece as text; on invalid UTF-8, None after `tally.bad` names the line of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Point at the line inside the document where the bad byte sits.
        where = LineWhere(where.path, where.start, where.line + data.count(b"\n", 0, exc.start))
        tally.bad(where(), f"invalid UTF-8 (byte 0x{data[exc.start]:02x})", "invalid_utf8")
        return None

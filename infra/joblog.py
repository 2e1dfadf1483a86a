"""A job's local log, as both backends keep it: appended across launches, read from this launch's start."""

from __future__ import annotations

import os
from pathlib import Path


class JobLog:
    """Follows one launch's part of an appended log file: new complete lines since the last call, and the end."""

    def __init__(self, path: Path, offset: int):
        self.path, self.offset = path, offset
        self._read_pos = offset
        self._partial = b""

    def new_lines(self, max_bytes: int = 4 << 20) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._read_pos)
                chunk = f.read(max_bytes)
        except FileNotFoundError:
            return []
        self._read_pos += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        return [line.decode(errors="replace") for line in lines]

    def tail(self, lines: int, max_bytes: int) -> str:
        """The last `lines` lines of this launch's output, reading at most its last `max_bytes`."""
        try:
            with open(self.path, "rb") as f:
                end = f.seek(0, os.SEEK_END)
                f.seek(max(self.offset, end - max_bytes))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def lines_with(self, marker: str) -> str:
        """This launch's lines that contain `marker`, read through in one pass (a long run's log is large)."""
        wanted = marker.encode()
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                return "\n".join(line.decode(errors="replace").rstrip("\n") for line in f if wanted in line)
        except FileNotFoundError:
            return ""

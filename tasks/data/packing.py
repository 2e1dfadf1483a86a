"""Pack a stream of token ids into fixed windows of seq_len.

Documents are concatenated with their EOS (and BOS) and cut into windows with no padding, so a
window may hold the end of one document and the start of the next. Workers only tokenize; the
parent packs their ids in document order, so the output is the same however the source was cut.
What is left at the very end (fewer than seq_len ids per split) is dropped and counted in
provenance as `tokens_dropped`: padding would train on fake tokens, and one partial window is
noise next to a pretraining corpus.
"""

from __future__ import annotations

import numpy as np


class Packer:
    """Buffers ids and hands out full windows as rows of a (n, seq_len) array."""

    def __init__(self, seq_len: int, dtype: str, flush_windows: int = 256):
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype)
        self._parts: list[np.ndarray] = []
        self._n = 0
        self._flush = seq_len * flush_windows

    def add(self, ids: np.ndarray) -> np.ndarray | None:
        """Add ids; return the full windows now available (or None while too few are buffered)."""
        self._parts.append(ids)
        self._n += len(ids)
        if self._n < self._flush:
            return None
        return self.windows()

    def windows(self) -> np.ndarray:
        """All full windows buffered so far; the rest stays as the tail."""
        if not self._parts:
            return np.zeros((0, self.seq_len), self.dtype)
        flat = np.concatenate(self._parts) if len(self._parts) != 1 else self._parts[0]
        full = (len(flat) // self.seq_len) * self.seq_len
        rest = flat[full:]
        self._parts, self._n = ([rest.copy()] if len(rest) else []), len(rest)
        return flat[:full].reshape(-1, self.seq_len)

    def tail(self) -> np.ndarray:
        if not self._parts:
            return np.zeros(0, self.dtype)
        return np.concatenate(self._parts).astype(self.dtype, copy=False)

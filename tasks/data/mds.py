"""Write one split as packed MDS samples: `{"tokens": seq_len ids}` per sample."""

from __future__ import annotations

import numpy as np

from tasks.data.packing import Packer


def columns(dtype: str, seq_len: int) -> dict[str, str]:
    # A fixed dtype and shape: each sample is stored as its raw seq_len ids, nothing else.
    return {"tokens": f"ndarray:{dtype}:{seq_len}"}


class SplitWriter:
    """Packs ids into windows and writes them; the MDSWriter opens with the first full window."""

    def __init__(self, out: str, seq_len: int, dtype: str, compression: str | None, hashes: list[str],
                 shard_size: int):
        self.out, self.seq_len, self.dtype = out, seq_len, dtype
        self.compression, self.hashes, self.shard_size = compression, list(hashes), shard_size
        self.packer = Packer(seq_len, dtype)
        self.samples = 0
        self._writer = None

    def add(self, ids: np.ndarray) -> None:
        self._write(self.packer.add(ids))

    def _write(self, windows: np.ndarray | None) -> None:
        if windows is None or not len(windows):
            return
        if self._writer is None:
            from streaming import MDSWriter

            self._writer = MDSWriter(out=self.out, columns=columns(self.dtype, self.seq_len),
                                     compression=self.compression, hashes=self.hashes,
                                     size_limit=self.shard_size, progress_bar=False, exist_ok=False)
        write = self._writer.write
        for row in windows:
            write({"tokens": row})
        self.samples += len(windows)

    def finish(self) -> int:
        """Write what fills a last window; return how many ids were left over (and dropped)."""
        self._write(self.packer.windows())
        if self._writer is not None:
            self._writer.finish()
        return len(self.packer.tail())

"""Write one split as packed MDS samples: `{"tokens": seq_len ids}` per sample."""

from __future__ import annotations

import sys
import threading
import types

import numpy as np

from tasks.data.packing import Packer

# Streaming's package __init__ imports its dataset collections (C4, WebVid, ImageNet, ...) too,
# which pull in transformers' auto-tokenizer machinery and scikit-learn: ~3 of the ~5 s and 300
# of the ~780 MB that `import streaming` costs, none of it used to write MDS.
_COLLECTIONS = ("streaming.multimodal", "streaming.text", "streaming.vision")
_IMPORT = threading.Lock()
_preload: threading.Thread | None = None


def writer_class() -> type:
    """streaming.MDSWriter, imported without the dataset collections when Streaming is not loaded yet.

    They are left out with placeholder modules while the package initialises, and the
    placeholders removed after, so a later `import streaming.text` imports the real one. A
    Streaming whose __init__ needs more of them than their names is imported whole instead.
    """
    with _IMPORT:
        if "streaming" not in sys.modules:
            placeholders = {n: types.ModuleType(n) for n in _COLLECTIONS if n not in sys.modules}
            sys.modules.update(placeholders)
            try:
                import streaming
            except ImportError:
                for name in placeholders:
                    sys.modules.pop(name, None)
                placeholders = {}
                import streaming  # noqa: F401
            finally:
                package = sys.modules.get("streaming")
                for name, placeholder in placeholders.items():
                    if sys.modules.get(name) is placeholder:
                        del sys.modules[name]
                    attr = name.rsplit(".", 1)[1]
                    if package is not None and getattr(package, attr, None) is placeholder:
                        delattr(package, attr)
        from streaming import MDSWriter

        return MDSWriter


def preload() -> None:
    """Import Streaming's MDSWriter in a background thread, once per process.

    Even without the collections, the import takes ~2 s (torch comes with it), and the first
    source to write would otherwise wait for it; started while Prefect's API server starts or the
    tokenizer resolves, it costs the sources nothing.
    """
    global _preload
    if _preload is None and "streaming" not in sys.modules:
        _preload = threading.Thread(target=writer_class, name="tessera-preload-streaming", daemon=True)
        _preload.start()


def columns(dtype: str, seq_len: int) -> dict[str, str]:
    # A fixed dtype and shape: each sample is stored as its raw seq_len ids, nothing else.
    return {"tokens": f"ndarray:{dtype}:{seq_len}"}


class SplitWriter:
    """Packs ids into windows and writes them; the MDSWriter opens with the first full window."""

    def __init__(self, out: str, seq_len: int, dtype: str, compression: str | None, hashes: list[str], shard_size: int):
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
            self._writer = writer_class()(
                out=self.out,
                columns=columns(self.dtype, self.seq_len),
                compression=self.compression,
                hashes=self.hashes,
                size_limit=self.shard_size,
                progress_bar=False,
                exist_ok=False,
            )
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

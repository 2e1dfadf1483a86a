"""Reading a checkpoint without running code it carries.

A `.pt` file is a zip holding a pickle, and a pickle may call any function while it loads: a file
someone hands to `tessera eval`, `tessera compare`, the `eval` deployment or
`train.init_optimizer_from` would run as the user who loads it. Every checkpoint tessera reads
therefore goes through torch's weights-only unpickler, which builds tensors, containers and plain
values and refuses every other global. A Composer checkpoint needs a few more, listed in
SAFE_GLOBALS: each builds a value and calls nothing (a `timedelta` of the timestamp, the torch
version in the metadata, and numpy arrays of numeric dtypes, which hold the saved RNG states).

The trainer loads its own checkpoints through Composer, which asks torch for a full unpickler;
`force_weights_only()` makes torch use the weights-only one there too (TORCH_FORCE_WEIGHTS_ONLY_LOAD
overrides a call's `weights_only=False`), so a file planted in a save folder, local or s3, cannot
run code in the trainer either.
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
from pathlib import Path

FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
TRUST_HINT = "pass --trust-checkpoint only for a file you made or trust"


class UnsafeCheckpoint(ValueError):
    """A model file tessera will not load: one that needs more than tensors and plain values, names code to run,
    or is not a checkpoint at all. `str()` is one line naming it."""


def _numpy_globals() -> list:
    """numpy's array reconstruction and its numeric dtypes, under their numpy 2 names and the numpy 1 aliases
    that files written by numpy 1 name. Object arrays stay refused: ObjectDType is not listed."""
    import numpy as np

    numeric = [
        getattr(np.dtypes, name)
        for name in (
            "BoolDType",
            "Int8DType",
            "Int16DType",
            "Int32DType",
            "Int64DType",
            "UInt8DType",
            "UInt16DType",
            "UInt32DType",
            "UInt64DType",
            "Float16DType",
            "Float32DType",
            "Float64DType",
            "LongLongDType",
            "ULongLongDType",
        )
        if hasattr(np.dtypes, name)
    ]
    core = np._core.multiarray
    return [
        core._reconstruct,
        (core._reconstruct, "numpy.core.multiarray._reconstruct"),
        core.scalar,
        (core.scalar, "numpy.core.multiarray.scalar"),
        np.ndarray,
        np.dtype,
        *numeric,
    ]


def safe_globals() -> list:
    """What a Composer checkpoint holds besides tensors, dicts, lists, tuples, strings and numbers."""
    from torch.torch_version import TorchVersion

    return [datetime.timedelta, TorchVersion, *_numpy_globals()]


def allow_checkpoint_types() -> None:
    """Register SAFE_GLOBALS with torch's weights-only unpickler, in this process (idempotent)."""
    import torch

    torch.serialization.add_safe_globals(safe_globals())


def force_weights_only() -> None:
    """Every torch.load in this process, Composer's included, uses the weights-only unpickler from now on,
    and so does the read of a sharded checkpoint's index (`guard_sharded_index`)."""
    allow_checkpoint_types()
    os.environ[FORCE_ENV] = "1"
    guard_sharded_index()


class _ShardIndexUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's `.metadata` is a plain pickle (torch reads it with pickle.load, whatever
    weights_only says): only the classes an index is made of may load, each a record of plain values."""

    def find_class(self, module: str, name: str):
        import torch

        allowed = module == "torch.distributed.checkpoint.metadata" or (module, name) in {
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),  # a layout by its name
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("pathlib", "PosixPath"),
            ("collections", "OrderedDict"),
        }
        allowed = allowed or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise pickle.UnpicklingError(f"Weights only load failed: unsupported GLOBAL {module}.{name}")
        return super().find_class(module, name)


def guard_sharded_index() -> None:
    """From now on this process reads a sharded checkpoint's `.metadata` with `_ShardIndexUnpickler` (idempotent).

    torch's FileSystemReader is the one reader of that file, Composer's resume and ours alike; it calls its
    module's `pickle.load`, which this replaces. A refused file raises pickle.UnpicklingError as torch's
    weights-only refusals do, so it is reported the same way (refusal())."""
    import types

    import torch.distributed.checkpoint.filesystem as filesystem

    if getattr(filesystem.pickle, "_tessera_guarded", False):
        return
    guarded = types.ModuleType("pickle")
    guarded.__dict__.update(pickle.__dict__)
    guarded.load = lambda f, **kw: _ShardIndexUnpickler(f, **kw).load()
    guarded._tessera_guarded = True
    filesystem.pickle = guarded


def refusal(path: str | Path, exc: BaseException) -> str:
    """The one line that says why `path` was refused, from torch's (long) weights-only error."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"but got <class '([\w.]+)'>", text)
    if found:
        return (
            f"{path}: refused to load: unpickling it needs `{found.group(1)}`, which can run code when loaded; "
            f"{TRUST_HINT} (a checkpoint tessera wrote never needs it)"
        )
    why = re.search(r"WeightsUnpickler error: ([^\n]+)", text)
    detail = why.group(1) if why else text.splitlines()[0]
    return f"{path}: refused to load: not a checkpoint of tensors and plain values ({detail})"


def load(path: str | Path, *, trust: bool = False, mmap: bool = False, shown: str | None = None) -> dict:
    """The checkpoint's pickled state, on CPU; UnsafeCheckpoint unless it holds only safe values or `trust`.
    `shown` names the file in the error when `path` is a downloaded copy.

    `mmap` is a wish: a file in torch's old (pre-1.6, non-zip) format cannot be mapped and is read whole. A
    file that is not a torch checkpoint at all is refused in one line too, not a traceback."""
    import zipfile

    import torch

    allow_checkpoint_types()
    mmap = mmap and zipfile.is_zipfile(path)
    if trust:
        # The caller vouches for the file: the full unpickler, even where force_weights_only() is in effect.
        saved = os.environ.pop(FORCE_ENV, None)
        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        finally:
            if saved is not None:
                os.environ[FORCE_ENV] = saved
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if "weights only" not in str(exc).lower() and "weights_only" not in str(exc):
            raise UnsafeCheckpoint(f"{shown or path}: refused to load: not a torch checkpoint ({exc})") from None
        raise UnsafeCheckpoint(refusal(shown or path, exc)) from None
    except (RuntimeError, EOFError) as exc:  # a truncated zip, a file of another kind
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UnsafeCheckpoint(f"{shown or path}: refused to load: not a readable torch checkpoint ({first})") from None

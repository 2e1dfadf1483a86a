"""A full disk: found in an error's chain, and said in one line naming the folder and its free space.

A full disk is not a failure a retry gets past, wherever it strikes (a checkpoint save, the metrics
journal, a log, MLflow's or Prefect's SQLite store), so trainer, tasks and CLI all classify it as
fatal before any retry, and say where the space ran out and how much is left. Standard library only:
the flow and the CLI use it too.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# File-system faults that a relaunch meets again, byte for byte: a name longer than the file system allows, a
# read-only or forbidden folder, a path through a file. (EIO, a vanished mount, a stale handle may pass.)
PERMANENT_ERRNOS = (
    errno.ENAMETOOLONG,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ELOOP,
)


def no_space(exc: BaseException | None) -> BaseException | None:
    """The error in `exc`'s chain that says a disk is full, or None.

    torch raises a RuntimeError from its zip writer while handling the OSError(ENOSPC) of the write
    that failed, so the type of the error that escapes says nothing: its cause and context do.
    SQLite (MLflow's and Prefect's stores) says "database or disk is full" without an errno.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return exc
        if "database or disk is full" in str(exc) or "No space left on device" in str(exc):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def permanent_fault(exc: BaseException | None) -> OSError | None:
    """The OSError in `exc`'s chain that no relaunch gets past (PERMANENT_ERRNOS), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in PERMANENT_ERRNOS:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def fault_line(error: OSError) -> str:
    """One line naming the path and what the file system said, shortened where the path itself is the fault."""
    path = str(error.filename or "")
    shown = f"{path[:80]}...({len(path)} characters)" if len(path) > 120 else path
    return f"{shown}: {error.strerror or error}; a file-system fault no relaunch gets past"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def existing(path: str | Path) -> Path:
    """`path`, or its nearest existing parent (a file that was never created has no disk to ask about)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def space(path: str | Path) -> str:
    """'<free> free of <total>' on the disk holding `path`."""
    try:
        usage = shutil.disk_usage(existing(path))
    except OSError:
        return "free space unknown"
    return f"{human_bytes(usage.free)} free of {human_bytes(usage.total)}"


def folder_of(error: BaseException, fallback: str | Path) -> Path:
    """The folder the failed write was in (the error's filename, when it names one), else `fallback`."""
    filename = getattr(error, "filename", None)
    if isinstance(filename, str | Path) and str(filename):
        return existing(Path(filename).parent)
    return existing(fallback)


def full_disk_line(error: BaseException, fallback: str | Path, fix: str) -> str:
    """One line: which folder's disk is full, how much is left on it, and `fix`."""
    folder = folder_of(error, fallback)
    return f"no space left on the disk holding {folder} ({space(folder)}); {fix}"

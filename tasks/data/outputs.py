"""Content-addressed output directories: staged beside the target, renamed in, marked done last.

A directory without the done-marker is never used: it is what a killed run leaves, and the next
run replaces it. Staging happens under the output's lease (tasks/data/claim.py): only the lease
holder writes an output or its staging, so whatever staging it finds was left by a dead run,
on this host or another, and is removed.

Filesystem errors that will fail the same way on every try (a read-only or full disk, a data
root that is a file, no permission) are bad input: they become a one-line DataError naming the
path, which the Prefect tasks do not retry.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator

from tasks.data import interrupt
from tasks.data.errors import DataError
from trainers.disk import NO_SPACE_ERRNOS, existing, space
from trainers.format.atomic import atomic_write_json, fsync_path, fsync_tree
from trainers.format.s3 import DONE  # one done-marker name, local and in a bucket

PROVENANCE = "provenance.json"

PERMANENT_ERRNOS = {
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EEXIST,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENAMETOOLONG,
    errno.ELOOP,
}

_ACTIVE: set[str] = set()  # staging directories this process is filling now
_ACTIVE_LOCK = threading.Lock()


def is_done(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DONE))


@contextlib.contextmanager
def permanent_errors(what: str) -> Iterator[None]:
    """Turn an OSError that no retry can fix into a DataError naming its path and `what` failed."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in PERMANENT_ERRNOS:
            raise
        path = exc.filename if exc.filename is not None else "?"
        why = exc.strerror or os.strerror(exc.errno)
        if exc.errno in NO_SPACE_ERRNOS:  # say how much is left, and where: the disk, not this file, is the problem
            folder = existing(os.path.dirname(os.path.abspath(path))) if path != "?" else "?"
            why += f" ({space(folder)} on the disk holding {folder})"
        raise DataError(str(path), f"{what}: {why}") from exc


def ensure_root(root: str) -> None:
    """The data root exists, is a directory and can be written, or a one-line DataError says why."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise DataError(root, "data.root is a file, not a directory")
    with permanent_errors("cannot create data.root"):
        os.makedirs(root, exist_ok=True)
    if not os.access(root, os.W_OK):
        why = "read-only file system" if _read_only(root) else "permission denied"
        raise DataError(root, f"data.root is not writable ({why})")


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _clear_staging(out: str) -> None:
    parent, base = os.path.split(os.path.abspath(out))
    prefix = f".{base}.tmp-"
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if name.startswith(prefix) and path not in _ACTIVE:
            shutil.rmtree(path, ignore_errors=True)


def write_json(path: str, obj: object) -> None:
    """A state file of an output (provenance, the done-marker): whole and on the disk when this returns."""
    atomic_write_json(path, obj, indent=2, sort_keys=True)


@contextlib.contextmanager
def _registered(tmp: str) -> Iterator[None]:
    """`tmp` is being filled or published by this process: a stop's exit cleanup waits for it, then removes it."""
    with _ACTIVE_LOCK:
        _ACTIVE.add(tmp)
    try:
        yield
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(tmp)


@contextlib.contextmanager
def _filling(tmp: str, lease) -> Iterator[str]:
    """`tmp` to fill; removed unless the block ends well with no stop requested and the lease still ours."""
    try:
        with permanent_errors("cannot write prepared data"):
            yield tmp
        interrupt.check()
        lease.check()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def staging(out: str, lease) -> Iterator[str]:
    """Yield a fresh directory to fill; on success it becomes `out`, done-marker written last.

    The caller holds `lease` (a tasks.data.claim.Lease) on `out`. Nothing is renamed in after a
    stop request or once the lease was lost.
    """
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    with permanent_errors("cannot write prepared data"):
        os.makedirs(parent, exist_ok=True)
        _clear_staging(out)
        tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
    with _registered(tmp):
        with _filling(tmp, lease):
            yield tmp
        with permanent_errors("cannot publish prepared data"):
            if os.path.exists(out):  # unfinished (no done-marker): what a killed run left
                shutil.rmtree(out)
            # The shards reach the disk before the done-marker names them, and the rename before it is
            # written: after a power loss a `_DONE` never vouches for files still in the page cache.
            fsync_tree(tmp)
            os.rename(tmp, out)
            fsync_path(parent)
            _fault("renamed")
            write_json(os.path.join(out, DONE), {"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


PART_STAGING = ".tmp-"  # a partition's staging folder inside its output: .tmp-<partition>-<pid>-<random>


def clear_partition_staging(out: str) -> None:
    """Remove what killed runs left staged inside `out` (the caller holds its lease): never a finished partition."""
    if not os.path.isdir(out):
        return
    for name in os.listdir(out):
        path = os.path.join(os.path.abspath(out), name)
        if name.startswith(PART_STAGING) and path not in _ACTIVE:
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def partition_staging(out: str, name: str, lease) -> Iterator[str]:
    """Yield a fresh folder for one partition: its `train`/`val` splits and `record/` (its partition.json). On
    success each split is renamed into `<out>/<split>/<name>` and the record into `<out>/parts/<name>`, replacing
    what a killed run left there, and the partition's done-marker is written last.

    The caller holds `lease` on `out`. Nothing is renamed in after a stop request or once the lease was lost.
    """
    out = os.path.abspath(out)
    with permanent_errors("cannot write prepared data"):
        os.makedirs(out, exist_ok=True)
        tmp = os.path.join(out, f"{PART_STAGING}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
    with _registered(tmp):
        with _filling(tmp, lease):
            yield tmp
        with permanent_errors("cannot publish prepared data"):
            fsync_tree(tmp)
            marker_dir = os.path.join(out, "parts", name)
            for staged, dest in [(os.path.join(tmp, s), os.path.join(out, s, name)) for s in ("train", "val")] + [
                (os.path.join(tmp, "record"), marker_dir)
            ]:
                if os.path.exists(dest):  # unfinished (no done-marker): what a killed run left
                    shutil.rmtree(dest)
                if os.path.isdir(staged):
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    os.rename(staged, dest)
                    fsync_path(os.path.dirname(dest))
            _fault("partition-renamed")
            write_json(os.path.join(marker_dir, DONE), {"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            shutil.rmtree(tmp, ignore_errors=True)
            _fault(f"partition-{name}-done")


def discard(out: str) -> None:
    """Remove an unfinished output the caller holds the lease on: it holds nothing a rerun could reuse."""
    if not is_done(out):
        shutil.rmtree(out, ignore_errors=True)


def mark_done(out: str) -> None:
    """The output's done-marker, once every partition (each synced before its own marker), the merged indexes and
    provenance (written atomically) are on the disk."""
    _fault("merged")
    with permanent_errors("cannot publish prepared data"):
        write_json(os.path.join(out, DONE), {"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def wait_for_staging(deadline: float) -> None:
    """Wait until no staging directory of this process is being filled, or time.monotonic() passes deadline."""
    while time.monotonic() < deadline:
        with _ACTIVE_LOCK:
            if not _ACTIVE:
                return
        time.sleep(0.05)


def remove_staging() -> None:
    """Remove the staging directories still being filled: the process is about to exit without them."""
    with _ACTIVE_LOCK:
        left = list(_ACTIVE)
    for tmp in left:
        shutil.rmtree(tmp, ignore_errors=True)


def _fault(point: str) -> None:
    # Lets the kill-and-rerun tests stop the process hard at the moments a plain SIGKILL cannot be timed: after a
    # rename, before its done-marker; right after a given partition's marker; after the merge, before `_DONE`.
    if os.environ.get("TESSERA_FAULT") == point:
        os._exit(137)


def withdraw(out: str, shard: str | None = None) -> bool:
    """Take back a damaged output's done-marker, and that of the partition holding the damaged `shard` (a basename
    of the merged index: `<partition>/shard.N.mds`), so the next prepare writes that partition again and merges;
    whether the output had its marker."""
    part = damaged_partition(shard)
    if part is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(out, "parts", part, DONE))
            fsync_path(os.path.join(out, "parts", part))
    try:
        os.unlink(os.path.join(out, DONE))
    except FileNotFoundError:
        return False
    fsync_path(out)  # a power loss must not bring the marker back
    return True


def damaged_partition(shard: str | None) -> str | None:
    """The partition folder a damaged shard's basename names (`00003/shard.00000.mds` -> `00003`), if it names one."""
    head = (shard or "").split("/", 1)[0]
    return head if "/" in (shard or "") and head.isdigit() else None


def damage(out: str) -> dict | None:
    """The first damage in the output's splits (trainers/data_check.py's record: which shard, why), or None."""
    from trainers.data_check import DamagedData, verify_stream

    try:
        for split in ("train", "val"):
            if os.path.isdir(os.path.join(out, split)):
                verify_stream(os.path.basename(out), os.path.join(out, split))
    except DamagedData as exc:
        return exc.record
    return None


def intact(out: str) -> bool:
    """Whether every shard of the output's splits still has the bytes its index records."""
    return damage(out) is None


def read_provenance(out: str) -> dict:
    with open(os.path.join(out, PROVENANCE)) as f:
        return json.load(f)


def _clean_on_exit(deadline: float | None) -> None:
    if deadline is not None:
        wait_for_staging(deadline=deadline)
    remove_staging()  # whatever a thread did not clear in time; never renamed in


interrupt.on_exit(_clean_on_exit)

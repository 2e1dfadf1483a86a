"""Content-addressed output directories: staged beside the target, renamed in, marked done last.

A directory without the done-marker is never used: it is what a killed run leaves, and the next
run replaces it. Staging directories carry the writer's pid so a later run can tell a dead
writer's leftovers from a live concurrent one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator

DONE = "_DONE"
PROVENANCE = "provenance.json"


def is_done(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DONE))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clear_stale(out: str) -> None:
    parent, base = os.path.split(os.path.abspath(out))
    prefix = f".{base}.tmp-"
    for name in os.listdir(parent):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def write_json(path: str, obj: object) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def staging(out: str) -> Iterator[str]:
    """Yield a fresh directory to fill; on success it becomes `out`, done-marker written last."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    _clear_stale(out)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if is_done(out):  # a concurrent run finished the same work first; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    _fault("renamed")
    write_json(os.path.join(out, DONE), {"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def _fault(point: str) -> None:
    # Lets the kill-and-rerun test stop the process hard at the one moment a plain SIGKILL
    # cannot be timed: after the rename, before the done-marker.
    if os.environ.get("TESSERA_FAULT") == point:
        os._exit(137)


def read_provenance(out: str) -> dict:
    with open(os.path.join(out, PROVENANCE)) as f:
        return json.load(f)

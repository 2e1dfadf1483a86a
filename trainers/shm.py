"""Streaming's shared memory left by killed launches, cleaned without touching anyone else's.

A StreamingDataset keeps its state in POSIX shared memory named `<prefix:06>_<what>` under
/dev/shm, where the prefix is the first number no live dataset on the host uses. A kill -9 leaves
those segments behind: they hold memory until reboot, and a leftover registration of a remote
stream's cache folder makes the next dataset on that folder fail ("Reused local directory").
Streaming's own `clean_stale_shared_memory()` unlinks every prefix on the host, a live trainer's of
another run included, whose next step then fails. Here a prefix is stale only if no live process
maps any of its segments (read from /proc/<pid>/maps): a live dataset keeps them mapped.

Another launch on the host may be creating its segments while this one looks: the names are listed
before the maps are read (a segment made after the listing is not a candidate, and one made before
is mapped by its creator at once, which the later read sees), and a segment younger than
YOUNG_S is left alone whatever the maps say. A killed launch's segments are older than that by the
time its relaunch has started Python and planned.
"""

from __future__ import annotations

import logging
import re
import tempfile
import time
from pathlib import Path

log = logging.getLogger("tessera.shm")

SHM_DIR = Path("/dev/shm")
_STREAMING_NAME = re.compile(r"(\d{6})_\w+")
YOUNG_S = 2.0  # a segment this new may be mid-creation by a live dataset (the race is milliseconds wide)


def _mapped_prefixes() -> set[str]:
    """Prefixes of the Streaming segments that some live process has mapped."""
    live = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
        for line in text.splitlines():
            _, sep, name = line.partition(str(SHM_DIR) + "/")
            match = _STREAMING_NAME.match(name) if sep else None
            if match:
                live.add(match.group(1))
    return live


def _age(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_ctime
    except OSError:  # gone meanwhile
        return 0.0


def clean_stale_streaming_shm() -> list[str]:
    """Unlink the Streaming segments (and their file locks) of prefixes no live process maps; their names."""
    if not SHM_DIR.is_dir():
        return []
    now = time.time()
    candidates = [p for p in SHM_DIR.iterdir() if _STREAMING_NAME.fullmatch(p.name) and _age(p, now) >= YOUNG_S]
    live = _mapped_prefixes()  # after the listing: see the module's docstring
    stale = sorted(p.name for p in candidates if p.name[:6] not in live)
    for name in stale:
        try:
            (SHM_DIR / name).unlink()
        except OSError:
            continue
    prefixes = {name[:6] for name in stale}
    for lock in Path(tempfile.gettempdir()).glob("[0-9][0-9][0-9][0-9][0-9][0-9]_*filelock*"):
        if lock.name[:6] in prefixes and lock.name[:6] not in live:
            try:
                lock.unlink()
            except OSError:
                continue
    if stale:
        log.info("removed %d shared-memory segment(s) a killed launch left: %s", len(stale), ", ".join(stale))
    return stale

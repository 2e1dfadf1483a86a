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

Two launches on one host (two runs, a run and an evaluation) also race for prefixes. Streaming has every
rank scan /dev/shm for the first free prefix on its own, then the node's first rank registers the prefix
it found and the others open the prefix *they* found: when another job registers or frees one between
two ranks' scans, they disagree, and the dataset dies "shared memory registered does not match local
leader" (a retryable launch lost). `leader_decides_prefixes` makes the choice one rank's: the node's first
rank scans and registers under a host-wide file lock (no other job's first rank registers meanwhile), and
the other ranks take its prefix through the launch's process group instead of scanning. The prefix it takes has
nothing under it at all: Streaming's scan would also accept one that still holds a stale segment of some other name
(a killed dataset's resume position), which the new dataset would then read as its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
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


def _taken_prefixes() -> set[int]:
    """Every prefix with a Streaming segment under /dev/shm or a file lock in the temporary folder, live or stale."""
    names = [p.name for p in SHM_DIR.iterdir()] if SHM_DIR.is_dir() else []
    names += [p.name for p in Path(tempfile.gettempdir()).glob("[0-9][0-9][0-9][0-9][0-9][0-9]_*filelock*")]
    return {int(name[:6]) for name in names if _STREAMING_NAME.match(name)}


PREFIX_LOCK = Path(tempfile.gettempdir()) / "tessera-streaming-prefixes.lock"
REGISTER_TRIES = 5


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    with open(PREFIX_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _register(streams_local: list[str], streams_remote: list, retry: int):
    """The node's first rank: the first free prefix, and its LOCALS segment registered, with no other job's first
    rank registering meanwhile."""
    from streaming.base.constant import LOCALS, SHM_TO_CLEAN
    from streaming.base.shared import prefix as streaming_prefix

    with _host_lock():
        for attempt in range(REGISTER_TRIES):
            # Streaming's scan (it also refuses a remote stream's cache folder another dataset registered)...
            prefix_int = max(
                streaming_prefix._check_and_find_retrying(streams_local, streams_remote, shm_name=name, retry=retry)
                for name in SHM_TO_CLEAN
            )
            # ...stops, for each name, at the first prefix without it, so the prefix it returns can still hold some
            # other segment: a killed dataset's `resume` (a dataset that attaches to one never unlinks it) or the
            # half its resource tracker had not unlinked yet. A new dataset there would read the stale resume
            # position as its own (CI: a 75-sample validation split "resumed" at sample 128, and the stage
            # died at its end), or share epoch counters with a stranger. Only a prefix with nothing under it is free.
            taken = _taken_prefixes()
            while prefix_int in taken:
                prefix_int += 1
            data = streaming_prefix._pack_locals(streams_local, prefix_int)
            try:
                shm = streaming_prefix.SharedMemory(streaming_prefix._get_path(prefix_int, LOCALS), True, len(data))
            except FileExistsError:  # a Streaming user that is not tessera took it between the scan and now
                if attempt == REGISTER_TRIES - 1:
                    raise
                continue
            shm.buf[: len(data)] = data
            return prefix_int, shm
    raise AssertionError("unreachable")


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _leaders_prefix(mine: int | None, failed: str | None, is_leader: bool) -> int | None:
    """The prefix this node's first rank registered, through the launch's process group (one all-gather); its
    failure is raised on the node's other ranks, so none waits for a prefix that will never come."""
    import torch.distributed as dist

    node = int(os.environ.get("NODE_RANK", "0"))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (node, is_leader, mine, failed))
    prefix, why = next((p, f) for n, leader, p, f in gathered if n == node and leader)
    if why is not None and not is_leader:
        raise RuntimeError(f"this node's first rank could not register Streaming's shared memory: {why}")
    return prefix


def get_shm_prefix(streams_local: list[str], streams_remote: list, world, retry: int = 100):
    """Streaming's `get_shm_prefix` with the choice made once per node (see the module's docstring)."""
    from streaming.base.constant import LOCALS
    from streaming.base.shared import SharedMemory
    from streaming.base.shared import prefix as streaming_prefix

    streaming_prefix._check_self(streams_local)
    registered = None
    if world.is_local_leader:
        try:
            registered = _register(streams_local, streams_remote, retry)
        except Exception as exc:  # said to the node's other ranks, then raised here
            if _several_ranks():
                _leaders_prefix(None, f"{type(exc).__name__}: {exc}", True)
            raise
    if not _several_ranks():  # one process: it is its node's first rank, unless Streaming counts otherwise
        return registered if registered is not None else _STREAMINGS[0](streams_local, streams_remote, world, retry)
    prefix_int = _leaders_prefix(registered[0] if registered else None, None, world.is_local_leader)
    if registered is not None:
        return registered
    try:
        shm = SharedMemory(streaming_prefix._get_path(prefix_int, LOCALS), False)
    except FileNotFoundError:
        raise RuntimeError(f"shared memory prefix {prefix_int} was not registered by this node's first rank") from None
    their_locals, _ = streaming_prefix._unpack_locals(bytes(shm.buf))
    if their_locals != streams_local:
        raise RuntimeError(
            f"shared memory prefix {prefix_int}: this node's first rank registered {their_locals}, this rank has "
            f"{streams_local} (the ranks were given different local folders)"
        )
    return prefix_int, shm


def leader_decides_prefixes() -> None:
    """Every StreamingDataset made in this process from now on takes its prefix as `get_shm_prefix` says
    (idempotent). Streaming's dataset module calls the name it imported, so that name is the one replaced."""
    import streaming.base.dataset as dataset

    if dataset.get_shm_prefix is not get_shm_prefix:
        _STREAMINGS.append(dataset.get_shm_prefix)
        dataset.get_shm_prefix = get_shm_prefix


_STREAMINGS: list = []  # Streaming's own get_shm_prefix, once replaced

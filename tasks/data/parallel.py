"""One process pool per Python process, shared by every source.

Processes are spawned, never forked: the parent runs Prefect's threads and event loop and may
have used tokenizers' thread pool, neither of which survives a fork. Spawning costs a start-up
(a fresh interpreter importing tokenizers and numpy), so the pool is kept for the life of the
process and `warm()` lets a flow pay that cost while it does other work.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import threading
from concurrent.futures import Future, ProcessPoolExecutor

from tasks.data import worker

_LOCK = threading.Lock()
_POOL: ProcessPoolExecutor | None = None
_SIZE = 0


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def pool(workers: int) -> ProcessPoolExecutor:
    global _POOL, _SIZE
    with _LOCK:
        if _POOL is None or _SIZE != workers:
            shutdown()
            _POOL = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=worker.init_worker)
            _SIZE = workers
        return _POOL


def warm(workers: int) -> list[Future]:
    """Start every worker process now; returns futures that finish once they are up."""
    p = pool(workers)
    return [p.submit(os.getpid) for _ in range(workers)]


def terminate() -> None:
    """Kill the workers now, dropping their jobs: a stop request, not an orderly end.

    The executor's own shutdown would let every running job finish first. ProcessPoolExecutor
    has no public way to end its workers before Python 3.14 (terminate_workers), hence
    `_processes`.
    """
    global _POOL
    with _LOCK:
        pool, _POOL = _POOL, None
    if pool is None:
        return
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.terminate()
    pool.shutdown(wait=False, cancel_futures=True)


def shutdown() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.shutdown(wait=True, cancel_futures=True)
        _POOL = None


atexit.register(shutdown)

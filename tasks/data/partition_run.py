"""Prepare partitions: tokenize their jobs in the shared pool, pack each partition's ids apart, publish each alone.

The pool's window of jobs in flight runs across partition edges, so the cores stay busy while one partition is
finished; ids are consumed in job order, so a partition's packing is the same as one process reading it whole.
A partition is published (its splits renamed in, its record, then its done-marker) as soon as its last job is
consumed: a prepare killed after that keeps it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tasks.data import interrupt, outputs, parallel, worker
from tasks.data.config import SourceConfig
from tasks.data.mds import SplitWriter
from tasks.data.partitions import RECORD, SPLITS, Partition, in_order
from tasks.data.tally import Tally
from tasks.data.tokenizer import TokenizerInfo
from tasks.data.units import group_units

Progress = Callable[[int, int], None]


@dataclass(frozen=True, kw_only=True)
class Packing:
    """How a partition's windows are written: the output's format settings."""

    seq_len: int
    dtype: str
    compression: str | None
    hashes: list[str]
    shard_size: int


def jobs_for(src: SourceConfig, part: Partition, chunk: int, tok: TokenizerInfo) -> list[worker.Job]:
    """A partition's jobs for the pool: its units grouped to about `chunk` bytes each, in order. A source read in
    order is one job (a cap stops at the same document whatever the worker count)."""
    common = dict(
        source=src, tokenizer_json=tok.tokenizer_json, eos_id=tok.eos_token_id, bos_id=tok.bos_token_id, dtype=tok.dtype
    )
    if in_order(src):
        return [worker.Job(units=part.units, **common)]
    return [worker.Job(units=tuple(g), **common) for g in group_units(list(part.units), chunk)]


def writer_name() -> str:
    """Who wrote a partition: the pod (its name is its hostname on Kubernetes) or this host, and the process."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()} pid {os.getpid()}"


@dataclass
class _Open:
    """A partition being written: its staging folder, split writers and the jobs' results so far."""

    part: Partition
    staging: object  # the partition_staging context manager, entered
    folder: str
    writers: dict[str, SplitWriter]
    jobs: int
    started: float = field(default_factory=time.time)
    results: list = field(default_factory=list)

    def add(self, split: str, ids) -> None:
        interrupt.check()
        self.writers[split].add(ids)


def _open(out: str, part: Partition, jobs: int, packing: Packing, lease) -> _Open:
    staging = outputs.partition_staging(out, part.name, lease)
    folder = staging.__enter__()
    writers = {
        s: SplitWriter(
            os.path.join(folder, s),
            packing.seq_len,
            packing.dtype,
            packing.compression,
            packing.hashes,
            packing.shard_size,
        )
        for s in SPLITS
    }
    return _Open(part, staging, folder, writers, jobs)


def _record(o: _Open, packing: Packing) -> dict:
    """What partition `o` holds, from its writers and its jobs' results: summed into the output's provenance."""
    tally = Tally()
    for r in o.results:
        tally.add(r.tally)
    counts = {}
    for split, w in o.writers.items():
        dropped = w.finish()
        parts = [getattr(r, split) for r in o.results]
        counts[split] = {
            "documents": sum(c.documents for c in parts),
            "tokens": sum(c.tokens for c in parts),
            "samples": w.samples,
            "tokens_written": w.samples * packing.seq_len,
            "tokens_dropped": dropped,
        }
    return {
        "index": o.part.index,
        "units": sum(r.units for r in o.results),
        "bytes": o.part.size,
        "jobs": o.jobs,
        "counts": counts,
        "filtered": tally.filtered,
        "truncated": tally.truncated,
        "skipped": dict(sorted(tally.skipped.items())),
        "unsplit": [list(u) for u in tally.unsplit],
        "capped": any(r.capped for r in o.results),
        "writer": writer_name(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(o.started)),
        "seconds": round(time.time() - o.started, 3),
    }


def _close(o: _Open, packing: Packing) -> dict:
    record = _record(o, packing)
    outputs.write_json(os.path.join(o.folder, "record", RECORD), record)
    o.staging.__exit__(None, None, None)
    return record


def run(
    out: str,
    todo: list[tuple[Partition, list[worker.Job]]],
    *,
    packing: Packing,
    workers: int,
    lease,
    progress: Progress | None = None,
    on_done: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Prepare each partition of `todo` (with its jobs, in order) into `out`; the records of those published.

    A stop request or bad input (DataError under on_error: fail) ends it within one batch or one poll; the
    partitions being written then are removed, the ones published stay.
    """
    flat = [(part, job, i, len(jobs)) for part, jobs in todo for i, job in enumerate(jobs)]
    records: list[dict] = []
    opened: dict[int, _Open] = {}

    def consume(part: Partition, n_jobs: int, result: worker.JobResult, last: bool) -> None:
        o = opened[part.index]
        o.results.append(result)
        if last:
            del opened[part.index]
            record = _close(o, packing)
            records.append(record)
            if on_done is not None:
                on_done(record)

    def writer_of(part: Partition, n_jobs: int) -> _Open:
        if part.index not in opened:
            opened[part.index] = _open(out, part, n_jobs, packing, lease)
        return opened[part.index]

    try:
        if len(flat) <= 1 or workers <= 1:
            for part, job, i, n in flat:
                o = writer_of(part, n)
                result = worker.run_job(job, sink=o.add, progress=progress)
                consume(part, n, result, i == n - 1)
            return records
        for part, result, i, n in _pooled(flat, workers):
            o = writer_of(part, n)
            for split, ids in result.ids.items():
                if len(ids):
                    o.add(split, ids)
            if progress is not None:  # per job: pool processes report when they hand back
                progress(result.train.documents + result.val.documents, result.train.tokens + result.val.tokens)
            result.ids = None
            consume(part, n, result, i == n - 1)
        return records
    except BaseException as exc:
        for o in opened.values():  # never renamed in: what they staged goes
            o.staging.__exit__(type(exc), exc, exc.__traceback__)
        raise


def _pooled(flat: list, workers: int) -> Iterator[tuple]:
    """The jobs' results in job order, from a bounded window of jobs in flight (finished-but-unwritten ids must
    not pile up), refilled one for one."""
    pool = parallel.pool(workers)
    pending: collections.deque = collections.deque()
    todo = iter(flat)
    try:
        for part, job, i, n in itertools.islice(todo, 2 * workers):
            pending.append((part, i, n, pool.submit(worker.run_job, job)))
        while pending:
            part, i, n, future = pending.popleft()
            result = _job_result(future)
            for nxt, job, j, m in itertools.islice(todo, 1):
                pending.append((nxt, j, m, pool.submit(worker.run_job, job)))
            yield part, result, i, n
    finally:
        for *_, f in pending:
            f.cancel()


def _job_result(future: concurrent.futures.Future) -> worker.JobResult:
    # Polled, not waited on: a thread blocked in result() would not notice a stop request.
    while True:
        interrupt.check()
        try:
            return future.result(timeout=0.2)
        except concurrent.futures.TimeoutError:
            continue
        except concurrent.futures.process.BrokenProcessPool:
            interrupt.check()  # the pool was terminated by a stop request
            raise


__all__ = ["Packing", "jobs_for", "run", "writer_name"]

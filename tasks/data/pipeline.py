"""Prepare one source: plan units, tokenize them in the pool, pack and write in order, publish.

Plain Python with no Prefect, so it can be tested and benchmarked on its own; tasks/prepare.py
wraps it as a cached Prefect task.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from tasks.data import claim, hashing, interrupt, outputs, parallel, storage, worker
from tasks.data.config import DataConfig, HFSource, SourceConfig
from tasks.data.errors import DataError
from tasks.data.home import LocalHome, S3Home, home_at
from tasks.data.mds import SplitWriter, columns
from tasks.data.results import PreparedSource
from tasks.data.tally import Tally
from tasks.data.tokenizer import TokenizerInfo
from tasks.data.units import chunk_size, group_units, plan_units

# Under `tessera`, which Prefect's logging setup reaches (PREFECT_LOGGING_EXTRA_LOGGERS): a warning or a
# wait for another run then shows in the flow run's log, not only on this process's stderr.
log = logging.getLogger("tessera.data")

# A file at least this large that a separator was meant to split, but that holds no separator at
# all, is almost surely a wrong separator: it is worth a warning even when it fits max_doc_chars.
UNSPLIT_WARN_BYTES = 256 << 10


@dataclass(frozen=True)
class Plan:
    """A source's inputs as found now, and the output they hash to."""

    source: SourceConfig
    refs: tuple[storage.FileRef, ...]
    files: list
    key: str
    out: str  # where it is written on this machine
    missing: dict  # pattern -> why, for patterns skipped under on_error: skip
    home: LocalHome | S3Home  # where it lasts, what training reads: `out` itself, or its s3:// copy


def resolve_files(src: SourceConfig) -> tuple[list[storage.FileRef], dict[str, str]]:
    """Expand each path; under `skip` a pattern that matches nothing or cannot be read is noted."""
    if isinstance(src, HFSource):
        return [], {}
    refs, missing = [], {}
    for pattern in src.paths:
        try:
            refs.extend(storage.expand([pattern]))
        except DataError as exc:
            if src.on_error == "fail":
                raise
            missing[pattern] = exc.what
    return refs, missing


def plan(src: SourceConfig, data: DataConfig, tok: TokenizerInfo) -> Plan:
    return _plan(src, data, tok.fingerprint)


def all_prepared(data: DataConfig) -> bool:
    """Whether the tokenizer and every source of `data` are already prepared, from file metadata
    alone (nothing is loaded): lets a caller skip warming up for work there is none of."""
    from tasks.data import tokenizer

    try:
        tok_dir = tokenizer.output_dir(data.tokenizer, data.local_root, data.sources, data.chunk_bytes)
        if not outputs.is_done(tok_dir):
            return False
        key = os.path.basename(tok_dir).removeprefix("tokenizer-")
        plans = [_plan(src, data, key) for src in data.sources]
        return all(p.home.is_done() for p in plans)
    except (DataError, OSError):
        return False  # the flow will say what is wrong


def _plan(src: SourceConfig, data: DataConfig, tokenizer_key: str) -> Plan:
    refs, missing = resolve_files(src)
    if isinstance(src, HFSource):
        files = hashing.fingerprints(src)
    else:
        files = [[r.path, r.size, r.version] for r in refs] + [[p, "missing", why] for p, why in missing.items()]
    key = hashing.source_key(src, files, tokenizer_key, data)
    name = f"{src.name}-{key}"
    home = home_at(f"{data.root.rstrip('/')}/{name}")
    return Plan(src, tuple(refs), files, key, os.path.join(data.local_root, name), missing, home)


def is_published(p: Plan) -> bool:
    """Whether the output is finished where training reads it: the bucket for an s3:// root."""
    return p.home.is_done()


def cached_result(p: Plan) -> PreparedSource | None:
    if p.home.is_done():
        return _result(p, p.home.provenance(), cached=True)
    prov = p.home.resume_publish(p.out)  # finished here, then its upload was cut short
    return None if prov is None else _result(p, prov, cached=True)


def _result(p: Plan, prov: dict, cached: bool) -> PreparedSource:
    out = p.home.where
    c = prov["counts"]
    val = c["val"]
    return PreparedSource(
        name=p.source.name,
        path=os.path.join(out, "train"),
        val_path=os.path.join(out, "val") if val["samples"] else None,
        root=out,
        hash=p.key,
        documents=c["train"]["documents"],
        tokens=c["train"]["tokens_written"],
        samples=c["train"]["samples"],
        val_documents=val["documents"],
        val_tokens=val["tokens_written"],
        skipped=c["skipped_total"],
        truncated=c["truncated"],
        dtype=prov["tokenizer"]["dtype"],
        cached=cached,
        warnings=prov.get("warnings", []),
    )


def uses_pool(p: Plan, data: DataConfig) -> bool:
    """Whether preparing `p` will hand parts to the process pool (see _jobs and _run), from sizes alone."""
    src = p.source
    if (data.workers or parallel.default_workers()) <= 1 or isinstance(src, HFSource):
        return False
    if src.max_documents is not None or src.max_tokens is not None:
        return False
    total = sum(r.size for r in p.refs)
    # Units are cut from files at about chunk_size bytes and grouped to about that size: a source no
    # larger than one chunk is one job, which runs in-process.
    return total > chunk_size(total, data.chunk_bytes)


def _jobs(p: Plan, data: DataConfig, tok: TokenizerInfo, tally: Tally) -> list[worker.Job]:
    units = plan_units(p.source, list(p.refs), data.chunk_bytes, tally)
    common = dict(
        source=p.source,
        tokenizer_json=tok.tokenizer_json,
        eos_id=tok.eos_token_id,
        bos_id=tok.bos_token_id,
        dtype=tok.dtype,
    )
    src = p.source
    # A cap must stop at the same document whatever the worker count, so capped sources run in order.
    if src.max_documents is not None or src.max_tokens is not None or isinstance(src, HFSource):
        return [worker.Job(units=tuple(units), **common)] if units else []
    groups = group_units(units, chunk_size(sum(r.size for r in p.refs), data.chunk_bytes))
    return [worker.Job(units=tuple(g), **common) for g in groups]


def _run(jobs: list[worker.Job], workers: int, writers: dict[str, SplitWriter], progress) -> list[worker.JobResult]:
    """Run the jobs and feed their ids to the writers in job order, so the packing is the same as
    one process reading the whole source. A stop request ends it within one batch or one poll."""

    def sink(split: str, ids) -> None:
        interrupt.check()
        writers[split].add(ids)

    if len(jobs) <= 1 or workers <= 1:
        return [worker.run_job(j, sink=sink, progress=progress) for j in jobs]
    pool = parallel.pool(workers)
    # A bounded window of jobs in flight keeps finished-but-unwritten ids from piling up.
    pending: collections.deque = collections.deque()
    results = []
    todo = iter(jobs)
    try:
        for job in itertools.islice(todo, 2 * workers):
            pending.append(pool.submit(worker.run_job, job))
        while pending:
            r = _job_result(pending.popleft())
            for split, ids in r.ids.items():
                if len(ids):
                    sink(split, ids)
            if progress is not None:  # per part: pool processes report when they hand back
                progress(r.train.documents + r.val.documents, r.train.tokens + r.val.tokens)
            results.append(dataclasses.replace(r, ids=None))
            for job in itertools.islice(todo, 1):
                pending.append(pool.submit(worker.run_job, job))
        return results
    finally:
        for f in pending:
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


def prepare_source(
    src: SourceConfig, data: DataConfig, tok: TokenizerInfo, progress: Callable[[int, int], None] | None = None
) -> PreparedSource:
    """Plan `src` and prepare it (`prepare_planned`)."""
    return prepare_planned(plan(src, data, tok), data, tok, progress)


def prepare_planned(
    p: Plan, data: DataConfig, tok: TokenizerInfo, progress: Callable[[int, int], None] | None = None
) -> PreparedSource:
    """Prepare the planned source under <root>/<name>-<hash>, or return the finished output if it exists.

    The finished output's `_DONE` is the only cache: a deleted or unfinished output is written again.
    The output's claim is held throughout: a concurrent run of the same output (here or on another
    host sharing the root) waits, then finds it done and reuses it.
    """
    src = p.source
    done = cached_result(p)
    if done is not None:
        log.info("source %s: up to date at %s, nothing to do", src.name, p.out)
        return done
    outputs.ensure_root(data.local_root)

    def waiting(holder: claim.Holder) -> None:
        log.warning("source %s: another run (%s) is preparing %s; waiting for it", src.name, holder.describe(), p.out)

    with (
        outputs.permanent_errors("cannot write prepared data"),
        claim.hold(p.out, on_wait=waiting, check_stop=interrupt.check) as held,
    ):
        done = cached_result(p)
        if done is not None:
            log.info("source %s: prepared by the run we waited for, at %s", src.name, p.out)
            return done
        return _write(p, data, tok, held, progress)


def _write(
    p: Plan, data: DataConfig, tok: TokenizerInfo, held: claim.Lease, progress: Callable[[int, int], None] | None
) -> PreparedSource:
    src = p.source
    started = time.time()
    tally = Tally(src.on_error)
    for pattern, why in p.missing.items():
        tally.bad(pattern, why, "unreadable_path")
    workers = data.workers or parallel.default_workers()
    with outputs.staging(p.out, held) as staging:
        writers = {
            split: SplitWriter(
                os.path.join(staging, split), data.seq_len, tok.dtype, data.compression, data.hashes, data.shard_size
            )
            for split in ("train", "val")
        }
        jobs = _jobs(p, data, tok, tally)
        results = _run(jobs, workers, writers, progress)
        for r in results:
            tally.add(r.tally)
        counts = {}
        for split, w in writers.items():
            dropped = w.finish()
            parts = [getattr(r, split) for r in results]
            counts[split] = {
                "documents": sum(c.documents for c in parts),
                "tokens": sum(c.tokens for c in parts),
                "samples": w.samples,
                "tokens_written": w.samples * data.seq_len,
                "tokens_dropped": dropped,
            }
        _refuse_empty(p, data, counts, tally)
        warnings = [
            f"source '{src.name}': {path} ({size:,} bytes) is one document: the separator "
            f"{getattr(src, 'separator', None)!r} never occurs in it"
            for path, size in tally.unsplit
            if size >= UNSPLIT_WARN_BYTES
        ]
        for w in warnings:
            log.warning("%s", w)
        prov = _provenance(p, data, tok, counts, tally, results, len(jobs), warnings, started)
        outputs.write_json(os.path.join(staging, outputs.PROVENANCE), prov)
    log.info(
        "source %s: wrote %d samples (%d tokens) to %s",
        src.name,
        counts["train"]["samples"],
        counts["train"]["tokens_written"],
        p.out,
    )
    if p.home.publish(p.out):
        log.info("source %s: published to %s", src.name, p.home.where)
    return _result(p, prov, cached=False)


def _refuse_empty(p: Plan, data: DataConfig, counts: dict, tally: Tally) -> None:
    """An output that would train on nothing, or report no validation loss, is refused in one line."""
    src, where = p.source, f"source '{p.source.name}'"
    if counts["train"]["documents"] + counts["val"]["documents"] == 0:
        raise DataError(
            where,
            f"no documents ({sum(tally.skipped.values())} skipped, {tally.filtered} filtered, {len(p.refs)} files)",
        )
    if counts["train"]["samples"] == 0:
        raise DataError(
            where, f"{counts['train']['tokens']} train tokens is less than one seq_len ({data.seq_len}) sample"
        )
    if src.val_fraction > 0 and counts["val"]["samples"] == 0:
        # Training would silently report no validation loss for this source.
        raise DataError(
            where,
            f"val_fraction={src.val_fraction} held out no validation sample "
            f"({counts['val']['documents']} documents, {counts['val']['tokens']} tokens; "
            f"one sample is seq_len={data.seq_len} tokens): add documents, lower "
            "seq_len, or set val_fraction: 0",
        )


def _provenance(
    p: Plan,
    data: DataConfig,
    tok: TokenizerInfo,
    counts: dict,
    tally: Tally,
    results: list,
    parts: int,
    warnings: list[str],
    started: float,
) -> dict:
    """What an output records of how it was made: inputs, tokenizer, packing, counts, format, code, times."""
    return {
        "source": p.source.model_dump(mode="json"),
        "hash": p.key,
        "inputs": p.files,
        "tokenizer": tok.model_dump(mode="json"),
        "seq_len": data.seq_len,
        "packing": "concatenate documents, each followed by EOS (BOS first when set); no padding; "
        "the final remainder of fewer than seq_len tokens per split is dropped",
        "counts": {
            **counts,
            "documents": counts["train"]["documents"] + counts["val"]["documents"],
            "tokens": counts["train"]["tokens"] + counts["val"]["tokens"],
            "skipped_total": sum(tally.skipped.values()),
            "skipped": dict(sorted(tally.skipped.items())),
            "filtered": tally.filtered,
            "truncated": tally.truncated,
            "capped": any(r.capped for r in results),
        },
        "warnings": warnings,
        "format": {
            "columns": columns(tok.dtype, data.seq_len),
            "compression": data.compression,
            "hashes": list(data.hashes),
            "units": sum(r.units for r in results),
            "parts": parts,
        },
        "code_version": hashing.CODE_VERSION,
        "git_sha": hashing.git_sha(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.time() - started, 3),
    }


__all__ = ["Plan", "plan", "prepare_source", "cached_result"]

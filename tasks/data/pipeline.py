"""Prepare one source: plan units, tokenize them in the pool, pack and write in order, publish.

Plain Python with no Prefect, so it can be tested and benchmarked on its own; tasks/prepare.py
wraps it as a cached Prefect task.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from tasks.data import hashing, outputs, parallel, readers, storage, worker
from tasks.data.config import DataConfig, HFSource, SourceConfig
from tasks.data.errors import DataError
from tasks.data.mds import SplitWriter, columns
from tasks.data.results import PreparedSource
from tasks.data.tokenizer import TokenizerInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """A source's inputs as found now, and the output they hash to."""

    source: SourceConfig
    refs: tuple[storage.FileRef, ...]
    files: list
    key: str
    out: str
    missing: dict  # pattern -> why, for patterns skipped under on_error: skip


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
    refs, missing = resolve_files(src)
    if isinstance(src, HFSource):
        files = hashing.fingerprints(src)
    else:
        files = [[r.path, r.size, r.version] for r in refs] + [[p, "missing", why] for p, why in missing.items()]
    key = hashing.source_key(src, files, tok.fingerprint, data)
    return Plan(src, tuple(refs), files, key, os.path.join(data.root, f"{src.name}-{key}"), missing)


def cached_result(p: Plan) -> PreparedSource | None:
    if not outputs.is_done(p.out):
        return None
    prov = outputs.read_provenance(p.out)
    return _result(p, prov, cached=True)


def _result(p: Plan, prov: dict, cached: bool) -> PreparedSource:
    out = os.path.abspath(p.out)
    c = prov["counts"]
    val = c["val"]
    return PreparedSource(
        name=p.source.name, path=os.path.join(out, "train"),
        val_path=os.path.join(out, "val") if val["samples"] else None,
        root=out, hash=p.key, documents=c["train"]["documents"], tokens=c["train"]["tokens_written"],
        samples=c["train"]["samples"], val_documents=val["documents"], val_tokens=val["tokens_written"],
        skipped=c["skipped_total"], truncated=c["truncated"], dtype=prov["tokenizer"]["dtype"], cached=cached,
    )


def _jobs(p: Plan, data: DataConfig, tok: TokenizerInfo, tally: readers.Tally) -> list[worker.Job]:
    units = readers.plan_units(p.source, list(p.refs), data.chunk_bytes, tally)
    common = dict(source=p.source, tokenizer_json=tok.tokenizer_json, eos_id=tok.eos_token_id,
                  bos_id=tok.bos_token_id, dtype=tok.dtype)
    src = p.source
    # A cap must stop at the same document whatever the worker count, so capped sources run in order.
    if src.max_documents is not None or src.max_tokens is not None or isinstance(src, HFSource):
        return [worker.Job(units=tuple(units), **common)] if units else []
    groups = readers.group_units(units, readers.chunk_size(sum(r.size for r in p.refs), data.chunk_bytes))
    return [worker.Job(units=tuple(g), **common) for g in groups]


def _run(jobs: list[worker.Job], workers: int, writers: dict[str, SplitWriter], progress) -> list[worker.JobResult]:
    """Run the jobs and feed their ids to the writers in job order, so the packing is the same as
    one process reading the whole source."""
    def sink(split: str, ids) -> None:
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
            r = pending.popleft().result()
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


def prepare_source(src: SourceConfig, data: DataConfig, tok: TokenizerInfo,
                   progress: Callable[[int, int], None] | None = None) -> PreparedSource:
    """Prepare `src` under <root>/<name>-<hash>, or return the finished output if it exists."""
    p = plan(src, data, tok)
    done = cached_result(p)
    if done is not None:
        log.info("source %s: up to date at %s, nothing to do", src.name, p.out)
        return done
    started = time.time()
    tally = readers.Tally(src.on_error)
    for pattern, why in p.missing.items():
        tally.bad(pattern, why, "unreadable_path")
    workers = data.workers or parallel.default_workers()
    with outputs.staging(p.out) as staging:
        writers = {split: SplitWriter(os.path.join(staging, split), data.seq_len, tok.dtype, data.compression,
                                      data.hashes, data.shard_size) for split in ("train", "val")}
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
        docs = counts["train"]["documents"] + counts["val"]["documents"]
        where = f"source '{src.name}'"
        if docs == 0:
            raise DataError(where, f"no documents ({sum(tally.skipped.values())} skipped, {tally.filtered} "
                                   f"filtered, {len(p.refs)} files)")
        if counts["train"]["samples"] == 0:
            raise DataError(where, f"{counts['train']['tokens']} train tokens is less than one seq_len "
                                   f"({data.seq_len}) sample")
        prov = {
            "source": src.model_dump(mode="json"),
            "hash": p.key,
            "inputs": p.files,
            "tokenizer": tok.model_dump(mode="json"),
            "seq_len": data.seq_len,
            "packing": "concatenate documents, each followed by EOS (BOS first when set); no padding; "
                       "the final remainder of fewer than seq_len tokens per split is dropped",
            "counts": {
                **counts,
                "documents": docs,
                "tokens": counts["train"]["tokens"] + counts["val"]["tokens"],
                "skipped_total": sum(tally.skipped.values()),
                "skipped": dict(sorted(tally.skipped.items())),
                "filtered": tally.filtered,
                "truncated": tally.truncated,
                "capped": any(r.capped for r in results),
            },
            "format": {"columns": columns(tok.dtype, data.seq_len), "compression": data.compression,
                       "hashes": list(data.hashes), "units": sum(r.units for r in results), "parts": len(jobs)},
            "code_version": hashing.CODE_VERSION,
            "git_sha": hashing.git_sha(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.time() - started, 3),
        }
        outputs.write_json(os.path.join(staging, outputs.PROVENANCE), prov)
    log.info("source %s: wrote %d samples (%d tokens) to %s", src.name, counts["train"]["samples"],
             counts["train"]["tokens_written"], p.out)
    return _result(p, prov, cached=False)


__all__ = ["Plan", "plan", "prepare_source", "cached_result"]

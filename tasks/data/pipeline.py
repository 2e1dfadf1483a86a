"""Prepare one source: plan units, tokenize them in the pool, pack and write in order, publish.

Plain Python with no Prefect, so it can be tested and benchmarked on its own; tasks/prepare.py
wraps it as a cached Prefect task.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Protocol

from tasks.data import (
    claim,
    hashing,
    interrupt,
    merge,
    outputs,
    parallel,
    partition_run,
    partitions,
    remote_root,
    storage,
)
from tasks.data.config import DataConfig, HFSource, SourceConfig
from tasks.data.errors import DataError
from tasks.data.home import LocalHome, S3Home, home_at
from tasks.data.results import PreparedSource
from tasks.data.spec import PLAN, Spec
from tasks.data.tally import Tally
from tasks.data.tokenizer import TokenizerInfo
from tasks.data.units import chunk_size, plan_units
from trainers.format.atomic import atomic_write

# Under `tessera`, which Prefect's logging setup reaches (PREFECT_LOGGING_EXTRA_LOGGERS): a warning or a
# wait for another run then shows in the flow run's log, not only on this process's stderr.
log = logging.getLogger("tessera.data")

# A file at least this large that a separator was meant to split, but that holds no separator at
# all, is almost surely a wrong separator: it is worth a warning even when it fits max_doc_chars.
UNSPLIT_WARN_BYTES = 256 << 10


class Progress(Protocol):
    """What a prepare reports as it goes: the source's partitions, documents and tokens, each partition done."""

    def begin(self, source: str, partitions: int, reused: int) -> None: ...

    def __call__(self, documents: int, tokens: int) -> None: ...

    def partition(self, record: dict) -> None: ...


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
        plans = [_plan(src, data, tokenizer_key(data)) for src in data.sources]
        return all(p.home.is_done() for p in plans)
    except (DataError, OSError):
        return False  # the flow will say what is wrong


def plan_keyed(src: SourceConfig, data: DataConfig, tokenizer_key: str) -> Plan:
    """`plan` from the tokenizer's key alone (its folder's hash): nothing of the tokenizer is loaded."""
    return _plan(src, data, tokenizer_key)


def tokenizer_key(data: DataConfig) -> str:
    """The key the prepare stage names the tokenizer's folder with, and every output's hash covers."""
    from tasks.data import tokenizer

    tok_dir = tokenizer.output_dir(data.tokenizer, data.local_root, data.sources, data.chunk_bytes)
    return os.path.basename(tok_dir).removeprefix("tokenizer-")


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
        return result(p, p.home.provenance(), cached=True)
    prov = p.home.resume_publish(p.out)  # finished here, then its upload was cut short
    return None if prov is None else result(p, prov, cached=True)


def result(p: Plan, prov: dict, cached: bool) -> PreparedSource:
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
    """Whether preparing `p` will hand parts to the process pool (see partition_run.jobs_for), from sizes alone."""
    src = p.source
    if (data.workers or parallel.default_workers()) <= 1 or partitions.in_order(src):
        return False
    total = sum(r.size for r in p.refs)
    # Units are cut from files at about chunk_size bytes and grouped to about that size: a source no
    # larger than one chunk is one job, which runs in-process.
    return total > chunk_size(total, data.chunk_bytes)


def cut(p: Plan, data: DataConfig) -> tuple[list[partitions.Partition], Tally]:
    """The plan's partitions, cut from the data alone, and what planning itself finds bad (an empty file, a pattern
    that matched nothing): counted in the tally, or raised under on_error: fail."""
    planned = Tally(p.source.on_error)
    for pattern, why in p.missing.items():
        planned.bad(pattern, why, "unreadable_path")
    units = plan_units(p.source, list(p.refs), data.chunk_bytes, planned)
    return partitions.cut(p.source, units, data.partition_bytes), planned


def spec_for(p: Plan, data: DataConfig, tok: TokenizerInfo) -> Spec:
    """The plan's partitions and what preparing one of them needs."""
    parts, planned = cut(p, data)
    return Spec(
        source=p.source,
        key=p.key,
        packing=packing(data, tok),
        tokenizer=tok,
        # bytes of input per pool job: only how a partition is spread over the cores, never what it holds
        chunk=chunk_size(sum(r.size for r in p.refs), data.chunk_bytes),
        partitions=parts,
        planned=planned,
    )


def packing(data: DataConfig, tok: TokenizerInfo) -> partition_run.Packing:
    return partition_run.Packing(
        seq_len=data.seq_len,
        dtype=tok.dtype,
        compression=data.compression,
        hashes=list(data.hashes),
        shard_size=data.shard_size,
    )


def prepare_source(
    src: SourceConfig, data: DataConfig, tok: TokenizerInfo, progress: Progress | None = None
) -> PreparedSource:
    """Plan `src` and prepare it (`prepare_planned`)."""
    return prepare_planned(plan(src, data, tok), data, tok, progress)


def prepare_planned(p: Plan, data: DataConfig, tok: TokenizerInfo, progress: Progress | None = None) -> PreparedSource:
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
    p: Plan, data: DataConfig, tok: TokenizerInfo, held: claim.Lease, progress: Progress | None
) -> PreparedSource:
    src = p.source
    started = time.time()
    spec = spec_for(p, data, tok)
    if not spec.partitions:
        merge.refuse_empty(src.name, len(p.refs), merge.counts([], spec.planned), data, src.val_fraction)
    with outputs.permanent_errors("cannot write prepared data"):
        os.makedirs(p.out, exist_ok=True)
        atomic_write(os.path.join(p.out, PLAN), spec.to_json())
    outputs.clear_partition_staging(p.out)
    todo = [part for part in spec.partitions if not partitions.is_done(p.out, part.index)]
    reused = len(spec.partitions) - len(todo)
    if reused:
        log.info("source %s: %d of %d partitions already prepared", src.name, reused, len(spec.partitions))
    if progress is not None:
        progress.begin(src.name, len(spec.partitions), reused)
    try:
        partition_run.run(
            p.out,
            [(part, partition_run.jobs_for(src, part, spec.chunk, tok)) for part in todo],
            packing=spec.packing,
            workers=data.workers or parallel.default_workers(),
            lease=held,
            progress=progress,
            on_done=None if progress is None else progress.partition,
        )
    except DataError:
        # Bad input: finished partitions stay for the rerun after the fix; an output with none holds nothing.
        if not any(partitions.is_done(p.out, part.index) for part in spec.partitions):
            outputs.discard(p.out)
        raise
    try:
        prov = finish(
            p,
            data,
            spec,
            merge.local_reader(p.out),
            lambda indexes, prov: merge.finish_local(p.out, indexes, prov),
            started=started,
            reused=reused,
        )
    except DataError:
        outputs.discard(p.out)  # refused whole (no documents, no validation sample): no rerun of it can succeed
        raise
    if p.home.publish(p.out):
        log.info("source %s: published to %s", src.name, p.home.where)
    return result(p, prov, cached=False)


def finish(p: Plan, data: DataConfig, spec: Spec, read: merge.Read, publish, *, started: float, reused: int) -> dict:
    """Every partition of the plan is done where `read` reads the output: merge the splits' indexes and write them
    with provenance through `publish(indexes, provenance)`, which writes the output's `_DONE` last. Its provenance."""
    src = p.source
    n = len(spec.partitions)
    recs = merge.records(read, n)
    counts = merge.counts(recs, spec.planned)
    merge.refuse_empty(src.name, len(p.refs), counts, data, src.val_fraction)
    warnings = merge.unsplit_warnings(src.name, getattr(src, "separator", None), recs, UNSPLIT_WARN_BYTES)
    for w in warnings:
        log.warning("%s", w)
    prov = merge.provenance(
        source=src.model_dump(mode="json"),
        key=p.key,
        inputs=p.files,
        data=data,
        tok=spec.tokenizer,
        recs=recs,
        counts=counts,
        warnings=warnings,
        started=started,
        reused=reused,
    )
    publish(merge.split_indexes(read, n), prov)
    log.info(
        "source %s: %d samples (%d tokens) in %d partitions at %s",
        src.name,
        counts["train"]["samples"],
        counts["train"]["tokens_written"],
        n,
        p.home.where,
    )
    return prov


__all__ = ["Plan", "plan", "prepare_source", "cached_result"]


def output_states(data: DataConfig) -> list[str]:
    """One line per source of `data` on where its output stands, from metadata alone (for `tessera status`): done,
    with its partitions and how many its last prepare reused; or how many partitions a rerun would skip."""
    key = tokenizer_key(data)
    lines = []
    for src in data.sources:
        p = plan_keyed(src, data, key)
        if p.home.is_done():
            prov = p.home.provenance()
            n = prov.get("format", {}).get("partitions", 1)
            lines.append(
                f"source {src.name}: prepared at {p.home.where}: {n} partitions "
                f"({prov.get('partitions_reused', 0)} reused from an earlier prepare), "
                f"{prov['counts']['train']['tokens_written']:,} train tokens"
            )
            continue
        total = _planned_partitions(p)
        done = {k for k in range(total or 0) if partitions.is_done(p.out, k)}
        if isinstance(p.home, S3Home):
            done |= remote_root.partitions_done(p.home.where)
        of = f" of {total}" if total is not None else ""
        lines.append(
            f"source {src.name}: not prepared yet: {len(done)}{of} partitions done at {p.home.where}; "
            f"a rerun skips those {len(done)}"
        )
    return lines


def _planned_partitions(p: Plan) -> int | None:
    """How many partitions the output's plan file (written before any partition) says it has, where one is."""
    raw = merge.local_reader(p.out)(PLAN)
    if raw is None and isinstance(p.home, S3Home):
        raw = remote_root.reader(p.home.where)(PLAN)
    return None if raw is None else len(json.loads(raw)["partitions"])

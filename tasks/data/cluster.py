"""The prepare stage on Kubernetes: every source's partitions left to prepare as one Indexed Job of CPU pods.

The flow plans each source here, as a local prepare does (the same partitions, cut from the data alone), writes each
output's plan file into the bucket, then one index file mapping the Job's indexes to (output, partition) pairs,
and submits the Job (infra/prepare_job.py) whose pods run `python -m tasks.data.pod`. It follows the Job as a
training stage's launch is followed (API faults ridden out, a pod's log relayed, the first failed index reported
with its pod's last lines), counts the partitions' done-markers in the bucket for progress, and once every index
has succeeded merges each output and writes its `_DONE` last. A cancel deletes the Job and its pods; finished
partitions stay, and the rerun's Job holds only the partitions left.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra.backends import backend_for
from infra.config import ComputeConfig
from tasks.data import merge, remote_root
from tasks.data.config import DataConfig
from tasks.data.errors import DataError
from tasks.data.partitions import folder
from tasks.data.pipeline import (
    Plan,
    Progress,
    cached_result,
    cut,
    finish,
    plan_keyed,
    result,
    spec_for,
    tokenizer_key,
)
from tasks.data.results import PreparedSource
from tasks.data.spec import JOBS, PLAN, Spec, index_file
from tasks.data.tokenizer import TokenizerInfo
from trainers.contract import FATAL

log = logging.getLogger("tessera.data")
POD_MODULE = "tasks.data.pod"
ERROR_PREFIX = "tessera: error: "


class PrepareJobFailed(RuntimeError):
    """The prepare Job failed for a reason a retry may not share (a pod's crash, a lost API): retryable."""


@dataclass
class _Output:
    plan: Plan
    spec: Spec
    done: set[int]


def pod_command(index_uri: str) -> list[str]:
    return ["python", "-m", POD_MODULE, index_uri]


KEY_PLACEHOLDER = "{prepare-key}"


@dataclass(frozen=True)
class Preview:
    """The prepare Job as `tessera prepare` would submit it now, or with placeholders where the data is unreadable."""

    index_uri: str
    key: str
    completions: int
    fail_fast: bool
    unread: str | None  # why the sources could not be planned here (placeholders stand in), or None


def preview(data: DataConfig) -> Preview:
    """What `tessera k8s render --prepare` prints: the partitions left to prepare, planned from the data as the flow
    plans them, when this machine can read the sources; else one index and the key's placeholder, saying why."""
    fail_fast = any(src.on_error == "fail" for src in data.sources)
    root = data.root.rstrip("/")
    try:
        key = tokenizer_key(data)
        entries = []
        for src in data.sources:
            p = plan_keyed(src, data, key)
            if p.home.is_done():
                continue
            parts, _ = cut(p, data)
            done = remote_root.partitions_done(p.home.where) if remote_root.is_remote(root) else set()
            entries += [(p.home.where, k) for k in range(len(parts)) if k not in done]
    except Exception as exc:  # noqa: BLE001 -- anything that stops planning here (no bucket, no credentials) is said
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return Preview(f"{root}/{JOBS}/{KEY_PLACEHOLDER}.json", KEY_PLACEHOLDER, 1, fail_fast, why)
    index_key = index_file(entries)[0]
    return Preview(f"{root}/{JOBS}/{index_key}.json", index_key, max(len(entries), 1), fail_fast, None)


def plan_outputs(plans: list[Plan], data: DataConfig, tok: TokenizerInfo) -> tuple[dict, dict[str, _Output]]:
    """(finished sources' results, the outputs still to prepare): each unfinished output's plan file written."""
    results, todo = {}, {}
    for p in plans:
        cached = cached_result(p)
        if cached is not None:
            log.info("source %s: up to date at %s, nothing to do", p.source.name, p.home.where)
            results[p.source.name] = cached
            continue
        spec = spec_for(p, data, tok)
        if not spec.partitions:
            merge.refuse_empty(p.source.name, len(p.refs), merge.counts([], spec.planned), data, p.source.val_fraction)
        remote_root.put(p.home.where, PLAN, spec.to_json())
        done = remote_root.partitions_done(p.home.where)
        if done:
            log.info("source %s: %d of %d partitions already prepared", p.source.name, len(done), len(spec.partitions))
        todo[p.source.name] = _Output(p, spec, done)
    return results, todo


def prepare(
    plans: list[Plan],
    data: DataConfig,
    tok: TokenizerInfo,
    compute: ComputeConfig,
    *,
    run: str,
    log_dir: Path,
    progress: dict[str, Progress] | None = None,
    relay: Callable[[str], None] = log.info,
    poll_s: float = 5.0,
    backend=None,
) -> dict[str, PreparedSource]:
    """Prepare every planned source on the cluster (the tokenizer already published: `tok.uri`); results by name."""
    if tok.uri is None:
        raise DataError(data.root, "the tokenizer must be published to the data root before the prepare Job")
    started = time.time()
    results, todo = plan_outputs(plans, data, tok)
    progress = progress or {}
    for name, o in todo.items():
        if name in progress:
            progress[name].begin(name, len(o.spec.partitions), len(o.done))
    index_uri = write_index(data, todo)
    if index_uri is not None:
        entries = index_entries(todo)
        fail_fast = any(o.plan.source.on_error == "fail" for o in todo.values())
        job = (backend or backend_for(compute)).launch_prepare(
            pod_command(index_uri),
            run=run,
            key=_key_of(index_uri),
            completions=len(entries),
            fail_fast=fail_fast,
            log_dir=log_dir,
        )
        relay(f"prepare Job for {len(entries)} partitions of {len(todo)} sources: {job.kind} {job.name}")
        _follow(job, todo, progress, relay, poll_s)
    results.update(merge_outputs(todo, data, started))
    return {p.source.name: results[p.source.name] for p in plans}


def index_entries(todo: dict[str, _Output]) -> list[tuple[str, int]]:
    """The Job's indexes: every (output, partition) not yet done, sources in recipe order, partitions in order."""
    return [(o.plan.home.where, k) for o in todo.values() for k in range(len(o.spec.partitions)) if k not in o.done]


def write_index(data: DataConfig, todo: dict[str, _Output]) -> str | None:
    """Write the Job's index file into the bucket; its URI, or None when no partition is left to prepare."""
    entries = index_entries(todo)
    if not entries:
        return None
    key, body = index_file(entries)
    root = data.root.rstrip("/")
    remote_root.put(root, f"{JOBS}/{key}.json", body)
    return f"{root}/{JOBS}/{key}.json"


def _key_of(index_uri: str) -> str:
    return index_uri.rsplit("/", 1)[1].removesuffix(".json")


def merge_outputs(todo: dict[str, _Output], data: DataConfig, started: float) -> dict[str, PreparedSource]:
    """Every index has succeeded: each output's indexes merged and provenance written in the bucket, `_DONE` last."""
    results = {}
    for name, o in todo.items():
        uri = o.plan.home.where
        prov = finish(
            o.plan,
            data,
            o.spec,
            remote_root.reader(uri),
            lambda indexes, prov, uri=uri: remote_root.finish(uri, indexes, prov),
            started=started,
            reused=len(o.done),
        )
        results[name] = result(o.plan, prov, cached=False)
    return results


def _follow(job, todo: dict[str, _Output], progress: dict[str, Progress], relay, poll_s: float) -> None:
    """Until the Job ends: its log relayed, each partition done reported; a stop deletes the Job and its pods."""
    seen = {name: set(o.done) for name, o in todo.items()}
    last = 0.0
    try:
        while True:
            for line in job.new_output():
                relay(line)
            code = job.poll()
            if code is not None or time.monotonic() - last >= poll_s:
                last = time.monotonic()
                _count(todo, seen, progress)
            if code is not None:
                break
            time.sleep(0.2)
    except BaseException:
        job.cancel(grace_s=0)
        raise
    for line in job.new_output():
        relay(line)
    job.cancel(grace_s=1)  # ended: the Job and its pods go (their output is in the local log), as a stage's do
    if code == 0:
        return
    said = [ln[len(ERROR_PREFIX) :] for ln in job.tail().splitlines() if ln.startswith(ERROR_PREFIX)]
    if code == FATAL and said:
        raise DataError(*_where_what(said[-1]))
    why = job.outcome.message if job.outcome is not None else f"exit {code}"
    raise PrepareJobFailed(f"the prepare Job {job.name} failed: {why}; finished partitions are kept")


def _count(todo: dict[str, _Output], seen: dict[str, set[int]], progress: dict[str, Progress]) -> None:
    for name, o in todo.items():
        uri = o.plan.home.where
        for k in sorted(remote_root.partitions_done(uri) - seen[name]):
            seen[name].add(k)
            if name in progress:
                raw = remote_root.reader(uri)(f"parts/{folder(k)}/partition.json")
                if raw is not None:
                    progress[name].partition(json.loads(raw))


def _where_what(line: str) -> tuple[str, str]:
    """A pod's one-line DataError (`where: what`) back into its two parts."""
    where, sep, what = line.partition(": ")
    return (where, what) if sep else (line, "bad input")


__all__ = [
    "PrepareJobFailed",
    "Preview",
    "merge_outputs",
    "plan_outputs",
    "pod_command",
    "prepare",
    "preview",
    "write_index",
]

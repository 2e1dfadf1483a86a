"""Prefect tasks of the prepare stage: resolve the tokenizer, plan the sources once, prepare each source.

No Prefect result cache: whether an output is prepared is decided by its `_DONE` marker where the data
lives (docs/ARCHITECTURE.md says why), so a rerun's task runs are Completed quickly, reporting each
source as cached, and a deleted output is simply written again.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from infra import allow_launches
from infra.config import ComputeConfig
from tasks.data import cluster, mds, parallel, pipeline, remote_root
from tasks.data import tokenizer as tokenizers_
from tasks.data.config import DataConfig, SourceConfig, TokenizerConfig
from tasks.data.errors import DataError
from tasks.data.results import PreparedSource
from tasks.data.tokenizer import TokenizerInfo
from tasks.retry import retry_unless

# Progress callbacks by source name, set by the flow in this process; kept out of the task's
# parameters because Prefect records parameters and a callable is not data.
PROGRESS: dict[str, SourceProgress] = {}

# Bad input fails the same way every time; only retry what might be transient (I/O, S3). `_DONE` is the one
# cache (a Prefect result cache would skip a task whose output was deleted since).
_RETRIED = dict(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5, retry_condition_fn=retry_unless(DataError))


@task(name="prepare-tokenizer", task_run_name="prepare-tokenizer", **_RETRIED)
def prepare_tokenizer(cfg: TokenizerConfig, root: str, sources: list[SourceConfig], chunk_bytes: int) -> TokenizerInfo:
    """Load the configured tokenizer or train one on the sources; saved under <root>/tokenizer-<hash>."""
    info = tokenizers_.resolve(cfg, root, sources, chunk_bytes)
    get_run_logger().info(
        "tokenizer at %s: vocab %d, eos id %d, %s", info.hf_dir, info.vocab_size, info.eos_token_id, info.dtype
    )
    return info


@task(name="plan-sources", task_run_name="plan-sources", **_RETRIED)
def plan_sources(data: DataConfig, tok: TokenizerInfo, on_cluster: bool = False) -> list[pipeline.Plan]:
    """Each source's inputs (S3 listed, files stat'ed) and output, once for the whole prepare; starts what
    the sources still to prepare will need while the first is set up."""
    logger = get_run_logger()
    plans = [pipeline.plan(src, data, tok) for src in data.sources]
    todo = [p for p in plans if not pipeline.is_published(p)]
    for p in plans:
        if p not in todo:
            logger.info("source %s: up to date at %s, nothing to do", p.source.name, p.out)
    if todo and not on_cluster:
        mds.preload()  # a no-op when the CLI's warm-up started it already
    if not on_cluster and any(pipeline.uses_pool(p, data) for p in todo):
        # Start the tokenizer processes now. Only when some source is cut into parts: one that is not
        # runs in this process, and spawning the pool would cost seconds of CPU for nothing.
        parallel.warm(data.workers or parallel.default_workers())
    return plans


@task(name="prepare-source", task_run_name="prepare-{plan.source.name}", **_RETRIED)
def prepare_source(plan: pipeline.Plan, data: DataConfig, tok: TokenizerInfo) -> PreparedSource:
    """Tokenize, pack and write one planned source to <root>/<source>-<hash>, or reuse the finished output."""
    result = pipeline.prepare_planned(plan, data, tok, progress=PROGRESS.get(plan.source.name))
    logger = get_run_logger()
    if not result.cached:
        logger.info(
            "source %s: %d documents, %d tokens in %d samples -> %s (%d skipped)",
            plan.source.name,
            result.documents,
            result.tokens,
            result.samples,
            result.root,
            result.skipped,
        )
    return result


@task(name="prepare-on-cluster", task_run_name="prepare-on-cluster", **_RETRIED)
def prepare_on_cluster(
    plans: list[pipeline.Plan], data: DataConfig, tok: TokenizerInfo, compute: ComputeConfig, run: str, log_dir: str
) -> dict[str, PreparedSource]:
    """Every source's partitions left to prepare as one Indexed Job of CPU pods; merged and published once every
    index has succeeded (tasks/data/cluster.py). A retry submits a Job for the partitions still missing only."""
    logger = get_run_logger()
    prepared = cluster.prepare(
        plans,
        data,
        tok,
        compute,
        run=run,
        log_dir=Path(log_dir),
        progress={name: PROGRESS[name] for name in PROGRESS},
        relay=logger.info,
    )
    for s in prepared.values():
        if not s.cached:
            logger.info(
                "source %s: %d documents, %d tokens in %d samples -> %s",
                s.name,
                s.documents,
                s.tokens,
                s.samples,
                s.root,
            )
    return prepared


@task(name="publish-tokenizer", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def publish_tokenizer(tok: TokenizerInfo, root: str) -> TokenizerInfo:
    """Beside the data in the bucket, done-marker last: a training pod cannot read the flow's disk."""
    uri = f"{root.rstrip('/')}/{Path(tok.hf_dir).name}"
    if not remote_root.is_done(uri):
        remote_root.publish(tok.hf_dir, uri)
    return tok.model_copy(update={"uri": uri})


class SourceProgress:
    """One source's progress (tasks.data.pipeline.Progress): a tqdm bar of documents on a terminal; partitions
    done of all, tokens/s and an ETA as a Prefect progress artifact and a log line per partition; otherwise a log
    line at most every `every_s` seconds, so a long source never looks hung in a worker's log."""

    def __init__(self, name: str, position: int, logger, every_s: float = 20.0):
        from tqdm.auto import tqdm

        self.name, self.logger, self.every_s = name, logger, every_s
        self.quiet = not sys.stderr.isatty()
        self.bar = tqdm(desc=name, unit=" docs", position=position, leave=True, disable=self.quiet, dynamic_ncols=True)
        self.docs = self.tokens = 0
        self.said = time.monotonic()
        self.total = self.done = self.reused = 0
        self.written = 0  # tokens in the partitions this run prepared
        self.started = time.monotonic()
        self.artifact = None

    def begin(self, source: str, partitions: int, reused: int) -> None:
        self.total, self.done, self.reused = partitions, reused, reused
        self.started = time.monotonic()
        if reused:  # in the flow run's log: the `tessera.data` logger's INFO lines reach only this process's stderr
            self.logger.info("source %s: %d of %d partitions already prepared", source, reused, partitions)
        with contextlib.suppress(Exception):  # progress is a view: never a reason for the prepare to fail
            self.artifact = create_progress_artifact(
                100.0 * reused / max(partitions, 1), key=_artifact_key(source), description=self._describe()
            )

    def __call__(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bar.set_postfix_str(f"{self.tokens:,} tokens", refresh=False)
        self.bar.update(docs)
        if self.quiet and time.monotonic() - self.said >= self.every_s:
            self.said = time.monotonic()
            self.logger.info(
                "source %s: %s documents, %s tokens so far", self.name, f"{self.docs:,}", f"{self.tokens:,}"
            )

    def partition(self, record: dict) -> None:
        self.done += 1
        self.written += sum(record["counts"][s]["tokens_written"] for s in ("train", "val"))
        line = self._describe()
        self.logger.info("source %s: partition %05d by %s; %s", self.name, record["index"], record["writer"], line)
        if self.artifact is not None:
            with contextlib.suppress(Exception):
                update_progress_artifact(self.artifact, 100.0 * self.done / max(self.total, 1), description=line)

    def _describe(self) -> str:
        """`12 of 52 partitions, 1,234,567 tokens/s, ETA 3m 20s`: the rate and ETA from this run's partitions."""
        line = f"{self.done} of {self.total} partitions"
        fresh = self.done - self.reused
        if fresh > 0:
            elapsed = time.monotonic() - self.started
            left = (self.total - self.done) * elapsed / fresh
            line += f", {self.written / max(elapsed, 1e-9):,.0f} tokens/s, ETA {_duration(left)}"
        return line

    def close(self) -> None:
        self.bar.close()


def _artifact_key(source: str) -> str:
    return "prepare-" + re.sub(r"[^a-z0-9-]+", "-", source.lower()).strip("-")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h {rest // 60}m" if h else f"{rest // 60}m {rest % 60}s"


@contextlib.contextmanager
def progress_bars(data: DataConfig, logger, every_s: float = 20.0):
    """One SourceProgress per source, found by name by the tasks that prepare them (PROGRESS)."""
    for i, src in enumerate(data.sources):
        PROGRESS[src.name] = SourceProgress(src.name, i, logger, every_s)
    try:
        yield
    finally:
        for src in data.sources:
            bar = PROGRESS.pop(src.name, None)
            if bar is not None:
                bar.close()


def warm_up(data: DataConfig) -> None:
    """Before Prefect starts: when there is data to prepare, start importing Streaming's writer
    (~4 s: torch and transformers come with it) so that it overlaps Prefect's server start-up
    instead of delaying the first source. A run with nothing to do imports nothing."""
    if not pipeline.all_prepared(data):
        mds.preload()


__all__ = [
    "ComputeConfig",
    "SourceProgress",
    "allow_launches",
    "plan_sources",
    "prepare_on_cluster",
    "prepare_source",
    "prepare_tokenizer",
    "progress_bars",
    "publish_tokenizer",
    "warm_up",
]  # ComputeConfig, allow_launches: for flows, which never import infra

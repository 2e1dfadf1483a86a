"""Prefect tasks of the prepare stage: resolve the tokenizer, plan the sources once, prepare each source.

No Prefect result cache: whether an output is prepared is decided by its `_DONE` marker where the data
lives (docs/ARCHITECTURE.md says why), so a rerun's task runs are Completed quickly, reporting each
source as cached, and a deleted output is simply written again.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from tasks.data import mds, parallel, pipeline, remote_root
from tasks.data import tokenizer as tokenizers_
from tasks.data.config import DataConfig, SourceConfig, TokenizerConfig
from tasks.data.errors import DataError
from tasks.data.results import PreparedSource
from tasks.data.tokenizer import TokenizerInfo
from tasks.retry import retry_unless

# Progress callbacks by source name, set by the flow in this process; kept out of the task's
# parameters because Prefect records parameters and a callable is not data.
PROGRESS: dict[str, Callable[[int, int], None]] = {}

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
def plan_sources(data: DataConfig, tok: TokenizerInfo) -> list[pipeline.Plan]:
    """Each source's inputs (S3 listed, files stat'ed) and output, once for the whole prepare; starts what
    the sources still to prepare will need while the first is set up."""
    logger = get_run_logger()
    plans = [pipeline.plan(src, data, tok) for src in data.sources]
    todo = [p for p in plans if not pipeline.is_published(p)]
    for p in plans:
        if p not in todo:
            logger.info("source %s: up to date at %s, nothing to do", p.source.name, p.out)
    if todo:
        mds.preload()  # a no-op when the CLI's warm-up started it already
    if any(pipeline.uses_pool(p, data) for p in todo):
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


@task(name="publish-tokenizer", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def publish_tokenizer(tok: TokenizerInfo, root: str) -> TokenizerInfo:
    """Beside the data in the bucket, done-marker last: a training pod cannot read the flow's disk."""
    uri = f"{root.rstrip('/')}/{Path(tok.hf_dir).name}"
    if not remote_root.is_done(uri):
        remote_root.publish(tok.hf_dir, uri)
    return tok.model_copy(update={"uri": uri})


@contextlib.contextmanager
def progress_bars(data: DataConfig, logger, every_s: float = 20.0):
    """One tqdm bar per source (documents, with tokens alongside) on a terminal; otherwise a log line per
    source at most every `every_s` seconds, so a long source never looks hung in a worker's log."""
    import time

    from tqdm.auto import tqdm

    quiet = not sys.stderr.isatty()
    bars = {}
    for i, src in enumerate(data.sources):
        bar = tqdm(desc=src.name, unit=" docs", position=i, leave=True, disable=quiet, dynamic_ncols=True)
        state = {"docs": 0, "tokens": 0, "said": time.monotonic()}

        def update(docs: int, tokens: int, bar=bar, state=state, name=src.name) -> None:
            state["docs"] += docs
            state["tokens"] += tokens
            bar.set_postfix_str(f"{state['tokens']:,} tokens", refresh=False)
            bar.update(docs)
            if quiet and time.monotonic() - state["said"] >= every_s:
                state["said"] = time.monotonic()
                logger.info(
                    "source %s: %s documents, %s tokens so far", name, f"{state['docs']:,}", f"{state['tokens']:,}"
                )

        bars[src.name] = bar
        PROGRESS[src.name] = update
    try:
        yield
    finally:
        for name, bar in bars.items():
            PROGRESS.pop(name, None)
            bar.close()


def warm_up(data: DataConfig) -> None:
    """Before Prefect starts: when there is data to prepare, start importing Streaming's writer
    (~4 s: torch and transformers come with it) so that it overlaps Prefect's server start-up
    instead of delaying the first source. A run with nothing to do imports nothing."""
    if not pipeline.all_prepared(data):
        mds.preload()

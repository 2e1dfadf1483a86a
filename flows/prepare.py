"""The prepare stage: tokenize every source of a recipe into packed MDS shards."""

from __future__ import annotations

import contextlib
import sys

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger

from tasks import prepare as prepare_tasks
from tasks.data import outputs, parallel, pipeline
from tasks.data.config import DataConfig
from tasks.data.errors import DataError
from tasks.data.results import PreparedData, PreparedSource, summarize
from tasks.data.tokenizer import TokenizerInfo
from tasks.data.tokenizer import output_dir as tokenizer_dir

__all__ = ["prepare_data", "PreparedData", "PreparedSource", "TokenizerInfo", "DataError", "summarize"]


@contextlib.contextmanager
def _progress_bars(data: DataConfig):
    """One tqdm bar per source (documents, with tokens alongside); silent when not on a terminal."""
    from tqdm.auto import tqdm

    quiet = not sys.stderr.isatty()
    bars = {}
    for i, src in enumerate(data.sources):
        bar = tqdm(desc=src.name, unit=" docs", position=i, leave=True, disable=quiet, dynamic_ncols=True)
        state = {"tokens": 0}

        def update(docs: int, tokens: int, bar=bar, state=state) -> None:
            state["tokens"] += tokens
            bar.set_postfix_str(f"{state['tokens']:,} tokens", refresh=False)
            bar.update(docs)

        bars[src.name] = bar
        prepare_tasks.PROGRESS[src.name] = update
    try:
        yield
    finally:
        for name, bar in bars.items():
            prepare_tasks.PROGRESS.pop(name, None)
            bar.close()


@flow(name="prepare-data")
def prepare_data(data: DataConfig) -> PreparedData:
    """Tokenize each source into `<data.root>/<source>-<hash>`; finished sources are skipped."""
    logger = get_run_logger()
    tok_dir = tokenizer_dir(data.tokenizer, data.root, data.sources, data.chunk_bytes)
    tok = prepare_tasks.prepare_tokenizer.with_options(refresh_cache=not outputs.is_done(tok_dir))(
        data.tokenizer, data.root, data.sources, data.chunk_bytes)

    was_done = {}
    for src in data.sources:
        out = pipeline.plan(src, data, tok).out
        was_done[src.name] = outputs.is_done(out)
        if was_done[src.name]:
            logger.info("source %s: up to date at %s, nothing to do", src.name, out)
    workers = data.workers or parallel.default_workers()
    if workers > 1 and not all(was_done.values()):
        parallel.warm(workers)  # start the tokenizer processes while the first source is planned

    futures = {}
    with _progress_bars(data):
        for src in data.sources:
            task = prepare_tasks.prepare_source.with_options(refresh_cache=not was_done[src.name])
            futures[src.name] = task.submit(src, data, tok)
        sources = {name: f.result() for name, f in futures.items()}
    # A Prefect cache hit replays the first run's result; say what happened in this run.
    sources = {n: s.model_copy(update={"cached": was_done[n]}) for n, s in sources.items()}
    prepared = PreparedData(tokenizer=tok, seq_len=data.seq_len, sources=sources)

    create_table_artifact(
        key="prepared-data",
        table=[{"source": s.name, "documents": s.documents, "tokens": s.tokens, "val_tokens": s.val_tokens,
                "skipped": s.skipped, "state": "cached" if s.cached else "written", "path": s.root}
               for s in sources.values()],
        description=f"Prepared sources (seq_len {data.seq_len}, tokenizer {tok.hf_dir})",
    )
    skipped = [s.name for s in sources.values() if s.cached]
    if len(skipped) == len(sources):
        logger.info("all %d sources were already prepared; no work done", len(sources))
    logger.info("prepared data:\n%s", summarize(prepared))
    return prepared

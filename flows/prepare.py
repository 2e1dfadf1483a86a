"""The prepare stage: tokenize every source of a recipe into packed MDS shards."""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger
from pydantic import BaseModel, Field

from tasks import prepare as prepare_tasks
from tasks.data import interrupt, mds, pipeline, remote_root
from tasks.data.config import DataConfig
from tasks.data.errors import DataError
from tasks.data.results import PreparedData, PreparedSource, summarize
from tasks.data.tokenizer import TokenizerInfo
from trainers.config import StageConfig

__all__ = [
    "warm_up",
    "prepare_data",
    "prepare_recipe_data",
    "prepare_sources",
    "RecipeData",
    "PreparedData",
    "PreparedSource",
    "TokenizerInfo",
    "DataError",
    "summarize",
]


@contextlib.contextmanager
def _progress_bars(data: DataConfig, logger, every_s: float = 20.0):
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
        prepare_tasks.PROGRESS[src.name] = update
    try:
        yield
    finally:
        for name, bar in bars.items():
            prepare_tasks.PROGRESS.pop(name, None)
            bar.close()


@flow(name="prepare-sources")
def prepare_sources(data: DataConfig) -> PreparedData:
    """Tokenize each source into `<data.root>/<source>-<hash>`; finished sources are skipped."""
    logger = get_run_logger()
    tok = prepare_tasks.prepare_tokenizer(data.tokenizer, data.local_root, data.sources, data.chunk_bytes)
    plans = prepare_tasks.plan_sources(data, tok)
    futures = {}
    with _progress_bars(data, logger):
        try:
            for plan in plans:
                futures[plan.source.name] = prepare_tasks.prepare_source.submit(plan, data, tok)
            sources = {name: f.result() for name, f in futures.items()}
        except BaseException as exc:
            # Ctrl-C, or Prefect's TerminationSignal when a worker cancels the run, reaches only this
            # thread: tell the source threads and the pool to stop, or they run on and publish.
            if not isinstance(exc, Exception):
                interrupt.request(getattr(exc, "signal", signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None))
            raise
    if remote_root.is_remote(data.root):
        tok = prepare_tasks.publish_tokenizer(tok, data.root)
    prepared = PreparedData(tokenizer=tok, seq_len=data.seq_len, sources=sources)

    create_table_artifact(
        key="prepared-data",
        table=[
            {
                "source": s.name,
                "documents": s.documents,
                "tokens": s.tokens,
                "val_tokens": s.val_tokens,
                "skipped": s.skipped,
                "state": "cached" if s.cached else "written",
                "path": s.root,
            }
            for s in sources.values()
        ],
        description=f"Prepared sources (seq_len {data.seq_len}, tokenizer {tok.hf_dir})",
    )
    skipped = [s.name for s in sources.values() if s.cached]
    if len(skipped) == len(sources):
        logger.info("all %d sources were already prepared; no work done", len(sources))
    logger.info("prepared data:\n%s", summarize(prepared))
    return prepared


def prepare_stage_lengths(
    data: DataConfig, stages: list[StageConfig], tokenizer_dir: str, run_name: str = ""
) -> dict[int, dict[str, str]]:
    """Stages with their own seq_len read their sources packed at that length: prepare those too.

    Each length is its own cached output (seq_len is part of a source's hash), so this costs one
    tokenization per (source, length) and nothing on a rerun. The tokenizer is the one already
    prepared, by path: a `train:` tokenizer would otherwise be retrained on the subset of sources.
    """
    wanted: dict[int, set[str]] = {}
    for stage in stages:
        if stage.seq_len and stage.seq_len != data.seq_len:
            wanted.setdefault(stage.seq_len, set()).update(stage.mixture)
    tokenizer = data.tokenizer
    if tokenizer.train is not None:
        tokenizer = tokenizer.model_copy(update={"path": tokenizer_dir, "train": None})
    streams = {}
    for seq_len, names in sorted(wanted.items()):
        sources = [s for s in data.sources if s.name in names]
        subset = data.model_copy(update={"seq_len": seq_len, "sources": sources, "tokenizer": tokenizer})
        name = f"prepare-{run_name}-seq{seq_len}" if run_name else f"prepare-sources-seq{seq_len}"
        prepared = prepare_sources.with_options(flow_run_name=name)(subset)
        streams[seq_len] = {name: str(src.path) for name, src in prepared.sources.items()}
    return streams


def warm_up(data: DataConfig) -> None:
    """Before Prefect starts: when there is data to prepare, start importing Streaming's writer
    (~4 s: torch and transformers come with it) so that it overlaps Prefect's server start-up
    instead of delaying the first source. A run with nothing to do imports nothing."""
    if not pipeline.all_prepared(data):
        mds.preload()


class RecipeData(BaseModel):
    """Everything a recipe's training reads: its sources at data.seq_len, plus any stage's own length."""

    prepared: PreparedData = Field(..., description="The sources packed at data.seq_len, and the tokenizer.")
    seq_len_streams: dict[int, dict[str, str]] = Field(
        default_factory=dict, description="seq_len -> {source -> MDS directory} for stages with their own seq_len."
    )

    def summary(self) -> str:
        lines = [summarize(self.prepared)]
        for seq_len, streams in sorted(self.seq_len_streams.items()):
            lines += [f"at seq_len {seq_len}:"] + [f"  {name}: {path}" for name, path in sorted(streams.items())]
        return "\n".join(lines)


def prepare_recipe_data(data: DataConfig, stages: list[StageConfig], run_name: str = "") -> RecipeData:
    """Prepare what `pretrain_pipeline` trains on: the same call serves `tessera prepare` and `tessera run`.

    The subflow runs are named after `run_name` (`prepare-tiny`), not Prefect's random names.
    """
    prepared = prepare_sources.with_options(flow_run_name=f"prepare-{run_name}" if run_name else None)(data)
    streams = prepare_stage_lengths(data, stages, prepared.tokenizer.hf_dir, run_name)
    return RecipeData(prepared=prepared, seq_len_streams=streams)


class PrepareParams(BaseModel):
    """The form of a prepare run: a recipe whose sources to tokenize (as `tessera prepare RECIPE`)."""

    recipe: str = Field(
        ..., min_length=1, description="Path to the recipe YAML; relative paths resolve against the worker's directory."
    )


def _prepare_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters.get("params")
    params = params.model_dump() if isinstance(params, BaseModel) else dict(params or {})
    return f"prepare-{Path(str(params.get('recipe', 'recipe'))).stem}"


@flow(name="prepare_data", flow_run_name=_prepare_run_name, log_prints=True)
def prepare_data(params: PrepareParams) -> RecipeData:
    """Tokenize every source a recipe trains on, at every seq_len its stages use; finished outputs are skipped."""
    from tasks.recipe import load_recipe

    recipe = load_recipe(params.recipe)
    return prepare_recipe_data(recipe.data, recipe.train.stages, recipe.name)

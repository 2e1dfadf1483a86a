"""The prepare stage: tokenize every source of a recipe into packed MDS shards."""

from __future__ import annotations

import signal
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger
from pydantic import BaseModel, Field

from tasks import prepare as prepare_tasks
from tasks.data import interrupt, remote_root
from tasks.data.config import DataConfig
from tasks.data.results import PreparedData, RecipeData, summarize
from tasks.prepare import ComputeConfig
from trainers.config import StageConfig


@flow(name="prepare-sources")
def prepare_sources(data: DataConfig, compute: ComputeConfig | None = None, run_name: str = "") -> PreparedData:
    """Tokenize each source into `<data.root>/<source>-<hash>`, partition by partition; finished partitions and
    sources are skipped. With compute.backend kubernetes the partitions run as one Indexed Job of CPU pods."""
    logger = get_run_logger()
    on_cluster = compute is not None and compute.backend == "kubernetes"
    tok = prepare_tasks.prepare_tokenizer(data.tokenizer, data.local_root, data.sources, data.chunk_bytes)
    if remote_root.is_remote(data.root):  # before the Job: every pod reads it from the bucket
        tok = prepare_tasks.publish_tokenizer(tok, data.root)
    plans = prepare_tasks.plan_sources(data, tok, on_cluster)
    with prepare_tasks.progress_bars(data, logger):
        if on_cluster:
            log_dir = f"{data.local_root}/.prepare-logs/{run_name or 'prepare'}"
            sources = prepare_tasks.prepare_on_cluster(plans, data, tok, compute, run_name or "prepare", log_dir)
        else:
            sources = _prepare_here(plans, data, tok)
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


def _prepare_here(plans, data: DataConfig, tok) -> dict:
    """Each source as a task run of this process, partition by partition through the shared pool."""
    futures = {}
    try:
        for plan in plans:
            futures[plan.source.name] = prepare_tasks.prepare_source.submit(plan, data, tok)
        return {name: f.result() for name, f in futures.items()}
    except BaseException as exc:
        # Ctrl-C, or Prefect's TerminationSignal when a worker cancels the run, reaches only this
        # thread: tell the source threads and the pool to stop, or they run on and publish.
        if not isinstance(exc, Exception):
            interrupt.request(getattr(exc, "signal", signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None))
        raise


def _prepare_stage_lengths(
    data: DataConfig,
    stages: list[StageConfig],
    tokenizer_dir: str,
    run_name: str = "",
    compute: ComputeConfig | None = None,
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
        prepared = prepare_sources.with_options(flow_run_name=name)(subset, compute, name)
        streams[seq_len] = {name: str(src.path) for name, src in prepared.sources.items()}
    return streams


def prepare_recipe_data(
    data: DataConfig, stages: list[StageConfig], run_name: str = "", compute: ComputeConfig | None = None
) -> RecipeData:
    """Prepare what `pretrain_pipeline` trains on: the body `prepare_data` and the training flows share.

    The subflow runs are named after `run_name` (`prepare-tiny`), not Prefect's random names.
    """
    name = f"prepare-{run_name}" if run_name else "prepare"
    prepared = prepare_sources.with_options(flow_run_name=name if run_name else None)(data, compute, name)
    streams = _prepare_stage_lengths(data, stages, prepared.tokenizer.hf_dir, run_name, compute)
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

    prepare_tasks.allow_launches()  # an earlier flow run in this same process may have stopped its jobs
    recipe = load_recipe(params.recipe)
    return prepare_recipe_data(recipe.data, recipe.train.stages, recipe.name, recipe.compute)

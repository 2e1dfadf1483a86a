"""Prefect tasks of the prepare stage: resolve the tokenizer, prepare one source.

Both are cached on the same content hash that names their output directory, so a re-run shows
Cached task runs in the UI. The flow passes `refresh_cache=True` when the directory is missing or
unfinished, so a cache entry never stands in for data that is no longer there.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

from prefect import task
from prefect.logging import get_run_logger

from tasks.data import pipeline
from tasks.data import tokenizer as tokenizers_
from tasks.data.config import DataConfig, SourceConfig, TokenizerConfig
from tasks.data.errors import DataError
from tasks.data.results import PreparedSource
from tasks.data.tokenizer import TokenizerInfo
from tasks.retry import retry_unless

# Progress callbacks by source name, set by the flow in this process; kept out of the task's
# parameters because Prefect records parameters and a callable is not data.
PROGRESS: dict[str, Callable[[int, int], None]] = {}


def _path_key(kind: str, out: str) -> str:
    return f"tessera-{kind}-{hashlib.sha256(os.path.abspath(out).encode()).hexdigest()[:24]}"


# Bad input fails the same way every time; only retry what might be transient (I/O, S3).
_retry_unless_bad_input = retry_unless(DataError)


def tokenizer_cache_key(context, parameters) -> str:
    p = parameters
    return _path_key("tokenizer", tokenizers_.output_dir(p["cfg"], p["root"], p["sources"], p["chunk_bytes"]))


def source_cache_key(context, parameters) -> str:
    p = parameters
    return _path_key("source", pipeline.plan(p["src"], p["data"], p["tok"]).out)


@task(name="prepare-tokenizer", cache_key_fn=tokenizer_cache_key, persist_result=True, retries=2,
      retry_delay_seconds=5, retry_condition_fn=_retry_unless_bad_input)
def prepare_tokenizer(cfg: TokenizerConfig, root: str, sources: list[SourceConfig], chunk_bytes: int) -> TokenizerInfo:
    """Load the configured tokenizer or train one on the sources; saved under <root>/tokenizer-<hash>."""
    info = tokenizers_.resolve(cfg, root, sources, chunk_bytes)
    get_run_logger().info("tokenizer at %s: vocab %d, eos id %d, %s", info.hf_dir, info.vocab_size,
                          info.eos_token_id, info.dtype)
    return info


@task(name="prepare-source", task_run_name="prepare-{src.name}", cache_key_fn=source_cache_key,
      persist_result=True, retries=2, retry_delay_seconds=5, retry_condition_fn=_retry_unless_bad_input)
def prepare_source(src: SourceConfig, data: DataConfig, tok: TokenizerInfo) -> PreparedSource:
    """Tokenize, pack and write one source to <root>/<source>-<hash>, or reuse the finished output."""
    result = pipeline.prepare_source(src, data, tok, progress=PROGRESS.get(src.name))
    logger = get_run_logger()
    if result.cached:
        logger.info("source %s: up to date at %s, nothing to do", src.name, result.root)
    else:
        logger.info("source %s: %d documents, %d tokens in %d samples -> %s (%d skipped)", src.name,
                    result.documents, result.tokens, result.samples, result.root, result.skipped)
    return result

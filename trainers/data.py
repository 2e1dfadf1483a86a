"""Streaming data for one curriculum stage: a mixture of prepared MDS sources, one epoch = one stage.

Why one epoch per stage: setting `epoch_size` to the stage's sample budget makes Streaming
draw exactly that many samples from the mixture (up/down-sampling each source to its
proportion) in a shuffle fixed by (seed, num_canonical_nodes). The data position is then a
single number, the sample index within the epoch, which Composer checkpoints through
`StreamingDataset.state_dict` and restores without replaying batches.
"""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from composer.core import DataSpec, Evaluator
from streaming import Stream, StreamingDataLoader, StreamingDataset

from trainers.config import Stage, TrainConfig
from trainers.contract import CACHE_DIR_ENV
from trainers.data_check import PREFERRED, DamagedData, remember

__all__ = ["build_stage_data", "build_val_evaluators", "cache_dir_for"]


SHM_PREFIX_TRIES = 5


class TokenSamples(StreamingDataset):
    """MDS samples with one `tokens` column of exactly seq_len ids, returned with their global sample index.

    The index rides along in the batch so tests (and debugging) can tell which samples a
    step consumed; HuggingFaceModel drops keys its forward does not take.
    """

    def __init__(self, *, seq_len: int, **kwargs):
        # Streaming picks a free shared-memory prefix by looking at /dev/shm and then creates it: two
        # launches on one machine starting together can pick the same one, and the later create fails
        # with FileExistsError (`/000471_locals`). Looking again then finds it taken and picks the next.
        for attempt in range(SHM_PREFIX_TRIES):
            try:
                # Fresh streams each try: a failed try has already set their weights (proportion, repeat, choose),
                # and Streaming refuses a stream that carries more than one (a fatal ValueError seen in CI).
                super().__init__(
                    **{**kwargs, "streams": copy.deepcopy(kwargs["streams"])} if "streams" in kwargs else kwargs
                )
                break
            except FileExistsError:
                if attempt == SHM_PREFIX_TRIES - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))
        self.seq_len = seq_len

    def get_item(self, sample_id: int, retry: int = 7) -> dict:
        tokens = super().get_item(sample_id, retry)["tokens"]
        if tokens.shape != (self.seq_len,):
            raise ValueError(f"sample {sample_id}: expected {self.seq_len} tokens, got shape {tokens.shape}")
        # uint16 ids -> int64: embedding lookups and the CE loss want long indices.
        return {"input_ids": torch.from_numpy(tokens.astype(np.int64)), "sample_idx": sample_id}


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    input_ids = torch.stack([s["input_ids"] for s in samples])  # (B, T)
    return {
        "input_ids": input_ids,
        # Causal LM targets are the inputs; LlamaForCausalLM shifts them by one internally. A copy:
        # Composer's eval_forward shifts `labels` in place, which would corrupt shared input ids.
        "labels": input_ids.clone(),
        "sample_idx": torch.tensor([s["sample_idx"] for s in samples], dtype=torch.int64),
    }


class VerifiedStream(Stream):
    """A remote stream whose downloads Streaming validates against the index's hash, a mismatch named as
    trainers.data_check.DamagedData (Streaming raises it in its download thread, and the training loop then
    sees only "Background thread failed": the entrypoint reports `data_check.first_damage()` instead)."""

    def __init__(self, *, source: str, **kwargs):
        super().__init__(**kwargs)
        self.source = source
        self._first_sample: dict[int, int] = {}  # id(shard reader) -> its first sample in this stream

    def get_shards(self, world, allow_unsafe_types: bool):
        shards = super().get_shards(world, allow_unsafe_types)
        start = 0
        for shard in shards:
            self._first_sample[id(shard)] = start
            start += shard.samples
        recorded = shards[0].file_pairs[0][0].hashes if shards else {}
        self.validate_hash = next((a for a in PREFERRED if a in recorded), next(iter(recorded), None))
        return shards

    def prepare_shard(self, shard) -> int:
        try:
            return super().prepare_shard(shard)
        except ValueError as exc:
            if not str(exc).startswith("Checksum failure"):
                raise
            first = self._first_sample.get(id(shard))
            damage = DamagedData(
                {
                    "source": self.source,
                    "path": self.remote,
                    "shard": shard.file_pairs[0][0].basename,
                    "samples": None if first is None else [first, first + shard.samples - 1],
                    "why": f"failed its {self.validate_hash} check when downloaded",
                }
            )
            remember(damage)
            raise damage from None


def _stream(path: str, run: str, proportion: float | None = None, source: str = "") -> Stream:
    """A local MDS directory is read in place (trainers/data_check.py verified it); a remote one (s3://...) is
    cached under $TESSERA_CACHE_DIR, each download validated."""
    if "://" not in path:
        return Stream(local=path, proportion=proportion)
    return VerifiedStream(source=source, remote=path, local=str(cache_dir_for(path, run)), proportion=proportion)


def cache_dir_for(uri: str, run: str) -> Path:
    """This node's local copy of a remote folder for run `run`: under $TESSERA_CACHE_DIR (on Kubernetes, the
    cache volume), else the temp dir.

    Keyed on the run too: Streaming refuses a local directory that a live dataset of another process already
    caches a remote in ("Reused local directory"), so two runs on one host reading one prefix each need their
    own. Not on the stage: a run's stages never read at once (one live trainer per run). Deterministic, so a
    relaunch of the run finds what it cached before.
    """
    root = Path(os.environ.get(CACHE_DIR_ENV) or Path(tempfile.gettempdir()) / "tessera-streams")
    return root / hashlib.sha1(f"{run}\n{uri}".encode()).hexdigest()[:16]


def _cache_limit(train: TrainConfig, paths: list[str]) -> str | None:
    """The recipe's bound on the local cache, only where something is remote: with a limit Streaming
    evicts shards from `local`, and for local data `local` is the prepared data itself."""
    return train.stream_cache_limit if any("://" in p for p in paths) else None


def build_stage_data(stage: Stage, train: TrainConfig, world_size: int, run: str = "") -> DataSpec:
    """The train DataSpec of one stage, for one rank of `world_size`; remote data is cached for run `run`."""
    if stage.batch_size % world_size:
        raise ValueError(
            f"stage {stage.name!r}: global batch size {stage.batch_size} is not divisible by the process count "
            f"({world_size})"
        )
    device_batch = stage.batch_size // world_size
    # Sorted, so the stream order (and hence the global sample index space) does not depend on dict order.
    mixture = stage.config.mixture
    streams = [_stream(stage.streams[name], run, p, name) for name, p in sorted(mixture.items())]
    dataset = TokenSamples(
        seq_len=stage.seq_len,
        streams=streams,
        cache_limit=_cache_limit(train, [stage.streams[name] for name in mixture]),
        epoch_size=stage.samples,
        batch_size=device_batch,
        shuffle=True,
        # A distinct shuffle per stage, stable across relaunches.
        shuffle_seed=train.seed + 1000 * stage.index,
        num_canonical_nodes=train.data_canonical_nodes,
    )
    loader = StreamingDataLoader(
        dataset,
        batch_size=device_batch,
        collate_fn=collate,
        # Samples are pre-tokenized and packed: reading them is cheap, and worker processes would
        # cost seconds of startup on every (re)launch, which the resume budget cannot afford.
        num_workers=0,
        drop_last=True,
    )
    return _spec(loader)


def _spec(loader: StreamingDataLoader) -> DataSpec:
    """Composer counts tokens per batch from this, for `Xtok` durations and the token timestamp."""
    return DataSpec(loader, get_num_tokens_in_batch=lambda batch: batch["input_ids"].numel())


def build_val_evaluators(
    val_streams: dict[str, str], seq_len: int, train: TrainConfig, world_size: int, due, run: str = ""
) -> list[Evaluator]:
    """One Composer Evaluator per source with a held-out split: `val/<source>`, scored when `due(state, event)`.

    The first `train.val_batches` global batches of each split, in file order (no shuffle), so
    every checkpoint is scored on the same samples and the curves are comparable across stages.
    """
    if not train.val_batches:
        return []
    device_batch = max(1, train.global_batch_size // world_size)
    evaluators = []
    for name, path in sorted(val_streams.items()):
        dataset = TokenSamples(
            seq_len=seq_len,
            streams=[_stream(path, run, source=name)],
            batch_size=device_batch,
            shuffle=False,
            cache_limit=_cache_limit(train, [path]),
        )
        loader = StreamingDataLoader(dataset, batch_size=device_batch, collate_fn=collate, num_workers=0)
        evaluators.append(
            Evaluator(
                label=f"val/{name}",
                dataloader=_spec(loader),
                metric_names=["LanguageCrossEntropy"],
                subset_num_batches=train.val_batches,
                eval_interval=due,
            )
        )
    return evaluators

"""The resolved job spec: what `python -m trainers.train` reads, and a stage of it with every number resolved.

The flow resolves everything a pod needs (data paths, vocabulary size, checkpoint interval, tracking target) into
one TrainJob JSON file, so a pod never sees the rest of the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, PositiveInt, model_validator

from trainers.config.sections import (
    MlflowTarget,
    ModelConfig,
    StageConfig,
    TrainConfig,
    _Strict,
    batch_alignment_error,
)


@dataclass(frozen=True)
class Stage:
    """One curriculum stage of a job, every number resolved: the one place a stage's defaults are applied.

    The saver, the data, the schedule's step, the repair and the rollback arithmetic all read these,
    so a stage's batch size or seq_len cannot be resolved two ways.
    """

    index: int
    config: StageConfig
    start: int  # run tokens trained before this stage
    end: int  # run tokens at this stage's end
    batch_size: int  # sequences per optimizer step
    seq_len: int  # tokens per sample
    streams: dict[str, str]  # source name -> MDS directory packed at this seq_len
    first_batch: int  # optimizer steps of the run before this stage

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def samples(self) -> int:
        return self.tokens // self.seq_len

    @property
    def steps(self) -> int:
        return self.tokens // self.tokens_per_batch


class TrainJob(_Strict):
    """Everything one training job needs, resolved by the flow; the only input of trainers.train."""

    run_name: str = Field(..., description="Run name; scopes checkpoint names for autoresume.")
    model: ModelConfig
    train: TrainConfig
    vocab_size: PositiveInt = Field(..., description="Tokenizer vocabulary size (model embedding rows).")
    eos_token_id: int = Field(..., ge=0, description="EOS id the data was packed with.")
    seq_len: PositiveInt = Field(..., description="Tokens per packed sample.")
    streams: dict[str, str] = Field(..., description="Source name -> prepared MDS directory (local path or URI).")
    val_streams: dict[str, str] = Field(
        default_factory=dict,
        description="Source name -> its held-out val MDS directory, for the sources that have one.",
    )
    seq_len_streams: dict[int, dict[str, str]] = Field(
        default_factory=dict,
        description="For stages with their own seq_len: seq_len -> {source name -> MDS directory prepared at it}.",
    )
    save_folder: str = Field(
        ..., description="The run's local checkpoint folder (the working copy when train.save_folder is s3://)."
    )
    checkpoint_every_tokens: PositiveInt = Field(..., description="Save a checkpoint every this many tokens.")
    tokenizer_dir: str | None = Field(None, description="HF tokenizer directory saved into checkpoints.")
    compile_cache_dir: str | None = Field(
        None,
        description="Where compiled kernels outlive a launch (the run's folder); null: the temp dir. The node's "
        "cache volume on Kubernetes wins over it (trainers/compile.py).",
    )
    mlflow: MlflowTarget | None = Field(None, description="Metrics destination; null logs to the console only.")

    @property
    def remote_folder(self) -> str | None:
        """The s3:// mirror of save_folder, scoped by run name; None for a local-only run."""
        folder = self.train.save_folder
        if folder is None or not folder.startswith("s3://"):
            return None
        return f"{folder.rstrip('/')}/{self.run_name}"

    @property
    def tokens_per_batch(self) -> int:
        return self.train.global_batch_size * self.seq_len

    @property
    def max_seq_len(self) -> int:
        """The longest sample any stage trains on: the model's position range."""
        return max(self.stage(k).seq_len for k in range(len(self.train.stages)))

    def stage(self, index: int) -> Stage:
        """Stage `index` with every number resolved (raises IndexError outside the curriculum)."""
        if not 0 <= index < len(self.train.stages):
            raise IndexError(f"stage {index} is out of range, the job has {len(self.train.stages)} stage(s)")
        start = first_batch = 0
        for k, config in enumerate(self.train.stages[: index + 1]):  # each stage starts where the last ended
            seq_len = config.seq_len or self.seq_len
            stage = Stage(
                index=k,
                config=config,
                start=start,
                end=start + config.tokens,
                batch_size=config.global_batch_size or self.train.global_batch_size,
                seq_len=seq_len,
                streams=self.streams if seq_len == self.seq_len else self.seq_len_streams.get(seq_len, {}),
                first_batch=first_batch,
            )
            start, first_batch = stage.end, first_batch + stage.steps
        return stage

    @model_validator(mode="after")
    def _consistent(self) -> TrainJob:
        for k in range(len(self.train.stages)):
            stage = self.stage(k)
            missing = sorted(set(stage.config.mixture) - set(stage.streams))
            if missing:
                at = f" at seq_len {stage.seq_len}" if stage.seq_len != self.seq_len else ""
                raise ValueError(f"stage {stage.name!r} mixes unknown sources{at}: {', '.join(missing)}")
        misaligned = batch_alignment_error(self.train, self.seq_len, self.checkpoint_every_tokens)
        if misaligned is not None:
            loc, message = misaligned
            raise ValueError(f"{'.'.join(map(str, loc))}: {message}")
        return self

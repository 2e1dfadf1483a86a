"""The recipe's `model` and `train` sections, owned by the trainer: ModelConfig, TrainConfig and their parts, the
MLflow target a job logs to, and the token arithmetic of stages (bounds, whole steps)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    field_validator,
    model_validator,
)

from trainers.contract import WatchdogConfig

# The most characters tessera adds to a run's name in a file name of its save folder: the longest is a set-aside
# checkpoint, `<run>-s<K>-tok<T>-rank0.pt.unpublished` (44 with a 15-digit token count), with room to spare.
# A run name longer than the file system's name limit less this is refused before anything runs (tasks/recipe.py).
NAME_RESERVE = 64


CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights and AdamW's two fp32 moments; the rest of a checkpoint is small


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """A Llama-style decoder (transformers LlamaConfig)."""

    n_layers: PositiveInt = Field(2, description="Number of transformer blocks.")
    d_model: PositiveInt = Field(64, description="Residual stream width.")
    n_heads: PositiveInt = Field(4, description="Attention heads; d_model must divide evenly.")
    n_kv_heads: PositiveInt | None = Field(None, description="Key/value heads for GQA; defaults to n_heads.")
    ffn_hidden: PositiveInt | None = Field(
        None, description="SwiGLU hidden width; defaults to 8/3*d_model rounded to 64."
    )
    tie_embeddings: bool = Field(True, description="Share the input embedding with the output projection.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init.")
    attention_dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the attention weights while training (LlamaConfig.attention_dropout)."
    )
    vocab_multiple: PositiveInt = Field(
        128,
        description="The embedding and head get the tokenizer's vocabulary rounded up to a multiple of this many rows "
        "(50,277 -> 50,304): an odd-sized head runs in slow matmul kernels. The tokenizer's ids do not change, the "
        "extra rows are never a target, and the gauntlet and generation never score or emit them. 1 pads nothing.",
    )
    init_from: str | None = Field(
        None,
        description="Continued pretraining: an HF model directory (or an MLflow 'models:/<name>/<version>' URI, "
        "resolved against the job's tracking server) whose weights start the run instead of a random init. "
        "Its architecture must match this section.",
    )

    def ffn_width(self) -> int:
        """SwiGLU width: 8/3*D keeps the 3-matrix MLP at the parameter count of a 4*D GELU MLP;
        rounding up to a multiple of 64 keeps matmul tiles aligned on tensor cores."""
        if self.ffn_hidden:
            return self.ffn_hidden
        return 64 * -(-(8 * self.d_model) // (3 * 64))

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the embedding and the head: the tokenizer's `vocab_size` rounded up to `vocab_multiple`.

        A head 50,277 wide runs in slow, odd-sized matmul kernels; 50,304 (a multiple of 128) in the fast ones.
        The extra rows are never a target (no token has their ids); the gauntlet and generation mask them out."""
        return -(-vocab_size // self.vocab_multiple) * self.vocab_multiple

    def total_params(self, vocab_size: int) -> int:
        """Every weight the model holds, the embedding's padded rows included (`vocab_size` is the tokenizer's)."""
        d, L, f = self.d_model, self.n_layers, self.ffn_width()
        kv_dim = d // self.n_heads * (self.n_kv_heads or self.n_heads)
        per_block = 2 * d * d + 2 * d * kv_dim + 3 * d * f + 2 * d
        embeddings = self.vocab_rows(vocab_size) * d * (1 if self.tie_embeddings else 2)
        return L * per_block + embeddings + d

    def checkpoint_bytes(self, vocab_size: int) -> int:
        """About how large one checkpoint is (no torch needed, so the flow and the preflight ask it too): the demo's
        3.3M parameters give 39.9 MB (42.6 MB on disk, tokenizer in)."""
        return CHECKPOINT_BYTES_PER_PARAM * self.total_params(vocab_size)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({kv})")
        return self


class OptimConfig(_Strict):
    """AdamW with a warmup then decay schedule that spans the whole run, across stages."""

    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    warmup_tokens: int = Field(0, ge=0, description="Linear warmup length in tokens, from the start of the run.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of peak.")
    grad_clip_norm: float | None = Field(1.0, gt=0, description="Clip gradients to this global norm; null disables.")
    decay_tokens: PositiveInt | None = Field(
        None,
        description="Token count where decay reaches min_lr_ratio; null uses the sum of all stages. "
        "Set it when stages may be appended later, so that appending does not bend the schedule already run.",
    )


class StageConfig(_Strict):
    """One curriculum stage: a token budget over a mixture of prepared sources."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Stage name, used in tags and paths.")
    tokens: PositiveInt = Field(..., description="Tokens this stage trains on.")
    mixture: dict[str, float] = Field(..., description="Source name -> proportion; proportions sum to 1.")
    lr_scale: float = Field(1.0, gt=0, description="Multiplies the global schedule's LR while this stage trains.")
    global_batch_size: PositiveInt | None = Field(
        None, description="Sequences per optimizer step in this stage; null uses train.global_batch_size."
    )
    seq_len: PositiveInt | None = Field(
        None,
        description="Tokens per sample in this stage (e.g. a final long-context stage); null uses data.seq_len. "
        "The flow prepares this stage's sources at this length as well.",
    )
    anneal: bool = Field(
        False,
        description="Decay the LR linearly from the global schedule's value at this stage's start to "
        "optim.min_lr_ratio x peak at its end (a final anneal stage, e.g. after a constant schedule).",
    )

    @field_validator("mixture")
    @classmethod
    def _mixture_sums_to_one(cls, mixture: dict[str, float]) -> dict[str, float]:
        if not mixture:
            raise ValueError("mixture must name at least one source")
        if any(p <= 0 for p in mixture.values()):
            raise ValueError("mixture proportions must be > 0")
        total = sum(mixture.values())
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"mixture proportions sum to {total:g}, not 1")
        return mixture


class LossGuardConfig(_Strict):
    """What to do when the loss goes NaN/inf or spikes: roll back to the last good checkpoint and skip data."""

    enabled: bool = Field(True, description="Check every step's loss.")
    spike_factor: float | None = Field(
        None,
        gt=1,
        description="A loss above spike_factor x its running mean counts as a spike; null checks NaN/inf only.",
    )
    ceiling: float | Literal["auto"] | None = Field(
        "auto",
        description="A loss above this counts as a spike from the first step. 'auto': 3 x ln(vocab size), three "
        "times the loss of guessing uniformly, which no sane training state reaches (a flipped byte in an "
        "optimizer moment sends it to 1e8); null: no ceiling.",
    )
    warmup_steps: PositiveInt = Field(20, description="Steps before spike detection starts (the running mean settles).")
    max_rollbacks: int = Field(
        2, ge=0, description="Rollbacks allowed per run; one more bad loss exits with the fatal code. 0 fails at once."
    )


class ParallelismConfig(_Strict):
    """How ranks share the model on GPUs. On CPU ranks always run plain DDP over gloo."""

    sharding: Literal["FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP", "NO_SHARD"] = Field(
        "FULL_SHARD", description="FSDP sharding strategy when procs_per_node > 1 on GPUs."
    )
    activation_checkpointing: bool = Field(False, description="Recompute each block's activations in backward.")


class TrainConfig(_Strict):
    """How to train: batch geometry, optimizer, seed and the curriculum."""

    global_batch_size: PositiveInt = Field(8, description="Sequences per optimizer step, across all ranks.")
    device_microbatch_size: PositiveInt | Literal["auto"] = Field(
        8, description="Sequences per forward pass on one device; 'auto' lets Composer search (GPU only)."
    )
    seed: int = Field(17, description="Seed for init, data shuffling and dropout.")
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="Compile each decoder block with torch.compile (inductor). 'auto' compiles on GPUs, where it "
        "about doubles throughput, and not on CPU, where compiling costs more than it gains; if compiling fails "
        "there it trains eager (a warning, and the MLflow tag tessera.compile, say why). true compiles on CPU too, "
        "and a failure to compile stops the run (exit 78). Compiled kernels are cached across launches "
        "(trainers/compile.py).",
    )
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        "inductor",
        description="The torch.compile backend when compiling: 'aot_eager' traces the same graphs without generating "
        "kernels (to tell a compiler problem from a model one).",
    )
    precision: Literal["auto", "fp32", "amp_bf16"] = Field(
        "auto", description="'auto' is amp_bf16 on GPU and fp32 on CPU."
    )
    keep_checkpoints: PositiveInt | None = Field(None, description="Keep the last K checkpoints; null keeps all.")
    save_folder: str | None = Field(
        None,
        description="Where the run's checkpoints live. null: <work_dir>/runs/<run>/checkpoints. "
        "An s3://bucket/prefix URI keeps every complete checkpoint under <prefix>/<run>/ as well, and a launch "
        "whose local working copy lacks them (a new node, a wiped work_dir) resumes from there.",
    )
    init_optimizer_from: str | None = Field(
        None,
        description="Continued pretraining: a Composer checkpoint (path or s3:// URI) whose optimizer state seeds a "
        "fresh run, when its parameter shapes match the model; otherwise the optimizer starts fresh "
        "(the run says which).",
    )
    trust_checkpoints: bool = Field(
        False,
        description="Load checkpoints (resumes, init_optimizer_from) even when they need more than tensors and plain "
        "values to unpickle, which can run code they carry; the recipe's --trust-checkpoint. Off: such a file stops "
        "the run in one line naming it. Checkpoints tessera writes never need it.",
    )
    val_batches: int = Field(
        8,
        ge=0,
        description="Global batches of each source's held-out val split (data.sources[].val_fraction) scored "
        "at every checkpoint and logged as val/<source>/loss; 0 disables.",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and LR schedule.")
    stream_cache_limit: str | None = Field(
        None,
        pattern=r"^[0-9]+(kb|mb|gb|tb)?$",
        description="Bound on Streaming's local cache of remote (s3://) data, e.g. '200gb': shards read "
        "longest ago are evicted past it. The cache lives under $TESSERA_CACHE_DIR (the pod's cache volume "
        "on Kubernetes), else the temp dir. Null: unbounded. Never applied to local data, which is read in place. "
        "Streaming needs at least 4x the largest shard, and a shuffled stage needs the shards its shuffle block "
        "spans (about 4M samples per canonical node): below that it stalls waiting for space.",
    )
    data_canonical_nodes: PositiveInt = Field(
        1,
        description="Streaming num_canonical_nodes: fixes the global sample order independently of the "
        "process count, so a run resumed on a different number of ranks sees the same samples.",
    )
    parallelism: ParallelismConfig = Field(
        default_factory=lambda: ParallelismConfig(), description="FSDP settings for multi-GPU runs."
    )
    loss_guard: LossGuardConfig = Field(
        default_factory=lambda: LossGuardConfig(), description="NaN / loss-spike detection and rollback."
    )
    watchdog: WatchdogConfig = Field(
        default_factory=lambda: WatchdogConfig(),
        description="Hang detection: how long each phase may go without progress before the group is relaunched.",
    )
    stages: list[StageConfig] = Field(..., min_length=1, description="Curriculum stages, trained in order.")

    @field_validator("save_folder")
    @classmethod
    def _save_folder_scheme(cls, folder: str | None) -> str | None:
        if folder is not None and "://" in folder and not folder.startswith("s3://"):
            raise ValueError(f"{folder}: only local paths and s3:// URIs are supported")
        if folder is not None and folder.startswith("s3://") and not folder[len("s3://") :].strip("/"):
            raise ValueError(f"{folder}: names no bucket")
        return folder

    @model_validator(mode="after")
    def _unique_stage_names(self) -> TrainConfig:
        names = [s.name for s in self.stages]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"stage names must be unique, repeated: {', '.join(dupes)}")
        return self


class MlflowTarget(_Strict):
    """Where the trainer logs metrics: an existing MLflow run, created by the flow."""

    tracking_uri: str = Field(..., description="MLflow tracking URI.")
    run_id: str = Field(..., description="The run to log into.")


def stage_bounds(train: TrainConfig) -> list[tuple[int, int]]:
    """[start, end) token range of each stage, counted from the start of the run."""
    bounds, start = [], 0
    for stage in train.stages:
        bounds.append((start, start + stage.tokens))
        start += stage.tokens
    return bounds


def batch_alignment_error(train: TrainConfig, seq_len: int, every: int) -> tuple[tuple, str] | None:
    """The first token count that whole steps cannot land on, as (recipe location, message); eval.every first.

    The one statement of the rule: the recipe's cross-check (tasks/recipe.py) and TrainJob both use it.
    A stage's step is its own global_batch_size x seq_len; eval.every is checked against the run's.
    """
    per_batch = train.global_batch_size * seq_len
    if every % per_batch:
        return ("eval", "every"), f"{every} is not a multiple of global_batch_size*seq_len ({per_batch})"
    for i, stage in enumerate(train.stages):
        per_step = (stage.global_batch_size or train.global_batch_size) * (stage.seq_len or seq_len)
        if stage.tokens % per_step:
            message = f"{stage.tokens} is not a multiple of global_batch_size*seq_len ({per_step})"
            return ("train", "stages", i, "tokens"), message
    return None

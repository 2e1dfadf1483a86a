"""The model: a Llama-style decoder built from `transformers`, plus its size presets and FLOPs.

Shapes use B = batch, T = sequence length, D = d_model, H = heads, Hkv = key/value heads,
F = SwiGLU hidden width, V = vocabulary size, L = layers.

Per block (pre-norm, no biases, as in Llama):
    x: (B, T, D)
    h = x + Attn(RMSNorm(x))      q: (B, H, T, D/H)  k, v: (B, Hkv, T, D/H), RoPE on q and k
    y = h + SwiGLU(RMSNorm(h))    gate, up: (B, T, F)  down: (B, T, D)
The head is a final RMSNorm and an (optionally tied) D -> V projection.

Why Llama and not GPT-2: RoPE needs no learned position table (so a stage may raise
seq_len), RMSNorm and SwiGLU are what current open models use, and `transformers` ships
an SDPA attention path that runs flash / memory-efficient kernels on GPU.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainers.config import ModelConfig
from trainers.exit_codes import FatalError
from trainers.format.checkpoints import SHARD_METADATA, DamagedCheckpoint, verify
from trainers.format.export import load_hf
from trainers.format.meta import empty_like_meta, parameters_on_meta
from trainers.format.model_dirs import hf_config, hf_folders, load_hf_causal_lm
from trainers.format.safe_load import UnsafeCheckpoint

log = logging.getLogger("tessera.train")

# Named sizes in the style of the GPT-3 paper's Table 2.1 (n_params counts every weight,
# with the GPT-NeoX vocabulary of ~50k and tied embeddings). Per-block weights are
# ~12*D^2 (4*D^2 attention + 3*D*F with F = 8/3*D), so n_params ~ 12*L*D^2 + V*D.
#
#   name    n_params   n_layers  d_model  n_heads  d_head  ffn_hidden
#   tiny      ~3.3M        2        64       4       16       192     (unit tests)
#   10m        ~30M        6       384       6       64      1024     (~10M non-embedding)
#   125m      ~124M       12       768      12       64      2048     (GPT-3 Small)
#   350m      ~355M       24      1024      16       64      2752     (GPT-3 Medium)
#   1b        ~1.3B       24      2048      16      128      5504     (GPT-3 XL)
#   7b        ~6.9B       32      4096      32      128     11008     (Llama-2 7B shape, untied)
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layers=2, d_model=64, n_heads=4),
    "10m": ModelConfig(n_layers=6, d_model=384, n_heads=6),
    "125m": ModelConfig(n_layers=12, d_model=768, n_heads=12),
    "350m": ModelConfig(n_layers=24, d_model=1024, n_heads=16),
    "1b": ModelConfig(n_layers=24, d_model=2048, n_heads=16),
    "7b": ModelConfig(n_layers=32, d_model=4096, n_heads=32, ffn_hidden=11008, tie_embeddings=False),
}


def llama_config(cfg: ModelConfig, vocab_size: int, max_seq_len: int, eos_token_id: int) -> LlamaConfig:
    """`vocab_size` is the tokenizer's; the model gets vocab_rows of it."""
    return LlamaConfig(
        vocab_size=cfg.vocab_rows(vocab_size),
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_width(),
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads or cfg.n_heads,
        max_position_embeddings=max_seq_len,
        rope_theta=cfg.rope_theta,
        initializer_range=cfg.init_std,
        attention_dropout=cfg.attention_dropout,
        tie_word_embeddings=cfg.tie_embeddings,
        # Packed data has no padding; EOS separates documents, so pad = eos is only a label for generate().
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        attention_bias=False,
        mlp_bias=False,
        # Training never reuses past keys; the cache only costs memory.
        use_cache=False,
        # SDPA dispatches to flash / mem-efficient kernels on GPU and stays exact in fp32 on CPU.
        attn_implementation="sdpa",
    )


def build_model(cfg: ModelConfig, vocab_size: int, max_seq_len: int, eos_token_id: int, seed: int) -> LlamaForCausalLM:
    """A freshly initialised decoder, identical on every rank, every relaunch and every number of ranks."""
    model = build_model_to_load(cfg, vocab_size, max_seq_len, eos_token_id)
    init_weights(model, cfg.init_std, seed)
    return model


def build_model_on_meta(cfg: ModelConfig, vocab_size: int, max_seq_len: int, eos_token_id: int) -> LlamaForCausalLM:
    """The decoder with every parameter on the meta device (no memory), for FSDP to shard before anything is
    allocated: each rank then allocates and fills only its own shards (init_weights, or a checkpoint)."""
    with parameters_on_meta():
        return LlamaForCausalLM(llama_config(cfg, vocab_size, max_seq_len, eos_token_id))


def build_model_to_load(cfg: ModelConfig, vocab_size: int, max_seq_len: int, eos_token_id: int) -> LlamaForCausalLM:
    """The decoder with uninitialised weights, for a launch that loads a checkpoint over them."""
    return empty_like_meta(build_model_on_meta(cfg, vocab_size, max_seq_len, eos_token_id))


def _param_seed(seed: int, name: str) -> int:
    """A generator seed per parameter name: stable across processes (unlike hash()), so a rank that holds one
    shard draws the same full tensor a single process draws."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def init_weights(model: torch.nn.Module, std: float, seed: int, source: dict[str, torch.Tensor] | None = None) -> None:
    """Fill every parameter: matrices N(0, std) and norm gains 1 (what LlamaForCausalLM's own init does), or
    `source[name]` (continued pretraining) when given.

    Each matrix is drawn whole on the CPU from its own generator, seeded by the run's seed and the parameter's
    name, then each process keeps the part it holds: a plain tensor keeps all of it, an FSDP2 shard (a DTensor)
    only its slice. So init is the same on 1 rank, under DDP and under FSDP2 at any rank count, and the peak is
    one parameter's full tensor, never the model's.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():  # tied weights are listed once
        name = name.replace("._checkpoint_wrapped_module", "")  # activation checkpointing's wrapper
        if source is not None:
            full = source[name].to(torch.float32)
        elif param.dim() < 2:
            full = torch.ones(param.shape)
        else:
            gen = torch.Generator().manual_seed(_param_seed(seed, name))
            full = torch.empty(param.shape).normal_(0.0, std, generator=gen)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the same full tensor, so each slices its own (no scatter)
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs per token: forward + backward = 3x forward, each matmul 2 FLOPs per MAC."""

    dense: int  # 6 * N, N = weights that take part in a matmul (the lm head counts, the lookup table does not)
    attention: int  # 6 * 2 * L * T * D for QK^T and AV (PaLM appendix B convention, no causal discount)

    @property
    def total(self) -> int:
        return self.dense + self.attention


def matmul_params(model: torch.nn.Module) -> int:
    """Weights that are multiplied per token. The input embedding is a gather, not a matmul, so it
    only counts when tied (then it is the lm head too); norms are elementwise and negligible."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    if head is not embed:
        total -= embed.numel()
    return total


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int) -> FlopsPerToken:
    """Analytic count, so it works for presets without building a 7B model on the meta device.

    `vocab_size` is the tokenizer's: the head's padded rows are work no token needs, so MFU does not count them."""
    d, L, f = cfg.d_model, cfg.n_layers, cfg.ffn_width()
    kv_dim = d // cfg.n_heads * (cfg.n_kv_heads or cfg.n_heads)
    per_block = d * d + 2 * d * kv_dim + d * d + 3 * d * f  # q, k, v, o, gate/up/down
    n = L * per_block + vocab_size * d  # + lm head
    return FlopsPerToken(dense=6 * n, attention=12 * L * seq_len * d)


def load_weights_from(
    model: LlamaForCausalLM, source_dir: str, *, trust: bool = False, vocab_size: int | None = None
) -> LlamaForCausalLM:
    """Continued pretraining: copy an HF model directory's weights into `model`, which was built from the recipe.

    Building from the recipe and copying (rather than adopting the directory's config) keeps one
    source of truth for the architecture; a directory that does not fit is refused by name.
    """
    model.load_state_dict(read_weights_from(model, source_dir, trust=trust, vocab_size=vocab_size), strict=True)
    return model


PADDED_KEYS = ("model.embed_tokens.weight", "lm_head.weight")  # the tensors with a row per vocabulary id


def read_weights_from(
    model: LlamaForCausalLM, source_dir: str, *, trust: bool = False, vocab_size: int | None = None
) -> dict[str, torch.Tensor]:
    """An HF model directory's weights by parameter name, after checking they fit `model` (which may be on the
    meta device: a sharded launch fills each rank's shards from them, trainers/sharding.py). A sharded
    checkpoint folder of another run is read the same way (its model tensors only); a registry version (an
    MLflow Model) through the HF folder its MLmodel names. Nothing in the folder runs unless `trust`
    (train.trust_checkpoints): a refusal is a FatalError naming the file.

    A source with exactly the tokenizer's `vocab_size` rows where `model` has padded rows (a model trained
    before vocabulary padding, or with model.vocab_multiple 1) is the same vocabulary: its rows are copied
    and the padding rows start at zero (they are never a target). Any other difference is refused."""
    from pathlib import Path

    source = None
    try:
        if (Path(source_dir) / SHARD_METADATA).is_file():  # a checkpoint of tessera's: as its manifest published
            checked = verify(source_dir)
            (log.info if checked.by_manifest else log.warning)("model.init_from: %s", checked.line)
            source, _ = load_hf(source_dir, trust=trust)
            theirs = source.config
        else:
            folders = hf_folders(source_dir)
            source_dir = str(folders.model)
            theirs = hf_config(folders.model, trust=trust)
    except (UnsafeCheckpoint, DamagedCheckpoint) as exc:
        raise FatalError(f"model.init_from: {exc}") from None
    ours = model.config
    pad_from = None
    if vocab_size is not None and theirs.vocab_size == vocab_size < ours.vocab_size:
        pad_from = vocab_size
    elif theirs.vocab_size != ours.vocab_size:
        raise FatalError(
            f"model.init_from: {source_dir} has {theirs.vocab_size} vocabulary rows but the recipe builds "
            f"{ours.vocab_size}"
            + (f" (its tokenizer's {vocab_size} ids padded by model.vocab_multiple)" if vocab_size else "")
        )
    for field, name in [
        ("num_hidden_layers", "n_layers"),
        ("hidden_size", "d_model"),
        ("num_attention_heads", "n_heads"),
        ("num_key_value_heads", "n_kv_heads"),
        ("intermediate_size", "ffn_hidden"),
        ("tie_word_embeddings", "tie_embeddings"),
    ]:
        if getattr(theirs, field, None) != getattr(ours, field):
            raise FatalError(
                f"model.init_from: {source_dir} has {field}={getattr(theirs, field, None)!r} but the recipe "
                f"builds {name}={getattr(ours, field)!r}"
            )
    if source is None:
        try:
            source = load_hf_causal_lm(folders.model, trust=trust, torch_dtype=torch.float32)
        except UnsafeCheckpoint as exc:
            raise FatalError(f"model.init_from: {exc}") from None
    weights = source.state_dict()
    if pad_from is not None:
        for key in PADDED_KEYS:
            if key in weights:
                rows = weights[key]
                weights[key] = torch.cat([rows, rows.new_zeros(ours.vocab_size - pad_from, *rows.shape[1:])])
    return weights

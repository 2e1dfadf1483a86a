"""What the prepare stage hands to training: the tokenizer and one MDS dataset per source."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from tasks.data.tokenizer import TokenizerInfo


class PreparedSource(BaseModel):
    """One prepared source: its train split (and optional validation split) as MDS."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(..., description="Source name from the recipe.")
    path: str = Field(..., description="Train-split MDS directory (index.json); samples are {'tokens': seq_len ids}.")
    val_path: str | None = Field(None, description="Validation-split MDS directory, when val_fraction > 0.")
    root: str = Field(..., description="The <data_root>/<source>-<hash> directory holding both splits.")
    hash: str = Field(..., description="Content hash in the directory name.")
    documents: int = Field(..., description="Documents in the train split.")
    tokens: int = Field(..., description="Tokens stored in the train split (samples x seq_len).")
    samples: int = Field(..., description="Train samples of seq_len tokens.")
    val_documents: int = Field(0, description="Documents in the validation split.")
    val_tokens: int = Field(0, description="Tokens stored in the validation split.")
    skipped: int = Field(0, description="Bad inputs skipped under on_error: skip (see provenance for reasons).")
    truncated: int = Field(0, description="Documents cut by max_doc_chars/truncate_long or max_tokens.")
    dtype: str = Field(..., description="Token dtype in the shards (uint16 or uint32).")
    cached: bool = Field(False, description="True when the output already existed and no work was done.")
    warnings: list[str] = Field(
        default_factory=list,
        description="Surprises worth a look, e.g. a file the separator never split; also in provenance.json.",
    )


class PreparedData(BaseModel):
    """The prepare stage's result."""

    model_config = ConfigDict(frozen=True)

    tokenizer: TokenizerInfo
    seq_len: int = Field(..., description="Tokens per sample in every source.")
    sources: dict[str, PreparedSource] = Field(..., description="Prepared sources by name, in recipe order.")


def summarize(prepared: PreparedData) -> str:
    """A plain-text table for the CLI."""
    rows = [("source", "documents", "tokens", "val tokens", "skipped", "state", "path")]
    for s in prepared.sources.values():
        rows.append(
            (
                s.name,
                f"{s.documents:,}",
                f"{s.tokens:,}",
                f"{s.val_tokens:,}",
                f"{s.skipped:,}",
                "cached" if s.cached else "written",
                s.root,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines += [f"warning: {w}" for s in prepared.sources.values() for w in s.warnings]
    lines.append(
        f"tokenizer: {prepared.tokenizer.hf_dir} (vocab {prepared.tokenizer.vocab_size}, "
        f"eos {prepared.tokenizer.eos_token_id}, {prepared.tokenizer.dtype}), seq_len {prepared.seq_len}"
    )
    return "\n".join(lines)


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

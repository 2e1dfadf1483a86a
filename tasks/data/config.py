"""The `data` section of a recipe: the tokenizer, the packing length and the sources.

A source is a discriminated union on `kind` (text | jsonl | parquet | hf). `kind` may be left
out of a recipe, in which case the source is a `text` source (the walking-skeleton form
`{name, paths, separator}`).
"""

from __future__ import annotations

import string
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, field_validator, model_validator

# About 1 MB of text, ~250k tokens: far above a paragraph, a web page or an article, and small
# enough that every tokenizer process together stays well inside the prepare stage's 2 GB budget.
DEFAULT_MAX_DOC_CHARS = 1_000_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainTokenizer(_Strict):
    """Train a byte-level BPE with `tokenizers` on a deterministic sample of the sources."""

    vocab_size: PositiveInt = Field(8192, ge=260, description="Target vocabulary size, special tokens included.")
    min_frequency: PositiveInt = Field(2, description="A pair must occur this often to be merged.")
    special_tokens: list[str] = Field(
        default_factory=lambda: ["<|endoftext|>"],
        description="Special tokens given the first ids, in this order; must include eos_token (and bos_token).",
    )
    sample_documents: PositiveInt = Field(
        20_000, description="At most this many documents from the start of each source are used for training."
    )
    sample_chars: PositiveInt = Field(
        20_000_000, description="At most this many characters from the start of each source are used for training."
    )


class TokenizerConfig(_Strict):
    """A pretrained tokenizer (`path`) or one trained on the sources (`train`); exactly one of the two."""

    path: str | None = Field(None, description="tokenizer.json path or HF tokenizer directory.")
    train: TrainTokenizer | None = Field(None, description="Train a byte-level BPE instead of loading one.")
    eos_token: str = Field("<|endoftext|>", description="Token appended after every document.")
    bos_token: str | None = Field(None, description="Token put before every document; none when null.")

    @model_validator(mode="after")
    def _one_source(self) -> TokenizerConfig:
        if (self.path is None) == (self.train is None):
            raise ValueError("tokenizer: give exactly one of `path` or `train`")
        if self.train is not None:
            for tok in filter(None, (self.eos_token, self.bos_token)):
                if tok not in self.train.special_tokens:
                    raise ValueError(f"tokenizer.train.special_tokens must include {tok!r}")
        return self


class _SourceBase(_Strict):
    """Options every source kind shares: naming, filtering, caps, the split and error policy."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Source name, used in mixtures and paths.")
    min_chars: NonNegativeInt = Field(0, description="Drop documents shorter than this many characters.")
    max_doc_chars: PositiveInt | None = Field(
        DEFAULT_MAX_DOC_CHARS,
        description="A document longer than this many characters is an error (skipped under on_error: skip). "
        "It also bounds memory: text and JSONL readers never hold much more of one document, and tokenizing "
        "one costs about 170 bytes per character per worker. null removes the limit, and the bound with it.",
    )
    truncate_long: bool = Field(
        False, description="Cut documents longer than max_doc_chars to that length instead of failing or skipping."
    )
    max_documents: PositiveInt | None = Field(None, description="Stop after this many kept documents.")
    max_tokens: PositiveInt | None = Field(
        None, description="Stop after this many tokens (EOS included); the document that crosses it is truncated."
    )
    val_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of documents held out (by a hash of their text) for validation."
    )
    on_error: Literal["fail", "skip"] = Field(
        "fail", description="fail: stop at the first bad input with a one-line error; skip: count it and go on."
    )


class _Fields(_Strict):
    """Choosing the document text from a record: one field, or a template over several."""

    text_field: str = Field("text", description="Record field that holds the document text.")
    template: str | None = Field(
        None, description='Python format string over record fields, e.g. "{question}\\n{answer}"; overrides text_field.'
    )

    @field_validator("template")
    @classmethod
    def _template_names_fields(cls, v: str | None) -> str | None:
        if v is not None:
            names = [f for _, f, _, _ in string.Formatter().parse(v) if f is not None]
            if not names or any(not n or not n.isidentifier() for n in names):
                raise ValueError("template must name fields like {question}; positional {} is not allowed")
        return v


class TextSource(_SourceBase):
    """Local or s3:// text files; each file is one document unless `separator` splits it."""

    kind: Literal["text"] = Field("text", description="Source kind.")
    paths: list[str] = Field(..., min_length=1, description="Files, glob patterns or s3:// prefixes/globs.")
    separator: str | None = Field(None, description="Split each file into documents on this string.")

    @field_validator("separator")
    @classmethod
    def _non_empty(cls, v: str | None) -> str | None:
        if v == "":
            raise ValueError("separator must be non-empty (use null for whole-file documents)")
        return v


class JsonlSource(_Fields, _SourceBase):
    """JSON Lines files (local or s3://): one record per line."""

    kind: Literal["jsonl"] = Field(..., description="Source kind.")
    paths: list[str] = Field(..., min_length=1, description="Files, glob patterns or s3:// prefixes/globs.")


class ParquetSource(_Fields, _SourceBase):
    """Parquet files (local or s3://): one record per row."""

    kind: Literal["parquet"] = Field(..., description="Source kind.")
    paths: list[str] = Field(..., min_length=1, description="Files, glob patterns or s3:// prefixes/globs.")


class HFSource(_Fields, _SourceBase):
    """Any Hugging Face `datasets` source, read with `datasets.load_dataset`."""

    kind: Literal["hf"] = Field(..., description="Source kind.")
    path: str = Field(
        ..., description='load_dataset path: a builder ("json", "parquet", "text"), a folder or a hub id.'
    )
    config: str | None = Field(None, description="Dataset configuration name (load_dataset's `name`).")
    split: str = Field("train", description="Split to read.")
    data_files: list[str] | None = Field(
        None, description="Data files or globs for the split (load_dataset's data_files)."
    )
    revision: str | None = Field(None, description="Hub revision; pin it so the output hash is meaningful.")
    streaming: bool = Field(False, description="Iterate with streaming=True instead of building the Arrow cache.")


SourceConfig = Annotated[TextSource | JsonlSource | ParquetSource | HFSource, Field(discriminator="kind")]


class DataConfig(_Strict):
    """Where prepared data goes and how it is tokenized and packed."""

    root: str = Field(
        ".tessera/data",
        description="Prepared MDS datasets go under <root>/<source>-<hash>: a local directory or an s3://bucket/prefix "
        "(prepared in local_cache, then uploaded; training streams it from the bucket).",
    )
    local_cache: str | None = Field(
        None,
        description="Working copy of an s3:// root where outputs (and the tokenizer) are prepared before upload; "
        "null: ~/.cache/tessera/data/<bucket>/<prefix>. Unused for a local root.",
    )
    seq_len: PositiveInt = Field(..., description="Tokens per packed training sample.")
    tokenizer: TokenizerConfig = Field(..., description="The tokenizer: a pretrained one, or trained on the sources.")
    sources: list[SourceConfig] = Field(..., min_length=1, description="The sources to prepare.")
    workers: PositiveInt | None = Field(None, description="Tokenizer processes; null uses every CPU core.")
    compression: Literal["zstd"] | None = Field(None, description="MDS shard compression.")
    hashes: list[Literal["sha1", "xxh64", "xxh3_64"]] = Field(
        default_factory=lambda: ["xxh64"], description="Per-shard hashes recorded in index.json."
    )
    shard_size: PositiveInt = Field(1 << 26, description="Bytes per MDS shard before a new one starts.")
    chunk_bytes: PositiveInt = Field(
        8 << 20, description="Large text/JSONL files are cut into chunks of about this size to tokenize in parallel."
    )
    partition_bytes: PositiveInt = Field(
        1 << 30,
        description="A source's chunks are grouped into partitions of about this many bytes of input, each packed, "
        "written and marked done on its own: what a killed prepare keeps, and what one index of the prepare Job "
        "writes on Kubernetes. Decided by the data alone, never by the cores or pods. Each partition drops its last "
        "fewer-than-seq_len tokens per split (docs/recipes.md).",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_kind_text(cls, data: object) -> object:
        # The skeleton recipe form {name, paths, separator} predates `kind`; keep it meaning text.
        if isinstance(data, dict) and isinstance(data.get("sources"), list):
            data = {
                **data,
                "sources": [
                    {**s, "kind": "text"} if isinstance(s, dict) and "kind" not in s else s for s in data["sources"]
                ],
            }
        return data

    @property
    def local_root(self) -> str:
        """Where outputs are written on this machine: the root itself, or the working copy of an s3:// root."""
        if not self.root.startswith("s3://"):
            return self.root
        if self.local_cache:
            return self.local_cache
        from tasks.data.remote_root import default_cache

        return default_cache(self.root)

    @field_validator("root")
    @classmethod
    def _root_scheme(cls, root: str) -> str:
        if "://" in root and not root.startswith("s3://"):
            raise ValueError(f"{root}: only local directories and s3:// URIs are supported")
        if root.startswith("s3://") and not root[len("s3://") :].strip("/"):
            raise ValueError(f"{root}: names no bucket")
        return root

    @model_validator(mode="after")
    def _unique_names(self) -> DataConfig:
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"source names must be unique: {dupes}")
        return self

"""Load or train the tokenizer and save it, with the data, as a directory `AutoTokenizer` loads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

from tasks.data import claim, outputs, storage
from tasks.data.config import SourceConfig, TokenizerConfig
from tasks.data.errors import DataError


class TokenizerInfo(BaseModel):
    """The tokenizer every source was tokenized with."""

    model_config = ConfigDict(frozen=True)

    hf_dir: str = Field(..., description="Directory with tokenizer.json + tokenizer_config.json.")
    vocab_size: int = Field(..., description="Ids in the vocabulary, added tokens included.")
    eos_token_id: int = Field(..., description="Id appended after every document.")
    bos_token_id: int | None = Field(None, description="Id put before every document, if any.")
    dtype: str = Field(..., description="Token dtype in MDS: uint16 when the vocabulary fits, else uint32.")
    fingerprint: str = Field(..., description="Hash of the tokenizer and the EOS/BOS policy; part of every data hash.")
    trained: bool = Field(False, description="Trained on the sources by this stage.")
    uri: str | None = Field(None, description="The copy published under an s3:// data root, which training pods load.")

    @property
    def tokenizer_json(self) -> str:
        return os.path.join(self.hf_dir, "tokenizer.json")


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _file_digest(paths: list[str]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(os.path.basename(p).encode())
        with open(p, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _pretrained_files(path: str) -> list[str]:
    if not os.path.exists(path):
        raise DataError(path, "tokenizer not found" + storage.relative_note(path))
    if os.path.isdir(path):
        return [os.path.join(path, f) for f in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, f))]
    return [path]


def _check_specials(vocab: dict, cfg: TokenizerConfig) -> None:
    # transformers would silently add an unknown eos/bos as a new token; refuse instead.
    for field, token in (("eos_token", cfg.eos_token), ("bos_token", cfg.bos_token)):
        if token is not None and token not in vocab:
            raise DataError(f"tokenizer.{field}={token!r}", "not in the tokenizer's vocabulary")


def _hf_config(cfg: TokenizerConfig, base: dict | None = None) -> dict:
    conf = dict(base or {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False})
    conf["eos_token"] = cfg.eos_token
    if cfg.bos_token is not None:
        conf["bos_token"] = cfg.bos_token
    conf.pop("tokenizer_file", None)  # an absolute path from elsewhere would shadow the copy
    return conf


def _save(tok, conf: dict, dest: str, extra_files: list[str] = ()) -> None:
    """tokenizer.json + tokenizer_config.json: all AutoTokenizer needs, written without transformers."""
    for f in extra_files:
        shutil.copy2(f, os.path.join(dest, os.path.basename(f)))
    tok.save(os.path.join(dest, "tokenizer.json"))
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f, indent=2)


def _write_pretrained(cfg: TokenizerConfig, dest: str) -> None:
    from tokenizers import Tokenizer

    path = cfg.path
    tok_json = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if os.path.isdir(path) and not os.path.isfile(tok_json):
        _write_converted(cfg, dest)  # a slow-only tokenizer: let transformers convert it
        return
    try:
        tok = Tokenizer.from_file(tok_json)
    except Exception as exc:
        raise DataError(tok_json, f"cannot load tokenizer ({type(exc).__name__}: {exc})") from exc
    _check_specials(tok.get_vocab(with_added_tokens=True), cfg)
    base, extras = None, []
    if os.path.isdir(path):
        conf_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(conf_path):
            with open(conf_path) as f:
                base = json.load(f)
        extras = [os.path.join(path, f) for f in ("special_tokens_map.json",) if os.path.isfile(os.path.join(path, f))]
    _save(tok, _hf_config(cfg, base), dest, extras)


def _write_converted(cfg: TokenizerConfig, dest: str) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(cfg.path, use_fast=True, local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        raise DataError(cfg.path, f"cannot load tokenizer ({type(exc).__name__}: {exc})") from exc
    _check_specials(tok.get_vocab(), cfg)
    tok.eos_token = cfg.eos_token
    if cfg.bos_token is not None:
        tok.bos_token = cfg.bos_token
    tok.save_pretrained(dest)


def _sample(sources: list[SourceConfig], cfg: TokenizerConfig, chunk_bytes: int) -> Iterator[str]:
    """The first documents of each source in recipe order: deterministic and bounded."""
    from tasks.data import readers
    from tasks.data.tally import Tally
    from tasks.data.units import plan_units

    spec = cfg.train
    for src in sources:
        refs = [] if src.kind == "hf" else storage.expand(src.paths)
        tally = Tally(src.on_error)
        docs = chars = 0
        for unit in plan_units(src, refs, chunk_bytes, tally):
            for text in readers.documents(src, unit, tally):
                yield text
                docs += 1
                chars += len(text)
                if docs >= spec.sample_documents or chars >= spec.sample_chars:
                    break
            else:
                continue
            break


def _train(cfg: TokenizerConfig, sources: list[SourceConfig], chunk_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = cfg.train
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=spec.min_frequency,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_sample(sources, cfg, chunk_bytes), trainer=trainer)
    return tok


def _training_key(cfg: TokenizerConfig, sources: list[SourceConfig], chunk_bytes: int) -> str:
    from tasks.data import hashing

    inputs = [{"source": s.model_dump(mode="json"), "files": hashing.fingerprints(s)} for s in sources]
    return hashing.digest(
        {
            "train": cfg.model_dump(mode="json"),
            "inputs": inputs,
            "chunk_bytes": chunk_bytes,
            "code": hashing.CODE_VERSION,
        }
    )


def output_dir(cfg: TokenizerConfig, root: str, sources: list[SourceConfig], chunk_bytes: int) -> str:
    """<root>/tokenizer-<hash>: the hash covers the tokenizer files (or the training spec and its
    inputs) and the EOS/BOS tokens."""
    from tasks.data import hashing

    if cfg.train is not None:
        key = _training_key(cfg, sources, chunk_bytes)
    else:
        key = hashing.digest(
            {
                "files": _file_digest(_pretrained_files(cfg.path)),
                "eos": cfg.eos_token,
                "bos": cfg.bos_token,
                "code": hashing.CODE_VERSION,
            }
        )
    return os.path.join(root, f"tokenizer-{key}")


def resolve(cfg: TokenizerConfig, root: str, sources: list[SourceConfig], chunk_bytes: int) -> TokenizerInfo:
    """Load or train the tokenizer, saved under <root>/tokenizer-<hash>; reused when already there."""
    out = output_dir(cfg, root, sources, chunk_bytes)
    key = os.path.basename(out).removeprefix("tokenizer-")
    if not outputs.is_done(out):
        outputs.ensure_root(root)
        with outputs.permanent_errors("cannot write the tokenizer"), claim.hold(out) as held:
            if not outputs.is_done(out):  # else a concurrent run wrote it while we waited
                trained = _train(cfg, sources, chunk_bytes) if cfg.train is not None else None
                with outputs.staging(out, held) as tmp:
                    if trained is not None:
                        _save(trained, _hf_config(cfg), tmp)
                    else:
                        _write_pretrained(cfg, tmp)
                    _info(tmp, cfg, key, trained=cfg.train is not None)  # fail before publishing a bad EOS
    return _info(out, cfg, key, trained=cfg.train is not None)


def _info(hf_dir: str, cfg: TokenizerConfig, key: str, trained: bool) -> TokenizerInfo:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    eos = tok.token_to_id(cfg.eos_token)
    if eos is None:
        raise DataError(f"tokenizer.eos_token={cfg.eos_token!r}", "not in the tokenizer's vocabulary")
    bos = None
    if cfg.bos_token is not None:
        bos = tok.token_to_id(cfg.bos_token)
        if bos is None:
            raise DataError(f"tokenizer.bos_token={cfg.bos_token!r}", "not in the tokenizer's vocabulary")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return TokenizerInfo(
        hf_dir=os.path.abspath(hf_dir),
        vocab_size=vocab,
        eos_token_id=eos,
        bos_token_id=bos,
        dtype=token_dtype(vocab),
        fingerprint=key,
        trained=trained,
    )


def peek(cfg: TokenizerConfig) -> TokenizerInfo | None:
    """The ids a pretrained tokenizer gives (vocabulary, EOS, BOS), read without preparing or publishing anything;
    None for one trained on the sources, whose ids exist only once the prepare stage has trained it."""
    import tempfile

    if cfg.train is not None:
        return None
    with tempfile.TemporaryDirectory(prefix="tessera-tokenizer-") as tmp:
        _write_pretrained(cfg, tmp)
        info = _info(tmp, cfg, "", trained=False)
    return info.model_copy(update={"hf_dir": cfg.path})


__all__ = ["TokenizerInfo", "peek", "resolve", "token_dtype"]

"""Turn a Composer checkpoint into a plain Hugging Face model directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

from trainers.format import safe_load
from trainers.format.meta import parameters_on_meta
from trainers.format.sharded import MODEL_PREFIX, load_hf_sharded, model_class, tensor_keys


def load_hf(ckpt_path: str | Path, *, trust: bool = False):
    """(model, tokenizer) from one Composer HuggingFaceModel checkpoint, a file or a sharded folder; tokenizer
    is None if none was embedded.

    The file is read by the weights-only unpickler (trainers/format/safe_load.py): one that needs more
    raises UnsafeCheckpoint, naming it, unless `trust`.

    Reads the file once. (HuggingFaceModel.hf_from_composer_checkpoint copies the file first and
    unpacks the tokenizer into the current directory, so its two helpers are called directly.)
    The file is memory-mapped: only the model's tensors are read, never the optimizer's moments,
    which are twice the model again (bench/eval_memory.py measures it).
    """
    from composer.models import HuggingFaceModel

    if Path(ckpt_path).is_dir():  # sharded: every rank's shard of the weights, read into one model
        return load_hf_sharded(ckpt_path, trust=trust)
    checkpoint = safe_load.load(ckpt_path, trust=trust, mmap=True)
    hf_state = checkpoint["state"]["integrations"]["huggingface"]
    tokenizer = None
    if hf_state.get("tokenizer"):  # absent when consolidated from a sharded checkpoint saved without one
        with tempfile.TemporaryDirectory(prefix="tessera-tok-") as tmp:
            tokenizer = HuggingFaceModel.load_huggingface_tokenizer_from_saved_state(hf_state, tokenizer_save_dir=tmp)
    # The class named in the embedded HF config, its parameters on the meta device: no init, no memory.
    with parameters_on_meta():  # (a file saved under FSDP2 names fully_shard's class: model_class maps it back)
        model = HuggingFaceModel.load_huggingface_model_from_saved_state(
            hf_state, checkpoint, model_class(hf_state), {}
        )
    # Composer keys the wrapped module as `model.<hf key>`. assign=True makes the memory-mapped tensors
    # the parameters themselves, so the weights are in memory once (as file pages), not copied.
    weights = {k.removeprefix("model."): v for k, v in checkpoint["state"]["model"].items()}
    model.load_state_dict(weights, strict=True, assign=True)
    model.tie_weights()  # assign gave the two tied names two tensors (over one storage): one Parameter again
    return model.eval(), tokenizer


def embedding_rows(ckpt_path: str | Path, *, trust: bool = False) -> int:
    """Rows of the input embedding a Composer checkpoint (file or sharded folder) holds, read from its index or
    its pickle alone (the file is memory-mapped: no tensor's bytes are read)."""
    if Path(ckpt_path).is_dir():
        shapes = tensor_keys(ckpt_path, MODEL_PREFIX, trust=trust)
    else:
        model = safe_load.load(ckpt_path, trust=trust, mmap=True)["state"]["model"]
        shapes = {key: tuple(value.shape) for key, value in model.items()}
    key = next(k for k in shapes if k.endswith("embed_tokens.weight"))
    return int(shapes[key][0])


def never_emit_padding(model, tokenizer) -> None:
    """A model with more vocabulary rows than its tokenizer has ids (ModelConfig.vocab_rows) never generates
    a padded id: `generate` suppresses them, in this process and wherever the saved model is loaded (the
    generation config travels with it: pyfunc, `mlflow.transformers`, a plain `from_pretrained`)."""
    rows, ids = model.get_input_embeddings().weight.shape[0], len(tokenizer)
    if rows > ids:
        model.generation_config.suppress_tokens = list(range(ids, rows))


def export_hf(ckpt_path: str | Path, out_dir: str | Path, *, trust: bool = False) -> Path:
    """Write config.json + model.safetensors (+ the tokenizer files) for `ckpt_path` into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_hf(ckpt_path, trust=trust)
    if tokenizer is not None:
        never_emit_padding(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out

"""Reading a sharded checkpoint folder (torch.distributed.checkpoint, written by FSDP2 ranks) in one process.

Evaluation, export, registration, `model.init_from` and `train.init_optimizer_from` read a checkpoint
without a process group and without the ranks that wrote it. DCP reads any subset of keys and reshards as
it reads: here every tensor is read whole into a plain (unsharded) tensor, the model's tensors into a model
built on the meta device and allocated once, so the peak is about one copy of the model. The optimizer's
moments (twice the model again) are read only when asked for.
"""

from __future__ import annotations

from pathlib import Path

from trainers.format.meta import empty_like_meta, parameters_on_meta
from trainers.format.safe_load import UnsafeCheckpoint, guard_sharded_index, refusal

MODEL_PREFIX = "state.model."  # Composer's state dict: state.model.<HuggingFaceModel key>, i.e. model.<hf key>
OPTIMIZER_PREFIX = "state.optimizers."


def _open(path: str | Path, trust: bool):
    """(the folder's reader, its index): the index is read here first, so a refused one raises UnsafeCheckpoint
    naming the folder (inside DCP's own calls it would come wrapped in a CheckpointException per rank)."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    if not trust:
        guard_sharded_index()
    reader = FileSystemReader(str(path))
    try:
        return reader, reader.read_metadata()
    except pickle.UnpicklingError as exc:
        if "weights only" not in str(exc).lower():
            raise
        raise UnsafeCheckpoint(refusal(path, exc)) from None


def cut_short(path: str | Path) -> str | None:
    """What is missing from a sharded folder that has no manifest, or None if every byte its index names is
    there. DCP writes `.metadata` after the shards, but a kill can still cut a shard short afterwards (a
    copy, a disk that fills): each extent the index records must lie inside its file. DCP keeps no
    checksums, so this catches loss, not bit rot; a published folder is verified by its manifest's hashes."""
    import pickle

    try:
        _, metadata = _open(path, trust=False)
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        return f"unreadable index ({type(exc).__name__}: {exc})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        try:
            size = (Path(path) / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size < end:
            return f"{name} has {size} bytes, its index needs {end}"
    return None


def tensor_keys(path: str | Path, prefix: str, *, trust: bool = False) -> dict[str, tuple]:
    """{key without `prefix`: shape} of the tensors stored under `prefix`, from the folder's index."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _, metadata = _open(path, trust)
    return {
        key[len(prefix) :]: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def read_values(path: str | Path, key: str, *, trust: bool = False) -> dict:
    """The non-tensor values stored under `key` (e.g. `state.integrations`), as the nested dict Composer saved."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    loaded = _load_state_dict_from_keys(keys={key}, storage_reader=_open(path, trust)[0])
    for part in key.split("."):
        loaded = loaded[part]
    return loaded


def read_into(path: str | Path, tensors: dict, prefix: str, *, trust: bool = False) -> None:
    """Fill `tensors` ({key without prefix: allocated tensor}) from the folder, in place, resharding as needed
    (DCP names nested state by dotted keys, so flat keys address it directly)."""
    import torch.distributed.checkpoint as dcp

    dcp.load({prefix + key: t for key, t in tensors.items()}, storage_reader=_open(path, trust)[0], no_dist=True)


def read_tensors(path: str | Path, prefix: str, *, trust: bool = False) -> dict:
    """Every tensor stored under `prefix`, read whole into a new CPU tensor, by its key without the prefix."""
    import torch

    tensors = {key: torch.empty(shape) for key, shape in tensor_keys(path, prefix, trust=trust).items()}
    read_into(path, tensors, prefix, trust=trust)
    return tensors


def model_class(hf_state: dict):
    """The transformers class of the saved model. Under FSDP2 Composer records the class fully_shard made
    (`torch...FSDPLlamaForCausalLM`, which cannot be imported): its transformers base has the same name
    without the prefix."""
    import transformers

    name = hf_state["model"]["config"]["class"].rsplit(".", 1)[-1]
    if name.startswith("FSDP") and hasattr(transformers, name[len("FSDP") :]):
        return getattr(transformers, name[len("FSDP") :])
    return None  # an importable class: Composer imports it by its recorded name


def load_hf_sharded(path: str | Path, *, trust: bool = False):
    """(model, tokenizer) from a sharded Composer HuggingFaceModel checkpoint folder; the model's weights only."""
    import tempfile

    from composer.models import HuggingFaceModel

    hf_state = read_values(path, "state.integrations", trust=trust)["huggingface"]
    tokenizer = None
    if hf_state.get("tokenizer"):  # DCP stores no key for an empty dict: a checkpoint saved without one
        with tempfile.TemporaryDirectory(prefix="tessera-tok-") as tmp:
            tokenizer = HuggingFaceModel.load_huggingface_tokenizer_from_saved_state(hf_state, tokenizer_save_dir=tmp)
    with parameters_on_meta():
        saved = {"state": {"integrations": {"huggingface": hf_state}}}  # where Composer looks for the config
        model = HuggingFaceModel.load_huggingface_model_from_saved_state(hf_state, saved, model_class(hf_state), {})
    model = empty_like_meta(model)  # one allocation: the tensors are read straight into it
    state = model.state_dict()  # tied weights: two names over one tensor, filled twice with the same values
    stored = tensor_keys(path, MODEL_PREFIX + "model.", trust=trust)
    if set(stored) != set(state):
        raise ValueError(
            f"{path}: its model tensors do not match the model its config builds "
            f"(missing {sorted(set(state) - set(stored))[:3]}, unexpected {sorted(set(stored) - set(state))[:3]})"
        )
    read_into(path, state, MODEL_PREFIX + "model.", trust=trust)
    model.tie_weights()
    return model.eval(), tokenizer

"""Turning what `tessera eval --model M` names into a transformers model and tokenizer.

M is a Composer checkpoint (.pt written through composer's HuggingFaceModel, HF config and
tokenizer embedded, or a sharded checkpoint's folder), an HF model directory, or an MLflow model
URI (`models:/name@alias`, `models:/name/3`) whose artifact is an HF model directory.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evaluation.errors import GauntletError
from trainers.format.checkpoints import Checked, DamagedCheckpoint, verify
from trainers.format.mlflow_model import download_model
from trainers.format.model_dirs import is_mlflow_model

_SEQ_LEN_ATTRS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    max_seq_len: int
    source: str


def model_max_seq_len(model: Any, default: int = 2048) -> int:
    cfg = getattr(model, "config", None)
    for attr in _SEQ_LEN_ATTRS:
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def _from_hf_folders(path: Path, source: str, trust: bool) -> LoadedModel:
    """An HF folder, or an MLflow Model of one, read by transformers with no code of the folder's run."""
    from trainers.format.model_dirs import hf_folders, load_hf_model
    from trainers.format.safe_load import UnsafeCheckpoint

    try:
        model, tokenizer = load_hf_model(hf_folders(path), trust=trust)
    except UnsafeCheckpoint as exc:
        raise GauntletError(str(exc)) from None
    return LoadedModel(model.eval(), tokenizer, model_max_seq_len(model), source)


def _from_composer(path: str, trust: bool, verified: bool) -> LoadedModel:
    from trainers.format.export import load_hf
    from trainers.format.safe_load import UnsafeCheckpoint

    if not verified:
        checked = check_checkpoint(path, None)
        if not checked.by_manifest:
            logging.getLogger("tessera.eval").warning("%s", checked.line)

    try:
        model, tokenizer = load_hf(path, trust=trust)
    except UnsafeCheckpoint as exc:
        raise GauntletError(str(exc)) from None
    except (KeyError, TypeError) as exc:
        raise GauntletError(f"{path}: not a Composer HuggingFaceModel checkpoint (no HF config inside)") from exc
    if tokenizer is None:
        raise GauntletError(f"{path}: checkpoint holds no tokenizer")
    return LoadedModel(model, tokenizer, model_max_seq_len(model), path)


def _hf_dir_under(root: Path) -> Path | None:
    if (root / "config.json").is_file():
        return root
    for config in sorted(root.rglob("config.json")):
        return config.parent
    return None


def _from_mlflow(uri: str, tracking_uri: str | None, trust: bool) -> LoadedModel:
    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not tracking_uri:
        raise GauntletError(f"{uri}: an MLflow model URI needs a tracking URI (--tracking-uri or MLFLOW_TRACKING_URI)")
    # The download lives only while the model loads: its weights end up in memory, and a kept folder would
    # leave a model-sized copy in /tmp on every `tessera eval`.
    with tempfile.TemporaryDirectory(prefix="tessera-eval-model-") as dest:
        try:
            local = download_model(uri, tracking_uri, dest)
        except ValueError as exc:
            raise GauntletError(str(exc)) from None
        except Exception as exc:  # MlflowException for unknown names, versions or aliases
            raise GauntletError(f"{uri}: cannot download from MLflow: {str(exc).splitlines()[0]}") from exc
        try:
            if is_mlflow_model(local):
                return _from_mlflow_model(Path(local), uri, trust)
            hf_dir = _hf_dir_under(Path(local))
            if hf_dir is None:
                raise GauntletError(f"{uri}: the model version's artifact holds no HF model directory (config.json)")
            return _from_hf_folders(hf_dir, uri, trust)
        except GauntletError as exc:
            if not local.startswith(dest):  # a version whose source is a local folder: named as it is
                raise
            # a refusal names the file by the URI a person gave, not by the download's temporary path
            raise GauntletError(str(exc).replace(str(Path(local)), uri)) from None


def _from_mlflow_model(path: Path, source: str, trust: bool) -> LoadedModel:
    """A model version registered as an MLflow Model (transformers flavor).

    Its weights and tokenizer are read from the folders its MLmodel names, by transformers: MLflow's own loader
    would put a `code` directory the flavor names first on sys.path. Only a trusted model that names code goes
    through MLflow's loader, which is what such a model expects."""
    from trainers.format.model_dirs import mlflow_code
    from trainers.format.safe_load import UnsafeCheckpoint

    try:
        code = mlflow_code(path)
    except UnsafeCheckpoint as exc:
        raise GauntletError(str(exc)) from None
    if not (trust and code):
        return _from_hf_folders(path, source, trust)
    import mlflow.transformers

    try:
        parts = mlflow.transformers.load_model(str(path), return_type="components")
    except Exception as exc:  # any flavor failure means this is not a model we can score
        raise GauntletError(f"{source}: cannot load the MLflow transformers model: {str(exc).splitlines()[0]}") from exc
    model = parts["model"].eval()
    return LoadedModel(model, parts["tokenizer"], model_max_seq_len(model), source)


def check_checkpoint(path: str, sha256: str | None, shown: str | None = None, files: list | None = None) -> Checked:
    """Refuse a Composer checkpoint that is not every byte the trainer published; returns how it was checked.

    torch.load checks nothing, so a flipped byte would be scored (and then registered). The format package's
    check (trainers/format/checkpoints.verify): the manifest's SHA-256 or file list, given or found beside the
    checkpoint, else its zip CRCs. `shown` names the file in the error when it was downloaded from elsewhere.
    """
    try:
        return verify(path, shown=shown, sha256=sha256, files=files)
    except DamagedCheckpoint as exc:
        raise GauntletError(f"{exc.name}: damaged checkpoint, not evaluated: {exc.why}") from None


def refuse_early(spec: str, *, trust: bool = False) -> None:
    """What `load_model` would refuse about `spec` that its own files tell, in one GauntletError line, before the
    command starts a Prefect server or the flow scores anything (seconds, where that took twenty): a missing path,
    a folder that is no model, a flavor or an `auto_map` that names code, a pickle (a Composer checkpoint, an HF
    `.bin`) that needs more than tensors. Pickles are read mapped, weights-only: the tensors' bytes are not read
    and nothing the file names runs. A registry URI (models:/, runs:/) needs the MLflow server: the flow checks it.
    Bytes that differ from a manifest are the load's to find (it hashes the file once, as it reads it)."""
    from trainers.format.model_dirs import hf_folders, refuse_custom_code
    from trainers.format.safe_load import UnsafeCheckpoint, load

    if spec.startswith(("models:/", "runs:/")) or trust:
        return
    path = Path(spec)
    try:
        if path.is_dir():
            if (path / ".metadata").is_file():  # a sharded Composer checkpoint: its index, as the load reads it
                from trainers.format.sharded import tensor_keys

                tensor_keys(path, "state.model.")
                return
            if not is_mlflow_model(path) and not (path / "config.json").is_file():
                raise GauntletError(f"{spec}: directory has no config.json; expected an HF model directory")
            folders = hf_folders(path)
            for folder in {folders.model, folders.tokenizer}:
                refuse_custom_code(folder)
            for weights in sorted(folders.model.glob("*.bin")):
                load(weights, mmap=True)
        elif path.is_file():
            load(path, mmap=True)
        else:
            raise GauntletError(f"{spec}: no such checkpoint file, HF model directory or MLflow model URI")
    except UnsafeCheckpoint as exc:
        raise GauntletError(str(exc)) from None


def load_model(
    spec: str, tracking_uri: str | None = None, *, trust: bool = False, verified: bool = False
) -> LoadedModel:
    """Load M for scoring; refused in one line when its head has fewer rows than its tokenizer has ids (see
    _load_model for the rest)."""
    from evaluation.runner import vocabulary_mismatch

    loaded = _load_model(spec, tracking_uri, trust=trust, verified=verified)
    why = vocabulary_mismatch(loaded.model, loaded.tokenizer)
    if why is not None:
        raise GauntletError(f"{spec}: {why}")
    return loaded


def _load_model(
    spec: str, tracking_uri: str | None = None, *, trust: bool = False, verified: bool = False
) -> LoadedModel:
    """Load M for scoring on CPU (or wherever the caller later moves it).

    Nothing M names runs code while it loads unless `trust` (--trust-checkpoint): a Composer checkpoint goes
    through the weights-only unpickler; HF directories and MLflow models through trainers/format/model_dirs.py,
    which refuses an MLflow `code` directory and an `auto_map`, and reads weights with transformers, safetensors
    or weights-only `.bin`. Each refusal is one GauntletError line naming the file. A Composer checkpoint is
    verified first (check_checkpoint, against the manifest beside it) unless the caller has (`verified`).
    """
    if spec.startswith("models:/") or spec.startswith("runs:/"):
        return _from_mlflow(spec, tracking_uri, trust)
    path = Path(spec)
    if path.is_dir():
        if is_mlflow_model(path):
            return _from_mlflow_model(path, spec, trust)
        if (path / ".metadata").is_file():  # a sharded Composer checkpoint (trainers/format/sharded.py)
            return _from_composer(spec, trust, verified)
        if not (path / "config.json").is_file():
            raise GauntletError(f"{spec}: directory has no config.json; expected an HF model directory")
        return _from_hf_folders(path, spec, trust)
    if path.is_file():
        return _from_composer(spec, trust, verified)
    raise GauntletError(f"{spec}: no such checkpoint file, HF model directory or MLflow model URI")

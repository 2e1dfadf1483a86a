"""Reading a model directory (a Hugging Face folder, or an MLflow Model of one) without running code it carries.

A folder is as dangerous as a pickle. Three ways it can run code while "only" loading weights:
- an MLflow Model whose flavor configuration names a `code` directory: `mlflow.transformers.load_model`
  puts that directory first on `sys.path`, so the next module this process imports for the first time
  (any of them, `huggingface_hub` included) comes from the folder;
- an HF `config.json` or `tokenizer_config.json` with an `auto_map`: the model's or tokenizer's class is
  a Python file in the folder, which transformers imports when `trust_remote_code` says yes, and asks
  about on stdin when it is left unset (a `y` piped into `tessera eval` runs it);
- a `pytorch_model.bin` whose pickle needs more than tensors: transformers loads it weights-only and
  fails with a long, unrelated "from_tf=True" error.

So every model tessera loads by a name a person or the registry gave goes through here: MLflow's `MLmodel`
is read as YAML and refused if it names code, and the weights and tokenizer are read from its folders by
transformers directly (MLflow's loader never runs); `trust_remote_code` is always passed, False unless the
caller was told `--trust-checkpoint`; an unreadable weights file is one line naming it. Each refusal is an
UnsafeCheckpoint whose `str()` is the one line.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.format.safe_load import TRUST_HINT, UnsafeCheckpoint, load

MLMODEL = "MLmodel"


@dataclass(frozen=True)
class HfFolders:
    """Where an HF model's weights and config live, and where its tokenizer lives (often the same folder)."""

    model: Path
    tokenizer: Path


def is_mlflow_model(path: str | Path) -> bool:
    return (Path(path) / MLMODEL).is_file()


def _read_mlmodel(folder: Path) -> dict:
    import yaml

    where = folder / MLMODEL
    try:
        raw = yaml.safe_load(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UnsafeCheckpoint(
            f"{where}: refused to load: not a readable MLmodel file ({type(exc).__name__})"
        ) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("flavors"), dict):
        raise UnsafeCheckpoint(f"{where}: refused to load: an MLmodel file has a 'flavors' mapping, this one does not")
    return raw


def mlflow_code(folder: str | Path) -> str | None:
    """The first flavor's `code` directory the MLmodel names ("flavor: dir"), or None: MLflow's loaders put it
    on sys.path, the transformers flavor's and pyfunc's alike."""
    for name, conf in _read_mlmodel(Path(folder))["flavors"].items():
        if isinstance(conf, dict) and conf.get("code"):
            return f"{name}: {conf['code']}"
    return None


def mlflow_hf_folders(folder: str | Path) -> HfFolders:
    """The HF folders inside an MLflow Model of the transformers flavor, read from its MLmodel (never loaded
    through MLflow). Refuses a model whose flavor names code, and one whose weights were never saved."""
    folder = Path(folder)
    flavors = _read_mlmodel(folder)["flavors"]
    where = folder / MLMODEL
    code = mlflow_code(folder)
    if code is not None:
        raise UnsafeCheckpoint(
            f"{where}: refused to load: flavor {code.split(':')[0]} names a code directory "
            f"({code.split(': ', 1)[1]!r}) that MLflow would put first on sys.path, so any module in it could run; "
            f"{TRUST_HINT} (a model tessera registered never has one)"
        )
    conf = flavors.get("transformers")
    if not isinstance(conf, dict):
        raise UnsafeCheckpoint(f"{where}: refused to load: not a transformers-flavor MLflow model ({sorted(flavors)})")
    binary = conf.get("model_binary")
    if not binary or not (folder / str(binary) / "config.json").is_file():
        raise UnsafeCheckpoint(
            f"{where}: refused to load: the model's weights are not in the folder (saved as a reference to "
            f"{conf.get('source_model_name', 'a hub repository')!r}), and tessera loads nothing from a hub"
        )
    model = folder / str(binary)
    tokenizer = folder / "components" / "tokenizer"
    return HfFolders(
        model, tokenizer if "tokenizer" in (conf.get("components") or []) and tokenizer.is_dir() else model
    )


def hf_folders(path: str | Path) -> HfFolders:
    """The HF folders that `path` (an HF model folder or an MLflow Model of one) holds."""
    return mlflow_hf_folders(path) if is_mlflow_model(path) else HfFolders(Path(path), Path(path))


def refuse_custom_code(folder: Path) -> None:
    """An `auto_map` in the folder's config or tokenizer config means its classes are Python files in the folder."""
    for name in ("config.json", "tokenizer_config.json"):
        file = folder / name
        try:
            raw = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise UnsafeCheckpoint(f"{file}: refused to load: not readable JSON ({type(exc).__name__})") from None
        if isinstance(raw, dict) and raw.get("auto_map"):
            classes = ", ".join(sorted(str(v) for v in _flat(raw["auto_map"])))
            raise UnsafeCheckpoint(
                f"{file}: refused to load: its auto_map names code in the folder ({classes}), which transformers "
                f"would import and run; {TRUST_HINT}"
            )


def _flat(value: Any) -> list:
    if isinstance(value, dict):
        return [v for item in value.values() for v in _flat(item)]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _flat(item)]
    return [value] if value else []


def load_hf_model(folders: HfFolders, *, trust: bool = False, **kwargs: Any):
    """(model, tokenizer) from HF folders; refused in one line where it would run code or cannot be read."""
    if not trust:
        refuse_custom_code(folders.tokenizer)  # before the model's weights cost the time to read
    return load_hf_causal_lm(folders.model, trust=trust, **kwargs), load_hf_tokenizer(folders.tokenizer, trust=trust)


def load_hf_causal_lm(folder: Path, *, trust: bool = False, **kwargs: Any):
    """The causal LM of an HF folder (no tokenizer), refused in one line where it would run code or cannot be read."""
    from transformers import AutoModelForCausalLM

    if not trust:
        refuse_custom_code(folder)
    try:
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=trust, local_files_only=True, **kwargs)
    except (OSError, ValueError, pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise UnsafeCheckpoint(_why_unloadable(folder, exc)) from None


def _why_unloadable(folder: Path, exc: BaseException) -> str:
    """transformers reads a `.bin` weights-only, and a pickle that needs more comes back as "Unable to load
    weights ... set from_tf=True": the file is read again (mapped, weights-only) to say what it needs."""
    for file in sorted(folder.glob("*.bin")):
        try:
            load(file, mmap=True)
        except UnsafeCheckpoint as refused:
            return str(refused)
    return f"{folder}: refused to load: {_first_line(exc)}"


def load_hf_tokenizer(folder: str | Path, *, trust: bool = False):
    from transformers import AutoTokenizer

    if not trust:
        refuse_custom_code(Path(folder))
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UnsafeCheckpoint(f"{folder}: refused to load its tokenizer: {_first_line(exc)}") from None


def hf_config(folder: str | Path, *, trust: bool = False):
    """The folder's transformers config (no weights read), refused like a load where it names code."""
    from transformers import AutoConfig

    if not trust:
        refuse_custom_code(Path(folder))
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UnsafeCheckpoint(f"{folder}/config.json: refused to load: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__

"""No model a person or the registry names runs its own code while it loads (trainers/format/model_dirs.py).

Each payload writes a marker file when its code runs. The evaluation pod's entrypoint (`python -m evaluation`,
the same `load_model` as `tessera eval`, the eval deployment and promotion's scoring, without a Prefect
server to start) runs as a real subprocess where the code would run only in a fresh process: an MLflow
`code` directory shadows a module imported for the first time, and transformers' "run the custom code?
[y/N]" prompt reads the `y` piped into it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from evaluation.errors import GauntletError
from tests.support.gauntlet import tiny_llama
from tests.support.mlflow_store import sqlite_store
from trainers.exit_codes import FatalError

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"
LOCAL_DATA = ROOT / "data" / "gauntlet" / "eval" / "local_data"


class _OpensAFile:
    """A pickled value that creates a file when it is unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def gauntlet_args(tmp_path_factory) -> list[str]:
    from tests.support.gauntlet import cut_demo_tasks

    root = cut_demo_tasks(LOCAL_DATA, tmp_path_factory.mktemp("gauntlet"), records=4)
    return ["--tasks", str(ROOT / "configs" / "gauntlet" / "tiny_tasks.yaml"), "--data-root", str(root)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A clean HF folder and a clean MLflow Model of it (what tessera registers), and the weights they hold."""
    from trainers.format.mlflow_model import save_mlflow_model

    base = tmp_path_factory.mktemp("models")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>", pad_token="<|padding|>"
    )
    hf = base / "hf"
    tiny_llama(len(tok), seed=5).save_pretrained(hf)
    tok.save_pretrained(hf)
    return {"hf": hf, "mlflow": save_mlflow_model(hf, base / "mlflow")}


def _mlflow_with_code(clean: Path, dest: Path, marker: Path) -> Path:
    """`clean` with `code: code` in its transformers flavor and a code/huggingface_hub.py that writes `marker`,
    then loads the real package (so a load that runs it still succeeds, as the issue's trial did)."""
    shutil.copytree(clean, dest)
    mlmodel = yaml.safe_load((dest / "MLmodel").read_text())
    mlmodel["flavors"]["transformers"]["code"] = "code"
    (dest / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    (dest / "code").mkdir()
    (dest / "code" / "huggingface_hub.py").write_text(
        "import importlib, sys\n"
        f"open({str(marker)!r}, 'w').close()\n"
        "here = sys.modules.pop(__name__)\n"
        "sys.path[:] = [p for p in sys.path if not p.endswith('code')]\n"
        "sys.modules[__name__] = importlib.import_module(__name__)\n"
    )
    return dest


def _hf_with_auto_map(clean: Path, dest: Path, marker: Path) -> Path:
    """`clean` whose config names its model class in a file of the folder (model_type unknown to transformers,
    so transformers asks on stdin whether to run it)."""
    shutil.copytree(clean, dest)
    config = json.loads((dest / "config.json").read_text())
    config["model_type"] = "evil_llama"
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilLM"}
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil_llama'\n"
        "class EvilLM(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    return dest


def _recipe_model():
    """The model a recipe of the clean folder's shape builds, for `model.init_from` to fill."""
    from trainers.config import ModelConfig
    from trainers.model import build_model

    return build_model(ModelConfig(ffn_hidden=128, vocab_multiple=1), 50277, 128, 0, seed=1)


def _pod(args: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "evaluation", "--report-only", *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tessera.eval: bad input: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0].removeprefix("tessera.eval: bad input: ")


def test_an_mlflow_model_that_names_code_is_refused_by_every_loader_and_runs_nothing(
    prefect_harness, models, gauntlet_args, tmp_path, capsys
):
    """`tessera eval FOLDER`, `tessera compare`, a `models:/` alias whose version's source is the folder, the
    evaluation pod and `model.init_from` each refuse it in one line naming its MLmodel; the code never runs,
    and nothing is put on sys.path. --trust-checkpoint is the way past, through MLflow's own loader."""
    from cli.main import main
    from evaluation.models import load_model
    from tests.conftest import tiny_recipe
    from trainers.model import load_weights_from

    marker = tmp_path / "code-ran"
    evil = _mlflow_with_code(models["mlflow"], tmp_path / "evil", marker)
    refused = (
        f"{evil}/MLmodel: refused to load: flavor transformers names a code directory ('code') that MLflow would "
        "put first on sys.path, so any module in it could run; pass --trust-checkpoint only for a file you made "
        "or trust (a model tessera registered never has one)"
    )

    proc = _pod(["--checkpoint", str(evil), *gauntlet_args])
    assert proc.returncode == 78 and _one_line(proc) == refused
    assert not marker.exists()  # the old loader wrote it here: huggingface_hub is first imported inside the load

    path_before = list(sys.path)
    capsys.readouterr()
    assert main(["eval", "--model", str(evil), *gauntlet_args, "--work-dir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"tessera: error: {refused}" in err.splitlines()

    recipe = tiny_recipe(tmp_path)
    raw = yaml.safe_load(recipe.read_text())
    raw["eval"] |= dict(zip(("tasks", "data_root"), gauntlet_args[1::2]))
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["compare", str(models["hf"]), str(evil), "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"tessera: error: {refused}" in err.splitlines()

    from mlflow.tracking import MlflowClient

    uri = sqlite_store(tmp_path / "registry.db")
    client = MlflowClient(uri, registry_uri=uri)
    client.create_registered_model("m")
    client.create_model_version("m", str(evil))
    client.set_registered_model_alias("m", "champion", "1")
    with pytest.raises(GauntletError) as alias:
        load_model("models:/m@champion", uri)
    assert str(alias.value) == refused

    with pytest.raises(FatalError) as init:
        load_weights_from(_recipe_model(), str(evil))
    assert str(init.value) == f"model.init_from: {refused}"
    assert sys.path == path_before and not marker.exists()

    # the explicit opt-in loads it with MLflow's loader, which is what puts its code on sys.path
    trusted = load_model(str(evil), trust=True)
    try:
        assert str(evil / "code") in sys.path
    finally:
        sys.path[:] = path_before
    clean = load_model(str(models["mlflow"]))
    assert all(
        torch.equal(a, b) for a, b in zip(trusted.model.state_dict().values(), clean.model.state_dict().values())
    )


def test_an_hf_folder_with_custom_code_is_refused_even_when_stdin_says_yes(models, gauntlet_args, tmp_path):
    """An `auto_map` in config.json: refused in one line, never asked about on stdin (a `y` is piped in), and
    `model.init_from` refuses it too."""
    from evaluation.models import load_model
    from trainers.model import load_weights_from

    marker = tmp_path / "custom-code-ran"
    evil = _hf_with_auto_map(models["hf"], tmp_path / "evil", marker)
    refused = (
        f"{evil}/config.json: refused to load: its auto_map names code in the folder (evil.EvilConfig, "
        "evil.EvilLM), which transformers would import and run; pass --trust-checkpoint only for a file you made "
        "or trust"
    )
    proc = _pod(["--checkpoint", str(evil), *gauntlet_args], stdin="y\n")
    assert proc.returncode == 78 and _one_line(proc) == refused
    assert not marker.exists()
    with pytest.raises(GauntletError, match="auto_map"):
        load_model(str(evil))
    with pytest.raises(FatalError) as init:
        load_weights_from(_recipe_model(), str(evil))
    assert str(init.value) == f"model.init_from: {refused}"
    assert not marker.exists()


def test_foreign_pickles_are_one_line_refusals_not_tracebacks(prefect_harness, models, gauntlet_args, tmp_path, capsys):
    """A payload in an old-format (non-zip) torch.save file and in an HF folder's pytorch_model.bin: one line
    naming the file and what it needs, from `tessera eval` and from `model.init_from`. A file that is not a
    checkpoint at all is one line too."""
    from safetensors.torch import load_file

    from cli.main import main
    from trainers.model import load_weights_from

    marker = tmp_path / "payload-ran"
    old = tmp_path / "old.pt"
    torch.save({"state": {"note": _OpensAFile(marker)}}, old, _use_new_zipfile_serialization=False)
    binary = shutil.copytree(models["hf"], tmp_path / "bin")
    weights = load_file(binary / "model.safetensors")
    (binary / "model.safetensors").unlink()
    torch.save({**weights, "note": _OpensAFile(marker)}, binary / "pytorch_model.bin")
    junk = tmp_path / "notes.pt"
    junk.write_text("not a checkpoint\n")
    needs = "refused to load: unpickling it needs `io.open`, which can run code when loaded"

    def said(spec: Path) -> str:
        capsys.readouterr()
        assert main(["eval", "--model", str(spec), *gauntlet_args, "--work-dir", str(tmp_path / "w")]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        lines = [line for line in err.splitlines() if line.startswith("tessera: error: ")]
        assert len(lines) == 1, err
        return lines[0]

    assert said(old).startswith(f"tessera: error: {old}: {needs}")
    assert said(binary).startswith(f"tessera: error: {binary / 'pytorch_model.bin'}: {needs}")
    assert said(junk).startswith(f"tessera: error: {junk}: refused to load: not a ")
    with pytest.raises(FatalError) as init:
        load_weights_from(_recipe_model(), str(binary))
    assert str(init.value).startswith(f"model.init_from: {binary / 'pytorch_model.bin'}: {needs}")
    assert not marker.exists()


def test_a_registered_version_in_s3_that_names_code_is_refused(models, gauntlet_args, tmp_path, moto_s3):
    """A version whose source is an s3:// MLflow Model with a `code` directory: downloaded, refused in one line
    naming the models:/ URI, by `load_model` and by the evaluation pod; its code never runs."""
    from mlflow.tracking import MlflowClient

    from evaluation.models import load_model

    marker = tmp_path / "code-ran"
    evil = _mlflow_with_code(models["mlflow"], tmp_path / "evil", marker)
    moto_s3.create_bucket(Bucket="models")
    for file in evil.rglob("*"):
        if file.is_file():
            moto_s3.upload_file(str(file), "models", f"evil/{file.relative_to(evil)}")
    uri = sqlite_store(tmp_path / "registry.db")
    client = MlflowClient(uri, registry_uri=uri)
    client.create_registered_model("m")
    client.create_model_version("m", "s3://models/evil")
    client.set_registered_model_alias("m", "champion", "1")
    refused = "models:/m@champion/MLmodel: refused to load: flavor transformers names a code directory ('code')"
    with pytest.raises(GauntletError) as error:
        load_model("models:/m@champion", uri)
    assert str(error.value).startswith(refused)
    proc = _pod(["--checkpoint", "models:/m@champion", "--tracking-uri", uri, *gauntlet_args])
    assert proc.returncode == 78 and _one_line(proc).startswith(refused)
    assert not marker.exists()


def test_tesseras_own_models_still_load(models):
    """A clean HF folder and a clean MLflow Model (as registration writes it) load, with the same weights."""
    from evaluation.models import load_model

    hf, mlflow_model = load_model(str(models["hf"])), load_model(str(models["mlflow"]))
    assert hf.tokenizer.eos_token == mlflow_model.tokenizer.eos_token == "<|endoftext|>"
    assert all(
        torch.equal(a, b) for a, b in zip(hf.model.state_dict().values(), mlflow_model.model.state_dict().values())
    )

"""Every `tessera` command ends a refusal or bad input with exactly one `tessera: error:` line, its exit code, no
traceback on the terminal, and nothing of the refused file executed (issue 42).

The real CLI of this checkout in a subprocess, as a person runs it (no PREFECT_API_URL: a command that needs a
server starts its temporary one). A refusal the model's own files tell (a pickle that needs code, an `auto_map`,
an MLflow flavor's `code` directory, a folder that is no model) happens before any server starts: the work dir
then holds no Prefect database. The rest meet their error inside a flow run, whose failure Prefect logs: that
must be the one line too, not the task's and the flow's tracebacks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import ROOT, tiny_recipe
from tests.support.prefect_home import seed_prefect_home
from tests.test_data_helpers import tessera
from tests.test_model_code import _hf_with_auto_map, _mlflow_with_code, _OpensAFile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Path]:
    """The refused models, each with its own marker (created only if its code runs), and the bad inputs."""
    import transformers

    from tests.support.gauntlet import tiny_llama
    from trainers.format.mlflow_model import save_mlflow_model

    base = tmp_path_factory.mktemp("refusals")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(ROOT / "data" / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"),
        eos_token="<|endoftext|>",
        pad_token="<|padding|>",
    )
    clean = base / "hf"
    tiny_llama(len(tok), seed=5).save_pretrained(clean)
    tok.save_pretrained(clean)
    out = {"clean": clean, "markers": base / "markers"}
    out["markers"].mkdir()
    legacy = base / "legacy.pt"  # torch's pre-1.6 format: read whole, not mapped
    torch.save({"state": {"x": _OpensAFile(out["markers"] / "legacy")}}, legacy, _use_new_zipfile_serialization=False)
    out["legacy"] = legacy
    pickled = base / "hf-bin"
    shutil.copytree(clean, pickled)
    for weights in pickled.glob("*.safetensors"):
        weights.unlink()
    torch.save({"lm_head.weight": _OpensAFile(out["markers"] / "bin")}, pickled / "pytorch_model.bin")
    out["bin"] = pickled
    out["auto_map"] = _hf_with_auto_map(clean, base / "auto-map", out["markers"] / "auto_map")
    out["mlflow"] = _mlflow_with_code(
        save_mlflow_model(clean, base / "mlflow"), base / "mlflow-code", out["markers"] / "mlflow"
    )
    out["not_a_model"] = base / "empty"
    out["not_a_model"].mkdir()
    bad = base / "bad.yaml"
    bad.write_text("name: bad\ndata:\n  seq_len: [oops\n")
    out["bad_recipe"] = bad
    recipe = tiny_recipe(base / "tiny", prefect_db=False)  # each test's own work dir gets one (_own_work_dir)
    raw = yaml.safe_load(recipe.read_text())
    raw["work_dir"] = str(base / "work")
    recipe.write_text(yaml.safe_dump(raw))
    out["recipe"] = recipe
    missing_source = base / "missing-source.yaml"
    raw["data"]["sources"][0]["paths"] = [str(base / "no-such-corpus" / "input.txt")]
    missing_source.write_text(yaml.safe_dump(raw))
    out["missing_source"] = missing_source
    tasks = base / "tasks.yaml"
    tasks.write_text("icl_tasks:\n  - label: copa\n    dataset_uri: [unclosed\n")
    out["bad_tasks"] = tasks
    return out


def _own_work_dir(recipe: Path, tmp: Path) -> str:
    """A copy of `recipe` whose work dir (Prefect's database among it) is this test's alone."""
    raw = yaml.safe_load(recipe.read_text())
    raw["work_dir"] = str(tmp / "work")
    copy = tmp / recipe.name
    copy.write_text(yaml.safe_dump(raw))
    return str(copy)


# (name, argv from the cases, exit code, what the one line says (a format of the cases), refused before any server)
ROWS = [
    ("run-bad-recipe", ["run", "{bad_recipe}"], 2, "{bad_recipe}:4: invalid YAML", True),
    ("prepare-missing-recipe", ["prepare", "{bad_recipe}.gone"], 2, "{bad_recipe}.gone", True),
    ("run-missing-data", ["run", "{missing_source}"], 2, "no-such-corpus", False),
    (
        "eval-legacy-pickle",
        ["eval", "--model", "{legacy}", "--tasks", "{bad_tasks}"],
        2,
        "{legacy}: refused to load",
        True,
    ),
    (
        "eval-pickled-bin",
        ["eval", "--model", "{bin}", "--tasks", "{bad_tasks}"],
        2,
        "pytorch_model.bin: refused to load",
        True,
    ),
    ("eval-auto-map", ["eval", "--model", "{auto_map}", "--tasks", "{bad_tasks}"], 2, "its auto_map names code", True),
    ("eval-mlflow-code", ["eval", "--model", "{mlflow}", "--tasks", "{bad_tasks}"], 2, "names a code directory", True),
    ("eval-no-model", ["eval", "--model", "{not_a_model}", "--tasks", "{bad_tasks}"], 2, "has no config.json", True),
    ("eval-bad-tasks", ["eval", "--model", "{clean}", "--tasks", "{bad_tasks}"], 2, "{bad_tasks}", False),
    ("compare-refused", ["compare", "{clean}", "{legacy}", "--recipe", "{recipe}"], 2, "{legacy}: refused", True),
    (
        "promote-not-a-version",
        ["promote", "models:/tiny@best", "--recipe", "{recipe}"],
        2,
        "expected models:/NAME/N",
        True,
    ),
    ("continue-no-data", ["continue", "{recipe}", "--new-data", "{bad_recipe}.d"], 2, "new data: no such", False),
    ("status-no-run", ["status", "nobody", "--recipe", "{recipe}"], 2, "no such run", True),
    ("k8s-render-local", ["k8s", "render", "{recipe}", "--stage", "0"], 2, "compute.backend", True),
    ("deploy-bad-recipe", ["deploy", "--recipe", "{bad_recipe}"], 2, "{bad_recipe}:4: invalid YAML", True),
]


@pytest.mark.parametrize("name, argv, code, says, early", ROWS, ids=[r[0] for r in ROWS])
def test_every_refusal_is_one_line_with_no_traceback_and_nothing_run(cases, tmp_path, name, argv, code, says, early):
    fmt = {k: str(v) for k, v in cases.items()}
    fmt |= {k: _own_work_dir(cases[k], tmp_path) for k in ("recipe", "missing_source")}
    if not early:  # a refusal that comes from the server's side: the server starts on a migrated database
        seed_prefect_home(tmp_path / "work" / "prefect")
    args = [a.format(**fmt) for a in argv]
    if args[0] == "eval":
        args += ["--work-dir", str(tmp_path / "work")]
    ran = tessera(*args, timeout=600)
    said = [line for line in ran.stderr.splitlines() if line.startswith("tessera: error: ")]
    shown = f"rc {ran.returncode}\n--- stdout\n{ran.stdout[-3000:]}\n--- stderr\n{ran.stderr[-6000:]}"
    assert ran.returncode == code, shown
    assert len(said) == 1 and says.format(**fmt) in said[0], shown
    assert "Traceback" not in ran.stdout + ran.stderr, shown
    # the last thing on the terminal, but for Prefect's own line as its temporary server stops at the exit
    after = ran.stderr.strip().splitlines()
    after = after[after.index(said[0]) + 1 :]
    assert [line for line in after if "Stopping temporary server" not in line] == [], shown
    assert sorted(p.name for p in cases["markers"].iterdir()) == []  # no refused file's code ran
    if early:  # refused from the files alone: no Prefect server started, no database made for one
        assert not (tmp_path / "work" / "prefect").exists(), shown

"""Shared helpers for the prepare-stage tests (no tests here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

from tasks.data.config import DataConfig
from tests.support.mlflow_store import sqlite_store

ROOT = Path(__file__).resolve().parents[1]
NEOX = ROOT / "data" / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"
SHAKESPEARE = ROOT / "data" / "corpora" / "tinyshakespeare" / "input.txt"
STORIES_SAMPLE = ROOT / "data" / "corpora" / "tinystories" / "tinystories_sample.txt"
EOS = 0


@lru_cache(maxsize=2)
def neox():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(NEOX))


def expected_tokens(docs: list[str]) -> int:
    """The tokenizer's count plus one EOS per document."""
    return sum(len(e.ids) + 1 for e in neox().encode_batch(docs, add_special_tokens=False))


def make_config(root, sources, seq_len=64, **kw) -> DataConfig:
    return DataConfig.model_validate(
        {
            "root": str(root),
            "seq_len": seq_len,
            "tokenizer": kw.pop("tokenizer", {"path": str(NEOX)}),
            "sources": sources,
            "workers": kw.pop("workers", 1),
            **kw,
        }
    )


def read_tokens(path: str) -> np.ndarray:
    """Every sample of an MDS directory through a plain StreamingDataset, in order, as (n, seq_len)."""
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(local=path, batch_size=1, shuffle=False, predownload=8)
    rows = [np.asarray(ds[i]["tokens"]) for i in range(ds.num_samples)]
    del ds
    clean_stale_shared_memory()
    return np.stack(rows) if rows else np.zeros((0, 0), np.uint16)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def prov(out_root: str) -> dict:
    with open(os.path.join(out_root, "provenance.json")) as f:
        return json.load(f)


def neox_info(tmp_path_factory):
    """The GPT-NeoX tokenizer resolved into a fresh root; modules wrap it as their `tok_info` fixture."""
    from tasks.data import tokenizer

    cfg = make_config(tmp_path_factory.mktemp("tok"), [{"name": "x", "paths": ["x"]}]).tokenizer
    return tokenizer.resolve(cfg, str(tmp_path_factory.mktemp("tokroot")), [], 1 << 20)


def write_recipe(
    path: Path,
    sources: list[dict],
    root,
    work_dir,
    stages: list[dict] | None = None,
    seq_len: int = 128,
    tokenizer: str | None = None,
    **data,
) -> Path:
    """A runnable recipe (the tiny demo's model, eval and tracking) over these data sources; `data`
    sets more fields of its data section."""
    import yaml

    recipe = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    recipe["work_dir"] = str(work_dir)
    recipe["data"].update({"root": str(root), "seq_len": seq_len, "sources": sources, **data})
    recipe["data"]["tokenizer"]["path"] = tokenizer or str(NEOX)
    recipe["train"]["stages"] = stages or [
        {"name": "all", "tokens": 8 * seq_len * 4, "mixture": {sources[0]["name"]: 1.0}}
    ]
    recipe["eval"]["every"] = 8 * seq_len * 4
    for key in ("tasks", "gauntlet", "data_root"):
        recipe["eval"][key] = str(ROOT / recipe["eval"][key])
    recipe["tracking"]["tracking_uri"] = sqlite_store(Path(work_dir) / "mlflow.db")
    recipe["tracking"].pop("artifact_location", None)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def tessera(*args: str, timeout: float = 300, **env: str):
    """Run the real `tessera` CLI of this checkout (cwd the project root); returns the CompletedProcess."""
    import subprocess

    clean = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    return subprocess.run(
        [str(ROOT / ".venv" / "bin" / "tessera"), *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Prepares the first source of the DataConfig JSON at argv[1] in a process of its own, and says whether it
# wrote the output or found it done: for the tests of concurrent and interrupted prepares.
PREPARE_SCRIPT = """
import sys
from tasks.data.config import DataConfig
from tasks.data import pipeline, tokenizer
data = DataConfig.model_validate_json(open(sys.argv[1]).read())
tok = tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
res = pipeline.prepare_source(data.sources[0], data, tok)
print("cached" if res.cached else "written")
"""


def spawn_prepare(cfg, **env):
    """`PREPARE_SCRIPT` on the config file `cfg` in a child process (text output, env on top of this one's)."""
    return subprocess.Popen(
        [sys.executable, "-c", PREPARE_SCRIPT, str(cfg)],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

"""Which gauntlet a score came from: a hash of everything that decides the numbers.

Scores are comparable only when they were produced by the same task list, gauntlet weighting,
task files, seed, truncation and scoring code. The registry picks `best`, and promotion
compares versions, only among scores with the same hash.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from evaluation.config import EvalConfig
from evaluation.sources import read_bytes, resolve
from evaluation.spec import load_tasks

# The modules whose code turns a model into numbers; a change to any of them is a new gauntlet.
_SCORING_CODE = ("aggregate.py", "prompts.py", "batching.py", "scoring.py", "generation.py", "runner.py", "spec.py")


def gauntlet_hash(cfg: EvalConfig) -> str:
    """16 hex digits over the task list, the gauntlet, every task file, the settings and the scoring code."""
    digest = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        digest.update(f"{label}\0{len(data)}\0".encode())
        digest.update(data)

    settings = {"seed": cfg.seed, "max_seq_len": cfg.max_seq_len}
    add("settings", json.dumps(settings, sort_keys=True).encode())
    add("tasks", read_bytes(cfg.tasks))
    add("gauntlet", read_bytes(cfg.gauntlet) if cfg.gauntlet else b"")
    for task in sorted(load_tasks(cfg.tasks), key=lambda t: t.label):
        uri = resolve(cfg.data_root, task.dataset_uri)
        try:
            add(f"file:{task.label}", read_bytes(uri))
        except FileNotFoundError:
            add(f"missing:{task.label}", b"")  # a partial gauntlet is a different gauntlet
    here = Path(__file__).parent
    for name in _SCORING_CODE:
        add(f"code:{name}", (here / name).read_bytes())
    return digest.hexdigest()[:16]

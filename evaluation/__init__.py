"""The eval gauntlet: Mosaic Eval Gauntlet files in, llm-foundry's scoring, reports out.

Never imports Prefect: it runs inside pods too. Heavy names load lazily, so reading the
`eval` recipe section (evaluation.config) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from evaluation.config import EvalConfig
from evaluation.errors import GauntletError

_LAZY = {
    "run_gauntlet": "evaluation.runner",
    "GauntletReport": "evaluation.report",
    "TaskResult": "evaluation.report",
    "compare_markdown": "evaluation.report",
    "load_model": "evaluation.models",
}

__all__ = ["EvalConfig", "GauntletError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'evaluation' has no attribute {name!r}")

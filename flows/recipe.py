"""A recipe: the YAML a user copies and edits, validated into one typed Recipe.

Each section's model belongs to the package that uses it; this module only composes them
and turns validation failures into one line that names the file, the line and the field.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evaluation.config import EvalConfig
from infra.config import ComputeConfig
from tasks.data.config import DataConfig
from tasks.tracking_config import TrackingConfig
from trainers.config import ModelConfig, TrainConfig


class RecipeError(ValueError):
    """A recipe that cannot be used; str() is one line naming the file, line and field."""


class Recipe(BaseModel):
    """The whole pipeline's input. Components receive their own section, never this object."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Run family name; scopes work dirs and runs.")
    work_dir: str = Field(".tessera", description="Where runs, checkpoints and job specs go.")
    data: DataConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig
    eval: EvalConfig
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    tracking: TrackingConfig

    def content_hash(self) -> str:
        """Stable hash of everything that defines the run; stored as the `recipe_hash` tag."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def cross_check(self) -> None:
        """Checks that span sections: they are the one place two owners must agree."""
        sources = {s.name for s in self.data.sources}
        for i, stage in enumerate(self.train.stages):
            unknown = sorted(set(stage.mixture) - sources)
            if unknown:
                raise _CrossCheckError(
                    ("train", "stages", i, "mixture"), f"names no data source: {', '.join(unknown)}"
                )
        per_batch = self.train.global_batch_size * self.data.seq_len
        if self.eval.every % per_batch:
            raise _CrossCheckError(
                ("eval", "every"), f"{self.eval.every} is not a multiple of global_batch_size*seq_len ({per_batch})"
            )
        for i, stage in enumerate(self.train.stages):
            if stage.tokens % per_batch:
                raise _CrossCheckError(
                    ("train", "stages", i, "tokens"),
                    f"{stage.tokens} is not a multiple of global_batch_size*seq_len ({per_batch})",
                )


class _CrossCheckError(Exception):
    """A cross-section failure carrying its recipe location, so it reports like a pydantic one."""

    def __init__(self, loc: tuple, msg: str):
        super().__init__(msg)
        self.loc, self.msg = loc, msg


def _line_of(node: yaml.Node | None, loc: tuple) -> int | None:
    """1-based line of the deepest YAML node on the path `loc` (pydantic's error location)."""
    line = None
    for key in loc:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == key), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            node = None
    if node is not None:
        line = node.start_mark.line + 1
    return line


def _dotted(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "<root>"


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    try:
        tree = yaml.compose(text)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{source}{where}: invalid YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: a recipe is a YAML mapping, got {type(raw).__name__}")
    try:
        recipe = Recipe.model_validate(raw)
        recipe.cross_check()
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        line = _line_of(tree, loc)
        msg = err["msg"].removeprefix("Value error, ")
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise RecipeError(f"{source}{f':{line}' if line else ''}: {_dotted(loc)}: {msg}{more}") from None
    except _CrossCheckError as exc:
        line = _line_of(tree, exc.loc)
        raise RecipeError(f"{source}{f':{line}' if line else ''}: {_dotted(exc.loc)}: {exc.msg}") from None
    return recipe


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read recipe: {exc}") from None
    return parse_recipe(text, str(path))

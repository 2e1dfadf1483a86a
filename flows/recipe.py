"""A recipe: the YAML a user copies and edits, validated into one typed Recipe.

Each section's model belongs to the package that uses it; this module only composes them
and turns validation failures into one line that names the file, the line and the field.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from evaluation.config import EvalConfig
from infra.config import ComputeConfig
from tasks.data.config import DataConfig
from tasks.tracking_config import TrackingConfig
from trainers.config import ModelConfig, TrainConfig


class RecipeError(ValueError):
    """A recipe that cannot be used; str() is one line naming the file, line and field."""


NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"


class Recipe(BaseModel):
    """The whole pipeline's input. Components receive their own section, never this object."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., pattern=NAME_PATTERN, description="Run family name; scopes work dirs and runs.")
    work_dir: str = Field(".tessera", description="Local directory for runs, checkpoints and job specs.")
    data: DataConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig
    eval: EvalConfig
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    tracking: TrackingConfig

    @field_validator("work_dir")
    @classmethod
    def _local_work_dir(cls, value: str) -> str:
        if "://" in value:
            raise ValueError(f"must be a local directory, not a URI ({value})")
        return value

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
            per_step = (stage.global_batch_size or self.train.global_batch_size) * (stage.seq_len or self.data.seq_len)
            if stage.tokens % per_step:
                raise _CrossCheckError(
                    ("train", "stages", i, "tokens"),
                    f"{stage.tokens} is not a multiple of global_batch_size*seq_len ({per_step})",
                )


class _CrossCheckError(Exception):
    """A cross-section failure carrying its recipe location, so it reports like a pydantic one."""

    def __init__(self, loc: tuple, msg: str):
        super().__init__(msg)
        self.loc, self.msg = loc, msg


def _locate(node: yaml.Node | None, loc: tuple) -> tuple[int | None, tuple]:
    """The 1-based line of the deepest YAML node on pydantic's error path `loc`, and that path as
    the user wrote it: union tags (e.g. `text` in `data.sources.0.text.paths`) name no YAML key and
    are dropped; a key missing at the end of the path (a required field) points at its parent."""
    line, path = None, []
    for i, key in enumerate(loc):
        if node is None:
            path.append(key)
            continue
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            child = next((v for k, v in node.value if k.value == key), None)
            if child is None and i + 1 < len(loc):
                continue  # a discriminator tag, not a key
            node = child
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            node = None
        path.append(key)
    if node is not None:
        line = node.start_mark.line + 1
    return line, tuple(path)


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
        line, loc = _locate(tree, loc)
        msg = err["msg"].removeprefix("Value error, ")
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise RecipeError(f"{source}{f':{line}' if line else ''}: {_dotted(loc)}: {msg}{more}") from None
    except _CrossCheckError as exc:
        line, loc = _locate(tree, exc.loc)
        raise RecipeError(f"{source}{f':{line}' if line else ''}: {_dotted(loc)}: {exc.msg}") from None
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

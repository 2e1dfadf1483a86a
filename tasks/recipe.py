"""A recipe: the YAML a user copies and edits, validated into one typed Recipe.

Each section's model belongs to the package that uses it; this module only composes them
and turns validation failures into one line that names the file, the line and the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, WithJsonSchema, field_validator

from evaluation.config import EvalConfig
from infra.config import ComputeConfig
from tasks.data.config import DataConfig
from tasks.promote_config import PromoteConfig
from tasks.tracking_config import TrackingConfig
from trainers.config import NAME_RESERVE, ModelConfig, TrainConfig, batch_alignment_error
from trainers.contract import OneLineError


class RecipeError(OneLineError, ValueError):
    """A recipe that cannot be used; str() is one line naming the file, line and field."""


# Letters, digits, '.', '_' and '-', and not only dots: names become folder names (runs/<name>, the work dir's
# scopes), where '.' and '..' would write into the runs folder itself or beside it. No '/' ever. {0,} rather than *:
# the Prefect UI shows a refused value's pattern as markdown, where two * turn into italics.
NAME_PATTERN = r"^[A-Za-z0-9_.-]{0,}[A-Za-z0-9_-][A-Za-z0-9_.-]{0,}$"


def run_folder(work_dir: str | Path, run_name: str) -> Path:
    """<work_dir>/runs/<run_name>, refused in one line if the name would resolve anywhere else, or if a file
    named after it would be longer than the work dir's file system allows (trainers/layout.NAME_RESERVE)."""
    runs = Path(work_dir).resolve() / "runs"
    folder = (runs / run_name).resolve()
    if folder.parent != runs or not re.fullmatch(NAME_PATTERN, run_name):
        raise RecipeError(f"run name {run_name!r}: must name a folder inside {runs} (letters, digits, '.', '_', '-')")
    most = longest_run_name(runs)
    if len(run_name.encode()) > most:
        raise RecipeError(
            f"run name {run_name[:40]!r}... is {len(run_name.encode())} characters; at most {most} fit: the file "
            f"system of {_existing(runs)} allows names of {most + NAME_RESERVE} bytes and tessera adds up to "
            f"{NAME_RESERVE} to a run's name in its checkpoint files"
        )
    return folder


def longest_run_name(folder: str | Path) -> int:
    """The longest run name whose files fit the file system holding `folder` (255-byte names: 191)."""
    try:
        name_max = os.pathconf(_existing(folder), "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    return name_max - NAME_RESERVE


def _existing(path: str | Path) -> Path:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


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
    promote: PromoteConfig = Field(
        default_factory=PromoteConfig, description="When continued pretraining's best version replaces the champion."
    )

    @field_validator("work_dir")
    @classmethod
    def _local_work_dir(cls, value: str) -> str:
        if "://" in value:
            raise ValueError(f"must be a local directory, not a URI ({value})")
        return value

    def content_hash(self) -> str:
        """Stable hash of everything that defines the run; the run's `recipe_hash` tag and each version's record."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def tracked_params(self) -> dict[str, str]:
        """What defines the run, flattened for MLflow params: model, optimizer, batch, stages, tokenizer, eval.

        Stages are keyed by name (`stage.literary.tokens`), so appending a stage adds params rather
        than renumbering them; data sources are named, their file lists live in the recipe artifact.
        """
        dump = self.model_dump(mode="json")
        out: dict[str, str] = {
            "recipe": self.name,
            "data.seq_len": str(self.data.seq_len),
            "data.sources": ",".join(s.name for s in self.data.sources),
        }
        tokenizer = dump["data"]["tokenizer"]
        out["data.tokenizer"] = tokenizer["path"] or f"train:{json.dumps(tokenizer['train'], sort_keys=True)}"

        def flatten(prefix: str, value) -> None:
            if isinstance(value, dict):
                for key, sub in value.items():
                    flatten(f"{prefix}.{key}", sub)
            elif value is not None:
                out[prefix] = (json.dumps(value) if isinstance(value, list) else str(value))[:6000]

        # A pod's plain environment is named, never valued: values belong in the recipe artifact, not in params
        # every reader of the experiment sees (credentials are refused there anyway, infra/config.py).
        kube = (dump["compute"].get("kubernetes") or {}) if isinstance(dump["compute"], dict) else {}
        if kube.get("env"):
            kube["env"] = ",".join(sorted(kube["env"]))
        for section in ("model", "eval", "compute"):
            flatten(section, dump[section])
        train = {k: v for k, v in dump["train"].items() if k != "stages"}
        flatten("train", train)
        for stage in dump["train"]["stages"]:
            name = stage.pop("name")
            stage["mixture"] = ",".join(f"{src}:{p:g}" for src, p in stage["mixture"].items())
            flatten(f"stage.{name}", stage)
        return out

    def cross_check(self) -> None:
        """Checks that span sections: they are the one place two owners must agree."""
        sources = {s.name for s in self.data.sources}
        for i, stage in enumerate(self.train.stages):
            unknown = sorted(set(stage.mixture) - sources)
            if unknown:
                raise _CrossCheckError(("train", "stages", i, "mixture"), f"names no data source: {', '.join(unknown)}")
        misaligned = batch_alignment_error(self.train, self.data.seq_len, self.eval.every)
        if misaligned is not None:
            raise _CrossCheckError(*misaligned)
        self._check_batch_split()
        if self.compute.backend == "kubernetes":
            # Pods share no disk with the flow nor with each other, and a restarted pod starts empty.
            for loc, value in ((("data", "root"), self.data.root), (("train", "save_folder"), self.train.save_folder)):
                if not (value or "").startswith("s3://"):
                    raise _CrossCheckError(
                        loc,
                        f"{value}: must be an s3:// URI with compute.backend kubernetes "
                        "(pods share no disk with the flow or with each other)",
                    )
            if not self.tracking.tracking_uri.startswith(("http://", "https://", "databricks")):
                raise _CrossCheckError(
                    ("tracking", "tracking_uri"),
                    f"{self.tracking.tracking_uri}: pods log to "
                    "MLflow over the network; use an http(s):// tracking server",
                )

    def notices(self) -> list[str]:
        """What a recipe may mean but should not mean by accident: one line each, said when a run starts.

        A stage shorter than `eval.every` gets no checkpoint inside it, only the one at its end: no gauntlet
        or model version until then, and a failure inside it re-trains it from its start. That is right for a
        short anneal stage, so it is said, not refused."""
        said = []
        for i, stage in enumerate(self.train.stages):
            if stage.tokens < self.eval.every:
                said.append(
                    f"train.stages[{i}] ({stage.name}): {stage.tokens:,} tokens, fewer than eval.every "
                    f"({self.eval.every:,}): its only checkpoint, gauntlet and model version come at its end, and a "
                    "failure inside it re-trains it from its start"
                )
        return said

    def _check_batch_split(self) -> None:
        """Every stage's global batch splits evenly over the ranks, and each rank's share into microbatches: the
        trainer would fail on it after the launch, a minute in."""
        k8s = self.compute.kubernetes if self.compute.backend == "kubernetes" else None
        nodes = k8s.nodes if k8s is not None else 1
        ranks = self.compute.ranks_per_node * nodes
        per_node = (
            "compute.kubernetes.gpus_per_node" if k8s is not None and k8s.gpus_per_node else "compute.procs_per_node"
        )
        spread = f"{ranks} ranks ({per_node} {self.compute.ranks_per_node} x {nodes} node{'s' * (nodes != 1)})"
        micro = self.train.device_microbatch_size
        for i, stage in enumerate(self.train.stages):
            own = stage.global_batch_size is not None
            batch = stage.global_batch_size or self.train.global_batch_size
            loc = ("train", "stages", i, "global_batch_size") if own else ("train", "global_batch_size")
            field = f"train.stages[{stage.name}].global_batch_size" if own else "train.global_batch_size"
            if batch % ranks:
                raise _CrossCheckError(loc, f"{batch} sequences do not split evenly over the {spread}")
            share = batch // ranks
            if micro != "auto" and micro < share and share % micro:
                raise _CrossCheckError(
                    ("train", "device_microbatch_size"),
                    f"{micro} does not divide the {share} sequences each of the {spread} takes of {field} {batch}",
                )


class _CrossCheckError(Exception):
    """A cross-section failure carrying its recipe location, so it reports like a pydantic one."""

    def __init__(self, loc: tuple, msg: str):
        super().__init__(msg)
        self.loc, self.msg = loc, msg


def _check_tokenizer_path(recipe: Recipe) -> None:
    # Found here, a missing tokenizer costs the user nothing; found by the prepare task, it costs
    # Prefect's start-up first.
    path = recipe.data.tokenizer.path
    if path is not None and not Path(path).exists():
        where = "" if Path(path).is_absolute() else f" (relative paths resolve against {Path.cwd()})"
        raise _CrossCheckError(("data", "tokenizer", "path"), f"{path} does not exist{where}")


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
        _check_tokenizer_path(recipe)
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


def _no_default(schema: dict) -> None:
    schema.pop("default", None)


def form_input(schema: dict) -> tuple:
    """Annotations that show an optional field in the Prefect form as one plain input, starting empty.

    Pydantic would write `anyOf: [<type>, null]` with `default: null`: the Prefect UI renders that as a
    `str | None` switch that must be clicked before typing, and a plain input with a null default fails
    its own validation ("None is not of type 'integer'"). With neither, a field left empty is not sent,
    and the parameter model's default (None: the recipe's value) applies.
    """
    return WithJsonSchema(schema), Field(json_schema_extra=_no_default)


class StageBudget(BaseModel):
    """One row of the form's stage budgets."""

    stage: str = Field(..., min_length=1, description="A stage name of the recipe (train.stages[].name).")
    tokens: PositiveInt = Field(
        ..., description="Tokens this stage trains on: a multiple of its global_batch_size x seq_len."
    )


class RecipeOverrides(BaseModel):
    """Fields a person changes from the Prefect form without editing the recipe; left empty, the recipe's value stays.

    Bounds are JSON-schema constraints, so the UI (and a deployment's enforced parameter schema)
    rejects a bad value before any infrastructure starts; each description states them in words, and
    the flow validates them again first thing (a run started with the UI's validation switched off).
    """

    stage_tokens: Annotated[
        list[StageBudget] | None,
        *form_input({"type": "array", "items": StageBudget.model_json_schema()}),
    ] = Field(
        None,
        title="Stage budgets (tokens)",
        description="Token budget of curriculum stages, one row per stage to change (the others keep the "
        "recipe's). Each budget is a positive multiple of that stage's global_batch_size x seq_len.",
    )
    lr: Annotated[float | None, *form_input({"type": "number", "exclusiveMinimum": 0, "maximum": 1})] = Field(
        None,
        gt=0,
        le=1,
        title="Peak learning rate",
        description="Peak learning rate (train.optim.lr): above 0 and at most 1.",
    )
    eval_every: Annotated[PositiveInt | None, *form_input({"type": "integer", "minimum": 1})] = Field(
        None,
        title="Checkpoint every (tokens)",
        description="Tokens between checkpoints, each evaluated and registered (eval.every): a positive multiple "
        "of global_batch_size x seq_len.",
    )
    backend: Literal["recipe", "local", "kubernetes"] = Field(
        "recipe",
        description="Where training runs (compute.backend): `recipe` keeps the recipe's choice, `local` trains in "
        "processes on the worker's machine, `kubernetes` in pods.",
    )
    procs_per_node: Annotated[int | None, *form_input({"type": "integer", "minimum": 1, "maximum": 64})] = Field(
        None,
        ge=1,
        le=64,
        title="Ranks per node",
        description="Training processes (ranks) per node (compute.procs_per_node): 1 to 64.",
    )
    tracking_uri: Annotated[str | None, *form_input({"type": "string", "minLength": 1})] = Field(
        None,
        min_length=1,
        title="MLflow tracking URI",
        description="MLflow tracking and registry URI (tracking.tracking_uri), e.g. http://127.0.0.1:5000 or "
        "sqlite:///path/mlflow.db.",
    )

    @field_validator("stage_tokens", mode="before")
    @classmethod
    def _rows_from_a_mapping(cls, value):
        # the CLI, the tests and older deployments say {"stage": tokens}; the form says rows
        if isinstance(value, dict):
            return [{"stage": k, "tokens": v} for k, v in value.items()]
        return value

    def updates(self) -> dict[tuple[str, ...], object]:
        """The recipe paths this form changes, and their new values."""
        fields = {
            ("train", "optim", "lr"): self.lr,
            ("eval", "every"): self.eval_every,
            ("compute", "backend"): None if self.backend == "recipe" else self.backend,
            ("compute", "procs_per_node"): self.procs_per_node,
            ("tracking", "tracking_uri"): self.tracking_uri,
        }
        out = {path: value for path, value in fields.items() if value is not None}
        for row in self.stage_tokens or []:
            out[("train", "stages", row.stage, "tokens")] = row.tokens
        return out


def apply_overrides(recipe: Recipe, overrides: RecipeOverrides, source: str = "<recipe>") -> Recipe:
    """A new Recipe with the form's values in place, validated as a whole like the YAML was."""
    updates = overrides.updates()
    if not updates:
        return recipe
    raw = recipe.model_dump(mode="json")
    shown = ", ".join(f"{'.'.join(path)}={value}" for path, value in updates.items())
    where = f"{source} (overrides: {shown})"
    stages = {stage["name"]: i for i, stage in enumerate(raw["train"]["stages"])}
    for path, value in updates.items():
        node = raw
        for key in path[:-1]:
            if isinstance(node, list):  # stages are addressed by name in the form, by index in the recipe
                if key not in stages:
                    raise RecipeError(f"{where}: stage_tokens: no stage named {key!r} (stages: {', '.join(stages)})")
                key = stages[key]
            node = node[key]
        node[path[-1]] = value
    try:
        edited = Recipe.model_validate(raw)
        edited.cross_check()
    except ValidationError as exc:
        err = exc.errors()[0]
        raise RecipeError(f"{where}: {_dotted(err['loc'])}: {err['msg'].removeprefix('Value error, ')}") from None
    except _CrossCheckError as exc:
        raise RecipeError(f"{where}: {_dotted(exc.loc)}: {exc.msg}") from None
    return edited

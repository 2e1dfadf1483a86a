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

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from evaluation.config import EvalConfig
from infra.config import ComputeConfig
from tasks.data.config import DataConfig
from tasks.registry.promote_config import PromoteConfig
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
        if kube.get("secrets"):  # which Secret gives which variable: names only, as manifests carry them
            kube["secrets"] = ",".join(f"{r['name']}:{var}" for r in kube["secrets"] for var in sorted(r["key_map"]))
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
                raise CrossCheckError(("train", "stages", i, "mixture"), f"names no data source: {', '.join(unknown)}")
        misaligned = batch_alignment_error(self.train, self.data.seq_len, self.eval.every)
        if misaligned is not None:
            raise CrossCheckError(*misaligned)
        self._check_batch_split()
        if self.compute.backend == "kubernetes":
            # Pods share no disk with the flow nor with each other, and a restarted pod starts empty.
            for loc, value in ((("data", "root"), self.data.root), (("train", "save_folder"), self.train.save_folder)):
                if not (value or "").startswith("s3://"):
                    raise CrossCheckError(
                        loc,
                        f"{value}: must be an s3:// URI with compute.backend kubernetes "
                        "(pods share no disk with the flow or with each other)",
                    )
            self._check_sources_reach_pods()
            if not self.tracking.tracking_uri.startswith(("http://", "https://", "databricks")):
                raise CrossCheckError(
                    ("tracking", "tracking_uri"),
                    f"{self.tracking.tracking_uri}: pods log to "
                    "MLflow over the network; use an http(s):// tracking server",
                )

    def _check_sources_reach_pods(self) -> None:
        """The prepare Job's pods read every source themselves: an s3:// path, or a Hugging Face dataset the pods
        fetch by name. A path on the flow's disk, which no pod can read, is refused naming the source."""
        for i, src in enumerate(self.data.sources):
            if src.kind == "hf":
                paths = list(src.data_files or [])
                if not paths and (src.path.startswith((".", "/", "~")) or Path(src.path).exists()):
                    paths = [src.path]
                field = "data_files" if src.data_files else "path"
            else:
                paths, field = list(src.paths), "paths"
            local = [p for p in paths if not p.startswith("s3://")]
            if local:
                raise CrossCheckError(
                    ("data", "sources", i, field),
                    f"source '{src.name}': {local[0]} is on this machine's disk, which the prepare Job's pods cannot "
                    "read with compute.backend kubernetes; use an s3:// path (or a Hugging Face dataset by name)",
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
                raise CrossCheckError(loc, f"{batch} sequences do not split evenly over the {spread}")
            share = batch // ranks
            if micro != "auto" and micro < share and share % micro:
                raise CrossCheckError(
                    ("train", "device_microbatch_size"),
                    f"{micro} does not divide the {share} sequences each of the {spread} takes of {field} {batch}",
                )


class CrossCheckError(Exception):
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
        raise CrossCheckError(("data", "tokenizer", "path"), f"{path} does not exist{where}")


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


def dotted(loc: tuple) -> str:
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
        raise RecipeError(f"{source}{f':{line}' if line else ''}: {dotted(loc)}: {msg}{more}") from None
    except CrossCheckError as exc:
        line, loc = _locate(tree, exc.loc)
        raise RecipeError(f"{source}{f':{line}' if line else ''}: {dotted(loc)}: {exc.msg}") from None
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

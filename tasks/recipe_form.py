"""A recipe as a Prefect form shows it: optional fields as plain inputs, the overrides a run's form may make
(stage budgets, the peak LR, the checkpoint interval, the backend, ranks per node, the tracking URI), and the
Recipe they make, validated whole as the YAML was."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, PositiveInt, ValidationError, WithJsonSchema, field_validator

from tasks.recipe import CrossCheckError, Recipe, RecipeError, dotted


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


# The peak-LR input of both forms (a run's overrides, a continuation's rewarm): its bounds and title; each form
# says in its own description what an empty field means.
PeakLR = Annotated[
    float | None,
    *form_input({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    Field(gt=0, le=1, title="Peak learning rate"),
]


class StageBudget(BaseModel):
    """One row of the form's stage budgets."""

    stage: str = Field(..., min_length=1, description="A stage name of the recipe (train.stages[].name).")
    tokens: PositiveInt = Field(
        ..., description="Tokens this stage trains on: a multiple of its global_batch_size x seq_len."
    )


# The form's train.compile choices, and the recipe value each stands for (None: the recipe's own).
CompileChoice = Literal["recipe", "auto", "on", "off"]
COMPILE_CHOICES: dict[str, bool | str | None] = {"recipe": None, "auto": "auto", "on": True, "off": False}
COMPILE_HELP = (
    "train.compile: `recipe` keeps the recipe's choice; `auto` compiles on GPUs and trains eager if compiling fails "
    "there (a warning says why); `on` compiles anywhere and a failure to compile stops the run; `off` trains eager."
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
    lr: PeakLR = Field(None, description="Peak learning rate (train.optim.lr): above 0 and at most 1.")
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
    compile: CompileChoice = Field("recipe", title="Compile the model", description=COMPILE_HELP)
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
            ("train", "compile"): COMPILE_CHOICES[self.compile],
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
        raise RecipeError(f"{where}: {dotted(err['loc'])}: {err['msg'].removeprefix('Value error, ')}") from None
    except CrossCheckError as exc:
        raise RecipeError(f"{where}: {dotted(exc.loc)}: {exc.msg}") from None
    return edited

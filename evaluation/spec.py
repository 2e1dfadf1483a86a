"""The Mosaic Eval Gauntlet's own YAML files, read unchanged into typed specs.

Two files: a task list (`icl_tasks: [...]`, as in llm-foundry's tasks_v0.3.yaml) and a
gauntlet (`eval_gauntlet: {weighting, subtract_random_baseline, rescale_accuracy,
categories, averages}`). Defaults are llm-foundry's: example_delimiter '\\n',
continuation_delimiter ' ', fewshot seed 1234, do_normalization true.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from evaluation.errors import GauntletError
from evaluation.sources import read_text

TaskType = Literal["language_modeling", "multiple_choice", "schema", "generation_task_with_answers", "code_evaluation"]
SUPPORTED_TASK_TYPES: tuple[str, ...] = TaskType.__args__  # type: ignore[attr-defined]
# llm-foundry still accepts the old name of the generation task type.
_TASK_TYPE_ALIASES = {"question_answering": "generation_task_with_answers"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerationKwargs(_Strict):
    """The subset of llm-foundry's `generation_kwargs` that greedy answer generation honours."""

    max_new_tokens: int | None = Field(None, gt=0, description="Cap on generated tokens; default: longest answer.")


class TaskSpec(_Strict):
    """One entry of `icl_tasks`."""

    label: str = Field(..., min_length=1, description="Benchmark name; the gauntlet refers to it.")
    dataset_uri: str = Field(..., min_length=1, description="jsonl file, relative to the eval data_root.")
    num_fewshot: tuple[int, ...] = Field(..., description="Few-shot counts; each is scored separately.")
    icl_task_type: TaskType = Field(..., description="How examples are prompted and scored.")
    prompt_string: str = Field("", description="Text put once before the few-shot examples.")
    example_delimiter: str = Field("\n", description="Separator before each example after the first.")
    continuation_delimiter: str = Field(" ", description="Separator between an example's context and answer.")
    question_prelimiter: str = Field("", description="Text before each context, few-shot ones included.")
    cot_delimiter: str = Field("", description="Generation: text between chain of thought and final answer.")
    early_stopping_criteria: tuple[str, ...] = Field((), description="Generation: stop strings.")
    do_normalization: bool = Field(True, description="Generation: compare answers after TriviaQA normalization.")
    has_categories: bool = Field(False, description="Score each `category` of the records separately, then average.")
    fewshot_random_seed: int | None = Field(None, description="Overrides the eval seed for this task.")
    batch_size: int | None = Field(None, gt=0, description="Overrides the eval batch size for this task.")
    max_seq_len: int | None = Field(None, gt=0, description="Overrides the eval max_seq_len for this task.")
    generation_kwargs: GenerationKwargs = Field(default_factory=GenerationKwargs, description="Generation settings.")
    # Accepted so reference YAMLs load unchanged; scoring is fixed by icl_task_type.
    metric_names: tuple[str, ...] = Field((), description="Ignored: the metric follows icl_task_type.")
    pass_at_k: Any = Field(None, description="code_evaluation only; code tasks are skipped.")
    generations_per_sample: Any = Field(None, description="code_evaluation only; code tasks are skipped.")

    @field_validator("num_fewshot", mode="before")
    @classmethod
    def _listify(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) else v

    @field_validator("early_stopping_criteria", mode="before")
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return () if v is None else v

    @field_validator("icl_task_type", mode="before")
    @classmethod
    def _alias(cls, v: Any) -> Any:
        return _TASK_TYPE_ALIASES.get(v, v)


class Benchmark(_Strict):
    name: str = Field(..., description="A task label from the task list.")
    num_fewshot: int = Field(..., ge=0, description="Which few-shot score of that task counts.")
    random_baseline: float = Field(0.0, ge=0, lt=1, description="Accuracy of random guessing.")


class Category(_Strict):
    name: str = Field(..., description="Category name, e.g. world_knowledge.")
    benchmarks: tuple[Benchmark, ...] = Field(..., min_length=1, description="Benchmarks averaged into it.")


class Weighting(str, enum.Enum):  # noqa: UP042 - StrEnum would change str(), which the gauntlet hash reads
    EQUAL = "EQUAL"
    SAMPLE_SZ = "SAMPLE_SZ"
    LOG_SAMPLE_SZ = "LOG_SAMPLE_SZ"


class GauntletSpec(_Strict):
    """The `eval_gauntlet` section."""

    weighting: Weighting = Field(Weighting.EQUAL, description="How benchmarks weigh inside a category.")
    subtract_random_baseline: bool = Field(True, description="Subtract each benchmark's random baseline.")
    rescale_accuracy: bool = Field(True, description="Divide by (1 - baseline) so every benchmark maxes at 1.")
    categories: tuple[Category, ...] = Field(..., description="Categories of benchmarks.")
    averages: dict[str, tuple[str, ...]] | None = Field(
        None, description="Named averages over categories; none means one `default_average` of all."
    )

    def named_averages(self) -> dict[str, tuple[str, ...]]:
        if self.averages is not None:
            return dict(self.averages)
        return {"default_average": tuple(c.name for c in self.categories)}


def _first_error(exc: ValidationError) -> tuple[str, str]:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "<root>"
    return field, err["msg"]


def _load_yaml(uri: str) -> Any:
    try:
        return yaml.safe_load(read_text(uri))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{uri}:{mark.line + 1}" if mark is not None else uri
        raise GauntletError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from exc


def parse_tasks(raw: Any, source: str = "<tasks>") -> list[TaskSpec]:
    """Validate an `icl_tasks` document; errors name the task and the field."""
    if not isinstance(raw, dict) or not isinstance(raw.get("icl_tasks"), list):
        raise GauntletError(f"{source}: expected a mapping with an `icl_tasks` list")
    tasks = []
    for i, entry in enumerate(raw["icl_tasks"]):
        name = entry.get("label", f"#{i}") if isinstance(entry, dict) else f"#{i}"
        if isinstance(entry, dict):
            kind = entry.get("icl_task_type")
            if kind is not None and _TASK_TYPE_ALIASES.get(kind, kind) not in SUPPORTED_TASK_TYPES:
                raise GauntletError(
                    f"{source}: task '{name}': unknown icl_task_type '{kind}'; "
                    f"supported: {', '.join(SUPPORTED_TASK_TYPES)}"
                )
        try:
            tasks.append(TaskSpec.model_validate(entry))
        except ValidationError as exc:
            field, msg = _first_error(exc)
            raise GauntletError(f"{source}: task '{name}': field '{field}': {msg}") from exc
    labels = [t.label for t in tasks]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise GauntletError(f"{source}: duplicate task label(s): {', '.join(dup)}")
    return tasks


def parse_gauntlet(raw: Any, source: str = "<gauntlet>") -> GauntletSpec:
    """Validate an `eval_gauntlet` document, with llm-foundry's consistency rules."""
    if not isinstance(raw, dict) or not isinstance(raw.get("eval_gauntlet"), dict):
        raise GauntletError(f"{source}: expected a mapping with an `eval_gauntlet` section")
    try:
        spec = GauntletSpec.model_validate(raw["eval_gauntlet"])
    except ValidationError as exc:
        field, msg = _first_error(exc)
        raise GauntletError(f"{source}: eval_gauntlet field '{field}': {msg}") from exc
    if spec.rescale_accuracy and not spec.subtract_random_baseline:
        raise GauntletError(f"{source}: rescale_accuracy requires subtract_random_baseline")
    names = {c.name for c in spec.categories}
    clash = sorted(names & set(spec.named_averages()))
    if clash:
        raise GauntletError(f"{source}: average name(s) also used as category: {', '.join(clash)}")
    return spec


def load_tasks(uri: str) -> list[TaskSpec]:
    return parse_tasks(_load_yaml(uri), uri)


def load_gauntlet(uri: str) -> GauntletSpec:
    return parse_gauntlet(_load_yaml(uri), uri)

"""`tessera eval`: score any model on a gauntlet, optionally against a second one.

`--model` is a Composer checkpoint, an HF model directory, or an MLflow model URI
(`models:/name@alias`, `models:/name/3`). With `--compare-to`, both are scored and the
report shows per-task deltas: the basis for promoting a checkpoint.
"""

from __future__ import annotations

from typing import Annotated

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field, PositiveInt

from evaluation.config import EvalConfig
from tasks.gauntlet.score import comparison_gains, score_model, write_reports
from tasks.recipe_form import form_input


class EvalParams(BaseModel):
    """Score a model on an Eval Gauntlet task list, optionally against a second one. Fields left empty keep their
    defaults."""

    model: str = Field(
        ..., description="Composer checkpoint, HF model directory, or models:/name@alias | models:/name/N."
    )
    tasks: str = Field(..., description="ICL task list YAML (Mosaic Eval Gauntlet format).")
    gauntlet: Annotated[str | None, *form_input({"type": "string", "minLength": 1})] = Field(
        None, description="Gauntlet YAML (categories, weighting, averages). Empty: report the tasks only."
    )
    data_root: str = Field(".", description="Root that task dataset_uri values resolve against (local or s3://).")
    batch_size: PositiveInt = Field(16, description="Sequences per forward pass: 1 or more.")
    max_seq_len: Annotated[PositiveInt | None, *form_input({"type": "integer", "minimum": 1})] = Field(
        None, description="Left-truncate contexts to this many tokens, 1 or more. Empty: the model's own length."
    )
    seed: int = Field(1234, description="Few-shot sampling seed.")
    strict: bool = Field(False, description="Fail when a task file is missing instead of skipping it.")
    tracking_uri: Annotated[str | None, *form_input({"type": "string", "minLength": 1})] = Field(
        None, description="MLflow tracking/registry URI for models:/ URIs."
    )
    compare_to: Annotated[str | None, *form_input({"type": "string", "minLength": 1})] = Field(
        None, description="A second model (same forms as `model`) to compare against."
    )
    output_dir: Annotated[str | None, *form_input({"type": "string", "minLength": 1})] = Field(
        None, description="Write report.md, report.json, report.html (and comparison.md) here."
    )
    run_id: Annotated[str | None, *form_input({"type": "string", "minLength": 1})] = Field(
        None, description="Also log metrics, table and reports to this MLflow run (needs tracking_uri)."
    )
    step: int = Field(0, ge=0, description="MLflow step for those metrics: the model's training tokens.")
    trust_checkpoint: bool = Field(
        False,
        title="Trust the checkpoint files",
        description="Load a Composer checkpoint even if it needs more than tensors and plain values to unpickle, "
        "which can run code it carries. Off: such a file is refused in one line. Only for files you made or trust.",
    )


class EvalOutcome(BaseModel):
    average: float = Field(..., description="Headline score of `model`.")
    metrics: dict[str, float] = Field(..., description="icl/..., gauntlet/... metrics of `model`.")
    markdown: str = Field(..., description="The report table (and comparison, if any) as markdown.")
    baseline_average: float | None = Field(None, description="Headline score of `compare_to`.")
    gain_interval: tuple[float, float] | None = Field(
        None, description="Paired-bootstrap interval of the headline's gain over `compare_to` (evaluation/noise.py)."
    )
    confidence: float | None = Field(None, description="The interval's confidence.")
    files: list[str] = Field(default_factory=list, description="Report files written under output_dir.")


@flow(name="tessera-eval", log_prints=True, validate_parameters=False)
def eval_flow(params: EvalParams) -> EvalOutcome:
    from tasks.runs.flow_outcome import form_values

    params = form_values(EvalParams, params)  # one line, also with the UI's validation switched off

    cfg = EvalConfig(
        every=1,  # unused outside training
        tasks=params.tasks,
        gauntlet=params.gauntlet,
        data_root=params.data_root,
        batch_size=params.batch_size,
        max_seq_len=params.max_seq_len,
        seed=params.seed,
        strict=params.strict,
    )
    trust = params.trust_checkpoint
    report = score_model(params.model, cfg, params.tracking_uri, trust=trust)
    baseline = score_model(params.compare_to, cfg, params.tracking_uri, trust=trust) if params.compare_to else None
    gains = comparison_gains(cfg, baseline, report) if baseline is not None else None
    headline_gain = gains.of(report.headline) if gains is not None else None
    written = write_reports(
        report,
        baseline,
        params.model,
        params.compare_to,
        params.output_dir,
        params.tracking_uri,
        params.run_id,
        params.step,
        gains,
    )
    create_markdown_artifact(markdown=written.markdown, description=f"tessera eval of {params.model}")
    print(written.markdown)
    return EvalOutcome(
        average=report.average,
        metrics=report.metrics(),
        markdown=written.markdown,
        baseline_average=None if baseline is None else baseline.average,
        gain_interval=None if headline_gain is None else (headline_gain.low, headline_gain.high),
        confidence=None if gains is None else gains.confidence,
        files=written.files,
    )

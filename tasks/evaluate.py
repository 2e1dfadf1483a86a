"""Score one checkpoint on the gauntlet, log it to the training run, and leave a markdown artifact.

The pipeline submits one of these per checkpoint while training goes on, on CPU.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from evaluation.config import EvalConfig
from evaluation.errors import GauntletError
from tasks.retry import retry_unless
from tasks.tracking import resolved_uri
from tasks.tracking_config import TrackingConfig
from trainers.checkpoints import CheckpointInfo


class EvalSummary(BaseModel):
    """What the register task and the flow need from a gauntlet run."""

    tokens: int = Field(..., description="Training tokens of the checkpoint (the MLflow step).")
    stage: str = Field(..., description="Curriculum stage that produced the checkpoint.")
    checkpoint: str = Field(..., description="Checkpoint file that was scored.")
    average: float = Field(..., description="Headline score: the gauntlet's first named average.")
    metrics: dict[str, float] = Field(..., description="icl/<task>/<n>-shot, gauntlet/<category>, gauntlet/<average>.")
    report_json: str | None = Field(None, description="Run-relative artifact path of the report JSON.")
    report_html: str | None = Field(None, description="Run-relative artifact path of the HTML report.")
    table: str | None = Field(None, description="Run-relative artifact path of the per-task MLflow table.")


def artifact_key(tokens: int) -> str:
    # Prefect artifact keys allow only lowercase letters, digits and dashes.
    return f"gauntlet-tok-{tokens:012d}"


# Retry crashes and flaky I/O, not a malformed task file: that fails the same way every time.
retry_unless_bad_input = retry_unless(GauntletError)


# Not cached: the side effects (MLflow metrics, artifacts) are the point, and a rerun is idempotent
# enough (same metric values at the same step) while a stale cache hit would hide a changed gauntlet.
@task(
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless_bad_input,
    cache_policy=NO_CACHE,
    task_run_name="evaluate-tok-{checkpoint.tokens}",
)
def evaluate_checkpoint(
    checkpoint: CheckpointInfo, cfg: EvalConfig, tracking: TrackingConfig, run_id: str, max_seq_len: int
) -> EvalSummary:
    from evaluation.models import load_model
    from evaluation.runner import run_gauntlet
    from evaluation.tracking import log_report

    logger = get_run_logger()
    loaded = load_model(checkpoint.path)
    report = run_gauntlet(loaded.model, loaded.tokenizer, cfg, max_seq_len)
    title = f"Gauntlet at {checkpoint.tokens:,} tokens (stage {checkpoint.stage})"
    paths = log_report(resolved_uri(tracking.tracking_uri), run_id, report, step=checkpoint.tokens, title=title)
    create_markdown_artifact(
        key=artifact_key(checkpoint.tokens),
        markdown=report.to_markdown(title),
        description=f"Eval gauntlet of {checkpoint.path}",
    )
    logger.info("%s: average %.4f (%d examples in %.1fs)", title, report.average, report.examples, report.seconds)
    return EvalSummary(
        tokens=checkpoint.tokens,
        stage=checkpoint.stage,
        checkpoint=checkpoint.path,
        average=report.average,
        metrics=report.metrics(),
        report_json=paths.json,
        report_html=paths.html,
        table=paths.table,
    )

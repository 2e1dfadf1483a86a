"""Score one checkpoint on the gauntlet, log it to the training run, and leave a markdown artifact.

The pipeline submits one of these per checkpoint while training goes on: in this process with the
local backend; with the kubernetes backend in a one-pod GPU Job (`python -m evaluation`), at most
compute.kubernetes.eval_concurrency at once, so the flow never loads the model itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import CacheKeyFnPolicy
from pydantic import BaseModel, Field

from evaluation.config import EvalConfig
from evaluation.errors import GauntletError
from infra.config import ComputeConfig
from tasks.artifacts import artifact_key
from tasks.mlflow_run import resolved_uri, retrying
from tasks.retry import retry_unless
from tasks.tracking_config import TrackingConfig
from trainers.format.checkpoints import CheckpointInfo
from trainers.format.mlflow_model import model_uri_for


class EvalSummary(BaseModel):
    """What the register task and the flow need from a gauntlet run."""

    tokens: int = Field(..., description="Training tokens of the checkpoint (the MLflow step).")
    stage: str = Field(..., description="Curriculum stage that produced the checkpoint.")
    checkpoint: str = Field(..., description="Checkpoint file that was scored.")
    average: float = Field(..., description="Headline score: the gauntlet's first named average.")
    headline: str = Field("average_score", description="Name of the headline score (e.g. core_average).")
    model_uri: str | None = Field(
        None, description="The checkpoint already packaged as an MLflow Model at this URI (by an evaluation pod)."
    )
    gauntlet_hash: str = Field(
        "", description="Identity of the gauntlet that produced the scores (evaluation.identity)."
    )
    metrics: dict[str, float] = Field(..., description="icl/<task>/<n>-shot, gauntlet/<category>, gauntlet/<average>.")
    report_json: str | None = Field(None, description="Run-relative artifact path of the report JSON.")
    report_html: str | None = Field(None, description="Run-relative artifact path of the HTML report.")
    table: str | None = Field(None, description="Run-relative artifact path of the per-task MLflow table.")


# Retry crashes and flaky I/O, not a malformed task file: that fails the same way every time.
retry_unless_bad_input = retry_unless(GauntletError)


def scored_key(context, parameters: dict) -> str:
    """A checkpoint's score is kept (Prefect's cache, its result persisted) under everything it depends on: the
    MLflow run it was logged to, the checkpoint's bytes (its manifest's SHA-256, or its files'), the gauntlet's
    identity (task files, settings, scoring code: evaluation.identity) and the sequence length. A rerun after a
    cancel or a crash between scoring and registering reads it instead of scoring the same bytes again (the report
    is in the run already); a changed gauntlet or checkpoint is another key, so nothing stale is ever read."""
    import hashlib

    from evaluation.identity import gauntlet_hash

    ckpt: CheckpointInfo = parameters["checkpoint"]
    files = json.dumps([f.model_dump() for f in ckpt.files or []], sort_keys=True)
    digest = ckpt.sha256 or hashlib.sha256(f"{Path(ckpt.path).name}\0{files}".encode()).hexdigest()
    parts = [parameters["run_id"], str(ckpt.tokens), digest, gauntlet_hash(parameters["cfg"])]
    return "gauntlet-" + "-".join(parts + [str(parameters["max_seq_len"])])


@task(
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless_bad_input,
    cache_policy=CacheKeyFnPolicy(cache_key_fn=scored_key),
    persist_result=True,
    task_run_name="evaluate-tok-{checkpoint.tokens}",
)
def evaluate_checkpoint(
    checkpoint: CheckpointInfo,
    cfg: EvalConfig,
    tracking: TrackingConfig,
    run_id: str,
    max_seq_len: int,
    run_name: str = "",
    compute: ComputeConfig | None = None,
) -> EvalSummary:
    if compute is not None and compute.backend == "kubernetes":
        return _evaluate_in_pod(checkpoint, cfg, tracking, run_id, max_seq_len, run_name, compute)
    from evaluation.identity import gauntlet_hash
    from evaluation.mlflow_report import log_report
    from evaluation.models import check_checkpoint, load_model
    from evaluation.runner import run_gauntlet

    logger = get_run_logger()
    checked = check_checkpoint(checkpoint.path, checkpoint.sha256, files=checkpoint.files)
    if not checked.by_manifest:  # a manifest written before hashes were recorded
        logger.warning(checked.line)
    loaded = load_model(checkpoint.path, verified=True)
    report = run_gauntlet(loaded.model, loaded.tokenizer, cfg, max_seq_len)
    title = f"Gauntlet at {checkpoint.tokens:,} tokens (stage {checkpoint.stage})"
    stamp = int(time.time() * 1000)  # one timestamp for every attempt: a retried log adds no duplicate points
    paths = retrying(
        f"logging the gauntlet at {checkpoint.tokens} tokens",
        lambda: log_report(
            resolved_uri(tracking.tracking_uri), run_id, report, step=checkpoint.tokens, title=title, timestamp_ms=stamp
        ),
    )
    create_markdown_artifact(
        key=artifact_key(run_name or run_id, "gauntlet", f"tok-{checkpoint.tokens:012d}"),
        markdown=report.to_markdown(title),
        # the file's name, not its path: the flow scores a pin (a hard link) that is gone once registered
        description=f"{report.headline} {report.average:.4f}: {title}, checkpoint {Path(checkpoint.path).name}",
    )
    logger.info("%s: average %.4f (%d examples in %.1fs)", title, report.average, report.examples, report.seconds)
    return EvalSummary(
        tokens=checkpoint.tokens,
        stage=checkpoint.stage,
        checkpoint=checkpoint.path,
        average=report.average,
        headline=report.headline,
        gauntlet_hash=gauntlet_hash(cfg),
        metrics=report.metrics(),
        report_json=paths.json,
        report_html=paths.html,
        table=paths.table,
    )


EVAL_PODS_LIMIT = "tessera-eval-pods"  # Prefect global concurrency limit: evaluation pods running at once


def pod_args(
    checkpoint: CheckpointInfo, cfg: EvalConfig, tracking: TrackingConfig, run_id: str, max_seq_len: int
) -> list[str]:
    """`python -m evaluation`'s arguments for one checkpoint: what the in-process task would do, in a pod."""
    args = [
        "--checkpoint",
        checkpoint.path,
        "--tasks",
        cfg.tasks,
        "--data-root",
        cfg.data_root,
        "--batch-size",
        str(cfg.batch_size),
        "--seed",
        str(cfg.seed),
        "--context-len",
        str(max_seq_len),
        "--tracking-uri",
        resolved_uri(tracking.tracking_uri),
        "--run-id",
        run_id,
        "--step",
        str(checkpoint.tokens),
        "--stage",
        checkpoint.stage,
        "--timestamp-ms",
        str(int(time.time() * 1000)),
        "--device",
        cfg.device,
        # the pod has the model loaded: it packages it for registration, so the flow pod never loads it
        "--package-to",
        model_uri_for(checkpoint.path.rsplit("/", 1)[0], checkpoint.tokens),
    ]
    args += ["--sha256", checkpoint.sha256] if checkpoint.sha256 else []
    if checkpoint.files is not None:  # sharded: the pod downloads and verifies each file of the folder
        args += ["--files", json.dumps([f.model_dump() for f in checkpoint.files])]
    args += ["--gauntlet", cfg.gauntlet] if cfg.gauntlet else []
    args += ["--max-seq-len", str(cfg.max_seq_len)] if cfg.max_seq_len else []
    args += ["--strict"] if cfg.strict else []
    return args


def run_eval_pod(
    compute: ComputeConfig, args: list[str], *, unit: str, tokens: int, what: str, max_bytes: int = 1 << 20
) -> list[str]:
    """`python -m evaluation ARGS` in a one-pod Job through the training launcher, within the limit of pods at once
    (compute.kubernetes.eval_concurrency); the lines of its log. A bad-input exit raises GauntletError with the
    pod's own line (never retried), any other failure RuntimeError (retried by the calling task).

    `unit` and `tokens` name the Job (a restarted flow finds a live pod of the same work again) and its log's
    own folder: two pods at once never write one file, so no flow reads another's summary line."""
    import tempfile

    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency

    from evaluation.protocol import BAD_INPUT, EXIT_FATAL
    from infra import backend_for

    logger = get_run_logger()
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(EVAL_PODS_LIMIT, compute.kubernetes.eval_concurrency)
    log_dir = Path(tempfile.gettempdir()) / "tessera-eval" / unit / f"tok-{tokens}"
    with concurrency(EVAL_PODS_LIMIT, occupy=1, strict=True):
        job = backend_for(compute).launch_one("evaluation", args, run=unit, tokens=tokens, log_dir=log_dir)
        logger.info("%s: pod log at %s", what, job.log_path)
        try:
            code = job.wait()
        finally:
            job.cancel()
    lines = job.tail(lines=1 << 30, max_bytes=max_bytes).splitlines()
    if code != 0:
        logger.error("evaluation pod of %s failed:\n%s", what, "\n".join(lines[-200:]))
        # the pod's own one line says what was wrong with the input; the launcher's last line only how it ended
        why = next((x.removeprefix(BAD_INPUT) for x in reversed(lines) if x.startswith(BAD_INPUT)), None)
        error = GauntletError if code == EXIT_FATAL else RuntimeError
        raise error(f"{what} exited {code}: {why or (lines[-1] if lines else '')}")
    return lines


def _evaluate_in_pod(
    checkpoint: CheckpointInfo,
    cfg: EvalConfig,
    tracking: TrackingConfig,
    run_id: str,
    max_seq_len: int,
    run_name: str,
    compute: ComputeConfig,
) -> EvalSummary:
    """The gauntlet in its own pod, through the training launcher; the pod logs to MLflow, this reads its summary."""
    from evaluation.protocol import parse_summary

    logger = get_run_logger()
    what = f"evaluation of {checkpoint.path}"
    lines = run_eval_pod(
        compute,
        pod_args(checkpoint, cfg, tracking, run_id, max_seq_len),
        unit=run_name or run_id,
        tokens=checkpoint.tokens,
        what=what,
    )
    summary = next((s for s in map(parse_summary, reversed(lines)) if s is not None), None)
    if summary is None:
        raise RuntimeError(f"{what} ended without its summary line")
    create_markdown_artifact(
        key=artifact_key(run_name or run_id, "gauntlet", f"tok-{checkpoint.tokens:012d}"),
        markdown=summary["markdown"],
        description=f"Eval gauntlet of {checkpoint.path}",
    )
    logger.info(
        "gauntlet at %s tokens: average %.4f (%d examples in %.1fs, in pod)",
        f"{checkpoint.tokens:,}",
        summary["average"],
        summary["examples"],
        summary["seconds"],
    )
    return EvalSummary(
        tokens=checkpoint.tokens,
        stage=checkpoint.stage,
        checkpoint=checkpoint.path,
        **{
            k: summary[k]
            for k in (
                "average",
                "headline",
                "gauntlet_hash",
                "metrics",
                "report_json",
                "report_html",
                "table",
                "model_uri",
            )
        },
    )

"""Scoring a model on the gauntlet outside training: `tessera eval`, `tessera compare`, promotion.

`score_model` loads any model tessera can name (a Composer checkpoint, an HF directory, a models:/ URI)
and runs the gauntlet on it in this process; `score_in_pod` does the same in an evaluation pod
(`python -m evaluation --report-only`), for the kubernetes backend, where the flow never loads a model;
`write_reports` turns one or two reports into the markdown, the report files and, when asked, the
metrics of an MLflow run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evaluation.config import EvalConfig
from evaluation.report import GauntletReport
from infra.config import ComputeConfig
from tasks.gauntlet.evaluate import retry_unless_bad_input, run_eval_pod


@task(cache_policy=NO_CACHE, task_run_name="score-{model}")
def score_model(model: str, cfg: EvalConfig, tracking_uri: str | None, *, trust: bool = False):
    """Load and score one model; returns an evaluation.GauntletReport. `trust`: see evaluation.models.load_model."""
    from evaluation.models import load_model
    from evaluation.runner import run_gauntlet

    loaded = load_model(model, tracking_uri, trust=trust)
    return run_gauntlet(loaded.model, loaded.tokenizer, cfg, cfg.max_seq_len or loaded.max_seq_len)


def report_pod_args(model: str, cfg: EvalConfig, tracking_uri: str | None) -> list[str]:
    """`python -m evaluation --report-only`'s arguments: what score_model does in this process, in a pod."""
    args = ["--report-only", "--checkpoint", model, "--tasks", cfg.tasks, "--data-root", cfg.data_root]
    args += ["--batch-size", str(cfg.batch_size), "--seed", str(cfg.seed), "--device", cfg.device]
    args += ["--gauntlet", cfg.gauntlet] if cfg.gauntlet else []
    args += ["--max-seq-len", str(cfg.max_seq_len)] if cfg.max_seq_len else []
    args += ["--strict"] if cfg.strict else []
    args += ["--tracking-uri", tracking_uri] if tracking_uri else []
    return args


# The report carries one character per example scored (its outcomes), so a large gauntlet's summary line can
# outgrow the 1 MiB a tail reads by default, and a line cut at its start no longer parses.
_SUMMARY_MAX_BYTES = 64 << 20


@task(
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless_bad_input,
    cache_policy=NO_CACHE,
    task_run_name="score-{model}-in-pod",
)
def score_in_pod(
    model: str, cfg: EvalConfig, tracking_uri: str | None, compute: ComputeConfig, unit: str
) -> GauntletReport:
    """Score one model in an evaluation pod, as `_evaluate_in_pod` scores a checkpoint
    (tasks.gauntlet.evaluate.run_eval_pod: the same launcher, limit on pods at once and failures). `unit` names the
    pod's Job, so a restarted flow finds the pod of the same model again instead of starting another."""
    from evaluation.protocol import parse_summary

    logger = get_run_logger()
    what = f"scoring {model}"
    args = report_pod_args(model, cfg, tracking_uri)
    lines = run_eval_pod(compute, args, unit=unit, tokens=0, what=what, max_bytes=_SUMMARY_MAX_BYTES)
    summary = next((s for s in map(parse_summary, reversed(lines)) if s is not None and "report" in s), None)
    if summary is None:
        raise RuntimeError(f"the evaluation pod {what} ended without its report")
    report = GauntletReport.from_json(json.dumps(summary["report"]))
    logger.info(
        "%s: %s %.4f (%d examples in %.1fs, in pod)",
        model,
        report.headline,
        report.average,
        report.examples,
        report.seconds,
    )
    return report


COMPARE_CONFIDENCE = 0.95


def comparison_gains(cfg: EvalConfig, baseline, report):
    """`report`'s gains over `baseline` with their paired-bootstrap intervals (evaluation/noise.py), or None
    when the two cannot be paired example by example."""
    from evaluation.noise import NotPaired, paired_gains
    from evaluation.spec import load_gauntlet

    spec = load_gauntlet(cfg.gauntlet) if cfg.gauntlet else None
    try:
        return paired_gains(spec, baseline, report, report.headline, confidence=COMPARE_CONFIDENCE)
    except NotPaired:
        return None


@dataclass
class Written:
    markdown: str
    files: list[str] = field(default_factory=list)


@task(cache_policy=NO_CACHE)
def write_reports(
    report,
    baseline,
    model: str,
    compare_to: str | None,
    output_dir: str | None,
    tracking_uri: str | None = None,
    run_id: str | None = None,
    step: int = 0,
    gains=None,
) -> Written:
    """The markdown of `report` (and its comparison with `baseline`), its files under `output_dir`, and its
    metrics on MLflow run `run_id` when given."""
    from evaluation.html import render_html
    from evaluation.report import compare_markdown

    title = f"Eval gauntlet: {model}"
    markdown = report.to_markdown(title)
    intervals = {k: (iv.low, iv.high) for k, iv in gains.gains.items()} if gains is not None else None
    confidence = gains.confidence if gains is not None else None
    comparison = (
        compare_markdown(baseline, report, compare_to, model, intervals, confidence) if baseline is not None else None
    )
    if comparison:
        markdown = f"{markdown}\n{comparison}"
    if run_id:
        from evaluation.mlflow_report import log_report

        if not tracking_uri:
            raise ValueError("run_id needs tracking_uri")
        log_report(tracking_uri, run_id, report, step=step, title=title)
    written = Written(markdown)
    if output_dir:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        texts = {
            "report.md": report.to_markdown(title),
            "report.json": report.to_json(),
            "report.html": render_html(report, title),
        }
        if comparison:
            from evaluation.compare import compare_png, render_comparison_html

            texts["comparison.md"] = comparison
            texts["comparison.html"] = render_comparison_html(
                baseline, report, compare_to, model, f"{compare_to} vs {model}", None, intervals, confidence
            )
            png = compare_png(baseline, report, compare_to, model, intervals, confidence)
            if png is not None:
                (out / "comparison.png").write_bytes(png)
                written.files.append(str(out / "comparison.png"))
        for name, text in texts.items():
            (out / name).write_text(text)
            written.files.append(str(out / name))
    return written

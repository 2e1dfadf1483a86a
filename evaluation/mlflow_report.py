"""Putting a GauntletReport on an MLflow run: metrics at step = tokens, a table, JSON and HTML."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from evaluation.html import History, render_html
from evaluation.report import GauntletReport


@dataclass(frozen=True)
class LoggedReport:
    table: str
    json: str
    html: str


def metric_key(name: str) -> str:
    """MLflow accepts only [A-Za-z0-9_-. /] in keys; a category from a task file may hold others."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", name)


def _history(client, run_id: str, names: list[str]) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for name in names:
        points = {m.step: m.value for m in client.get_metric_history(run_id, name)}  # last write per step wins
        out[name.removeprefix("gauntlet/")] = sorted(points.items())
    return out


def report_paths(step: int) -> LoggedReport:
    """Where the report of the checkpoint at `step` tokens is logged in its run's artifacts."""
    tag = f"tok-{step:012d}"
    return LoggedReport(f"eval/table-{tag}.json", f"eval/gauntlet-{tag}.json", f"eval/report-{tag}.html")


def log_report(
    tracking_uri: str, run_id: str, report: GauntletReport, step: int, title: str, timestamp_ms: int | None = None
) -> LoggedReport:
    """Log metrics with step = tokens seen, then the per-task table and reports under `eval/`.

    Pass the same `timestamp_ms` when retrying after a tracking outage: MLflow stores a metric
    point once per (key, value, timestamp, step), so a retried call adds no duplicate points.
    """
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    now = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    metrics = [Metric(metric_key(key), float(value), now, step) for key, value in report.metrics().items()]
    for i in range(0, len(metrics), 500):  # MLflow caps a batch at 1000 entries
        client.log_batch(run_id, metrics=metrics[i : i + 500])

    rows = report.table_rows()
    table = {k: [r[k] for r in rows] for k in ("task", "shots", "type", "examples", "accuracy", "baseline", "score")}
    paths = report_paths(step)
    client.log_table(run_id, data=table, artifact_file=paths.table)
    client.log_text(run_id, report.to_json(), paths.json)

    series = [f"gauntlet/{k}" for k in [*report.averages, *report.categories]] or [f"icl/{t.key}" for t in report.tasks]
    history: History = _history(client, run_id, series) if series else {}
    client.log_text(run_id, render_html(report, title, history), paths.html)
    return paths

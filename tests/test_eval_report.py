"""Report renderings: metric keys, markdown table, JSON round trip, side-by-side comparison."""

from __future__ import annotations

import pytest

from evaluation.mlflow_report import metric_key
from evaluation.report import GauntletReport, TaskResult, compare_markdown


def _report(copa: float, lambada: float) -> GauntletReport:
    return GauntletReport(
        tasks=[
            TaskResult("copa", 0, "multiple_choice", copa, 100, random_baseline=0.5, score=(copa - 0.5) / 0.5),
            TaskResult("jeopardy", 3, "language_modeling", lambada, 40, categories={"history": lambada}),
        ],
        categories={"commonsense_reasoning": (copa - 0.5) / 0.5},
        averages={"core_average": (copa - 0.5) / 0.5},
        skipped={"gsm8k": "task file missing"},
    )


def test_metrics_markdown_and_json():
    r = _report(0.7, 0.25)
    assert r.metrics() == {
        "icl/copa/0-shot": 0.7,
        "icl/jeopardy/3-shot": 0.25,
        "icl/jeopardy/3-shot/history": 0.25,
        "gauntlet/commonsense_reasoning": pytest.approx(0.4),
        "gauntlet/core_average": pytest.approx(0.4),
    }
    assert r.average == pytest.approx(0.4)
    md = r.to_markdown()
    assert "| copa | 0 | multiple_choice | 100 | 0.7000 | 0.50 | 0.4000 |" in md
    assert "| jeopardy | 3 | language_modeling | 40 | 0.2500 |  |  |" in md
    assert "gsm8k (task file missing)" in md
    assert GauntletReport.from_json(r.to_json()) == r


def test_comparison_shows_per_task_deltas():
    md = compare_markdown(_report(0.6, 0.25), _report(0.7, 0.20), "v1", "v2")
    assert "Headline average: 0.2000 -> 0.4000 (+0.2000)" in md
    assert "| copa/0-shot | 0.6000 | 0.7000 | +0.1000 | 0.2000 | 0.4000 | +0.2000 |" in md
    assert "| jeopardy/3-shot | 0.2500 | 0.2000 | -0.0500 |" in md


def test_metric_keys_are_mlflow_safe():
    assert metric_key("icl/mmlu/5-shot/law & order: 2") == "icl/mmlu/5-shot/law _ order_ 2"

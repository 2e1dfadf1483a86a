"""Gauntlet arithmetic: baselines, rescaling, weights, dropped categories, named averages."""

from __future__ import annotations

import math

import pytest

from evaluation.aggregate import aggregate
from evaluation.spec import parse_gauntlet


def _spec(weighting="EQUAL", subtract=True, rescale=True, averages=None):
    raw = {
        "eval_gauntlet": {
            "weighting": weighting,
            "subtract_random_baseline": subtract,
            "rescale_accuracy": rescale,
            "categories": [
                {
                    "name": "reasoning",
                    "benchmarks": [
                        {"name": "mc4", "num_fewshot": 0, "random_baseline": 0.25},
                        {"name": "lm", "num_fewshot": 3, "random_baseline": 0.0},
                    ],
                },
                {"name": "knowledge", "benchmarks": [{"name": "mc2", "num_fewshot": 5, "random_baseline": 0.5}]},
                {"name": "absent", "benchmarks": [{"name": "nowhere", "num_fewshot": 0, "random_baseline": 0.0}]},
            ],
        }
    }
    if averages is not None:
        raw["eval_gauntlet"]["averages"] = averages
    return parse_gauntlet(raw)


ACC = {("mc4", 0): 0.55, ("lm", 3): 0.30, ("mc2", 5): 0.80}
SIZES = {("mc4", 0): 16, ("lm", 3): 4, ("mc2", 5): 100}


def test_equal_weights_with_baseline_subtraction_and_rescaling():
    scores = aggregate(_spec(averages={"core": ["reasoning", "knowledge"]}), ACC, SIZES)
    # mc4: (0.55 - 0.25) / 0.75 = 0.4; lm: 0.3; mc2: (0.8 - 0.5) / 0.5 = 0.6
    assert scores.categories["reasoning"] == pytest.approx((0.4 + 0.3) / 2)
    assert scores.categories["knowledge"] == pytest.approx(0.6)
    assert "absent" not in scores.categories
    assert any("absent" in w and "nowhere/0-shot" in w for w in scores.warnings)
    assert scores.averages == {"core": pytest.approx((0.35 + 0.6) / 2)}


def test_subtract_without_rescale_and_raw_accuracy():
    scores = aggregate(_spec(rescale=False), ACC, SIZES)
    assert scores.categories["reasoning"] == pytest.approx(((0.55 - 0.25) + 0.3) / 2)
    scores = aggregate(_spec(subtract=False, rescale=False), ACC, SIZES)
    assert scores.categories["reasoning"] == pytest.approx((0.55 + 0.3) / 2)
    assert scores.categories["knowledge"] == pytest.approx(0.8)


def test_sample_size_weights():
    scores = aggregate(_spec("SAMPLE_SZ"), ACC, SIZES)
    assert scores.categories["reasoning"] == pytest.approx((0.4 * 16 + 0.3 * 4) / 20)
    scores = aggregate(_spec("LOG_SAMPLE_SZ"), ACC, SIZES)
    w1, w2 = math.log2(16), max(math.log2(4), 1)
    assert scores.categories["reasoning"] == pytest.approx((0.4 * w1 + 0.3 * w2) / (w1 + w2))


def test_default_average_and_averages_naming_missing_categories():
    scores = aggregate(_spec(), ACC, SIZES)
    # no `averages`: one default_average over every category that was scored
    assert scores.averages == {"default_average": pytest.approx((0.35 + 0.6) / 2)}
    scores = aggregate(_spec(averages={"core": ["knowledge", "programming"], "none": ["absent"]}), ACC, SIZES)
    assert scores.averages["core"] == pytest.approx(0.6)
    assert scores.averages["none"] == 0.0
    assert any("programming" in w for w in scores.warnings)


def test_reference_gauntlet_tolerates_its_missing_programming_category():
    from pathlib import Path

    from evaluation.spec import load_gauntlet

    path = Path(__file__).resolve().parents[1] / "data" / "gauntlet" / "yamls" / "eval_gauntlet.yaml"
    spec = load_gauntlet(str(path))
    acc = {(b.name, b.num_fewshot): 0.5 for c in spec.categories for b in c.benchmarks}
    scores = aggregate(spec, acc, {})
    assert any("'core_average'" in w and "programming" in w for w in scores.warnings)
    # every benchmark at 0.5: a 0.5-baseline one scores 0, a 0.25 one 1/3, a 0 one 0.5
    wk = [b for b in scores.benchmarks if b.category == "world_knowledge"]
    assert scores.categories["world_knowledge"] == pytest.approx(sum(b.score for b in wk) / len(wk))
    assert scores.averages["core_average"] == pytest.approx(
        sum(
            scores.categories[c]
            for c in (
                "world_knowledge",
                "commonsense_reasoning",
                "language_understanding",
                "symbolic_problem_solving",
                "reading_comprehension",
            )
        )
        / 5
    )

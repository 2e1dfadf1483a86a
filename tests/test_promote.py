"""The promotion rule, and how its decisions are written into a real (sqlite) MLflow registry."""

from __future__ import annotations

import pytest

from evaluation.report import GauntletReport, TaskResult
from tasks.promote import bootstrap, decide, promote_by_hand, record_decision
from tasks.promote_config import PromoteConfig
from tasks.register import CHAMPION_ALIAS, PREVIOUS_CHAMPION_ALIAS


def _report(reasoning: float, language: float) -> GauntletReport:
    return GauntletReport(
        tasks=[TaskResult("copa", 0, "multiple_choice", 0.5 + reasoning / 2, 100, random_baseline=0.5, score=reasoning)],
        categories={"commonsense_reasoning": reasoning, "language_understanding": language},
        averages={"core_average": (reasoning + language) / 2},
    )


def test_rule_accepts_a_gain_with_no_category_falling_too_far():
    d = decide(_report(0.30, 0.40), _report(0.36, 0.395), PromoteConfig(min_gain=0.0, max_category_drop=0.01))
    assert d.accepted and d.reasons == []
    assert d.headline == "core_average" and d.gain == pytest.approx(0.0275)
    assert d.category_deltas == pytest.approx({"commonsense_reasoning": 0.06, "language_understanding": -0.005})
    assert d.summary() == "core_average 0.3775 vs 0.3500 (+0.0275), worst category language_understanding -0.0050"


def test_rule_rejects_too_small_a_gain_and_a_category_that_falls():
    d = decide(_report(0.30, 0.40), _report(0.40, 0.35), PromoteConfig(min_gain=0.05, max_category_drop=0.01))
    assert not d.accepted
    assert d.reasons == [
        "core_average gained +0.0250, less than promote.min_gain +0.0500",
        "category language_understanding fell -0.0500, more than promote.max_category_drop 0.0100",
    ]
    named = decide(_report(0.30, 0.40), _report(0.40, 0.35), PromoteConfig(headline="commonsense_reasoning",
                                                                            max_category_drop=1.0))  # fmt: skip
    assert named.accepted and named.gain == pytest.approx(0.10)
    with pytest.raises(ValueError, match="'nope' is not an average or category"):
        decide(_report(0.3, 0.4), _report(0.3, 0.4), PromoteConfig(headline="nope"))


@pytest.fixture()
def registry(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri, uri)
    client.create_registered_model("m")
    for tokens, score in ((1024, 0.30), (2048, 0.35), (3072, 0.32)):
        client.create_model_version("m", source=f"file:///tmp/v{tokens}", tags={
            "tokens": str(tokens), "stage": "s", "run": "base", "gauntlet_average": f"{score:.6f}",
            "headline": "core_average", "gauntlet_hash": "g"})  # fmt: skip
    return client


def test_bootstrap_then_accepted_then_rejected_are_all_recorded(registry):
    assert bootstrap(registry, "m", "2", "base")
    assert not bootstrap(registry, "m", "3", "base")  # a champion exists: bootstrap never moves it
    assert str(registry.get_model_version_by_alias("m", CHAMPION_ALIAS).version) == "2"
    v2 = registry.get_model_version("m", "2")
    assert v2.tags["promotion"] == "bootstrap"
    assert "champion: champion since " in v2.description and "(bootstrap)" in v2.description

    accept = decide(_report(0.30, 0.40), _report(0.36, 0.395), PromoteConfig())
    record_decision(registry, "m", "2", "3", accept, "cpt-1")
    assert str(registry.get_model_version_by_alias("m", CHAMPION_ALIAS).version) == "3"
    assert str(registry.get_model_version_by_alias("m", PREVIOUS_CHAMPION_ALIAS).version) == "2"
    v3, v2 = registry.get_model_version("m", "3"), registry.get_model_version("m", "2")
    assert v3.tags["promotion"] == "accepted" and v2.tags["promotion"] == "accepted"
    assert v3.tags["promotion.vs"] == "v2 (champion)" and v2.tags["promotion.vs"] == "v3 (challenger)"
    assert v3.tags["promotion.delta.core_average"] == "+0.027500"
    assert v3.tags["promotion.delta.category.language_understanding"] == "-0.005000"
    assert "champion since" in v3.description and "core_average 0.3775 vs 0.3500 (v2)" in v3.description
    assert "no category below -0.0050" in v3.description
    assert "previous-champion: champion until" in v2.description and "replaced by v3" in v2.description

    reject = decide(_report(0.36, 0.395), _report(0.20, 0.40), PromoteConfig())
    record_decision(registry, "m", "3", "1", reject, "cpt-2")
    assert str(registry.get_model_version_by_alias("m", CHAMPION_ALIAS).version) == "3"  # did not move
    v1 = registry.get_model_version("m", "1")
    assert v1.tags["promotion"] == "rejected" and "less than promote.min_gain" in v1.tags[
        next(k for k in v1.tags if k.startswith("promotion.history."))]
    # the champion keeps every decision it took part in: the history tags are never overwritten
    history = sorted(k for k in registry.get_model_version("m", "3").tags if k.startswith("promotion.history."))
    assert len(history) >= 1 and registry.get_model_version("m", "3").tags["promotion"] == "rejected"


def test_promote_by_hand_moves_champion_and_records_it(registry):
    assert promote_by_hand(registry, "m", "1", "rollback after a bad week") is None
    assert promote_by_hand(registry, "m", "3", "operator choice") == "1"
    assert str(registry.get_model_version_by_alias("m", CHAMPION_ALIAS).version) == "3"
    assert str(registry.get_model_version_by_alias("m", PREVIOUS_CHAMPION_ALIAS).version) == "1"
    v3 = registry.get_model_version("m", "3")
    assert v3.tags["promotion"] == "manual" and "promoted by hand (operator choice)" in v3.description

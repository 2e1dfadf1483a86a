"""The promotion rule, and how its decisions are written into a real (sqlite) MLflow registry."""

from __future__ import annotations

import pytest

from evaluation.report import GauntletReport, TaskResult
from tasks.aliases import LATEST_ALIAS, reconcile_aliases, record_started, set_aliases
from tasks.promote import bootstrap, decide, promote_by_hand, record_decision
from tasks.promote_config import PromoteConfig
from tasks.register import CHAMPION_ALIAS, PREVIOUS_CHAMPION_ALIAS
from tasks.version_record import decision_history, write_version_record


def _report(reasoning: float, language: float) -> GauntletReport:
    return GauntletReport(
        tasks=[
            TaskResult("copa", 0, "multiple_choice", 0.5 + reasoning / 2, 100, random_baseline=0.5, score=reasoning)
        ],
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
    named = decide(
        _report(0.30, 0.40), _report(0.40, 0.35), PromoteConfig(headline="commonsense_reasoning", max_category_drop=1.0)
    )
    assert named.accepted and named.gain == pytest.approx(0.10)
    with pytest.raises(ValueError, match="'nope' is not an average or category"):
        decide(_report(0.3, 0.4), _report(0.3, 0.4), PromoteConfig(headline="nope"))


@pytest.fixture()
def registry(tmp_path):
    """Three versions of model `m` as tessera registers them: each from a run, with its tags and record."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri, uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    client.create_registered_model("m", tags=record_started())
    for tokens, score in ((1024, 0.30), (2048, 0.35), (3072, 0.32)):
        run_id = client.create_run(experiment).info.run_id
        mv = client.create_model_version(
            "m",
            source=f"file:///tmp/v{tokens}",
            run_id=run_id,
            tags={
                "tokens": str(tokens),
                "stage": "s",
                "run": "base",
                "gauntlet_average": f"{score:.6f}",
                "headline": "core_average",
                "gauntlet_hash": "g",
            },
        )
        write_version_record(
            client,
            "m",
            mv.version,
            {"checkpoint": f"/ckpts/base-tok{tokens}.pt", "storage": "copy", "model_uri": f"file:///tmp/v{tokens}"},
        )
    return client


def _alias(client, alias: str) -> str | None:
    version = client.get_registered_model("m").aliases.get(alias)
    return None if version is None else str(version)


def _without_time(entries: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in ("stamp", "at", "detected_at")} for e in entries]


def test_bootstrap_then_accepted_then_rejected_are_all_recorded(registry):
    assert bootstrap(registry, "m", "2", "base")
    assert not bootstrap(registry, "m", "3", "base")  # a champion exists: bootstrap never moves it
    assert _alias(registry, CHAMPION_ALIAS) == "2"
    v2 = registry.get_model_version("m", "2")
    assert v2.tags["promotion"] == "bootstrap"
    assert "champion: champion since " in v2.description and "(bootstrap)" in v2.description

    accept = decide(_report(0.30, 0.40), _report(0.36, 0.395), PromoteConfig())
    record_decision(registry, "m", "2", "3", accept, "cpt-1")
    assert (_alias(registry, CHAMPION_ALIAS), _alias(registry, PREVIOUS_CHAMPION_ALIAS)) == ("3", "2")
    v3, v2 = registry.get_model_version("m", "3"), registry.get_model_version("m", "2")
    assert v3.tags["promotion"] == "accepted" and v2.tags["promotion"] == "accepted"
    # the decision's numbers are in the history, not in a dozen tags
    assert set(v3.tags) == {"tokens", "stage", "run", "gauntlet_average", "headline", "gauntlet_hash", "promotion"}
    won = decision_history(registry, "m", "3")[-1]
    assert (won["kind"], won["role"], won["vs"], won["run"]) == ("accepted", "challenger", "v2 (champion)", "cpt-1")
    assert won["rule"] == "core_average gain >= +0.0000 and no category below -0.0100"
    assert won["deltas"] == pytest.approx(
        {"core_average": 0.0275, "category.commonsense_reasoning": 0.06, "category.language_understanding": -0.005}
    )
    assert decision_history(registry, "m", "2")[-1]["vs"] == "v3 (challenger)"
    assert "champion since" in v3.description and "core_average 0.3775 vs 0.3500 (v2)" in v3.description
    assert "no category below -0.0050" in v3.description
    assert "Last promotion decision (" in v3.description and "challenger vs v2: accepted: " in v3.description
    assert "previous-champion: champion until" in v2.description and "replaced by v3" in v2.description

    reject = decide(_report(0.36, 0.395), _report(0.20, 0.40), PromoteConfig())
    record_decision(registry, "m", "3", "1", reject, "cpt-2")
    assert _alias(registry, CHAMPION_ALIAS) == "3"  # did not move
    v1 = registry.get_model_version("m", "1")
    assert v1.tags["promotion"] == "rejected"
    assert [e["kind"] for e in decision_history(registry, "m", "1")] == ["rejected"]
    assert "less than promote.min_gain" in decision_history(registry, "m", "1")[0]["text"]
    # the champion keeps every decision it took part in, oldest first
    assert [(e["kind"], e["role"]) for e in decision_history(registry, "m", "3")] == [
        ("accepted", "challenger"),
        ("rejected", "champion"),
    ]
    assert registry.get_model_version("m", "3").tags["promotion"] == "rejected"
    # and its description still says why it is champion: the newest decision that gave it the alias
    assert "champion: champion since" in registry.get_model_version("m", "3").description


def test_decisions_in_the_same_second_all_stay(registry):
    reject = decide(_report(0.36, 0.395), _report(0.20, 0.40), PromoteConfig())
    bootstrap(registry, "m", "2", "base")
    for run in ("cpt-1", "cpt-2", "cpt-3"):  # three in well under a second: at least two share one
        record_decision(registry, "m", "2", "1", reject, run)
    history = decision_history(registry, "m", "1")
    assert len({e["stamp"][:15] for e in history}) < 3
    assert [e["run"] for e in history] == ["cpt-1", "cpt-2", "cpt-3"]
    assert [(e["kind"], e["run"]) for e in decision_history(registry, "m", "2")] == [
        ("bootstrap", "base"),
        ("rejected", "cpt-1"),
        ("rejected", "cpt-2"),
        ("rejected", "cpt-3"),
    ]
    folder = registry.list_artifacts(registry.get_model_version("m", "1").run_id, "registry/m/v1/history")
    assert len(folder) == 3


def test_promote_by_hand_moves_champion_and_records_it(registry):
    assert promote_by_hand(registry, "m", "1", "rollback after a bad week") is None
    assert promote_by_hand(registry, "m", "3", "operator choice") == "1"
    assert (_alias(registry, CHAMPION_ALIAS), _alias(registry, PREVIOUS_CHAMPION_ALIAS)) == ("3", "1")
    v3 = registry.get_model_version("m", "3")
    assert v3.tags["promotion"] == "manual" and "promoted by hand (operator choice)" in v3.description
    assert [e["text"] for e in decision_history(registry, "m", "1")][-1] == "manual: replaced by v3 (operator choice)"


def test_an_alias_moved_outside_tessera_is_recorded_once_on_both_versions(registry):
    bootstrap(registry, "m", "2", "base")
    registry.set_registered_model_alias("m", CHAMPION_ALIAS, "1")  # MLflow's UI: the alias pencil
    lines = reconcile_aliases(registry, "m", "flow cpt-9")
    moved = decision_history(registry, "m", "1")
    assert len(moved) == 1
    at = moved[0]["detected_at"]
    assert lines == [f"m: alias champion moved from v2 to v1 outside tessera (detected {at} by flow cpt-9)"]
    why = (
        f"champion since {at[:10]}: moved here from v2 outside tessera (MLflow UI or API), detected {at} by "
        "flow cpt-9; no rule applied"
    )
    assert _without_time(moved) == [
        {
            "version": "1",
            "kind": "outside tessera",
            "role": "to",
            "alias": "champion",
            "from": "2",
            "to": "1",
            "detected_by": "flow cpt-9",
            "why": {"champion": why},
            "text": f"alias champion moved from v2 to v1 outside tessera (detected {at} by flow cpt-9)",
        }
    ]
    assert _without_time(decision_history(registry, "m", "2"))[1:] == [
        {
            "version": "2",
            "kind": "outside tessera",
            "role": "from",
            "alias": "champion",
            "from": "2",
            "to": "1",
            "detected_by": "flow cpt-9",
            "text": f"alias champion moved from v2 to v1 outside tessera (detected {at} by flow cpt-9)",
        }
    ]
    assert [registry.get_model_version("m", v).tags["promotion"] for v in ("1", "2")] == ["outside tessera"] * 2
    assert f"Aliases: champion: {why}." in registry.get_model_version("m", "1").description
    assert "Aliases" not in registry.get_model_version("m", "2").description

    # found once: a second look, and tessera's next move, record nothing more
    assert reconcile_aliases(registry, "m", "flow cpt-10") == []
    assert len(decision_history(registry, "m", "1")) == 1 and len(decision_history(registry, "m", "2")) == 2


def test_a_deleted_alias_and_moves_just_before_tessera_moves_are_recorded_first(registry):
    promote_by_hand(registry, "m", "1", "first")
    promote_by_hand(registry, "m", "2", "second")  # previous-champion -> v1
    registry.delete_registered_model_alias("m", PREVIOUS_CHAMPION_ALIAS)
    registry.set_registered_model_alias("m", CHAMPION_ALIAS, "3")
    # tessera moves champion itself before any reconcile at a flow's start: the moves made elsewhere come first
    promote_by_hand(registry, "m", "1", "back to v1")
    kinds = [(e["kind"], e.get("alias"), e.get("role")) for e in decision_history(registry, "m", "1")]
    assert kinds == [
        ("manual", None, "promoted"),
        ("manual", None, "replaced"),
        ("outside tessera", "previous-champion", "from"),
        ("manual", None, "promoted"),
    ]
    texts = [e["text"] for e in decision_history(registry, "m", "3")]
    assert len(texts) == 2 and texts[1] == "manual: replaced by v1 (back to v1)"
    assert texts[0].startswith("alias champion moved from v2 to v3 outside tessera (detected ")
    assert texts[0].endswith(" by tessera promote)")
    assert (_alias(registry, CHAMPION_ALIAS), _alias(registry, PREVIOUS_CHAMPION_ALIAS)) == ("1", "3")
    assert reconcile_aliases(registry, "m", "tessera promote") == []

    # any alias tessera moves goes through set_aliases, which records what was done elsewhere first
    registry.set_registered_model_alias("m", "staging", "2")
    set_aliases(registry, "m", {LATEST_ALIAS: "3"}, "run base")
    entry = decision_history(registry, "m", "2")[-1]
    assert (entry["kind"], entry["alias"], entry["from"], entry["to"], entry["detected_by"]) == (
        "outside tessera",
        "staging",
        None,
        "2",
        "run base",
    )
    assert entry["text"].startswith("alias staging set on v2 outside tessera (detected ")
    assert "staging: moved here outside tessera (MLflow UI or API)" in registry.get_model_version("m", "2").description
    assert reconcile_aliases(registry, "m", "run base") == []


def test_a_model_from_before_the_record_adopts_its_aliases_without_history(registry):
    for key in list(registry.get_registered_model("m").tags):
        registry.delete_registered_model_tag("m", key)  # as registered before tessera recorded its moves
    registry.set_registered_model_alias("m", CHAMPION_ALIAS, "2")
    assert reconcile_aliases(registry, "m", "flow a") == []
    assert all(decision_history(registry, "m", v) == [] for v in ("1", "2", "3"))
    assert registry.get_registered_model("m").tags["tessera.alias.champion"] == "2"
    registry.set_registered_model_alias("m", CHAMPION_ALIAS, "3")
    assert len(reconcile_aliases(registry, "m", "flow b")) == 1
    assert [e["from"] for e in decision_history(registry, "m", "3")] == ["2"]

"""The promotion rule, and how its decisions are written into a real (sqlite) MLflow registry."""

from __future__ import annotations

import pytest

from evaluation.report import GauntletReport, TaskResult
from tasks.registry.aliases import LATEST_ALIAS, reconcile_aliases, record_started, set_aliases
from tasks.registry.promote import bootstrap, promote_by_hand, record_decision
from tasks.registry.promote_config import PromoteConfig
from tasks.registry.promote_rule import decide
from tasks.registry.register import CHAMPION_ALIAS, PREVIOUS_CHAMPION_ALIAS
from tasks.registry.version_record import decision_history, write_version_record
from tests.conftest import ROOT
from tests.support.mlflow_store import sqlite_store

# every move of `champion` takes the promotion lock, a Prefect global concurrency limit
pytestmark = pytest.mark.usefixtures("prefect_harness")


SPEC = ROOT / "configs" / "gauntlet" / "tiny_gauntlet.yaml"
N = 200  # examples per task


def _hits(right) -> str:
    right = set(right)
    return "".join("1" if i in right else "0" for i in range(N))


def _report(copa, lambada, winograd) -> GauntletReport:
    """The tiny gauntlet's report of a model that got these examples (indices) of each task right, through
    the gauntlet's own arithmetic (copa and winograd are two-way choices, baseline 0.5; LAMBADA has none)."""
    from evaluation.runner import assemble_report
    from evaluation.spec import load_gauntlet

    results = [
        TaskResult(label, 0, kind, len(set(right)) / N, N, hits={"": _hits(right)})
        for label, kind, right in (
            ("lambada_openai_small", "language_modeling", lambada),
            ("copa", "multiple_choice", copa),
            ("winograd", "schema", winograd),
        )
    ]
    return assemble_report(results, load_gauntlet(str(SPEC)))


def _spec():
    from evaluation.spec import load_gauntlet

    return load_gauntlet(str(SPEC))


# commonsense = (copa - .5)/.5 = 0.2; language = mean(lambada 0.30, (winograd - .5)/.5 = 0.1) = 0.2; core 0.2
BASE = dict(copa=range(120), lambada=range(60), winograd=range(110))
# right on everything BASE was, and more: +0.4, +0.15 and +0.3, so core_average +0.3125
BETTER = dict(copa=range(160), lambada=range(90), winograd=range(140))
# three of BASE's copa answers lost, six others gained: +0.03 on commonsense, +0.015 core, from 9 examples
NOISY = dict(copa={*range(3, 120), *range(150, 156)}, lambada=range(60), winograd=range(110))


def test_a_clear_gain_is_accepted_with_its_interval():
    d = decide(_report(**BASE), _report(**BETTER), PromoteConfig(), _spec())
    assert d.accepted and d.reasons == []
    assert d.headline == "core_average" and d.gain == pytest.approx(0.3125)
    assert d.category_deltas == pytest.approx({"commonsense_reasoning": 0.4, "language_understanding": 0.225})
    assert d.examples == 3 * N and d.confidence == 0.95 and d.resamples == 2000
    low, high = d.gain_interval
    # closed form: copa gains 40 of 200 (sd of its accuracy gain sqrt(.2 * .8 / 200), doubled by the rescale),
    # LAMBADA and winograd 30 each; the category and core means combine them: sd 0.0316, 95% +-0.062
    assert low == pytest.approx(0.3125 - 0.062, abs=0.008) and high == pytest.approx(0.3125 + 0.062, abs=0.008)
    assert set(d.category_intervals) == {"commonsense_reasoning", "language_understanding"}
    assert d.summary().startswith(f"core_average 0.5125 vs 0.2000 (+0.3125, 95% interval {low:+.4f} to {high:+.4f}")
    # the same reports and seed: the same interval, to the last digit
    assert decide(_report(**BASE), _report(**BETTER), PromoteConfig(), _spec()).gain_interval == d.gain_interval


def test_a_gain_within_noise_is_rejected_and_says_so():
    d = decide(_report(**BASE), _report(**NOISY), PromoteConfig(), _spec())
    assert d.gain == pytest.approx(0.015) and d.gain > 0  # the point estimate gained
    low, high = d.gain_interval
    assert low < 0 < high
    assert not d.accepted
    assert d.reasons == [
        f"core_average gained +0.0150 (95% interval {low:+.4f} to {high:+.4f}): within noise, the interval does "
        "not clear promote.min_gain +0.0000"
    ]


def test_swapping_the_two_models_flips_the_verdict():
    forward = decide(_report(**BASE), _report(**BETTER), PromoteConfig(), _spec())
    swapped = decide(_report(**BETTER), _report(**BASE), PromoteConfig(), _spec())
    assert forward.accepted and not swapped.accepted
    assert swapped.gain == pytest.approx(-forward.gain)
    assert swapped.reasons[0].startswith("core_average gained -0.3125 (95% interval ")
    assert swapped.reasons[0].endswith("less than promote.min_gain +0.0000")
    # and the category falls are significant, far beyond max_category_drop 0.01
    assert [r.split(" fell ")[0] for r in swapped.reasons[1:]] == [
        "category commonsense_reasoning",
        "category language_understanding",
    ]


def test_a_category_drop_rejects_only_when_it_is_significant():
    # commonsense up a lot; language down: LAMBADA loses 40 of its 60 right answers
    falls = dict(copa=range(160), lambada=range(20), winograd=range(110))
    d = decide(_report(**BASE), _report(**falls), PromoteConfig(max_category_drop=0.01), _spec())
    assert not d.accepted and len(d.reasons) == 1
    assert d.reasons[0].startswith("category language_understanding fell -0.1000 (95% interval ")
    assert d.reasons[0].endswith("significantly more than promote.max_category_drop 0.0100")
    # a drop past max_category_drop by its point estimate (-0.015) but of six examples is within noise: it
    # does not reject what gained clearly elsewhere
    dips = dict(copa=range(160), lambada=range(54), winograd=range(110))
    assert decide(_report(**BASE), _report(**dips), PromoteConfig(max_category_drop=0.01), _spec()).accepted


def test_reports_without_example_results_are_never_accepted():
    bare = [TaskResult("copa", 0, "multiple_choice", 0.9, N, random_baseline=0.5, score=0.8)]
    a, b = GauntletReport(tasks=bare), GauntletReport(tasks=[*bare])
    b.tasks[0] = TaskResult("copa", 0, "multiple_choice", 1.0, N, random_baseline=0.5, score=1.0)
    d = decide(a, b, PromoteConfig(min_gain=-1.0), None)
    assert not d.accepted and d.gain_interval is None
    assert d.reasons == [
        "no paired interval (copa/0-shot: no example-level results (a report written before they were kept)), "
        "so the gain cannot be told from noise"
    ]


def test_the_paired_interval_has_the_width_of_the_closed_form():
    """One task, 400 examples: the champion alone right on 20, the challenger alone right on 40. The paired
    difference of two proportions has sd sqrt((p01 + p10 - (p01 - p10)^2) / n); 95% is 1.96 sd either side."""
    from evaluation.noise import paired_gains

    n = 400
    a = "1" * 100 + "1" * 20 + "0" * 40 + "0" * 240
    b = "1" * 100 + "0" * 20 + "1" * 40 + "0" * 240
    rep = lambda hits: GauntletReport(  # noqa: E731
        tasks=[TaskResult("t", 0, "multiple_choice", hits.count("1") / n, n, hits={"": hits})]
    )
    gains = paired_gains(None, rep(a), rep(b), "average_score", resamples=20000, seed=1)
    iv = gains.of("average_score")
    half = 1.96 * ((0.10 + 0.05 - 0.05**2) / n) ** 0.5
    assert iv.gain == pytest.approx(0.05)
    assert iv.low == pytest.approx(0.05 - half, abs=0.004) and iv.high == pytest.approx(0.05 + half, abs=0.004)
    assert gains.examples == n


@pytest.fixture()
def registry(tmp_path):
    """Three versions of model `m` as tessera registers them: each from a run, with its tags and record."""
    from mlflow.tracking import MlflowClient

    uri = sqlite_store(tmp_path / "m.db")
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

    accept = decide(_report(**BASE), _report(**BETTER), PromoteConfig(), _spec())
    record_decision(registry, "m", "2", "3", accept, "cpt-1")
    assert (_alias(registry, CHAMPION_ALIAS), _alias(registry, PREVIOUS_CHAMPION_ALIAS)) == ("3", "2")
    v3, v2 = registry.get_model_version("m", "3"), registry.get_model_version("m", "2")
    # each says what it did: the challenger won, the champion lost its title
    assert v3.tags["promotion"] == "accepted" and v2.tags["promotion"] == "replaced"
    # the decision's numbers are in the history, not in a dozen tags
    assert set(v3.tags) == {"tokens", "stage", "run", "gauntlet_average", "headline", "gauntlet_hash", "promotion"}
    won = decision_history(registry, "m", "3")[-1]
    assert (won["kind"], won["role"], won["vs"], won["run"]) == ("accepted", "challenger", "v2 (champion)", "cpt-1")
    assert won["rule"] == (
        "core_average gain's 95% lower bound above +0.0000 and no category's drop significantly beyond -0.0100 "
        "(paired bootstrap over the gauntlet's examples, 2000 resamples, seed 0)"
    )
    assert won["deltas"] == pytest.approx(
        {"core_average": 0.3125, "category.commonsense_reasoning": 0.4, "category.language_understanding": 0.225}
    )
    assert decision_history(registry, "m", "2")[-1]["vs"] == "v3 (challenger)"
    assert "champion since" in v3.description and "core_average 0.5125 vs 0.2000 (v2)" in v3.description
    assert "no category below +0.2250" in v3.description
    assert "Last promotion decision (" in v3.description and "challenger vs v2: accepted: " in v3.description
    assert "previous-champion: champion until" in v2.description and "replaced by v3" in v2.description

    reject = decide(_report(**BETTER), _report(**BASE), PromoteConfig(), _spec())
    record_decision(registry, "m", "3", "1", reject, "cpt-2")
    assert _alias(registry, CHAMPION_ALIAS) == "3"  # did not move
    v1 = registry.get_model_version("m", "1")
    assert v1.tags["promotion"] == "rejected"
    assert [e["kind"] for e in decision_history(registry, "m", "1")] == ["rejected"]
    assert "less than promote.min_gain" in decision_history(registry, "m", "1")[0]["text"]
    # the champion keeps every decision it took part in, oldest first
    assert [(e["kind"], e["role"]) for e in decision_history(registry, "m", "3")] == [
        ("accepted", "challenger"),
        ("defended", "champion"),
    ]
    assert registry.get_model_version("m", "3").tags["promotion"] == "defended"
    # and its description still says why it is champion: the newest decision that gave it the alias
    assert "champion: champion since" in registry.get_model_version("m", "3").description


def test_decisions_in_the_same_second_all_stay(registry):
    reject = decide(_report(**BETTER), _report(**BASE), PromoteConfig(), _spec())
    bootstrap(registry, "m", "2", "base")
    for run in ("cpt-1", "cpt-2", "cpt-3"):  # three in well under a second: at least two share one
        record_decision(registry, "m", "2", "1", reject, run)
    history = decision_history(registry, "m", "1")
    assert len({e["stamp"][:15] for e in history}) < 3
    assert [e["run"] for e in history] == ["cpt-1", "cpt-2", "cpt-3"]
    assert [(e["kind"], e["run"]) for e in decision_history(registry, "m", "2")] == [
        ("bootstrap", "base"),
        ("defended", "cpt-1"),
        ("defended", "cpt-2"),
        ("defended", "cpt-3"),
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


def _scorer(reports: dict[str, GauntletReport], during: dict[str, object] | None = None):
    """A `score` for `contest` that returns the given reports and, while scoring a version listed in `during`,
    does what is listed (someone promoting meanwhile); records the order versions were scored in."""
    calls: list[str] = []

    def score(version: str) -> GauntletReport:
        calls.append(version)
        if during and version in during:
            during.pop(version)()
        return reports[version]

    return score, calls


def test_a_hand_promotion_during_scoring_is_never_reverted(registry):
    from tasks.registry.promote import contest

    bootstrap(registry, "m", "2", "base")
    hand = lambda: promote_by_hand(registry, "m", "1", "hand promotion while v3 is scored")  # noqa: E731
    # v1 and v3 answered exactly alike: against v1 the challenger gains nothing
    score, calls = _scorer({"1": _report(**BETTER), "2": _report(**BASE), "3": _report(**BETTER)}, {"3": hand})
    result = contest(registry, "m", "3", score, PromoteConfig(), _spec(), "cpt-race")
    assert calls == ["2", "3", "1"]  # v2 scored, the champion moved to v1 meanwhile: v1 scored, v3 not again
    assert result.champion == "1" and not result.decision.accepted
    assert "within noise" in result.decision.reasons[0]
    # the hand promotion stands, and previous-champion is the champion it replaced
    assert (_alias(registry, CHAMPION_ALIAS), _alias(registry, PREVIOUS_CHAMPION_ALIAS)) == ("1", "2")
    assert [(e["kind"], e["vs"]) for e in decision_history(registry, "m", "3")] == [("rejected", "v1 (champion)")]
    assert [(e["kind"], e.get("role")) for e in decision_history(registry, "m", "1")] == [
        ("manual", "promoted"),
        ("defended", "champion"),
    ]
    assert registry.get_model_version("m", "1").tags["promotion"] == "defended"


def test_a_challenger_that_beats_the_new_champion_replaces_it_not_the_old_one(registry):
    from tasks.registry.promote import contest

    bootstrap(registry, "m", "2", "base")
    hand = lambda: promote_by_hand(registry, "m", "1", "hand promotion while v3 is scored")  # noqa: E731
    score, calls = _scorer({"1": _report(**BASE), "2": _report(**BETTER), "3": _report(**BETTER)}, {"3": hand})
    result = contest(registry, "m", "3", score, PromoteConfig(), _spec(), "cpt-race")
    assert calls == ["2", "3", "1"] and result.champion == "1" and result.decision.accepted
    # previous-champion names v1, which was champion when v3 took over; v2's title was lost by hand, not to v3
    assert (_alias(registry, CHAMPION_ALIAS), _alias(registry, PREVIOUS_CHAMPION_ALIAS)) == ("3", "1")
    assert [e["kind"] for e in decision_history(registry, "m", "2")] == ["bootstrap", "manual"]
    assert registry.get_model_version("m", "1").tags["promotion"] == "replaced"


def test_a_champion_that_keeps_moving_stops_the_promotion_without_moving_it(registry, monkeypatch):
    import tasks.registry.promote
    from tasks.registry.promote import DECIDE_ROUNDS, ChampionKeptMoving, contest

    bootstrap(registry, "m", "2", "base")
    # every look finds the other version: someone promoting v1 and v2 in turn, faster than scoring
    looks = iter(["2", "1", "2", "1", "2", "1"])
    monkeypatch.setattr(tasks.registry.promote, "champion_version", lambda client, name: next(looks))
    score, calls = _scorer({"1": _report(**BASE), "2": _report(**BASE), "3": _report(**BETTER)})
    with pytest.raises(ChampionKeptMoving, match=f"champion moved {DECIDE_ROUNDS} times while v3 was being scored"):
        contest(registry, "m", "3", score, PromoteConfig(), _spec(), "cpt-race")
    assert calls == ["2", "3", "1"]  # each version scored once
    assert _alias(registry, CHAMPION_ALIAS) == "2" and decision_history(registry, "m", "3") == []


def test_tessera_promote_waits_for_the_promotion_lock(registry, tmp_path):
    """Another process's `tessera promote` does not move `champion` while a decision holds the lock."""
    import os
    import subprocess
    import sys
    import time

    import yaml
    from prefect.settings import PREFECT_API_URL

    from tasks.registry.promote_lock import promotion_lock

    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    raw["tracking"] |= {"tracking_uri": registry._registry_uri, "registered_model": "m"}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    bootstrap(registry, "m", "2", "base")
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    cmd = [sys.executable, "-m", "cli.main", "promote", "models:/m/1", "--recipe", str(recipe), "--note", "wait"]
    with promotion_lock("m", "test"):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(15)  # the CLI starts in a few seconds; then it waits on the lock
        assert proc.poll() is None and _alias(registry, CHAMPION_ALIAS) == "2"
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert out.strip().splitlines() == ["m: champion v1 (was v2; now previous-champion)"], out
    assert (_alias(registry, CHAMPION_ALIAS), _alias(registry, PREVIOUS_CHAMPION_ALIAS)) == ("1", "2")


def test_best_says_when_it_is_within_noise_of_the_runner_up(registry):
    from evaluation.mlflow_report import report_paths
    from tasks.registry.register import best_margin

    for version, hits in (("1", BASE), ("2", NOISY), ("3", BETTER)):
        mv = registry.get_model_version("m", version)
        registry.log_text(mv.run_id, _report(**hits).to_json(), report_paths(int(mv.tags["tokens"])).json)
    v1, v2, v3 = (registry.get_model_version("m", v) for v in "123")
    near = best_margin(registry, [v1, v2], v2)
    assert near.startswith("within noise of v1, the runner-up: core_average +0.0150 (95% interval -")
    assert near.endswith(f") over {3 * N} examples")
    far = best_margin(registry, [v1, v2, v3], v3)
    assert far.startswith("clear of v2, the runner-up: core_average +0.2975 (95% interval +")
    assert best_margin(registry, [v3], v3) is None  # no runner-up

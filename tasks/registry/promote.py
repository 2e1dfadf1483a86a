"""Champion/challenger promotion in the MLflow registry, by a rule on fresh gauntlet scores.

`champion` moves only here, and every decision is written onto the versions involved: MLflow
keeps no history of alias moves (mlflow#2169), so each version's decision history is
(tasks/registry/version_record.py: one JSON file per decision, never rewritten, read by `decision_history`).
- the tag `promotion`: the latest decision this version took part in, from its side, because people
  filter on it: accepted | rejected (a challenger), defended | replaced (a champion), bootstrap,
  manual, outside tessera;
- each history entry: the verdict (`kind`), the version's `role`, `vs`, `summary`, `rule`,
  `reasons`, `deltas` (headline and categories) with their `intervals`, `confidence` and `examples`,
  `run`, and `why` for an alias it gave the version,
  which the description repeats.
A move of an alias made in MLflow's UI is found and recorded by `tasks.registry.aliases.reconcile_aliases`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from evaluation.config import EvalConfig
from evaluation.report import GauntletReport
from evaluation.spec import GauntletSpec
from infra.config import ComputeConfig
from tasks.artifacts import artifact_key
from tasks.gauntlet.score import score_in_pod, score_model
from tasks.mlflow_run import client_for, resolved_uri, retrying
from tasks.registry.aliases import (
    CHAMPION_ALIAS,
    PREVIOUS_CHAMPION_ALIAS,
    reconcile_aliases,
    refresh_descriptions,
    set_aliases,
)
from tasks.registry.promote_config import PromoteConfig
from tasks.registry.promote_lock import promotion_lock
from tasks.registry.promote_rule import Decision, decide
from tasks.registry.version_record import append_decision, now
from tasks.tracking_config import TrackingConfig
from trainers.contract import EXIT_FAILED, OneLineError

log = logging.getLogger("tessera.promote")


def _today() -> str:
    return now()[1][:10]


def _catch_up(client, name: str, observer: str) -> None:
    """Record moves made outside tessera before this decision, so each history reads in the order things happened."""
    for line in reconcile_aliases(client, name, observer):
        log.warning("%s", line)


def _record(client, name: str, version: str, verdict: str, entry: dict) -> None:
    """One history entry on the version, and the verdict as its `promotion` tag (what people filter on)."""
    append_decision(client, name, version, {"kind": verdict, **entry})
    client.set_model_version_tag(name, str(version), "promotion", verdict)


def record_decision(client, name: str, champion: str, challenger: str, decision: Decision, run_name: str) -> None:
    """Write the decision onto both versions; on acceptance move `champion` and `previous-champion`."""
    _catch_up(client, name, f"run {run_name}")
    day = _today()
    verdict = "accepted" if decision.accepted else "rejected"
    lost_or_kept = "replaced" if decision.accepted else "defended"  # the champion's side of the same verdict
    why = "; ".join(decision.reasons) or "every condition of the rule held"
    deltas = {decision.headline: decision.gain, **{f"category.{k}": v for k, v in decision.category_deltas.items()}}
    common = {
        "summary": decision.summary(),
        "rule": decision.rule,
        "reasons": decision.reasons,
        "run": run_name,
        "headline": decision.headline,
        "champion_score": decision.champion_score,
        "challenger_score": decision.challenger_score,
        "deltas": deltas,
        # the noise the verdict was decided against: intervals of the gains, over this many examples
        "confidence": decision.confidence,
        "examples": decision.examples,
        "intervals": {
            decision.headline: decision.gain_interval,
            **{f"category.{k}": v for k, v in decision.category_intervals.items()},
        },
    }
    as_challenger = {
        **common,
        "role": "challenger",
        "vs": f"v{champion} (champion)",
        "text": f"challenger vs v{champion}: {verdict}: {decision.summary()}; {why}",
    }
    as_champion = {
        **common,
        "role": "champion",
        "vs": f"v{challenger} (challenger)",
        "text": f"champion vs v{challenger}: {lost_or_kept}: {decision.summary()}; {why}",
    }
    if decision.accepted:
        worst = decision.worst
        floor = f"no category below {worst[1]:+.4f}" if worst else "no categories"
        as_challenger["why"] = {
            CHAMPION_ALIAS: f"champion since {day}: {decision.headline} "
            f"{decision.challenger_score:.4f} vs {decision.champion_score:.4f} (v{champion}), "
            f"{floor} (run {run_name})"
        }
        as_champion["why"] = {PREVIOUS_CHAMPION_ALIAS: f"champion until {day}, replaced by v{challenger}"}
    _record(client, name, challenger, verdict, as_challenger)
    _record(client, name, champion, lost_or_kept, as_champion)
    if decision.accepted:  # rewrites both descriptions too
        set_aliases(client, name, {CHAMPION_ALIAS: challenger, PREVIOUS_CHAMPION_ALIAS: champion}, f"run {run_name}")
    else:
        refresh_descriptions(client, name, [champion, challenger])


def champion_version(client, name: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        aliases = client.get_registered_model(name).aliases
    except MlflowException:  # no registered model yet: no champion either
        return None
    return str(aliases[CHAMPION_ALIAS]) if CHAMPION_ALIAS in aliases else None


def bootstrap(client, name: str, version: str, run_name: str) -> bool:
    """Make `version` the first champion when the model has none; False when one exists."""
    with promotion_lock(name, f"run {run_name}"):
        return _bootstrap(client, name, version, run_name)


def _bootstrap(client, name: str, version: str, run_name: str) -> bool:
    _catch_up(client, name, f"run {run_name}")
    if champion_version(client, name) is not None:
        return False
    mv = client.get_model_version(name, version)
    score = mv.tags.get("gauntlet_average", "?")
    why = (
        f"champion since {_today()}: the first champion, the best version of run {run_name} "
        f"({mv.tags.get('headline', 'gauntlet average')} {score}); no rule applied (bootstrap)"
    )
    _record(
        client,
        name,
        version,
        "bootstrap",
        {
            "summary": "first champion, no rule applied",
            "run": run_name,
            "text": f"bootstrap: {why}",
            "why": {CHAMPION_ALIAS: why},
        },
    )
    set_aliases(client, name, {CHAMPION_ALIAS: version}, f"run {run_name}")
    return True


def promote_by_hand(client, name: str, version: str, note: str) -> str | None:
    """`tessera promote models:/NAME/N`: move `champion` to N, recorded like a decision; returns the old champion."""
    with promotion_lock(name, "tessera promote"):
        return _promote_by_hand(client, name, version, note)


def _promote_by_hand(client, name: str, version: str, note: str) -> str | None:
    _catch_up(client, name, "tessera promote")
    old = champion_version(client, name)
    if old == str(version):
        return old
    day = _today()
    why = f"champion since {day}: promoted by hand ({note})"
    _record(
        client,
        name,
        version,
        "manual",
        {
            "summary": note,
            "vs": f"v{old}" if old else "none",
            "role": "promoted",
            "text": f"manual: {why}",
            "why": {CHAMPION_ALIAS: why},
        },
    )
    moves = {CHAMPION_ALIAS: str(version)}
    if old is not None:
        _record(
            client,
            name,
            old,
            "manual",
            {
                "summary": note,
                "vs": f"v{version}",
                "role": "replaced",
                "text": f"manual: replaced by v{version} ({note})",
                "why": {PREVIOUS_CHAMPION_ALIAS: f"champion until {day}, replaced by hand by v{version}"},
            },
        )
        moves[PREVIOUS_CHAMPION_ALIAS] = old
    set_aliases(client, name, moves, "tessera promote")
    return old


@dataclass(frozen=True)
class Contest:
    """A decided comparison: against which champion, the verdict, and both reports."""

    champion: str
    decision: Decision
    champion_report: GauntletReport
    challenger_report: GauntletReport


class ChampionKeptMoving(OneLineError, RuntimeError):
    """The champion changed during every scoring round; str() is one line."""

    exit_code = EXIT_FAILED


# Scoring takes minutes to hours; a champion moved during it is scored and decided against again. This many
# moves during one promotion means someone is promoting in a loop: stop rather than chase it.
DECIDE_ROUNDS = 3


def contest(
    client,
    name: str,
    challenger: str,
    score: Callable[[str], GauntletReport],
    rule: PromoteConfig,
    spec: GauntletSpec | None,
    run_name: str,
) -> Contest | None:
    """Decide `challenger` against the champion as it is when the decision is recorded; None without a champion.

    Scoring runs outside the promotion lock (it is long); inside it the champion is read again, and only
    if it is still the one scored is the decision recorded and `champion` moved. Otherwise the new
    champion is scored and the challenger decided against it: a promotion made meanwhile (by hand, by
    another run) is never reverted, and `previous-champion` only ever names a version that was champion.
    """
    reports: dict[str, GauntletReport] = {}

    def report(version: str) -> GauntletReport:
        if version not in reports:
            reports[version] = score(version)
        return reports[version]

    scored = champion_version(client, name)
    for _ in range(DECIDE_ROUNDS):
        if scored is None or scored == challenger:
            return None
        report(scored), report(challenger)
        with promotion_lock(name, f"run {run_name}"):
            now_champion = champion_version(client, name)
            if now_champion == scored:
                decision = decide(reports[scored], reports[challenger], rule, spec)
                record_decision(client, name, scored, challenger, decision, run_name)
                return Contest(
                    champion=scored,
                    decision=decision,
                    champion_report=reports[scored],
                    challenger_report=reports[challenger],
                )
        log.warning(
            "%s: champion moved from v%s to v%s while run %s was scored; deciding v%s against v%s instead",
            name,
            scored,
            now_champion,
            run_name,
            challenger,
            now_champion,
        )
        scored = now_champion
    raise ChampionKeptMoving(
        f"run {run_name}: {name}'s champion moved {DECIDE_ROUNDS} times while v{challenger} was being scored; "
        "nothing decided, champion left where it is"
    )


@task(cache_policy=NO_CACHE)
def promote_challenger(
    eval_cfg: EvalConfig,
    tracking: TrackingConfig,
    rule: PromoteConfig,
    run_name: str,
    run_id: str,
    challenger: int,
    max_seq_len: int,
    compute: ComputeConfig | None = None,
) -> tuple[Decision | None, int | None]:
    """Score champion and challenger now, on the same gauntlet, decide by the rule, record it everywhere.

    With the kubernetes backend each model is scored in an evaluation pod, as the gauntlet of a checkpoint is:
    the flow pod has neither the memory nor the accelerator for a model of billions of parameters.
    """
    from evaluation.compare import render_comparison_html
    from evaluation.report import compare_markdown
    from evaluation.spec import load_gauntlet

    logger = get_run_logger()
    name = tracking.registered_model
    client = client_for(tracking)
    cfg = eval_cfg.model_copy(update={"strict": True, "max_seq_len": eval_cfg.max_seq_len or max_seq_len})
    uri = resolved_uri(tracking.tracking_uri)
    spec = load_gauntlet(cfg.gauntlet) if cfg.gauntlet else None

    def score(version: str) -> GauntletReport:
        role = "challenger" if version == str(challenger) else "champion"
        model, task_name = f"models:/{name}/{version}", f"score-{role}-v{version}"
        if compute is not None and compute.backend == "kubernetes":
            # the pod's Job is named by run and version, so a restarted promotion re-attaches to its live pod
            pod = f"{run_name}-promote-v{version}"
            return score_in_pod.with_options(task_run_name=task_name)(model, cfg, uri, compute, pod)
        return score_model.with_options(task_run_name=task_name)(model, cfg, uri)

    result = contest(client, name, str(challenger), score, rule, spec, run_name)
    if result is None:
        champion = champion_version(client, name)
        return None, int(champion) if champion else None
    decision, champion = result.decision, result.champion
    a, b = result.champion_report, result.challenger_report
    verdict = (
        f"{'ACCEPTED' if decision.accepted else 'REJECTED'}: v{challenger} vs champion v{champion}: "
        f"{decision.summary()}; rule: {decision.rule}"
        + (f"; {'; '.join(decision.reasons)}" if decision.reasons else "")
    )
    intervals = decision_intervals(decision)
    markdown = f"# Promotion of {name} v{challenger}\n\n**{verdict}**\n\n" + compare_markdown(
        a, b, f"champion v{champion}", f"challenger v{challenger}", intervals, decision.confidence
    )
    html = render_comparison_html(
        a,
        b,
        f"champion v{champion}",
        f"challenger v{challenger}",
        f"{name}: champion v{champion} vs challenger v{challenger}",
        verdict,
        intervals,
        decision.confidence,
    )
    create_markdown_artifact(
        key=artifact_key(run_name, "promotion"),
        markdown=markdown,
        description=f"Champion/challenger comparison of run {run_name}",
    )
    retrying(
        "logging the promotion report",
        lambda: (
            client.log_text(run_id, html, "promotion/comparison.html"),
            client.log_text(run_id, markdown, "promotion/comparison.md"),
            client.log_text(run_id, decision.model_dump_json(indent=1), "promotion/decision.json"),
        ),
    )
    logger.info(verdict)
    return decision, int(champion_version(client, name) or 0) or None


def decision_intervals(decision: Decision) -> dict[str, tuple[float, float]]:
    """The decision's gain intervals by score name (headline and categories), for the comparison report."""
    out = dict(decision.category_intervals)
    if decision.gain_interval is not None:
        out[decision.headline] = decision.gain_interval
    return out

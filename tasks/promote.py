"""Champion/challenger promotion in the MLflow registry, by a rule on fresh gauntlet scores.

`champion` moves only here, and every decision is written onto the versions involved: MLflow
keeps no history of alias moves (mlflow#2169), so each version's decision history is
(tasks/version_record.py: one JSON file per decision, never rewritten, read by `decision_history`).
- the tag `promotion`: accepted | rejected | bootstrap | manual | outside tessera, the latest
  decision this version took part in, because people filter on it;
- each history entry: the verdict (`kind`), the version's `role`, `vs`, `summary`, `rule`,
  `reasons`, `deltas` (headline and categories), `run`, and `why` for an alias it gave the version,
  which the description repeats.
A move of an alias made in MLflow's UI is found and recorded by `tasks.aliases.reconcile_aliases`.
"""

from __future__ import annotations

import logging

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from evaluation.compare import deltas
from evaluation.config import EvalConfig
from evaluation.report import GauntletReport
from tasks.aliases import CHAMPION_ALIAS, PREVIOUS_CHAMPION_ALIAS, reconcile_aliases, refresh_descriptions, set_aliases
from tasks.artifacts import artifact_key
from tasks.mlflow_run import client_for, resolved_uri, retrying
from tasks.promote_config import PromoteConfig
from tasks.score import score_model
from tasks.tracking_config import TrackingConfig
from tasks.version_record import append_decision, now

log = logging.getLogger("tessera.promote")


class Decision(BaseModel):
    """One comparison of a challenger with the champion, and its verdict."""

    accepted: bool
    headline: str
    champion_score: float
    challenger_score: float
    gain: float
    category_deltas: dict[str, float]
    rule: str
    reasons: list[str]

    @property
    def worst(self) -> tuple[str, float] | None:
        return min(self.category_deltas.items(), key=lambda kv: kv[1]) if self.category_deltas else None

    def summary(self) -> str:
        worst = self.worst
        categories = f"worst category {worst[0]} {worst[1]:+.4f}" if worst else "no categories"
        return (
            f"{self.headline} {self.challenger_score:.4f} vs {self.champion_score:.4f} ({self.gain:+.4f}), {categories}"
        )


def decide(champion: GauntletReport, challenger: GauntletReport, rule: PromoteConfig) -> Decision:
    """Apply the rule to two reports scored on the same gauntlet with the same code and seed."""
    headline = rule.headline or champion.headline
    a, b = champion.score_of(headline), challenger.score_of(headline)
    if a is None or b is None:
        raise ValueError(f"promote.headline: {headline!r} is not an average or category of this gauntlet")
    categories = {d.name: d.delta for d in deltas(champion, challenger) if d.kind == "category" and d.delta is not None}
    reasons = []
    if b - a < rule.min_gain:
        reasons.append(f"{headline} gained {b - a:+.4f}, less than promote.min_gain {rule.min_gain:+.4f}")
    for name, delta in sorted(categories.items()):
        if delta < -rule.max_category_drop:
            reasons.append(
                f"category {name} fell {delta:+.4f}, more than promote.max_category_drop {rule.max_category_drop:.4f}"
            )
    text = f"{headline} gain >= {rule.min_gain:+.4f} and no category below -{rule.max_category_drop:.4f}"
    return Decision(
        accepted=not reasons,
        headline=headline,
        champion_score=a,
        challenger_score=b,
        gain=b - a,
        category_deltas=categories,
        rule=text,
        reasons=reasons,
    )


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
        "text": f"champion vs v{challenger}: {verdict}: {decision.summary()}; {why}",
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
    _record(client, name, champion, verdict, as_champion)
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


@task(cache_policy=NO_CACHE)
def promote_challenger(
    eval_cfg: EvalConfig,
    tracking: TrackingConfig,
    rule: PromoteConfig,
    run_name: str,
    run_id: str,
    challenger: int,
    max_seq_len: int,
) -> tuple[Decision | None, int | None]:
    """Score champion and challenger now, on the same gauntlet, decide by the rule, record it everywhere."""
    from evaluation.compare import render_comparison_html
    from evaluation.report import compare_markdown

    logger = get_run_logger()
    name = tracking.registered_model
    client = client_for(tracking)
    champion = champion_version(client, name)
    if champion is None or champion == str(challenger):
        return None, int(champion) if champion else None
    cfg = eval_cfg.model_copy(update={"strict": True, "max_seq_len": eval_cfg.max_seq_len or max_seq_len})
    uri = resolved_uri(tracking.tracking_uri)
    a = score_model.with_options(task_run_name=f"score-champion-v{champion}")(f"models:/{name}/{champion}", cfg, uri)
    b = score_model.with_options(task_run_name=f"score-challenger-v{challenger}")(
        f"models:/{name}/{challenger}", cfg, uri
    )
    decision = decide(a, b, rule)
    record_decision(client, name, champion, str(challenger), decision, run_name)
    verdict = (
        f"{'ACCEPTED' if decision.accepted else 'REJECTED'}: v{challenger} vs champion v{champion}: "
        f"{decision.summary()}; rule: {decision.rule}"
        + (f"; {'; '.join(decision.reasons)}" if decision.reasons else "")
    )
    markdown = f"# Promotion of {name} v{challenger}\n\n**{verdict}**\n\n" + compare_markdown(
        a, b, f"champion v{champion}", f"challenger v{challenger}"
    )
    html = render_comparison_html(
        a,
        b,
        f"champion v{champion}",
        f"challenger v{challenger}",
        f"{name}: champion v{champion} vs challenger v{challenger}",
        verdict,
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

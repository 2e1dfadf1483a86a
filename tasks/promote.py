"""Champion/challenger promotion in the MLflow registry, by a rule on fresh gauntlet scores.

`champion` moves only here, and every decision is written onto the versions involved: MLflow
keeps no history of alias moves (mlflow#2169), so the version tags are that history.
- `promotion`: accepted | rejected | bootstrap | manual (the latest decision this version took part in);
- `promotion.summary`, `promotion.rule`, `promotion.vs`, `promotion.date`, `promotion.run`,
  `promotion.delta.<headline>` and `promotion.delta.category.<name>`: that decision's numbers;
- `promotion.history.<UTC timestamp>`: one line per decision, never overwritten;
- `champion.why` / `previous_champion.why`: what the description says about those aliases.
"""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel

from evaluation.compare import deltas
from evaluation.report import GauntletReport
from tasks.promote_config import PromoteConfig
from tasks.register import CHAMPION_ALIAS, PREVIOUS_CHAMPION_ALIAS, refresh_descriptions, set_aliases


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
        return (f"{self.headline} {self.challenger_score:.4f} vs {self.champion_score:.4f} ({self.gain:+.4f}), "
                f"{categories}")  # fmt: skip


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
            reasons.append(f"category {name} fell {delta:+.4f}, more than promote.max_category_drop "
                           f"{rule.max_category_drop:.4f}")  # fmt: skip
    text = f"{headline} gain >= {rule.min_gain:+.4f} and no category below -{rule.max_category_drop:.4f}"
    return Decision(accepted=not reasons, headline=headline, champion_score=a, challenger_score=b, gain=b - a,
                    category_deltas=categories, rule=text, reasons=reasons)  # fmt: skip


def _now() -> tuple[str, str]:
    now = dt.datetime.now(dt.UTC)
    return now.strftime("%Y-%m-%d"), now.strftime("%Y%m%dT%H%M%SZ")


def _tag_all(client, name: str, version: str, tags: dict[str, str]) -> None:
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value[:5000])


def record_decision(client, name: str, champion: str, challenger: str, decision: Decision, run_name: str) -> None:
    """Write the decision onto both versions; on acceptance move `champion` and `previous-champion`."""
    day, stamp = _now()
    verdict = "accepted" if decision.accepted else "rejected"
    common = {
        "promotion": verdict,
        "promotion.summary": decision.summary(),
        "promotion.rule": decision.rule,
        "promotion.date": day,
        "promotion.run": run_name,
        f"promotion.delta.{decision.headline}": f"{decision.gain:+.6f}",
        **{f"promotion.delta.category.{k}": f"{v:+.6f}" for k, v in decision.category_deltas.items()},
    }
    why = "; ".join(decision.reasons) or "every condition of the rule held"
    _tag_all(client, name, challenger, {**common, "promotion.vs": f"v{champion} (champion)",
                                        f"promotion.history.{stamp}": f"challenger vs v{champion}: {verdict}: "
                                        f"{decision.summary()}; {why}"})  # fmt: skip
    _tag_all(client, name, champion, {**common, "promotion.vs": f"v{challenger} (challenger)",
                                      f"promotion.history.{stamp}": f"champion vs v{challenger}: {verdict}: "
                                      f"{decision.summary()}; {why}"})  # fmt: skip
    if decision.accepted:
        worst = decision.worst
        floor = f"no category below {worst[1]:+.4f}" if worst else "no categories"
        _tag_all(client, name, challenger, {
            "champion.why": f"champion since {day}: {decision.headline} {decision.challenger_score:.4f} vs "
                            f"{decision.champion_score:.4f} (v{champion}), {floor} (run {run_name})"})  # fmt: skip
        _tag_all(client, name, champion, {"previous_champion.why": f"champion until {day}, replaced by v{challenger}"})
        set_aliases(client, name, {CHAMPION_ALIAS: challenger, PREVIOUS_CHAMPION_ALIAS: champion})
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
    if champion_version(client, name) is not None:
        return False
    day, stamp = _now()
    mv = client.get_model_version(name, version)
    score = mv.tags.get("gauntlet_average", "?")
    why = (f"champion since {day}: the first champion, the best version of run {run_name} "
           f"({mv.tags.get('headline', 'gauntlet average')} {score}); no rule applied (bootstrap)")  # fmt: skip
    _tag_all(client, name, version, {"promotion": "bootstrap", "promotion.summary": "first champion, no rule applied",
                                     "promotion.date": day, "promotion.run": run_name, "champion.why": why,
                                     f"promotion.history.{stamp}": f"bootstrap: {why}"})  # fmt: skip
    set_aliases(client, name, {CHAMPION_ALIAS: version})
    return True


def promote_by_hand(client, name: str, version: str, note: str) -> str | None:
    """`tessera promote models:/NAME/N`: move `champion` to N, recorded like a decision; returns the old champion."""
    old = champion_version(client, name)
    if old == str(version):
        return old
    day, stamp = _now()
    why = f"champion since {day}: promoted by hand ({note})"
    _tag_all(client, name, version, {"promotion": "manual", "promotion.summary": note, "promotion.date": day,
                                     "promotion.vs": f"v{old}" if old else "none", "champion.why": why,
                                     f"promotion.history.{stamp}": f"manual: {why}"})  # fmt: skip
    moves = {CHAMPION_ALIAS: str(version)}
    if old is not None:
        _tag_all(client, name, old, {"previous_champion.why": f"champion until {day}, replaced by hand by v{version}",
                                     f"promotion.history.{stamp}": f"manual: replaced by v{version} ({note})"})  # fmt: skip
        moves[PREVIOUS_CHAMPION_ALIAS] = old
    set_aliases(client, name, moves)
    return old

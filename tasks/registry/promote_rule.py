"""The promotion rule: is a challenger's gain over the champion real, by the recipe's `promote` section?

The rule sees two gauntlet reports scored on the same examples, with the same code and seed, and
decides on intervals, not on two numbers (evaluation/noise.py): a gain within noise never promotes.
tasks/registry/promote.py records the decision and moves the aliases.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from evaluation.compare import deltas
from evaluation.noise import NotPaired, paired_gains
from evaluation.report import GauntletReport
from evaluation.spec import GauntletSpec
from tasks.registry.promote_config import PromoteConfig


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
    # the paired bootstrap (evaluation/noise.py): None when the reports could not be paired
    confidence: float | None = None
    examples: int = Field(0, description="Examples each model answered; the bootstrap resampled these.")
    resamples: int = 0
    seed: int = 0
    gain_interval: tuple[float, float] | None = None
    category_intervals: dict[str, tuple[float, float]] = Field(default_factory=dict)

    @property
    def worst(self) -> tuple[str, float] | None:
        return min(self.category_deltas.items(), key=lambda kv: kv[1]) if self.category_deltas else None

    def summary(self) -> str:
        worst = self.worst
        categories = f"worst category {worst[0]} {worst[1]:+.4f}" if worst else "no categories"
        noise = ""
        if self.gain_interval is not None and self.confidence is not None:
            low, high = self.gain_interval
            noise = f", {self.confidence:.0%} interval {low:+.4f} to {high:+.4f} over {self.examples} examples"
        return (
            f"{self.headline} {self.challenger_score:.4f} vs {self.champion_score:.4f} ({self.gain:+.4f}{noise}), "
            f"{categories}"
        )


def decide(
    champion: GauntletReport, challenger: GauntletReport, rule: PromoteConfig, spec: GauntletSpec | None
) -> Decision:
    """Apply the rule to two reports scored on the same gauntlet (`spec`) with the same code and seed.

    The headline gain counts only when its paired-bootstrap interval clears `min_gain`: a gain whose
    interval reaches down to `min_gain` is within noise and rejects. A category rejects only when its
    whole interval lies below `-max_category_drop`: a drop that could be noise does not.
    """
    headline = rule.headline or champion.headline
    a, b = champion.score_of(headline), challenger.score_of(headline)
    if a is None or b is None:
        raise ValueError(f"promote.headline: {headline!r} is not an average or category of this gauntlet")
    categories = {d.name: d.delta for d in deltas(champion, challenger) if d.kind == "category" and d.delta is not None}
    pct = f"{rule.confidence:.0%}"
    reasons = []
    try:
        gains = paired_gains(
            spec, champion, challenger, headline, confidence=rule.confidence, resamples=rule.resamples, seed=rule.seed
        )
    except NotPaired as exc:
        gains = None
        reasons.append(f"no paired interval ({exc}), so the gain cannot be told from noise")
    iv = gains.of(headline) if gains else None
    if iv is not None:
        if iv.high < rule.min_gain:
            reasons.append(
                f"{headline} gained {iv.text(rule.confidence)}, less than promote.min_gain {rule.min_gain:+.4f}"
            )
        elif iv.low <= rule.min_gain:
            reasons.append(
                f"{headline} gained {iv.text(rule.confidence)}: within noise, the interval does not clear "
                f"promote.min_gain {rule.min_gain:+.4f}"
            )
    intervals = {}
    for name in sorted(categories):
        civ = gains.of(name) if gains else None
        if civ is None:
            continue
        intervals[name] = (civ.low, civ.high)
        if civ.high < -rule.max_category_drop:
            reasons.append(
                f"category {name} fell {civ.text(rule.confidence)}, significantly more than "
                f"promote.max_category_drop {rule.max_category_drop:.4f}"
            )
    text = (
        f"{headline} gain's {pct} lower bound above {rule.min_gain:+.4f} and no category's drop significantly "
        f"beyond -{rule.max_category_drop:.4f} (paired bootstrap over the gauntlet's examples, "
        f"{rule.resamples} resamples, seed {rule.seed})"
    )
    return Decision(
        accepted=not reasons,
        headline=headline,
        champion_score=a,
        challenger_score=b,
        gain=b - a,
        category_deltas=categories,
        rule=text,
        reasons=reasons,
        confidence=rule.confidence if gains else None,
        examples=gains.examples if gains else 0,
        resamples=rule.resamples if gains else 0,
        seed=rule.seed,
        gain_interval=(iv.low, iv.high) if iv else None,
        category_intervals=intervals,
    )

"""How much of a score difference between two models is noise: a paired bootstrap over the gauntlet's examples.

Two models scored on the same gauntlet, with the same code and seed, answered the same examples. A
difference in the headline is only a gain when it would survive drawing another set of examples
of the same kind; on a small gauntlet, consecutive checkpoints of one run move the headline as much
as a real improvement does. So the gain gets an interval:

- resample the examples with replacement, the same draw for both models (paired), each task (and
  each category partition of a task) keeping its size (stratified), `resamples` times from `seed`;
- recompute both models' task accuracies, and from them the categories and averages through the
  gauntlet's own arithmetic (evaluation/aggregate.py works on arrays as on numbers);
- the interval of each gain is the central `confidence` share of its resampled values.

A paired resample of n (champion, challenger) outcomes is the count of each of the four pairs
(both wrong, only the challenger right, only the champion right, both right) drawn from a
multinomial with the observed shares: exactly the same distribution as drawing the examples
themselves, at a cost that does not grow with n.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from evaluation.aggregate import aggregate
from evaluation.report import GauntletReport, TaskResult
from evaluation.spec import GauntletSpec


class NotPaired(ValueError):
    """Two reports that cannot be compared example by example; str() says which task and why."""


@dataclass(frozen=True)
class Interval:
    """A gain (challenger minus champion) and its bootstrap interval."""

    gain: float
    low: float
    high: float

    def text(self, confidence: float) -> str:
        return f"{self.gain:+.4f} ({confidence:.0%} interval {self.low:+.4f} to {self.high:+.4f})"


@dataclass(frozen=True)
class PairedGains:
    headline: str
    confidence: float
    resamples: int
    seed: int
    examples: int = 0  # examples each model answered, counted once per few-shot setting
    gains: dict[str, Interval] = field(default_factory=dict)  # headline, each average and each category

    def of(self, name: str) -> Interval | None:
        return self.gains.get(name)


def _pairs(a: TaskResult, b: TaskResult) -> list[tuple[str, str]]:
    if not a.hits or not b.hits:
        raise NotPaired(f"{a.key}: no example-level results (a report written before they were kept)")
    if sorted(a.hits) != sorted(b.hits):
        raise NotPaired(f"{a.key}: the two reports split the task into different categories")
    out = []
    for part in sorted(a.hits):
        x, y = a.hits[part], b.hits[part]
        if len(x) != len(y):
            raise NotPaired(f"{a.key}{'/' + part if part else ''}: {len(x)} examples against {len(y)}")
        out.append((x, y))
    return out


def _resampled_accuracy(pairs: list[tuple[str, str]], rng: np.random.Generator, resamples: int):
    """Both models' task accuracy in each resample: the mean over partitions, as run_tasks scores a task."""
    acc_a, acc_b = np.zeros(resamples), np.zeros(resamples)
    for x, y in pairs:
        n = len(x)
        if n == 0:
            continue
        # cell of each example: 0 both wrong, 1 only b right, 2 only a right, 3 both right
        pair = 2 * (np.frombuffer(x.encode(), np.uint8) == ord("1")) + (np.frombuffer(y.encode(), np.uint8) == ord("1"))
        cells = np.bincount(pair, minlength=4)
        counts = rng.multinomial(n, cells / n, size=resamples)
        acc_a += (counts[:, 2] + counts[:, 3]) / n
        acc_b += (counts[:, 1] + counts[:, 3]) / n
    return acc_a / len(pairs), acc_b / len(pairs)


def paired_gains(
    spec: GauntletSpec | None,
    champion: GauntletReport,
    challenger: GauntletReport,
    headline: str,
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> PairedGains:
    """Every gain of `challenger` over `champion` (the headline, each average, each category) with its
    paired-bootstrap interval. `spec` None: the gauntlet the reports carry, if any. Raises NotPaired when
    the two were not scored on the same examples."""
    if spec is None and champion.gauntlet is not None:
        if champion.gauntlet != challenger.gauntlet:
            raise NotPaired("the reports were aggregated by different gauntlets")
        spec = GauntletSpec.model_validate(champion.gauntlet)
    ta, tb = {t.key: t for t in champion.tasks}, {t.key: t for t in challenger.tasks}
    if sorted(ta) != sorted(tb):
        raise NotPaired(f"the reports scored different tasks: {sorted(set(ta) ^ set(tb))}")
    rng = np.random.default_rng(seed)
    acc_a: dict[tuple[str, int], np.ndarray] = {}
    acc_b: dict[tuple[str, int], np.ndarray] = {}
    samples: dict[tuple[str, int], int] = {}
    examples = 0
    for key in sorted(ta):
        a, b = ta[key], tb[key]
        pairs = _pairs(a, b)
        k = (a.label, a.num_fewshot)
        acc_a[k], acc_b[k] = _resampled_accuracy(pairs, rng, resamples)
        samples[k] = a.examples
        examples += sum(len(x) for x, _ in pairs)
    draws: dict[str, np.ndarray] = {}
    if spec is not None:
        sa, sb = aggregate(spec, acc_a, samples), aggregate(spec, acc_b, samples)
        for name in [*sb.averages, *sb.categories]:
            draws[name] = np.asarray(sb.averages.get(name, sb.categories.get(name))) - np.asarray(
                sa.averages.get(name, sa.categories.get(name))
            )
    if headline not in draws:  # no gauntlet: the headline is the mean task accuracy (GauntletReport.average)
        draws[headline] = sum(acc_b.values()) / len(acc_b) - sum(acc_a.values()) / len(acc_a)
    tail = (1.0 - confidence) / 2
    gains = {}
    for name, values in draws.items():
        a, b = champion.score_of(name), challenger.score_of(name)
        point = (b - a) if a is not None and b is not None else float(np.mean(values))
        low, high = np.quantile(values, [tail, 1.0 - tail])
        gains[name] = Interval(gain=point, low=float(low), high=float(high))
    return PairedGains(headline, confidence, resamples, seed, examples, gains)

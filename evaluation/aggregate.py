"""Gauntlet arithmetic: benchmark scores -> category scores -> named averages.

Follows llm-foundry's EvalGauntlet callback (llmfoundry/callbacks/eval_gauntlet_callback.py):
- a benchmark is a (task label, num_fewshot) pair; a task with categories scores the plain
  mean of its per-category accuracies;
- score = accuracy - baseline, divided by (1 - baseline) when rescaling;
- benchmark weights inside a category: EQUAL 1, SAMPLE_SZ the example count,
  LOG_SAMPLE_SZ max(log2(count), 1);
- a category with any benchmark missing is dropped, with a warning;
- a named average is the plain mean of the categories it names that were scored; names of
  categories that do not exist or were dropped are left out with a warning; 0 when none is left.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from evaluation.spec import GauntletSpec, Weighting

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchmarkScore:
    category: str
    name: str
    num_fewshot: int
    accuracy: float
    random_baseline: float
    score: float
    weight: float


@dataclass(frozen=True)
class GauntletScores:
    benchmarks: list[BenchmarkScore]
    categories: dict[str, float]
    averages: dict[str, float]
    warnings: list[str]


def benchmark_score(accuracy: float, baseline: float, subtract: bool, rescale: bool) -> float:
    # no in-place arithmetic: evaluation/noise.py passes arrays of resampled accuracies, which must not change
    score = accuracy
    if subtract:
        score = score - baseline
        if rescale:
            score = score / (1.0 - baseline)
    return score


def weight_of(weighting: Weighting, samples: int) -> float:
    samples = max(samples, 1)
    if weighting is Weighting.SAMPLE_SZ:
        return float(samples)
    if weighting is Weighting.LOG_SAMPLE_SZ:
        return max(math.log2(samples), 1.0)
    return 1.0


def aggregate(
    spec: GauntletSpec, accuracy: dict[tuple[str, int], float], samples: dict[tuple[str, int], int]
) -> GauntletScores:
    """`accuracy` and `samples` are keyed by (task label, num_fewshot)."""
    warnings: list[str] = []
    benchmarks: list[BenchmarkScore] = []
    categories: dict[str, float] = {}
    for cat in spec.categories:
        missing = [f"{b.name}/{b.num_fewshot}-shot" for b in cat.benchmarks if (b.name, b.num_fewshot) not in accuracy]
        if missing:
            warnings.append(f"category '{cat.name}' dropped: no result for {', '.join(missing)}")
            continue
        scored = []
        for b in cat.benchmarks:
            key = (b.name, b.num_fewshot)
            scored.append(
                BenchmarkScore(
                    category=cat.name,
                    name=b.name,
                    num_fewshot=b.num_fewshot,
                    accuracy=accuracy[key],
                    random_baseline=b.random_baseline,
                    score=benchmark_score(
                        accuracy[key], b.random_baseline, spec.subtract_random_baseline, spec.rescale_accuracy
                    ),
                    weight=weight_of(spec.weighting, samples.get(key, 0)),
                )
            )
        total = sum(s.weight for s in scored)
        categories[cat.name] = sum(s.score * (s.weight / total) for s in scored)
        benchmarks.extend(scored)

    known = {c.name for c in spec.categories}
    averages: dict[str, float] = {}
    for name, members in spec.named_averages().items():
        unknown = [m for m in members if m not in known]
        if unknown:
            warnings.append(f"average '{name}' names categories not in the gauntlet: {', '.join(unknown)}")
        present = [categories[m] for m in members if m in categories]
        averages[name] = sum(present) / len(present) if present else 0.0
    for w in warnings:
        log.warning(w)
    return GauntletScores(benchmarks, categories, averages, warnings)

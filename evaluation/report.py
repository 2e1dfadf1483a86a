"""What a gauntlet run produced, and its renderings: metrics, markdown, table rows, JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from evaluation.aggregate import BenchmarkScore


@dataclass(frozen=True)
class TaskResult:
    """One (task, num_fewshot): its accuracy, and its gauntlet baseline and score when it is a benchmark."""

    label: str
    num_fewshot: int
    icl_task_type: str
    accuracy: float
    examples: int
    categories: dict[str, float] = field(default_factory=dict)
    random_baseline: float | None = None
    score: float | None = None
    # Each example's outcome, "1" right and "0" wrong, in scoring order, per category partition ("" when the
    # task has none): what a paired comparison of two models on the same examples needs (evaluation/noise.py).
    hits: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.label}/{self.num_fewshot}-shot"


@dataclass
class GauntletReport:
    tasks: list[TaskResult]
    categories: dict[str, float] = field(default_factory=dict)
    averages: dict[str, float] = field(default_factory=dict)
    benchmarks: list[BenchmarkScore] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # task label -> why
    warnings: list[str] = field(default_factory=list)
    examples: int = 0
    tokens: int = 0
    seconds: float = 0.0
    # the gauntlet spec (GauntletSpec as JSON) the scores were aggregated with: a report read back from MLflow
    # can then be compared example by example without the YAML it came from (evaluation/noise.py)
    gauntlet: dict | None = None

    @property
    def headline(self) -> str:
        """Name of the headline score: the gauntlet's first named average, else `average_score`."""
        return next(iter(self.averages), "average_score")

    def score_of(self, name: str) -> float | None:
        """A named average or category score, or the headline's when `name` is `average_score`."""
        if name == "average_score" and not self.averages:
            return self.average
        return self.averages.get(name, self.categories.get(name))

    def category_of(self) -> dict[tuple[str, int], str]:
        """(task label, shots) -> the gauntlet category it counts in."""
        return {(b.name, b.num_fewshot): b.category for b in self.benchmarks}

    @property
    def average(self) -> float:
        """Headline score: the first named average, else the mean task score."""
        if self.averages:
            return next(iter(self.averages.values()))
        scores = [t.score if t.score is not None else t.accuracy for t in self.tasks]
        return sum(scores) / len(scores) if scores else 0.0

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in self.tasks:
            out[f"icl/{t.key}"] = t.accuracy
            for cat, acc in t.categories.items():
                out[f"icl/{t.key}/{cat}"] = acc
        for name, value in {**self.categories, **self.averages}.items():
            out[f"gauntlet/{name}"] = value
        return out

    def table_rows(self) -> list[dict[str, Any]]:
        """One row per task and shot count: the MLflow table and the markdown table."""
        return [
            {
                "task": t.label,
                "shots": t.num_fewshot,
                "type": t.icl_task_type,
                "examples": t.examples,
                "accuracy": round(t.accuracy, 6),
                "baseline": t.random_baseline,
                "score": None if t.score is None else round(t.score, 6),
            }
            for t in self.tasks
        ]

    def to_markdown(self, title: str = "Eval gauntlet") -> str:
        lines = [f"## {title}", "", f"**Headline average: {self.average:.4f}**", ""]
        if self.averages or self.categories:
            lines += ["| average / category | score |", "|---|---:|"]
            lines += [f"| **{k}** | {v:.4f} |" for k, v in self.averages.items()]
            lines += [f"| {k} | {v:.4f} |" for k, v in self.categories.items()]
            lines.append("")
        # One table per gauntlet category (tasks in no category last), as the gauntlet is read.
        category_of = self.category_of()
        groups: dict[str, list[dict[str, Any]]] = {}
        for t, row in zip(self.tasks, self.table_rows(), strict=True):
            groups.setdefault(category_of.get((t.label, t.num_fewshot), ""), []).append(row)
        for category in sorted(groups, key=lambda c: (c == "", c)):
            score = self.categories.get(category)
            heading = category or "not in a category"
            lines += [f"### {heading}" + (f" ({score:.4f})" if score is not None else ""), ""]
            lines += [
                "| task | shots | type | examples | accuracy | baseline | score |",
                "|---|---:|---|---:|---:|---:|---:|",
            ]
            for r in groups[category]:
                base = "" if r["baseline"] is None else f"{r['baseline']:.2f}"
                score_cell = "" if r["score"] is None else f"{r['score']:.4f}"
                lines.append(
                    f"| {r['task']} | {r['shots']} | {r['type']} | {r['examples']} | {r['accuracy']:.4f} | "
                    f"{base} | {score_cell} |"
                )
            lines.append("")
        if self.skipped:
            lines += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in self.skipped.items())]
        if self.warnings:
            lines += ["", *[f"- warning: {w}" for w in self.warnings]]
        if self.seconds > 0:
            lines += [
                "",
                f"{self.examples} examples, {self.tokens} tokens in {self.seconds:.2f}s "
                f"({self.examples / self.seconds:.1f} examples/s, {self.tokens / self.seconds:.0f} tokens/s)",
            ]
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> GauntletReport:
        raw = json.loads(text)
        raw["tasks"] = [TaskResult(**t) for t in raw["tasks"]]
        raw["benchmarks"] = [BenchmarkScore(**b) for b in raw["benchmarks"]]
        return cls(**raw)


def compare_markdown(
    a: GauntletReport,
    b: GauntletReport,
    name_a: str = "A",
    name_b: str = "B",
    intervals: dict[str, tuple[float, float]] | None = None,
    confidence: float | None = None,
) -> str:
    """Two reports side by side with per-task and per-category deltas (B - A); `intervals` (by average or
    category name, from evaluation/noise.py) add each delta's interval at `confidence`."""

    def fmt(x: float | None) -> str:
        return "" if x is None else f"{x:.4f}"

    def delta(x: float | None, y: float | None) -> str:
        return "" if x is None or y is None else f"{y - x:+.4f}"

    lines = [
        f"## Gauntlet comparison: {name_a} vs {name_b}",
        "",
        f"Headline average: {a.average:.4f} -> {b.average:.4f} ({b.average - a.average:+.4f})",
        "",
    ]
    shown = intervals is not None and confidence is not None
    if shown:
        lines += [
            f"| average / category | {name_a} | {name_b} | delta | {confidence:.0%} interval of the delta |",
            "|---|---:|---:|---:|---|",
        ]
    else:
        lines += [f"| average / category | {name_a} | {name_b} | delta |", "|---|---:|---:|---:|"]
    for src in ("averages", "categories"):
        da, db = getattr(a, src), getattr(b, src)
        for k in list(dict.fromkeys([*da, *db])):
            row = f"| {k} | {fmt(da.get(k))} | {fmt(db.get(k))} | {delta(da.get(k), db.get(k))} |"
            if shown:
                iv = intervals.get(k)
                row += f" {iv[0]:+.4f} to {iv[1]:+.4f} |" if iv else " |"
            lines.append(row)
    ta = {t.key: t for t in a.tasks}
    tb = {t.key: t for t in b.tasks}
    lines += ["", f"| task | {name_a} accuracy | {name_b} accuracy | delta | {name_a} score | {name_b} score | delta |"]
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for k in list(dict.fromkeys([*ta, *tb])):
        x, y = ta.get(k), tb.get(k)
        acc_x, acc_y = (x.accuracy if x else None), (y.accuracy if y else None)
        sc_x, sc_y = (x.score if x else None), (y.score if y else None)
        lines.append(
            f"| {k} | {fmt(acc_x)} | {fmt(acc_y)} | {delta(acc_x, acc_y)} "
            f"| {fmt(sc_x)} | {fmt(sc_y)} | {delta(sc_x, sc_y)} |"
        )
    return "\n".join(lines) + "\n"

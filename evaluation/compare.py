"""Two gauntlet reports of two models, side by side: deltas, a plot and an HTML page.

Used by `tessera compare A B` and by promotion (champion vs challenger). Deltas are B - A.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass

from evaluation.html import _table, figure_png, page_head
from evaluation.report import GauntletReport, compare_markdown


@dataclass(frozen=True)
class Delta:
    name: str
    kind: str  # "average", "category" or "task"
    a: float | None
    b: float | None

    @property
    def delta(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a


def deltas(a: GauntletReport, b: GauntletReport) -> list[Delta]:
    """Averages, then categories, then tasks (by score where the gauntlet gives one, else accuracy)."""
    out = []
    for kind, da, db in (("average", a.averages, b.averages), ("category", a.categories, b.categories)):
        for name in dict.fromkeys([*da, *db]):
            out.append(Delta(name, kind, da.get(name), db.get(name)))
    ta, tb = {t.key: t for t in a.tasks}, {t.key: t for t in b.tasks}
    for key in dict.fromkeys([*ta, *tb]):
        x, y = ta.get(key), tb.get(key)
        value = lambda t: None if t is None else (t.score if t.score is not None else t.accuracy)  # noqa: E731
        out.append(Delta(key, "task", value(x), value(y)))
    return out


def compare_png(
    a: GauntletReport,
    b: GauntletReport,
    name_a: str,
    name_b: str,
    intervals: dict[str, tuple[float, float]] | None = None,
    confidence: float | None = None,
) -> bytes | None:
    """Grouped bars of every average and category for both models and, with `intervals`, a second panel of
    each delta with its interval as an error bar; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [d for d in deltas(a, b) if d.kind != "task"] or [d for d in deltas(a, b) if d.kind == "task"]
    labels = [d.name for d in rows]
    xs = range(len(rows))
    width = max(5.0, 1.2 * len(rows) + 2)
    gains = [d for d in rows if intervals and d.name in intervals and d.delta is not None]
    if gains:
        fig, (ax, gain_ax) = plt.subplots(2, 1, figsize=(width, 7), dpi=100, height_ratios=[3, 2])
    else:
        fig, ax = plt.subplots(figsize=(width, 4), dpi=100)
    ax.bar([x - 0.2 for x in xs], [d.a or 0.0 for d in rows], width=0.4, label=name_a)
    ax.bar([x + 0.2 for x in xs], [d.b or 0.0 for d in rows], width=0.4, label=name_b)
    for x, d in zip(xs, rows, strict=True):
        if d.delta is not None:
            ax.annotate(f"{d.delta:+.3f}", (x, max(d.a or 0, d.b or 0)), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_ylabel("score")
    ax.set_title(f"{name_a} vs {name_b}")
    ax.legend(fontsize=8)
    if gains:
        low = [d.delta - intervals[d.name][0] for d in gains]
        high = [intervals[d.name][1] - d.delta for d in gains]
        gain_ax.errorbar(range(len(gains)), [d.delta for d in gains], yerr=[low, high], fmt="o", capsize=4)
        gain_ax.axhline(0, color="black", linewidth=0.5)
        gain_ax.set_xticks(range(len(gains)), [d.name for d in gains], rotation=20, ha="right", fontsize=8)
        gain_ax.set_ylabel("delta")
        gain_ax.set_title(f"{name_b} minus {name_a}, with {confidence or 0.95:.0%} intervals", fontsize=9)
        fig.tight_layout()
    return figure_png(fig)


def render_comparison_html(
    a: GauntletReport,
    b: GauntletReport,
    name_a: str,
    name_b: str,
    title: str,
    verdict: str | None = None,
    intervals: dict[str, tuple[float, float]] | None = None,
    confidence: float | None = None,
) -> str:
    parts = page_head(title)
    if verdict:
        parts.append(f"<p><b>{html.escape(verdict)}</b></p>")
    noise = (intervals or {}).get(a.headline)
    noise_text = f", {confidence or 0.95:.0%} interval {_interval(noise)}" if noise else ""
    parts.append(
        f"<p>Headline ({html.escape(a.headline)}): {a.average:.4f} &rarr; {b.average:.4f} "
        f"({b.average - a.average:+.4f}{noise_text})</p>"
    )
    png = compare_png(a, b, name_a, name_b, intervals, confidence)
    if png is not None:
        parts.append(f"<img alt='comparison' src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
    for kind, heading in (("average", "Averages"), ("category", "Categories"), ("task", "Tasks")):
        rows = [(d.name, d.a, d.b, d.delta) for d in deltas(a, b) if d.kind == kind]
        if rows and intervals and confidence and kind != "task":
            rows = [(*r, _interval(intervals.get(r[0]))) for r in rows]
            parts += [
                f"<h2>{heading}</h2>",
                _table([kind, name_a, name_b, "delta", f"{confidence:.0%} interval"], rows),
            ]
        elif rows:
            parts += [f"<h2>{heading}</h2>", _table([kind, name_a, name_b, "delta"], rows)]
    parts.append("</body></html>")
    return "\n".join(parts)


def _interval(iv: tuple[float, float] | None) -> str:
    return "" if iv is None else f"{iv[0]:+.4f} to {iv[1]:+.4f}"


__all__ = ["Delta", "deltas", "compare_markdown", "compare_png", "render_comparison_html"]

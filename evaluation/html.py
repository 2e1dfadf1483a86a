"""A self-contained HTML report: category and task tables, and a PNG of scores against tokens."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence

from evaluation.report import GauntletReport

# metric name -> [(tokens, value)], oldest first
History = Mapping[str, Sequence[tuple[int, float]]]


def plot_png(history: History, title: str = "Gauntlet scores") -> bytes | None:
    """PNG bytes of each series against tokens; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for name, points in history.items():
        if points:
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("tokens")
    ax.set_ylabel("score")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if history:
        ax.legend(fontsize=8)
    return figure_png(fig)


def figure_png(fig) -> bytes:
    """A finished matplotlib figure as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(x: object) -> str:
        if x is None:
            return ""
        return f"{x:.4f}" if isinstance(x, float) else html.escape(str(x))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(x)}</td>" for x in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page_head(title: str) -> list[str]:
    """The opening of a self-contained report page: styles and the title."""
    return [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,th:first-child{text-align:left}"
        "</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]


def render_html(report: GauntletReport, title: str, history: History | None = None) -> str:
    parts = [
        *page_head(title),
        f"<p><b>Headline average: {report.average:.4f}</b></p>",
    ]
    if report.averages or report.categories:
        parts.append("<h2>Categories</h2>")
        rows = [(k, v) for k, v in report.averages.items()] + [(k, v) for k, v in report.categories.items()]
        parts.append(_table(["average / category", "score"], rows))
    parts.append("<h2>Tasks</h2>")
    cols = ["task", "shots", "type", "examples", "accuracy", "baseline", "score"]
    parts.append(_table(cols, [[r[c] for c in cols] for r in report.table_rows()]))
    if history:
        png = plot_png(history)
        parts.append("<h2>Scores against tokens</h2>")
        if png is not None:
            parts.append(
                f"<img alt='scores against tokens' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
            )
        steps = sorted({s for pts in history.values() for s, _ in pts})
        rows = [[s, *[dict(history[k]).get(s) for k in history]] for s in steps]
        parts.append(_table(["tokens", *history], rows))
    if report.skipped:
        items = "".join(f"<li>{html.escape(k)}: {html.escape(v)}</li>" for k, v in report.skipped.items())
        parts.append(f"<h2>Skipped</h2><ul>{items}</ul>")
    if report.warnings:
        parts.append("<h2>Warnings</h2><ul>" + "".join(f"<li>{html.escape(w)}</li>" for w in report.warnings) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)

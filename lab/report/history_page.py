"""The history page: one self-contained HTML file, one plot per KEEP metric with its steps marked,
and under each plot the table of labels and values behind it."""

from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lab.report.document import CSS
from lab.report.history import History, MetricHistory

REGRESSION, IMPROVEMENT, LEVEL = "#d62728", "#2ca02c", "#1f77b4"


def folder_name(series: str) -> str:
    """The page's folder in the reports folder, beside the runs' reports, which link to it."""
    return "history-" + re.sub(r"[^A-Za-z0-9._-]+", "_", series)


def write(history: History, out: str | Path) -> Path:
    """Write `<out>/history-<series>/index.html`; returns the file."""
    folder = Path(out) / folder_name(history.series)
    folder.mkdir(parents=True, exist_ok=True)
    parts = [f"<h1>History of {html.escape(history.series)}</h1>",
             f"<p>Each point is the median of a label's warm control boots; the bar spans its boots. A step is a "
             f"level change beyond the KEEP threshold ({history.threshold_pct:g} %) and the noise band that "
             f"persists over the next labels (see <code>lab/analysis/steps.py</code>); a lone departure is an "
             f"outlier.</p>"]
    regressions = history.regressions()
    parts.append("<h2>Check</h2><p>" + ("<br>".join(html.escape(r) for r in regressions) if regressions
                                        else "No metric's latest level is a regression.") + "</p>")
    for mh in history.metrics:
        parts.append(f"<h2>{html.escape(mh.metric)}</h2>")
        if mh.analysis is None:
            parts.append('<p class="note">fewer than two labels with a value: nothing to compare</p>')
        else:
            a = mh.analysis
            sigma = f"{a.sigma_pct:.2f} %" if a.sigma_pct is not None else "not estimated (under 4 labels)"
            parts.append(f"<p>noise: one label's robust SD {sigma}; band ±{a.band_pct:.2f} %; a departure must "
                         f"exceed ±{a.limit_pct:.2f} %</p>")
            labels = [p.label for p in mh.used]
            if a.steps:
                parts.append("<ul>" + "".join(f"<li>{html.escape(s.describe(labels, mh.unit, a.limit_pct))}</li>"
                                              for s in a.steps) + "</ul>")
        parts.append(f'<img alt="{html.escape(mh.metric)}" src="data:image/png;base64,{_plot(mh)}">')
        parts.append(_table(mh))
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(history.series)}</title>"
            f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n")
    path = folder / "index.html"
    path.write_text(page)
    return path


def _marks(mh: MetricHistory) -> dict[int, str]:
    """Index among the used points -> what happened there."""
    if mh.analysis is None:
        return {}
    marks = {i: "outlier" for i in mh.analysis.outliers}
    marks.update({i: "pending" for i in mh.analysis.pending})
    marks.update({s.index: f"{'regression' if s.regression else 'improvement'} {s.delta_pct:+.1f} %"
                  for s in mh.analysis.steps})
    return marks


def _table(mh: MetricHistory) -> str:
    marks = _marks(mh)
    used = {id(p): i for i, p in enumerate(mh.used)}
    rows = []
    for p in mh.points:
        value = f"{p.value:.4g}" if p.value is not None else "no usable control value"
        boots = ", ".join(f"{v:.4g}" for v in p.boots)
        drift = f"{p.drift_pct:.2f}" if p.drift_pct is not None else ""
        mark = marks.get(used.get(id(p), -1), "")
        rows.append(f"<tr><td>{html.escape(p.label)}</td><td>{html.escape(p.run)}</td><td>{value}</td>"
                    f"<td>{boots}</td><td>{drift}</td><td>{mark}</td></tr>")
    return (f"<table><tr><th>label</th><th>run</th><th>{html.escape(mh.unit)}</th><th>control boots</th>"
            f"<th>controls' drift %</th><th>step</th></tr>{''.join(rows)}</table>")


def _plot(mh: MetricHistory) -> str:
    fig = Figure(figsize=(9, 3.4), dpi=100)
    ax = fig.add_subplot()
    used = mh.used
    xs = list(range(len(used)))
    ax.errorbar(xs, [p.value for p in used],
                yerr=[[p.value - min(p.boots) for p in used], [max(p.boots) - p.value for p in used]],
                fmt="o-", color=LEVEL, capsize=3, lw=1)
    marks = _marks(mh)
    for i, what in marks.items():
        if what in ("outlier", "pending"):
            ax.plot([i], [used[i].value], "x", color="#555", ms=10)
        else:
            ax.axvline(i - 0.5, color=REGRESSION if what.startswith("regression") else IMPROVEMENT, ls="--")
            ax.annotate(what, (i - 0.5, ax.get_ylim()[1]), fontsize=8, ha="left", va="top")
    ax.set_xticks(xs, [p.label for p in used], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"{mh.unit} ({'higher' if mh.higher_is_better else 'lower'} is better)")
    ax.set_title(mh.metric, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return base64.b64encode(buf.getvalue()).decode()

"""The history page: one self-contained HTML file that states first what the series can detect, then
the gate's finding, one plot per KEEP metric with its steps and base changes marked, and under each plot
the table of labels and values behind it."""

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

REGRESSION, IMPROVEMENT, LEVEL, BASE = "#d62728", "#2ca02c", "#1f77b4", "#7f7f7f"


def _text(text: str) -> str:
    """Text as HTML element content (an apostrophe stays one)."""
    return html.escape(text, quote=False)


def folder_name(series: str) -> str:
    """The page's folder in the reports folder, beside the runs' reports, which link to it."""
    return "history-" + re.sub(r"[^A-Za-z0-9._-]+", "_", series)


def write(history: History, out: str | Path) -> Path:
    """Write `<out>/history-<series>/index.html`; returns the file."""
    folder = Path(out) / folder_name(history.series)
    folder.mkdir(parents=True, exist_ok=True)
    labels = history.labels
    parts = [f"<h1>History of {_text(history.series)}</h1>",
             f"<p>{len(labels)} labels ({_text(labels[0])} … {_text(labels[-1])}). Each point is the "
             f"median of a label's warm control boots; the bar spans its boots. A step is a level change beyond the "
             f"KEEP threshold ({history.threshold_pct:g} %) and the noise band that persists over the next labels "
             f"(see <code>lab/analysis/steps.py</code>); a lone departure is an outlier. Labels under different base "
             f"configs are not compared.</p>",
             "<h2>What this series detects</h2><p>Under its current base, from the noise the gate uses:</p><ul>"
             + "".join(f"<li>{_text(line)}</li>" for line in history.detectable()) + "</ul>"]
    if history.base_changes():
        parts.append("<h2>Base changes</h2><ul>" + "".join(f"<li>{_text(line)}</li>"
                                                          for line in history.base_changes()) + "</ul>")
    check = history.check()
    found = check.regressions or ["No metric's latest level is a regression."]
    parts.append(f"<h2>Check</h2><p>{_text(check.summary)} (<code>lab history --check</code> exit status "
                 f"{int(check.outcome)}: {check.outcome.name.lower().replace('_', ' ')})</p><p>"
                 + "<br>".join(_text(r) for r in found + check.warnings) + "</p>")
    for mh in history.metrics:
        parts.append(f"<h2>{_text(mh.metric)}</h2>")
        if not any(seg.comparable for seg in mh.segments):
            parts.append('<p class="note">fewer than two labels with a value under one base: nothing to compare</p>')
        for seg in mh.segments:
            if not seg.comparable:
                continue
            a = seg.analysis
            seg_labels = [p.label for p in seg.points]
            under = (f"labels {_text(seg_labels[0])} … {_text(seg_labels[-1])}: "
                     if len(mh.segments) > 1 else "")
            sigma = f"{a.sigma_pct:.2f} %" if a.sigma_pct is not None else "not estimated (under 3 differences)"
            parts.append(f"<p>{under}noise: one label's robust SD {sigma}; band ±{a.band_pct:.2f} %; a departure "
                         f"must exceed ±{a.limit_pct:.2f} %</p>")
            if a.steps:
                parts.append("<ul>" + "".join(f"<li>{_text(s.describe(seg_labels, mh.unit, a.limit_pct))}</li>"
                                              for s in a.steps) + "</ul>")
        if mh.used:
            parts.append(f'<img alt="{html.escape(mh.metric)}" src="data:image/png;base64,{_plot(history, mh)}">')
        parts.append(_table(history, mh))
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{_text(history.series)}</title>"
            f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n")
    path = folder / "index.html"
    path.write_text(page)
    return path


def _marks(mh: MetricHistory) -> dict[int, str]:
    """id of a point -> what happened there."""
    marks: dict[int, str] = {}
    for seg in mh.segments:
        if not seg.comparable:
            continue
        a = seg.analysis
        marks.update({id(seg.points[i]): "outlier" for i in a.outliers})
        marks.update({id(seg.points[i]): "pending" for i in a.pending})
        marks.update({id(seg.points[s.index]): f"{'regression' if s.regression else 'improvement'} "
                                                f"{s.delta_pct:+.1f} %" for s in a.steps})
    return marks


def _table(history: History, mh: MetricHistory) -> str:
    marks = _marks(mh)
    rows = []
    for p in mh.points:
        value = f"{p.value:.4g}" if p.value is not None else "no usable control value"
        boots = ", ".join(f"{v:.4g}" for v in p.boots)
        drift = f"{p.drift_pct:.2f}" if p.drift_pct is not None else ""
        base = history.bases[p.base]
        new = f" (new: {base.change})" if p.base and base.label == p.label else ""
        rows.append(f"<tr><td>{_text(p.label)}</td><td>{_text(p.run)}</td><td>{value}</td>"
                    f"<td>{boots}</td><td>{drift}</td><td>{_text(base.config_hash[:8] + new)}</td>"
                    f"<td>{marks.get(id(p), '')}</td></tr>")
    return (f"<table><tr><th>label</th><th>run</th><th>{_text(mh.unit)}</th><th>control boots</th>"
            f"<th>controls' drift %</th><th>base</th><th>step</th></tr>{''.join(rows)}</table>")


def _plot(history: History, mh: MetricHistory) -> str:
    fig = Figure(figsize=(9, 3.4), dpi=100)
    ax = fig.add_subplot()
    used = mh.used
    xs = list(range(len(used)))
    at = {id(p): i for i, p in enumerate(used)}
    for seg in mh.segments:  # one line per base: labels under different bases are not joined
        seg_xs = [at[id(p)] for p in seg.points]
        ax.errorbar(seg_xs, [p.value for p in seg.points],
                    yerr=[[p.value - min(p.boots) for p in seg.points], [max(p.boots) - p.value for p in seg.points]],
                    fmt="o-", color=LEVEL, capsize=3, lw=1)
    for k in range(1, len(history.bases)):
        first = next((i for i, p in enumerate(used) if p.base >= k), None)
        if first is not None:
            ax.axvline(first - 0.5, color=BASE, ls=":")
            ax.annotate("base changed", (first - 0.5, ax.get_ylim()[0]), fontsize=8, ha="left", va="bottom")
    for point_id, what in _marks(mh).items():
        i = at[point_id]
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

"""The report's figures, drawn with matplotlib's Agg canvas into PNG bytes.

Each figure reads one instrument's cells from warm, finished boots only (a cold boot is never a
figure) and plots one line, bar group or panel per boot, in slot order: one colour per arm (all its
boots), every control in grey, dashed, so the distance between the controls (the window's noise)
is visible next to every arm. Line legends name arms, not boots, so they fit a ladder of many
boots. A figure whose instrument is not in the run is skipped with the reason, never an error.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib import colormaps
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import NullLocator

from lab.report.data import RunData

DPI = 110
ARM_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
               "#bcbd22", "#7f7f7f")
CONTROL_COLOUR = "#8a8a8a"
CONTROL_MARKERS = {"open": "s", "between": "^", "close": "D"}
CONTROLS = "controls"
# Legend entries per column before another column is started (8-point entries on a 4.8-inch figure).
LEGEND_ROWS = 24
DECISION_COLOURS = {"keep": "#2ca02c", "reject": "#d62728", "inconclusive": "#e6a700"}
STATUS_COLOURS = {"done": "#2ca02c", "failed": "#d62728", "refused": "#ff7f0e", "died": "#9467bd",
                  "hung": "#8c564b", "interrupted": "#7f7f7f", "starting": "#bcbd22", "ready": "#bcbd22"}


@dataclass(frozen=True)
class Drawn:
    """One figure of the report: its PNG, or the reason it is absent."""

    name: str  # file stem: decode_ladder.png
    title: str
    png: bytes | None
    note: str  # a caption, or why there is no figure


@dataclass(frozen=True)
class SlotStyle:
    label: str
    colour: str
    linestyle: str
    marker: str
    group: str = ""  # the legend entry it belongs to: its arm, or CONTROLS


def arm_colour(index: int, arms: int) -> str:
    """The colour of the index-th arm: the ten distinct base colours, then evenly spaced hues, so
    no two arms of a long ladder share one."""
    if arms <= len(ARM_COLOURS):
        return ARM_COLOURS[index]
    red, green, blue, _ = colormaps["hsv"](index / arms)
    return f"#{int(red * 255):02x}{int(green * 255):02x}{int(blue * 255):02x}"


def slot_styles(slots: pd.DataFrame) -> dict[str, SlotStyle]:
    """Slot label -> how its line looks; an arm keeps its colour in every figure, controls are grey."""
    ordered = slots.sort_values("idx")
    arms = list(dict.fromkeys(ordered.loc[ordered["role"] == "arm", "arm"]))
    styles = {}
    for row in ordered.itertuples():
        if row.role == "control":
            styles[row.label] = SlotStyle(row.label, CONTROL_COLOUR, "--", CONTROL_MARKERS.get(row.position, "s"),
                                          CONTROLS)
        elif row.role == "arm":
            styles[row.label] = SlotStyle(row.label, arm_colour(arms.index(row.arm), len(arms)), "-", "o", row.arm)
    return styles


def new_figure(width: float = 10.0, height: float = 4.8) -> Figure:
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def by_slot(cells: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Cells grouped per slot, in slot order."""
    return [(label, group) for (_, label), group in cells.groupby(["idx", "label"], sort=True)]


def curve(cells: pd.DataFrame, metric: str, x: str) -> pd.Series:
    """Median over repeats of `metric` for each value of param `x`, sorted by x."""
    picked = cells[(cells["metric"] == metric) & cells[x].notna()] if x in cells else cells.iloc[0:0]
    return picked.groupby(x)["value"].median().sort_index()


def unit_of(cells: pd.DataFrame, metric: str, fallback: str) -> str:
    units = cells.loc[cells["metric"] == metric, "unit"].dropna().unique()
    return str(units[0]) if len(units) else fallback


def line_per_slot(ax: Axes, cells: pd.DataFrame, metric: str, x: str, styles: dict[str, SlotStyle]) -> list[str]:
    """One line per slot; returns the labels of those drawn."""
    drawn = []
    for label, group in by_slot(cells):
        series = curve(group, metric, x)
        if series.empty:
            continue
        style = styles.get(label, SlotStyle(label, "#444444", ":", "x"))
        ax.plot(series.index.astype(float), series.values, color=style.colour, linestyle=style.linestyle,
                marker=style.marker, label=label, linewidth=1.8, markersize=5)
        drawn.append(label)
    return drawn


def legend_by_arm(ax: Axes, labels: list[str], styles: dict[str, SlotStyle]) -> None:
    """One entry per arm drawn (its boots counted) and one for all controls, beside the axes, in as
    many columns as it takes to fit: a ladder of 37 boots is a legend of its arms, not cut off."""
    boots: dict[str, int] = {}
    for label in labels:
        group = styles[label].group if label in styles else label
        boots[group] = boots.get(group, 0) + 1
    handles = []
    for group, count in boots.items():
        style = next((styles[l] for l in labels if l in styles and styles[l].group == group), None)
        colour, linestyle = (style.colour, style.linestyle) if style else ("#444444", ":")
        name = "controls" if group == CONTROLS else group
        handles.append(Line2D([], [], color=colour, linestyle=linestyle, marker="o" if group != CONTROLS else "s",
                              label=f"{name} ({count} boot{'s' if count > 1 else ''})", linewidth=1.8,
                              markersize=5))
    ax.legend(handles=handles, title="arm", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              title_fontsize=8, frameon=False, ncols=math.ceil(len(handles) / LEGEND_ROWS))


# --- the figures ---------------------------------------------------------------------------------------------

# The cells each figure reads, as lab/instruments/{decode,prefill,needle,mixed}.py store them.
DECODE_AGGREGATE, DECODE_PER_STREAM, DECODE_X = "agg_tok_s", "stream_tok_s", "level"
PREFILL_METRIC, PREFILL_X = "prefill_tok_s", "length"
NEEDLE_METRIC, NEEDLE_LENGTH, NEEDLE_DEPTH = "found", "length", "depth"
MIXED_ALONE, MIXED_BEHIND = "short_ttft_alone_s", "short_ttft_behind_s"


def decode_ladder(cells: pd.DataFrame, styles: dict[str, SlotStyle]) -> Figure | str:
    if cells.empty:
        return "no decode cells from a warm finished boot"
    figure = new_figure(12.0, 4.8)
    left, right = figure.subplots(1, 2)
    panels = ((left, DECODE_AGGREGATE, "aggregate: all streams together"),
              (right, DECODE_PER_STREAM, "per stream, after its first token"))
    drawn: list[str] = []
    for ax, metric, subtitle in panels:
        drawn = list(dict.fromkeys(drawn + line_per_slot(ax, cells, metric, DECODE_X, styles)))
        ax.set_title(subtitle, fontsize=10)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(f"output tokens/s ({unit_of(cells, metric, 'tok/s')})")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    legend_by_arm(right, drawn, styles)
    figure.suptitle("Decode ladder: output throughput against concurrency (controls grey, dashed)")
    return figure


def prefill(cells: pd.DataFrame, styles: dict[str, SlotStyle]) -> Figure | str:
    if cells.empty:
        return "no prefill cells from a warm finished boot"
    figure = new_figure()
    ax = figure.subplots()
    drawn = line_per_slot(ax, cells, PREFILL_METRIC, PREFILL_X, styles)
    ax.set_xscale("log", base=2)
    # Ticks at the measured lengths, written out: "2^9" makes a reader compute.
    lengths = sorted(cells.loc[cells["metric"] == PREFILL_METRIC, PREFILL_X].dropna().unique())
    ax.set_xticks([float(v) for v in lengths], [tokens(v) for v in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("prompt length (tokens, log scale)")
    ax.set_ylabel(f"prefill throughput ({unit_of(cells, PREFILL_METRIC, 'tok/s')})")
    ax.set_title("Cold prefill: prompt tokens / time to first token (median of repeats; controls dashed)")
    ax.grid(alpha=0.3, which="both")
    legend_by_arm(ax, drawn, styles)
    return figure


def needle(cells: pd.DataFrame, styles: dict[str, SlotStyle]) -> Figure | str:
    found = cells[cells["metric"] == NEEDLE_METRIC] if not cells.empty else cells
    if found.empty or NEEDLE_LENGTH not in found or NEEDLE_DEPTH not in found:
        return "no needle cells from a warm finished boot"
    panels = by_slot(found)
    columns = min(4, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = new_figure(3.4 * columns + 1.2, 3.0 * rows + 0.8)
    axes = np.atleast_1d(figure.subplots(rows, columns, squeeze=False)).ravel()
    colours = ListedColormap(["#d62728", "#f4a582", "#fddbc7", "#d9f0d3", "#7fbf7b", "#1b7837"])
    image = None
    for ax, (label, group) in zip(axes, panels):
        grid = group.pivot_table(index=NEEDLE_DEPTH, columns=NEEDLE_LENGTH, values="value", aggfunc="mean")
        grid = grid.sort_index().sort_index(axis=1)
        image = ax.imshow(grid.values, cmap=colours, vmin=0, vmax=1, aspect="auto", origin="lower")
        ax.set_xticks(range(grid.shape[1]), [tokens(v) for v in grid.columns], fontsize=7)
        ax.set_yticks(range(grid.shape[0]), [_depth(v) for v in grid.index], fontsize=7)
        for (i, j), value in np.ndenumerate(grid.values):
            if not math.isnan(value):
                ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=7)
        ax.set_title(label, fontsize=9, color=styles[label].colour if label in styles else "black")
        ax.set_xlabel("context length (tokens)", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if image is not None:
        figure.colorbar(image, ax=list(axes[:len(panels)]), label="found rate (share of repeats answered)",
                        shrink=0.8)
    figure.suptitle("Needle retrieval: found rate by context length and depth")
    return figure


def tokens(value: float) -> str:
    """A token count as a tick label: 1024, 8000, 93K, 131K (a separator would read as a decimal point to many)."""
    return f"{int(value)}" if value < 10_000 else f"{round(value / 1000)}K"


def _depth(value: float) -> str:
    return f"{value:.0%}" if 0 <= value <= 1 else f"{value:g}"


def mixed(cells: pd.DataFrame, styles: dict[str, SlotStyle]) -> Figure | str:
    if cells.empty:
        return "no mixed-traffic cells from a warm finished boot"
    table = cells[cells["metric"].isin([MIXED_ALONE, MIXED_BEHIND])].pivot_table(
        index=["idx", "label"], columns="metric", values="value", aggfunc="median")
    if table.empty:
        return "no mixed-traffic TTFT cells from a warm finished boot"
    figure = new_figure()
    ax = figure.subplots()
    labels = [label for _, label in table.index]
    x = np.arange(len(labels))
    width = 0.38
    for offset, metric, text, hatch in ((-width / 2, MIXED_ALONE, "short chat alone", ""),
                                        (width / 2, MIXED_BEHIND, "short chat behind a long prefill", "//")):
        values = table[metric].to_numpy() if metric in table else np.full(len(labels), np.nan)
        bars = ax.bar(x + offset, values, width, label=text, hatch=hatch,
                      color=[styles[label].colour if label in styles else "#444444" for label in labels],
                      edgecolor="white", alpha=0.95 if not hatch else 0.6)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_xticks(x, labels, rotation=20, ha="right")
    ax.set_ylabel(f"time to first token ({unit_of(cells, MIXED_BEHIND, 's')})")
    ax.set_title("Mixed traffic: a short chat's TTFT alone and behind a cold long prefill")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(handles=[Patch(facecolor="#999999", label="alone"),
                       Patch(facecolor="#999999", hatch="//", alpha=0.6, label="behind a long prefill")],
              loc="upper left", fontsize=8, frameon=False)
    return figure


def keep_deltas(verdicts: pd.DataFrame) -> Figure | str:
    """Each judged arm's change per key metric against its controls, coloured by its verdict."""
    if verdicts.empty:
        return "no verdicts: the ladder names no key metric, or no arm was judged"
    rows = []
    for verdict in verdicts.itertuples():
        for metric in verdict.detail.get("metrics", []):
            rows.append((verdict.arm, verdict.decision, metric["name"], metric.get("delta_pct"),
                         metric.get("drift_pct")))
    frame = pd.DataFrame(rows, columns=["arm", "decision", "metric", "delta", "drift"])
    metrics = list(dict.fromkeys(frame["metric"]))
    arms = list(dict.fromkeys(frame["arm"]))
    threshold = float(verdicts.iloc[0]["detail"].get("threshold_pct", 2.0))
    figure = new_figure(10.0, 1.4 + 0.45 * len(arms) * len(metrics) + 0.7 * len(metrics))
    axes = np.atleast_1d(figure.subplots(len(metrics), 1, squeeze=False)).ravel()
    for ax, metric in zip(axes, metrics):
        part = frame[frame["metric"] == metric].set_index("arm").reindex(arms)
        y = np.arange(len(arms))
        values = part["delta"].astype(float).fillna(0.0).to_numpy()
        colours = [DECISION_COLOURS.get(d, "#999999") for d in part["decision"]]
        ax.axvspan(-threshold, threshold, color="#dddddd", alpha=0.6, lw=0)
        ax.barh(y, values, color=colours, height=0.6)
        for i, (delta, drift, decision) in enumerate(zip(part["delta"], part["drift"], part["decision"])):
            # The verdict in words too: colour alone does not reach every reader.
            text = ("no figure" if pd.isna(delta) else f"{delta:+.1f} %") + f", {decision}"
            if not pd.isna(drift):
                text += f"  (controls {drift:.1f} % apart)"
            ax.text(0, i, "  " + text, va="center", ha="left", fontsize=8)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(y, arms)
        ax.invert_yaxis()
        limit = max(threshold * 2.5, float(np.nanmax(np.abs(values))) * 1.3 if len(values) else 0.0)
        ax.set_xlim(-limit, limit)
        ax.set_title(metric, fontsize=9, loc="left")
        ax.set_xlabel("improvement against the window's controls (%, in the metric's good direction)", fontsize=8)
    handles = [Patch(color=c, label=d) for d, c in DECISION_COLOURS.items()]
    handles.append(Patch(color="#dddddd", label=f"within ±{threshold:g} % (the KEEP threshold)"))
    figure.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    figure.suptitle("KEEP: each arm against its window's controls")
    return figure


def boot_timeline(boots: pd.DataFrame, steps: pd.DataFrame) -> Figure | str:
    """A Gantt of every boot: start → ready → instruments → stopped, coloured by how the boot ended."""
    if boots.empty:
        return "no boots yet"
    boots = boots.sort_values(["idx", "attempt"]).reset_index(drop=True)
    origin = boots["started_at"].min()
    seconds: Callable[[datetime], float] = lambda t: (t - origin).total_seconds()  # noqa: E731
    ends = [t for t in (boots["stopped_at"].max(), steps["finished_at"].max() if not steps.empty else None)
            if t is not None and not pd.isna(t)]
    span = max([seconds(t) for t in ends] + [1.0])
    figure = new_figure(11.0, 1.2 + 0.42 * len(boots))
    ax = figure.subplots()
    labels = []
    for i, boot in boots.iterrows():
        labels.append(boot["label"] + (f" (try {boot['attempt']})" if boot["attempt"] > 1 else ""))
        colour = STATUS_COLOURS.get(boot["status"], "#444444")
        start = seconds(boot["started_at"])
        ready = seconds(boot["ready_at"]) if not pd.isna(boot["ready_at"]) else None
        own = steps[steps["boot_id"] == boot["id"]]
        last = seconds(own["finished_at"].max()) if not own.empty else None
        end_candidates = [t for t in (seconds(boot["stopped_at"]) if not pd.isna(boot["stopped_at"]) else None,
                                      last, ready) if t is not None]
        end = max(end_candidates) if end_candidates else start
        ax.barh(i, (ready if ready is not None else end) - start, left=start, color=colour, alpha=0.35,
                hatch="xx" if boot["cold"] else "", edgecolor=colour, height=0.6)
        for instrument, part in own.groupby("instrument", sort=False):
            begin, finish = seconds(part["started_at"].min()), seconds(part["finished_at"].max())
            ax.barh(i, finish - begin, left=begin, color=colour, alpha=0.95, height=0.6, edgecolor="white",
                    linewidth=0.8)
            # Name the instrument where its segment has room for the word (about 0.75 % of the span a letter).
            if finish - begin > span * 0.0075 * (len(instrument) + 2):
                ax.text((begin + finish) / 2, i, instrument, ha="center", va="center", fontsize=7, color="white")
        if ready is not None:
            ax.barh(i, end - (last if last is not None else ready), left=last if last is not None else ready,
                    color=colour, alpha=0.15, height=0.6)
        note = boot["status"] + (", cold" if boot["cold"] else "")
        ax.text(end, i, f"  {note}", va="center", fontsize=7)
    ax.set_yticks(range(len(boots)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run's first boot started")
    ax.set_title("Boot timeline: start → ready (light) → each instrument (solid) → stopped (faint)")
    ax.grid(alpha=0.3, axis="x")
    statuses = list(dict.fromkeys(boots["status"]))
    handles = [Patch(color=STATUS_COLOURS.get(s, "#444444"), label=s) for s in statuses]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="xx", label="cold (never used for KEEP)"))
    ax.legend(handles=handles, title="boot ended", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              title_fontsize=8, frameon=False)
    ax.set_xlim(0, ax.get_xlim()[1] * 1.12)
    return figure


INSTRUMENT_FIGURES: tuple[tuple[str, str, str, Callable[[pd.DataFrame, dict[str, SlotStyle]], Figure | str]], ...] = (
    ("decode_ladder", "Decode ladder", "decode", decode_ladder),
    ("prefill", "Prefill throughput", "prefill", prefill),
    ("needle", "Needle retrieval", "needle", needle),
    ("mixed", "Mixed traffic", "mixed", mixed),
)


def draw_all(data: RunData, instruments: list[str]) -> list[Drawn]:
    """Every figure of the report, in report order; `instruments` are the ladder's."""
    styles = slot_styles(data.slots)
    drawn = [_drawn("keep", "KEEP against the controls", keep_deltas(data.verdicts))]
    for name, title, instrument, draw in INSTRUMENT_FIGURES:
        if instrument not in instruments:
            drawn.append(Drawn(name, title, None, f"not measured: `{instrument}` is not in this ladder"))
            continue
        drawn.append(_drawn(name, title, draw(data.instrument_cells(instrument), styles)))
    drawn.append(_drawn("boot_timeline", "Boot timeline", boot_timeline(data.boots, data.steps)))
    return drawn


def _drawn(name: str, title: str, result: Figure | str) -> Drawn:
    if isinstance(result, str):
        return Drawn(name, title, None, result)
    return Drawn(name, title, png(result), "")

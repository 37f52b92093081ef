"""`lab history SERIES`: each KEEP metric of a series' control across its labels, with steps.

A label's value is the median over its warm, finished control boots (each boot's own value being
the median of its repeats, as KEEP reads it); its within-label drift is how far those controls
disagree (`lab.analysis.stats.noise_band`), the same noise band a window states. Steps come from
`lab.analysis.steps.analyse` with the ladder's own KEEP threshold. A label whose controls stored no usable
value is shown and skipped by the analysis.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from lab.analysis import steps, verdicts
from lab.analysis.stats import median_of_repeats, noise_band
from lab.store import reader
from lab.store.db import Store


@dataclass
class Point:
    label: str
    run: str
    value: float | None
    boots: list[float]
    drift_pct: float | None


@dataclass
class MetricHistory:
    metric: str
    unit: str
    higher_is_better: bool
    points: list[Point]
    analysis: steps.Analysis | None  # None with fewer than 2 usable labels

    @property
    def used(self) -> list[Point]:
        return [p for p in self.points if p.value is not None]


@dataclass
class History:
    series: str
    threshold_pct: float
    metrics: list[MetricHistory] = field(default_factory=list)

    def regressions(self) -> list[str]:
        """One line per metric whose latest level is a confirmed regression: what, by how much, since when."""
        lines = []
        for mh in self.metrics:
            found = steps.regressed_since(mh.analysis) if mh.analysis else None
            if found:
                first, total = found
                labels = [p.label for p in mh.used]
                lines.append(f"{mh.metric} regressed {total:+.1f} % since label {labels[first.index]} "
                             f"(run {mh.used[first.index].run}): {first.describe(labels, mh.unit, mh.analysis.limit_pct)}")
        return lines

    def pending(self) -> list[str]:
        """Metrics whose latest labels depart downwards, too few to confirm a step yet."""
        return [f"{mh.metric}: label {mh.used[mh.analysis.pending[0]].label} departs beyond "
                f"±{mh.analysis.limit_pct:.1f} % in the bad direction; unconfirmed until {steps.PERSIST} labels "
                "in a row do" for mh in self.metrics if mh.analysis and mh.analysis.pending_regression]


def resolve(store: Store, ref: str) -> str:
    """A series by its name, or by its ladder's name when that ladder has exactly one series."""
    names = list(dict.fromkeys(p.series for p in reader.series_points(store)))
    if ref in names:
        return ref
    mine = list(dict.fromkeys(p.series for p in reader.series_points(store) if p.ladder_name == ref))
    if len(mine) == 1:
        return mine[0]
    if mine:
        raise LookupError(f"ladder {ref} has {len(mine)} series ({', '.join(mine)}); name one")
    raise LookupError(f"no series {ref!r} in this store; `lab history` lists them, `lab sweep` makes them")


def load(store: Store, series: str, persist: int = steps.PERSIST) -> History:
    points = reader.series_points(store, series)
    history: History | None = None
    rows: dict[str, MetricHistory] = {}
    for point in points:
        evidence = verdicts.load(store, point.run_id)
        if history is None:
            history = History(series, evidence.ladder.keep.threshold_pct)
        controls = [s for s in evidence.slots if s.role == "control" and s.measured and not s.cold]
        for selector in evidence.spec.metrics:
            boots, unit = [], ""
            for slot in controls:
                found = evidence.select(slot, selector)
                unit = unit or found.unit
                if found.values:
                    boots.append(median_of_repeats(found.values))
            mh = rows.setdefault(selector.label, MetricHistory(selector.label, unit,
                                                               bool(evidence.higher_is_better(selector)), [], None))
            mh.unit = mh.unit or unit
            value = statistics.median(boots) if boots else None
            drift = noise_band(max(boots), min(boots)) * 100 if len(boots) > 1 else None
            mh.points.append(Point(point.label, evidence.run_name, value, boots, drift))
    if history is None:
        raise LookupError(f"series {series} has no runs")
    for mh in rows.values():
        used = mh.used
        if len(used) >= 2 and all(p.value > 0 for p in used):
            mh.analysis = steps.analyse([p.value for p in used], mh.higher_is_better, history.threshold_pct,
                                        [p.drift_pct for p in used if p.drift_pct is not None], persist)
        history.metrics.append(mh)
    return history

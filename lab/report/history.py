"""`lab history SERIES`: each KEEP metric of a series' control across its labels, with steps, and
the gate `--check` applies to it.

A label's value is the median over its warm, finished control boots (each boot's own value being
the median of its repeats, as KEEP reads it); its within-label drift is how far those controls
disagree (`lab.analysis.stats.noise_band`), the same noise band a window states. A label whose
controls stored no usable value is shown and skipped by the analysis.

Each point records the base config its control ran. Where it changes from one label to the next,
the series goes on under a new *base*: labels under different bases are never compared (a new
flag may move every figure), so steps come from `lab.analysis.steps.analyse` within each base, with
the latest label's KEEP threshold, and the noise pooled over the whole series (the differences
within each base, the drift of every label): it is the same host's noise either way. The smallest
change the latest base can detect is stated per metric before anything else.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass, field
from typing import Any

from lab.analysis import steps, verdicts
from lab.analysis.stats import median_of_repeats, noise_band
from lab.store import reader
from lab.store.db import Store


class Outcome(enum.IntEnum):
    """What `lab history --check` found; the value is its exit status (docs/loop.md), one per outcome
    so that a nightly job can alert on a regression and a broken gate and on nothing else."""

    OK = 0  # the latest level of every metric compared is no regression
    REGRESSION = 1  # a metric's latest level is a confirmed regression
    BROKEN = 2  # the gate cannot run: bad arguments, an unknown or ambiguous series, a store it cannot read
    NO_DATA = 3  # fewer than two labels with a value under the current base: nothing to compare yet
    BASE_CHANGED = 4  # the latest label ran a new base config: nothing under it to compare with yet


@dataclass
class Point:
    label: str
    run: str
    value: float | None
    boots: list[float]
    drift_pct: float | None
    base: int  # index of its base in History.bases


@dataclass(frozen=True)
class Base:
    """One base config of the series' control, from the first label that ran it."""

    first: int  # index of that label among the series' labels
    label: str
    config_hash: str
    change: str  # how it differs from the base before it, in flags; "" for the first base


@dataclass
class Segment:
    """One metric's labels with a value under one base: only these are compared with each other."""

    base: int
    points: list[Point]
    analysis: steps.Analysis | None  # None when no label has a positive value

    @property
    def comparable(self) -> bool:
        return self.analysis is not None and len(self.points) >= 2


@dataclass
class MetricHistory:
    metric: str
    unit: str
    higher_is_better: bool
    points: list[Point]
    segments: list[Segment] = field(default_factory=list)

    @property
    def used(self) -> list[Point]:
        return [p for p in self.points if p.value is not None]

    def segment(self, base: int) -> Segment | None:
        return next((s for s in self.segments if s.base == base), None)


@dataclass
class Check:
    """The gate's finding: its outcome, one line naming the series and what was compared, and the
    regressions and warnings behind it."""

    outcome: Outcome
    summary: str
    regressions: list[str]
    warnings: list[str]


@dataclass
class History:
    series: str
    threshold_pct: float  # the latest label's KEEP threshold
    labels: list[str] = field(default_factory=list)
    bases: list[Base] = field(default_factory=list)
    metrics: list[MetricHistory] = field(default_factory=list)

    @property
    def current(self) -> int:
        """The base of the latest label: the one the gate checks."""
        return len(self.bases) - 1

    def regressions(self) -> list[str]:
        """One line per metric whose latest level is a confirmed regression: what, by how much, since when."""
        lines = []
        for mh in self.metrics:
            seg = mh.segment(self.current)
            found = steps.regressed_since(seg.analysis) if seg and seg.comparable else None
            if found:
                first, total = found
                labels = [p.label for p in seg.points]
                lines.append(f"{mh.metric} regressed {total:+.1f} % since label {labels[first.index]} "
                             f"(run {seg.points[first.index].run}): "
                             f"{first.describe(labels, mh.unit, seg.analysis.limit_pct)}")
        return lines

    def pending(self) -> list[str]:
        """Metrics whose latest labels depart downwards, too few to confirm a step yet."""
        lines = []
        for mh in self.metrics:
            seg = mh.segment(self.current)
            if seg and seg.comparable and seg.analysis.pending_regression:
                lines.append(f"{mh.metric}: label {seg.points[seg.analysis.pending[0]].label} departs beyond "
                             f"±{seg.analysis.limit_pct:.1f} % in the bad direction; unconfirmed until "
                             f"{steps.PERSIST} labels in a row do")
        return lines

    def base_changes(self) -> list[str]:
        return [f"the base changed at label {b.label} ({b.change})" for b in self.bases[1:]]

    def detectable(self) -> list[str]:
        """Per metric, the smallest change the gate can see under the current base, and what sets it."""
        lines = []
        for mh in self.metrics:
            seg = mh.segment(self.current)
            if seg is None or seg.analysis is None:
                lines.append(f"{mh.metric}: nothing yet (no label under the current base has a value)")
                continue
            a = seg.analysis
            text = f"{mh.metric}: changes larger than ±{a.limit_pct:.1f} %, set by {a.limit_source}"
            if a.sigma_pct is None:
                text += (f"; the label-to-label noise is not estimated yet ({a.differences} of the 3 differences "
                         "it needs), so this is a floor")
            lines.append(text)
        return lines

    def check(self) -> Check:
        regressions = self.regressions()
        warnings = self.pending()
        base = self.bases[self.current]
        under = self.labels[base.first:]
        since = f" since the base changed at label {base.label}" if self.current else ""
        compared = [mh for mh in self.metrics if (seg := mh.segment(self.current)) and seg.comparable]
        for mh in self.metrics:
            if mh not in compared:
                seg = mh.segment(self.current)
                warnings.append(f"{mh.metric} is not compared: {len(seg.points) if seg else 0} label(s) with a value"
                                f"{since}, it needs 2")
        if regressions:
            return Check(Outcome.REGRESSION, f"series {self.series}: {len(regressions)} metric(s) regressed "
                                             f"(labels {under[0]} … {under[-1]}{since})", regressions, warnings)
        if not compared:
            if self.current and len(under) == 1:
                return Check(Outcome.BASE_CHANGED, f"series {self.series}: the base changed at label {base.label} "
                             f"({base.change}); nothing under it to compare with yet, the gate compares again from "
                             "the next label", [], [])
            return Check(Outcome.NO_DATA, f"series {self.series}: no metric has 2 labels with a value{since} "
                         f"({len(under)} label(s)); nothing to compare yet", [], [])
        return Check(Outcome.OK, f"series {self.series}: no regression in {len(compared)} metric(s) over "
                                 f"{len(under)} labels ({under[0]} … {under[-1]}){since}", [], warnings)


def resolve(store: Store, ref: str) -> str:
    """A series by its name (also as an earlier lab named it, with `:<config hash>` after the host), or
    by its ladder's name when that ladder has one series (one host)."""
    names = list(dict.fromkeys(p.series for p in reader.series_points(store)))
    if ref in names:
        return ref
    if ":" in ref and ref.rsplit(":", 1)[0] in names:
        return ref.rsplit(":", 1)[0]
    mine = list(dict.fromkeys(p.series for p in reader.series_points(store) if p.ladder_name == ref))
    if len(mine) == 1:
        return mine[0]
    if mine:
        raise LookupError(f"ladder {ref} has {len(mine)} series, one per host ({', '.join(mine)}); name one")
    raise LookupError(f"no series {ref!r} in this store; `lab history` lists them, `lab sweep` makes them")


def describe_change(before: dict[str, Any], after: dict[str, Any]) -> str:
    """How a point's base config differs from the one before: engine, model, flags and environment
    added, removed or changed; the knobs of the config when those are equal; else the config hash."""
    parts = [f"{key.replace('_', ' ')} {before.get(key)} → {after.get(key)}" for key in ("engine_kind", "model")
             if before.get(key) != after.get(key)]
    for key, what in (("flags", "flags"), ("env", "env")):
        if key in before and key in after:
            parts += [f"{what} {change}" for change in _dict_changes(before[key], after[key])]
    if not parts and "config" in before and "config" in after:
        parts = [f"config {change}" for change in _dict_changes(before["config"], after["config"])]
    old, new = before.get("control_config_hash", "?"), after.get("control_config_hash", "?")
    return ", ".join(parts) if parts else f"config hash {old[:8]} → {new[:8]}"


def _dict_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    changes = []
    for key in dict.fromkeys([*before, *after]):
        if key not in before:
            changes.append(f"+{key}={after[key]}")
        elif key not in after:
            changes.append(f"-{key} (was {before[key]})")
        elif before[key] != after[key]:
            changes.append(f"{key} {before[key]} → {after[key]}")
    return changes


def load(store: Store, series: str, persist: int = steps.PERSIST) -> History:
    points = reader.series_points(store, series)
    if not points:
        raise LookupError(f"series {series} has no runs")
    history = History(series, 0.0)
    rows: dict[str, MetricHistory] = {}
    previous: dict[str, Any] | None = None
    for n, point in enumerate(points):
        if previous is None or point.identity.get("control_config_hash") != previous.get("control_config_hash"):
            history.bases.append(Base(n, point.label, point.identity.get("control_config_hash", ""),
                                      describe_change(previous, point.identity) if previous is not None else ""))
        previous = point.identity
        history.labels.append(point.label)
        evidence = verdicts.load(store, point.run_id)
        history.threshold_pct = evidence.ladder.keep.threshold_pct
        controls = [s for s in evidence.slots if s.role == "control" and s.measured and not s.cold]
        for selector in evidence.spec.metrics:
            boots, unit = [], ""
            for slot in controls:
                found = evidence.select(slot, selector)
                unit = unit or found.unit
                if found.values:
                    boots.append(median_of_repeats(found.values))
            mh = rows.setdefault(selector.label, MetricHistory(selector.label, unit,
                                                               bool(evidence.higher_is_better(selector)), []))
            mh.unit = mh.unit or unit
            value = statistics.median(boots) if boots else None
            drift = noise_band(max(boots), min(boots)) * 100 if len(boots) > 1 else None
            mh.points.append(Point(point.label, evidence.run_name, value, boots, drift, history.current))
    for mh in rows.values():
        by_base: dict[int, list[Point]] = {}
        for p in mh.used:
            if p.value > 0:
                by_base.setdefault(p.base, []).append(p)
        differences = {base: steps.log_differences([p.value for p in pts]) for base, pts in by_base.items()}
        drifts = [p.drift_pct for p in mh.used if p.drift_pct is not None]
        for base, pts in by_base.items():
            pooled = [d for other, found in differences.items() if other != base for d in found]
            analysis = steps.analyse([p.value for p in pts], mh.higher_is_better, history.threshold_pct, drifts,
                                     persist, pooled)
            mh.segments.append(Segment(base, pts, analysis))
        history.metrics.append(mh)
    return history

"""Steps in a series of labels: a change of level that persists, not one outlier.

The method, small enough to check by hand (change-point libraries such as ruptures find where a
series changes but say nothing about persistence or noise in the lab's terms):

1. Work on logs, so a change is a ratio and a band is a percentage either way.
2. Noise: the robust SD of one label, sigma = 1.4826 * MAD(first differences) / sqrt(2). First
   differences cancel the level, and the MAD ignores the one large difference a step makes and
   the two an outlier makes. The differences of other stretches of the same series (labels under
   an earlier base config, which are never compared with these) may be pooled in: they measure the
   same host's label-to-label noise. The noise band is 3 sigma, or the median within-label drift of
   the controls when that is wider (two controls per label disagree by at least that much anyway).
   max(threshold, band) is the smallest change the series can detect, and `Analysis.limit_source`
   says which of the three set it.
3. The level of a segment is the median of its points. Walking forward, a point departs when it
   is further from the current level than max(threshold, noise band). It starts a step only when
   it and the next `persist - 1` points all depart in the same direction; a lone departure is an
   outlier and is left out of the level. Departures at the end too few to confirm are *pending*.
4. Each step is stated as the lab states an effect: the change of the median level in %, the
   band and threshold it cleared, the points on each side and an exact Mann-Whitney p between the
   two segments (`lab.analysis.stats.mann_whitney`), with the smallest p those sample sizes can reach.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from scipy.stats import median_abs_deviation

from lab.analysis.effects import to_pct
from lab.analysis.stats import mann_whitney, min_reachable_p

PERSIST = 2  # labels in a row that must depart before a change is a step
SIGMAS = 3.0


@dataclass(frozen=True)
class Step:
    index: int  # the first point of the new level
    before: float  # median level of the segment before
    after: float  # median level of the segment from `index` to the next step (or the end)
    delta_pct: float
    regression: bool
    n_before: int
    n_after: int
    p: float | None  # Mann-Whitney between the two segments; None when a side has one point
    min_p: float

    def describe(self, labels: Sequence[str], unit: str, limit_pct: float) -> str:
        what = "regression" if self.regression else "improvement"
        p = (f"Mann-Whitney p={self.p:.3g} (smallest reachable {self.min_p:.3g})" if self.p is not None
             else "one point on a side: no test")
        return (f"{what} of {self.delta_pct:+.1f} % from label {labels[self.index]} "
                f"({self.before:.4g} → {self.after:.4g} {unit}, {self.n_before} → {self.n_after} labels; "
                f"beyond ±{limit_pct:.1f} %; {p})")


@dataclass(frozen=True)
class Analysis:
    sigma_pct: float | None  # one label's robust SD; None with fewer than 3 differences
    band_pct: float  # noise band: 3 sigma or the within-label control drift, whichever is wider
    limit_pct: float  # what a departure must exceed: max(threshold, band); the smallest detectable change
    steps: list[Step]
    outliers: list[int]
    pending: list[int]  # departures at the end, too few to confirm or rule out
    pending_regression: bool
    threshold_pct: float = 0.0
    drift_pct: float | None = None  # median within-label drift of the controls; None when no label has two
    differences: int = 0  # label-to-label differences behind sigma, pooled ones included
    sigma_band_pct: float = 0.0  # SIGMAS sigma as a percentage; 0 when sigma is unknown

    @property
    def limit_source(self) -> str:
        """What set `limit_pct`, in words."""
        if self.limit_pct <= self.threshold_pct:
            return f"the KEEP threshold ({self.threshold_pct:g} %)"
        if self.drift_pct is not None and self.drift_pct >= self.sigma_band_pct:
            return f"the controls' median drift within a label ({self.drift_pct:.2f} %)"
        return (f"the label-to-label noise ({SIGMAS:g} × {self.sigma_pct:.2f} % robust SD, from "
                f"{self.differences} differences)")


def log_differences(values: Sequence[float]) -> list[float]:
    """Label-to-label changes of positive `values` as log ratios: what sigma is estimated from."""
    logs = [math.log(v) for v in values]
    return [b - a for a, b in zip(logs, logs[1:])]


def analyse(values: Sequence[float], higher_is_better: bool, threshold_pct: float,
            within_drift_pct: Sequence[float] = (), persist: int = PERSIST,
            pooled_differences: Sequence[float] = ()) -> Analysis:
    """Steps, outliers and pending departures of positive `values` in label order; the noise is
    estimated from their own differences and `pooled_differences` (`log_differences` of other
    stretches of the same series)."""
    if any(v <= 0 or not math.isfinite(v) for v in values):
        raise ValueError("step detection works on positive finite values")
    logs = [math.log(v) for v in values]
    diffs = log_differences(values) + list(pooled_differences)
    sigma = None
    if len(diffs) >= 3:
        # Robust SD of the label-to-label changes (normal-consistent MAD); a change of two
        # independent levels has sqrt(2) times one level's spread.
        sigma = float(median_abs_deviation(diffs, scale="normal")) / math.sqrt(2)
    drift = statistics.median(within_drift_pct) if within_drift_pct else None
    sigma_band = to_pct(SIGMAS * sigma) if sigma is not None else 0.0
    band = max(sigma_band, drift or 0.0)
    limit_pct = max(threshold_pct, band)
    limit = math.log1p(limit_pct / 100)

    starts = [0]
    outliers: list[int] = []
    pending: list[int] = []
    segment = [0] if logs else []
    i = 1
    while i < len(logs):
        level = statistics.median(logs[j] for j in segment)
        side = _side(logs[i] - level, limit)
        if side == 0:
            segment.append(i)
            i += 1
            continue
        run = [j for j in range(i, min(i + persist, len(logs)))]
        if all(_side(logs[j] - level, limit) == side for j in run):
            if len(run) < persist:
                pending = run
                break
            starts.append(i)
            segment = run
            i += persist
            continue
        outliers.append(i)
        i += 1

    steps = []
    ends = starts[1:] + [pending[0] if pending else len(logs)]
    for k in range(1, len(starts)):
        before = [values[j] for j in range(starts[k - 1], ends[k - 1]) if j not in outliers]
        after = [values[j] for j in range(starts[k], ends[k]) if j not in outliers]
        b, a = statistics.median(before), statistics.median(after)
        delta = (a - b) * 100 / b
        test = mann_whitney(before, after) if len(before) > 1 and len(after) > 1 else None
        steps.append(Step(starts[k], b, a, delta, (delta < 0) == higher_is_better, len(before), len(after),
                          test.p if test else None, min_reachable_p(len(before), len(after))))
    pending_regression = bool(pending) and ((values[pending[0]] < statistics.median(
        values[j] for j in range(starts[-1], pending[0]) if j not in outliers)) == higher_is_better)
    return Analysis(to_pct(sigma) if sigma is not None else None, band, limit_pct, steps, outliers, pending,
                    pending_regression, threshold_pct, drift, len(diffs), sigma_band)


def regressed_since(analysis: Analysis) -> tuple[Step, float] | None:
    """When the latest level is a regression: the first step of the unbroken chain of regressions
    that led to it, and the total change in % since the level before that chain."""
    if not analysis.steps or not analysis.steps[-1].regression:
        return None
    chain = []
    for step in reversed(analysis.steps):
        if not step.regression:
            break
        chain.append(step)
    first = chain[-1]
    return first, (analysis.steps[-1].after - first.before) * 100 / first.before


def _side(distance: float, limit: float) -> int:
    return 0 if abs(distance) <= limit else (1 if distance > 0 else -1)

"""An arm's effect on one metric as an interval: drift-corrected, with the noise it was measured at.

The unit of replication is the boot. Each warm arm boot is compared with the control as it stood
at that boot's place in the window: the linear interpolation between the warm controls that
bracket it (the nearest one when only one side has a control), so a control that drifts steadily
through the window moves the reference with it instead of into the effect. Effects are log ratios
(arm / interpolated control), so a 5 % gain and a 5 % loss are symmetric and averaging them is fair.

The interval is a Student t interval of the mean log ratio. Its spread comes from the arm's own
boots (n >= 2) pooled with a calibrated noise model of the same metric (`lab calibrate`: the
spread of A/A effects measured the same way), or from the calibration alone for a single boot.
With neither there is no interval, and the caller falls back to the point rule.

Figures are reported as percentages in the metric's good direction ("better" is positive).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
POWER = 0.8
# More repeats than this are not worth suggesting: the design, not the count, is then the problem.
MAX_SUGGESTED_REPEATS = 50


@dataclass(frozen=True)
class Noise:
    """Boot-to-boot spread of the log ratio of one metric, from a calibration: its SD and degrees of freedom."""

    sd_log: float
    df: int
    source: str  # "calibration <run>" for the reasons


@dataclass(frozen=True)
class Interval:
    effect_pct: float  # point estimate, good direction
    low_pct: float
    high_pct: float
    n: int  # warm arm boots
    df: int
    sd_log: float  # per-boot SD of the log ratio used
    se_log: float
    mde_pct: float  # smallest true effect found non-zero with POWER at CONFIDENCE, this many boots
    confidence: float
    power: float
    source: str  # where the spread came from, in words


def interpolate(controls: Sequence[tuple[float, float]], at: float) -> float:
    """The control's value at time `at` from (time, value) pairs, linear between the two that bracket it."""
    ordered = sorted(controls)
    before = [c for c in ordered if c[0] <= at]
    after = [c for c in ordered if c[0] >= at]
    if not before:
        return after[0][1]
    if not after:
        return before[-1][1]
    (t0, v0), (t1, v1) = before[-1], after[0]
    if t1 == t0:
        return (v0 + v1) / 2
    return v0 + (v1 - v0) * (at - t0) / (t1 - t0)


def log_effects(arm: Sequence[tuple[float, float]], controls: Sequence[tuple[float, float]],
                higher_is_better: bool) -> list[float]:
    """Per arm boot: log(arm / interpolated control), signed so that better is positive."""
    sign = 1.0 if higher_is_better else -1.0
    return [sign * math.log(value / interpolate(controls, at)) for at, value in arm]


def to_pct(log_effect: float) -> float:
    """A log ratio in the good direction as a percentage change in the good direction."""
    return math.expm1(log_effect) * 100


def interval(effects: Sequence[float], noise: Noise | None, confidence: float = CONFIDENCE,
             power: float = POWER) -> Interval | None:
    """The t interval of the mean effect; None when nothing says how noisy a boot is."""
    n = len(effects)
    if n == 0:
        return None
    mean = float(np.mean(effects))
    own_df = n - 1
    own_var = float(np.var(effects, ddof=1)) if n >= 2 else 0.0
    if noise is not None and noise.df > 0:
        df = own_df + noise.df
        var = (own_df * own_var + noise.df * noise.sd_log**2) / df
        source = f"{n} boot{'s' if n > 1 else ''} pooled with {noise.source}" if n >= 2 else noise.source
    elif n >= 2:
        df, var, source = own_df, own_var, f"{n} boots of the arm"
    else:
        return None
    sd = math.sqrt(var)
    se = sd / math.sqrt(n)
    t = float(stats.t.ppf(0.5 + confidence / 2, df))
    return Interval(effect_pct=to_pct(mean), low_pct=to_pct(mean - t * se), high_pct=to_pct(mean + t * se), n=n,
                    df=df, sd_log=sd, se_log=se, mde_pct=mde_pct(sd, n, df, confidence, power),
                    confidence=confidence, power=power, source=source)


def drift_expected_pct(sd_log: float, confidence: float = CONFIDENCE) -> float:
    """How far apart (%) two warm controls land, at `confidence`, when each boot scatters by
    `sd_log`: their log ratio has SD sqrt(2) * sd_log."""
    return to_pct(float(stats.norm.ppf(0.5 + confidence / 2)) * math.sqrt(2) * sd_log)


def mde_pct(sd_log: float, n: int, df: int, confidence: float = CONFIDENCE, power: float = POWER) -> float:
    """The smallest true effect (%) that n boots at this per-boot spread find non-zero with `power`:
    (t_{1-alpha/2} + t_{power}) * sd / sqrt(n), with the interval's degrees of freedom."""
    t_sum = float(stats.t.ppf(0.5 + confidence / 2, df)) + float(stats.t.ppf(power, df))
    return to_pct(t_sum * sd_log / math.sqrt(n))


def repeats_needed(found: Interval, threshold_pct: float) -> int | None:
    """Arm boots that would put an interval as wide as the measured noise clear of ±threshold,
    if the effect stays where it was measured; None when no count up to MAX_SUGGESTED_REPEATS does."""
    effect = math.log1p(found.effect_pct / 100)
    edge = math.log1p(threshold_pct / 100)
    # Inside ±threshold the interval must fit inside it; outside, it must clear it.
    margin = min(abs(effect - edge), abs(effect + edge))
    if margin == 0 or found.sd_log == 0:
        return None
    extra_df = found.df - (found.n - 1)  # the calibration's, which more boots do not change
    for n in range(found.n + 1, MAX_SUGGESTED_REPEATS + 1):
        t = float(stats.t.ppf(0.5 + found.confidence / 2, n - 1 + extra_df))
        if t * found.sd_log / math.sqrt(n) < margin:
            return n
    return None

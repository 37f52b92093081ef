"""The statistics behind verdicts: ratio intervals, rank tests, drift (the paired pass/fail test of
qeval is `lab.instruments.paired`).

Pure functions over plain numbers (no store, no I/O) so that `lab compare`, the KEEP rule and the
reports all compute the same figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _scipy_stats

# Above this many (n1 * n2) pairs the exact Mann-Whitney distribution costs more than it is worth:
# the normal approximation is already accurate to well under 1e-3 there.
_EXACT_U_MAX_PAIRS = 2500

# No interval from fewer values a side: the median of two resampled values takes only three values,
# so a "95 %" percentile interval of 2 against 2 is a coarse range of three ratios, not a confidence
# statement, and it can claim an effect that the controls' own drift dwarfs.
MIN_INTERVAL_SAMPLES = 3

# Bootstrap resamples are medianed in blocks of at most this many drawn indices, so that a long
# sample (thousands of per-request latencies) does not need a resamples x n matrix at once.
_BOOTSTRAP_BLOCK_ELEMENTS = 1 << 20


def median_of_repeats(values: Sequence[float]) -> float:
    """The value one boot contributes for one metric: the median of its repeats."""
    array = _finite_array(values, "repeats")
    if array.size == 0:
        raise ValueError("no repeats to take a median of")
    return float(np.median(array))


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    method: str
    confidence: float


def bootstrap_ratio_of_medians(a: Sequence[float], b: Sequence[float], n_resamples: int = 10_000,
                               confidence: float = 0.95, seed: int = 0) -> Interval:
    """Percentile bootstrap interval (not BCa) for median(a) / median(b), resampling each side alone.

    Determinism and symmetry: two index streams U and V are drawn from `seed`, and every draw
    contributes both median(a[U]) / median(b[V]) and median(a[V]) / median(b[U]) (2 * n_resamples
    ratios). Swapping a and b therefore yields exactly the reciprocal ratios, so
    compare(A, B) and compare(B, A) report reciprocal intervals for the same seed. Indices come
    from integers in [0, n_a * n_b) reduced modulo each side's size, which is uniform on both.
    The bounds are order statistics (no interpolation) so that the mirroring is exact too.
    """
    x = _finite_array(a, "a")
    y = _finite_array(b, "b")
    if min(x.size, y.size) < MIN_INTERVAL_SAMPLES:
        raise ValueError(f"a bootstrap interval needs at least {MIN_INTERVAL_SAMPLES} samples per side, got {x.size} "
                         f"and {y.size}")
    if (x <= 0).any() or (y <= 0).any():
        raise ValueError("a ratio of medians needs positive values on both sides")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be at least 1, got {n_resamples}")

    rng = np.random.default_rng(seed)
    width = max(x.size, y.size)
    modulus = x.size * y.size
    rows_per_block = max(1, _BOOTSTRAP_BLOCK_ELEMENTS // width)
    ratios = []
    for start in range(0, n_resamples, rows_per_block):
        rows = min(rows_per_block, n_resamples - start)
        u = rng.integers(0, modulus, size=(rows, width))
        v = rng.integers(0, modulus, size=(rows, width))
        x_u, y_u = _resampled_medians(x, u), _resampled_medians(y, u)
        x_v, y_v = _resampled_medians(x, v), _resampled_medians(y, v)
        ratios.append(x_u / y_v)
        ratios.append(x_v / y_u)
    ordered = np.sort(np.concatenate(ratios))
    k = math.floor((1 - confidence) / 2 * ordered.size)
    return Interval(estimate=float(np.median(x) / np.median(y)), low=float(ordered[k]),
                    high=float(ordered[ordered.size - 1 - k]), confidence=confidence,
                    method=f"percentile bootstrap (not BCa), {2 * n_resamples} resampled ratios, seed {seed}")


@dataclass(frozen=True)
class RatioSummary:
    """Repeats of a new side against a reference: the bootstrap interval of median(new) /
    median(reference) as a change in percent, and a Mann-Whitney test of the same samples."""

    n_new: int
    n_reference: int
    low_pct: float  # better positive when the direction is known, else the raw change
    high_pct: float
    interval: Interval
    test: MannWhitney
    min_reachable_p: float  # below which `test` cannot go at these sample sizes


def ratio_summary(new: Sequence[float], reference: Sequence[float], higher_is_better: bool | None,
                  confidence: float, seed: int) -> RatioSummary:
    """What `lab compare` and the KEEP rule's repeats line say about two sets of repeats; needs at
    least MIN_INTERVAL_SAMPLES positive values a side (`bootstrap_ratio_of_medians` says why not otherwise)."""
    interval = bootstrap_ratio_of_medians(new, reference, confidence=confidence, seed=seed)
    if higher_is_better is False:
        # A lower figure is the improvement: the ratio is turned around so better stays positive.
        low, high = (1 - interval.high) * 100, (1 - interval.low) * 100
    else:
        low, high = (interval.low - 1) * 100, (interval.high - 1) * 100
    return RatioSummary(n_new=len(new), n_reference=len(reference), low_pct=low, high_pct=high, interval=interval,
                        test=mann_whitney(new, reference), min_reachable_p=min_reachable_p(len(new), len(reference)))


def _resampled_medians(values: np.ndarray, draws: np.ndarray) -> np.ndarray:
    return np.median(values[draws[:, :values.size] % values.size], axis=1)


@dataclass(frozen=True)
class MannWhitney:
    u: float  # U of the first sample: pairs (a_i, b_j) with a_i > b_j, ties counting one half
    p: float  # two-sided
    method: str


def mann_whitney(a: Sequence[float], b: Sequence[float]) -> MannWhitney:
    """Two-sided Mann-Whitney U test (scipy's `mannwhitneyu`).

    Exact null distribution when there are no ties and n_a * n_b <= 2500; otherwise the normal
    approximation with the tie-corrected variance and a 0.5 continuity correction. `method`
    names which one was used. Check `min_reachable_p` before reading a large p as "no effect".
    """
    x = _finite_array(a, "a")
    y = _finite_array(b, "b")
    if x.size == 0 or y.size == 0:
        raise ValueError(f"Mann-Whitney needs at least 1 sample per side, got {x.size} and {y.size}")
    has_ties = np.unique(np.concatenate([x, y])).size < x.size + y.size
    if not has_ties and x.size * y.size <= _EXACT_U_MAX_PAIRS:
        test = _scipy_stats.mannwhitneyu(x, y, alternative="two-sided", method="exact")
        return MannWhitney(u=float(test.statistic), p=float(test.pvalue), method="exact")
    test = _scipy_stats.mannwhitneyu(x, y, alternative="two-sided", method="asymptotic", use_continuity=True)
    method = "normal approximation, tie-corrected" if has_ties else "normal approximation"
    return MannWhitney(u=float(test.statistic), p=float(test.pvalue), method=method)


def min_reachable_p(n1: int, n2: int) -> float:
    """Smallest two-sided exact Mann-Whitney p for these sample sizes: 2 / C(n1+n2, n1), at most 1.

    3 vs 3 gives 0.1, so no outcome of three repeats per side can pass alpha = 0.05.
    """
    if n1 < 1 or n2 < 1:
        raise ValueError(f"sample sizes must be at least 1, got {n1} and {n2}")
    return min(1.0, 2 / math.comb(n1 + n2, n1))


def noise_band(first_control: float, last_control: float) -> float:
    """How far the two bracketing controls of a window disagree: |a - b| / mean, a fraction.

    This is the noise floor of the window: an arm's change smaller than it is indistinguishable
    from the drift between the controls.
    """
    if first_control == last_control:
        return 0.0
    mean = (first_control + last_control) / 2
    if mean == 0:
        raise ValueError("controls average to 0: their relative difference is undefined")
    return abs(first_control - last_control) / abs(mean)


def relative_delta(arm: float, reference: float) -> float:
    """Signed relative change of `arm` from `reference`, in percent (+5.0 means 5 % higher).

    Divides by |reference| so the sign always follows the direction of the change. Multiplies
    before dividing so that round figures (102 vs 100) give exact percentages (2.0).
    """
    if reference == 0:
        raise ValueError("relative change against a reference of 0 is undefined")
    return (arm - reference) * 100 / abs(reference)


def _finite_array(values: Sequence[float], name: str) -> np.ndarray:
    array = np.asarray(values, dtype=float).ravel()
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains a non-finite value (NaN or infinity)")
    return array

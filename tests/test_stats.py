"""lab.analysis.stats against hand-computed values, scipy, and properties that must hold for any input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from lab.analysis.stats import (bootstrap_ratio_of_medians, mann_whitney, median_of_repeats, min_reachable_p,
                                noise_band, relative_delta)
from lab.instruments.paired import PairedCounts, mcnemar_exact, paired_counts

counts = st.integers(min_value=0, max_value=60)
positive = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)


# --- McNemar -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("b", "c", "expected"), [
    (0, 0, 1.0),
    (3, 0, 0.25),  # 2 * C(3,0) / 2^3
    (0, 3, 0.25),
    (6, 0, 0.03125),  # 2 / 64
    (1, 4, 0.375),  # 2 * (1 + 5) / 32
    (10, 2, 0.03857421875),  # 2 * (1 + 12 + 66) / 4096
    (4, 4, 1.0),  # doubling the tail exceeds 1 when b == c
])
def test_mcnemar_hand_computed(b: int, c: int, expected: float) -> None:
    assert mcnemar_exact(b, c) == expected


def test_mcnemar_matches_scipy_binomtest() -> None:
    for b in range(0, 25):
        for c in range(0, 25):
            if b + c == 0:
                continue
            assert mcnemar_exact(b, c) == pytest.approx(scipy_stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-12)


def test_mcnemar_keeps_a_tiny_tail_of_a_large_task_set() -> None:
    # 2 * 2^-1000 underflows nothing in exact arithmetic and is still a positive float.
    assert mcnemar_exact(1000, 0) == 2.0 ** -999


def test_mcnemar_refuses_negative_counts() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        mcnemar_exact(-1, 2)


@given(counts, counts)
def test_mcnemar_is_symmetric_and_a_probability(b: int, c: int) -> None:
    p = mcnemar_exact(b, c)
    assert p == mcnemar_exact(c, b)
    assert 0.0 < p <= 1.0


@given(counts, counts)
def test_mcnemar_one_more_on_the_larger_side_never_raises_p(b: int, c: int) -> None:
    big, small = max(b, c), min(b, c)
    assert mcnemar_exact(big + 1, small) <= mcnemar_exact(big, small)


# --- paired counts -------------------------------------------------------------------------------

def test_paired_counts_cross_tabulates_and_reports_missing_ids() -> None:
    control = {"t1": True, "t2": True, "t3": False, "t4": False, "t5": True, "only_control": True}
    arm = {"t1": True, "t2": False, "t3": True, "t4": False, "t5": False, "only_arm": False}
    result = paired_counts(control, arm)
    assert result == PairedCounts(both_pass=1, both_fail=1, broke=2, fixed=1, n=5,
                                  missing=("only_arm", "only_control"))
    assert result.p_value == mcnemar_exact(2, 1)
    assert result.summary() == "2 broke, 1 fixed, p=1, 2 task(s) on one side only"


def test_paired_counts_summary_reads_like_a_gate_detail() -> None:
    control = {f"t{i}": True for i in range(5)}
    arm = {**control, "t0": False, "t1": False, "t2": False}
    assert paired_counts(control, arm).summary() == "3 broke, 0 fixed, p=0.25"


# --- medians, drift, relative change -------------------------------------------------------------

def test_median_of_repeats() -> None:
    assert median_of_repeats([3.0, 1.0, 2.0]) == 2.0
    assert median_of_repeats([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError, match="no repeats"):
        median_of_repeats([])
    with pytest.raises(ValueError, match="non-finite"):
        median_of_repeats([1.0, math.nan])


def test_noise_band_is_relative_difference_as_a_fraction() -> None:
    assert noise_band(101.0, 99.0) == pytest.approx(0.02)
    assert noise_band(99.0, 101.0) == noise_band(101.0, 99.0)
    assert noise_band(0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="undefined"):
        noise_band(1.0, -1.0)


def test_relative_delta_in_percent() -> None:
    assert relative_delta(105.0, 100.0) == 5.0
    assert relative_delta(95.0, 100.0) == -5.0
    assert relative_delta(102.0, 100.0) == 2.0  # exactly, so thresholds compare cleanly
    assert relative_delta(-90.0, -100.0) == 10.0  # the sign follows the direction of the change
    with pytest.raises(ValueError, match="reference of 0"):
        relative_delta(1.0, 0.0)


# --- bootstrap -----------------------------------------------------------------------------------

def test_bootstrap_matches_the_exact_bootstrap_distribution_of_a_tiny_sample() -> None:
    # median([1, 2, 3]*) is 1, 2 or 3 with probability 7/27, 13/27, 7/27; b's median is always 4,
    # so the ratio's 2.5 % and 97.5 % points are 0.25 and 0.75.
    interval = bootstrap_ratio_of_medians([1.0, 2.0, 3.0], [4.0, 4.0, 4.0])
    assert (interval.estimate, interval.low, interval.high) == (0.5, 0.25, 0.75)
    # Its 30 % and 70 % points are both 2.
    interval = bootstrap_ratio_of_medians([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], confidence=0.4)
    assert (interval.low, interval.high) == (2.0, 2.0)
    assert "not BCa" in interval.method and interval.confidence == 0.4


def test_bootstrap_agrees_with_scipy_percentile_bootstrap() -> None:
    rng = np.random.default_rng(7)
    a, b = rng.lognormal(size=201), rng.lognormal(size=199) * 1.1
    ours = bootstrap_ratio_of_medians(a, b)
    theirs = scipy_stats.bootstrap((a, b), lambda x, y, axis: np.median(x, axis=axis) / np.median(y, axis=axis),
                                   method="percentile", n_resamples=20_000, vectorized=True,
                                   random_state=np.random.default_rng(0)).confidence_interval
    assert ours.estimate == pytest.approx(np.median(a) / np.median(b))
    # Two Monte Carlo estimates of the same percentiles: equal within their sampling error.
    assert ours.low == pytest.approx(theirs.low, rel=0.02)
    assert ours.high == pytest.approx(theirs.high, rel=0.02)


def test_bootstrap_is_deterministic_for_a_seed() -> None:
    a, b = [10.0, 12.0, 11.0, 15.0], [9.0, 10.0, 14.0, 8.0]
    assert bootstrap_ratio_of_medians(a, b, seed=3) == bootstrap_ratio_of_medians(a, b, seed=3)
    assert bootstrap_ratio_of_medians(a, b, seed=3) != bootstrap_ratio_of_medians(a, b, seed=4)


def test_bootstrap_excludes_one_for_clearly_separated_samples() -> None:
    interval = bootstrap_ratio_of_medians([110.0, 111.0, 112.0, 113.0], [100.0, 101.0, 102.0, 103.0])
    assert 1.0 < interval.low <= interval.estimate <= interval.high


@pytest.mark.parametrize(("a", "b", "message"), [
    ([1.0], [1.0, 2.0, 3.0], "at least 3 samples per side, got 1 and 3"),
    # Two a side: the median of two resampled values takes three values, too few for a 95 % interval.
    ([1.0, 2.0], [1.0, 2.0], "at least 3 samples per side, got 2 and 2"),
    ([1.0, 2.0, 3.0], [], "at least 3 samples per side, got 3 and 0"),
    ([1.0, 2.0, 0.0], [1.0, 2.0, 3.0], "positive"),
    ([1.0, 2.0, math.inf], [1.0, 2.0, 3.0], "non-finite"),
])
def test_bootstrap_refuses_unusable_samples(a: list[float], b: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bootstrap_ratio_of_medians(a, b)


samples = st.lists(positive, min_size=3, max_size=12)


@settings(max_examples=60, deadline=None)
@given(samples, samples, st.integers(min_value=0, max_value=2**32 - 1))
def test_swapping_the_samples_inverts_the_interval(a: list[float], b: list[float], seed: int) -> None:
    forward = bootstrap_ratio_of_medians(a, b, n_resamples=300, seed=seed)
    backward = bootstrap_ratio_of_medians(b, a, n_resamples=300, seed=seed)
    assert backward.estimate == pytest.approx(1 / forward.estimate, rel=1e-12)
    assert backward.low == pytest.approx(1 / forward.high, rel=1e-12)
    assert backward.high == pytest.approx(1 / forward.low, rel=1e-12)
    assert forward.low <= forward.high


@settings(max_examples=60, deadline=None)
@given(samples, samples, st.integers(min_value=-20, max_value=20))
def test_interval_scales_with_the_units_of_one_side(a: list[float], b: list[float], power: int) -> None:
    scale = 2.0 ** power  # a power of two rescales every float exactly
    plain = bootstrap_ratio_of_medians(a, b, n_resamples=300)
    scaled = bootstrap_ratio_of_medians([x * scale for x in a], b, n_resamples=300)
    assert (scaled.estimate, scaled.low, scaled.high) == (plain.estimate * scale, plain.low * scale,
                                                          plain.high * scale)


# --- Mann-Whitney --------------------------------------------------------------------------------

@pytest.mark.parametrize(("n1", "n2"), [(1, 1), (3, 3), (4, 6), (8, 8), (12, 7), (20, 25)])
def test_mann_whitney_exact_matches_scipy(n1: int, n2: int) -> None:
    rng = np.random.default_rng(n1 * 100 + n2)
    a, b = rng.normal(size=n1), rng.normal(size=n2) + 0.7
    ours = mann_whitney(a, b)
    theirs = scipy_stats.mannwhitneyu(a, b, method="exact")
    assert ours.method == "exact"
    assert ours.u == theirs.statistic
    assert ours.p == pytest.approx(theirs.pvalue, rel=1e-9)


def test_mann_whitney_uses_the_tie_corrected_normal_approximation_with_ties() -> None:
    a, b = [1.0, 2.0, 2.0, 3.0, 4.0, 5.0], [2.0, 3.0, 3.0, 6.0, 7.0]
    ours = mann_whitney(a, b)
    theirs = scipy_stats.mannwhitneyu(a, b, method="asymptotic")
    assert ours.method == "normal approximation, tie-corrected"
    assert (ours.u, ours.p) == pytest.approx((theirs.statistic, theirs.pvalue), rel=1e-12)


def test_mann_whitney_uses_the_normal_approximation_for_large_samples() -> None:
    rng = np.random.default_rng(5)
    a, b = rng.normal(size=60), rng.normal(size=60) + 0.3
    ours = mann_whitney(a, b)
    assert ours.method == "normal approximation"
    assert ours.p == pytest.approx(scipy_stats.mannwhitneyu(a, b, method="asymptotic").pvalue, rel=1e-12)


def test_mann_whitney_on_identical_values_finds_nothing() -> None:
    assert mann_whitney([5.0, 5.0, 5.0], [5.0, 5.0]).p == 1.0


def test_complete_separation_of_three_vs_three_only_reaches_the_minimum_p() -> None:
    result = mann_whitney([4.0, 5.0, 6.0], [1.0, 2.0, 3.0])
    assert (result.u, result.p) == (9.0, pytest.approx(0.1))
    assert result.p == pytest.approx(min_reachable_p(3, 3))


@pytest.mark.parametrize(("n1", "n2", "expected"), [(3, 3, 0.1), (4, 4, 2 / 70), (5, 5, 2 / 252), (1, 1, 1.0)])
def test_min_reachable_p(n1: int, n2: int, expected: float) -> None:
    assert min_reachable_p(n1, n2) == pytest.approx(expected)


def test_mann_whitney_refuses_empty_samples() -> None:
    with pytest.raises(ValueError, match="at least 1 sample per side"):
        mann_whitney([], [1.0])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 20).map(float), min_size=1, max_size=10),
       st.lists(st.integers(0, 20).map(float), min_size=1, max_size=10))
def test_mann_whitney_swap_mirrors_u_and_keeps_p(a: list[float], b: list[float]) -> None:
    forward, backward = mann_whitney(a, b), mann_whitney(b, a)
    assert forward.u + backward.u == len(a) * len(b)
    assert forward.p == pytest.approx(backward.p, rel=1e-12)
    assert 0.0 <= forward.p <= 1.0
    if forward.method == "exact":
        assert forward.p >= min_reachable_p(len(a), len(b)) * (1 - 1e-12)

"""Interval verdicts over repeated boots: drift interpolated at each arm boot, the effect's confidence
interval against ±threshold, the repeats an undecided verdict needs, and the minimum detectable effect."""

from __future__ import annotations

import math

import pytest

from lab.analysis.effects import Noise, interpolate, interval, log_effects, repeats_needed
from lab.analysis.keep import ArmEvidence, BootValues, Decision, KeepRule, KeyMetric, MetricStatus, judge

DECODE = KeyMetric("decode.agg_tok_s[level=4]", higher_is_better=True)
TTFT = KeyMetric("mixed.short_ttft_behind_s", higher_is_better=False)
RULE = KeepRule(2.0, [DECODE])


def interleaved(controls: list[float], arm: list[float], metric: KeyMetric = DECODE,
                noise: dict | None = None) -> ArmEvidence:
    """C A C A C …: controls at even places, arm boots at odd ones (len(controls) == len(arm) + 1)."""
    assert len(controls) == len(arm) + 1
    boots = [BootValues(f"C#{2 * i}", {metric.name: v}, at=2.0 * i) for i, v in enumerate(controls)]
    return ArmEvidence(arm=[BootValues(f"A#{2 * i + 1}", {metric.name: v}, at=2.0 * i + 1) for i, v in enumerate(arm)],
                       opening_control=boots[0], closing_control=boots[-1], between_controls=boots[1:-1],
                       noise=noise or {})


def test_the_control_is_interpolated_at_each_arm_boot() -> None:
    assert interpolate([(0, 100.0), (2, 110.0)], 1) == 105.0
    assert interpolate([(0, 100.0), (2, 110.0), (4, 90.0)], 3) == 100.0
    assert interpolate([(2, 110.0)], 7) == 110.0  # one side only: the nearest control
    # Lower is better: an arm 10 % slower in latency is a -log(1.1) effect, "better" stays positive.
    assert log_effects([(1, 110.0)], [(0, 100.0), (2, 100.0)], higher_is_better=False) == [-math.log(1.1)]


def test_steady_drift_makes_no_false_keep_and_an_unchanged_arm_is_no_effect() -> None:
    # Controls climb 6 % through the window (the point rule would void it); the arm sits on the line.
    controls = [100.0, 102.0, 104.0, 106.0]
    arm = [101.1, 102.9, 105.1]
    verdict = judge(RULE, interleaved(controls, arm))
    row = verdict.metrics[0]
    assert verdict.decision is Decision.REJECT and row.status is MetricStatus.WITHIN
    assert row.interval is not None and -2 < row.interval.low_pct and row.interval.high_pct < 2
    assert "no effect larger than 2 %" in verdict.reasons[1] and "interpolated at each arm boot" in verdict.reasons[1]


def test_an_effect_whose_interval_clears_the_threshold_keeps() -> None:
    verdict = judge(RULE, interleaved([100.0, 101.0, 100.0, 99.0], [110.0, 111.0, 109.0]))
    assert verdict.decision is Decision.KEEP
    assert verdict.metrics[0].interval.low_pct > 2


def test_a_slowdown_whose_interval_is_below_minus_threshold_rejects_as_a_regression() -> None:
    # A latency metric 5 % worse in every boot: better is positive, so the effect is about -5 %.
    verdict = judge(KeepRule(2.0, [TTFT]), interleaved([1.00, 1.01, 0.99, 1.00], [1.05, 1.055, 1.045], metric=TTFT))
    row = verdict.metrics[0]
    assert verdict.decision is Decision.REJECT and row.status is MetricStatus.REGRESSED
    assert row.interval.high_pct < -2 and row.delta_pct < 0
    assert "regresses beyond 2 %" in verdict.reasons[0]


def test_an_interval_that_straddles_is_inconclusive_and_says_how_many_boots_would_resolve_it() -> None:
    verdict = judge(RULE, interleaved([100.0, 100.0, 100.0], [104.0, 108.0]))
    row = verdict.metrics[0]
    assert verdict.decision is Decision.INCONCLUSIVE and row.status is MetricStatus.UNDECIDED
    assert row.repeats_needed is not None and row.repeats_needed > 2
    assert f"about {row.repeats_needed} boots of the arm would resolve it" in verdict.reasons[0]


def test_repeats_needed_shrinks_the_interval_clear_of_the_threshold() -> None:
    found = interval([math.log(1.06), math.log(1.02)], None)
    n = repeats_needed(found, 2.0)
    assert n is not None
    # At that count an interval of the same spread centred on the same effect clears +2 %.
    from scipy import stats
    half = stats.t.ppf(0.975, n - 1) * found.sd_log / math.sqrt(n)
    assert math.log1p(found.effect_pct / 100) - half > math.log1p(0.02)


def test_one_boot_with_a_calibration_gets_an_interval_and_the_same_rule() -> None:
    noise = {DECODE.name: Noise(sd_log=0.005, df=10, source="calibration cal-1")}
    verdict = judge(RULE, interleaved([100.0, 100.5], [110.0], noise=noise))
    assert verdict.decision is Decision.KEEP and verdict.metrics[0].interval.n == 1
    assert any("minimum detectable effect ±1.6 % at 80 % power" in r and "calibration cal-1" in r
               for r in verdict.reasons)


def test_one_boot_in_a_drifting_window_stays_inconclusive_even_with_a_calibration() -> None:
    noise = {DECODE.name: Noise(sd_log=0.005, df=10, source="calibration cal-1")}
    verdict = judge(RULE, interleaved([100.0, 106.0], [115.0], noise=noise))
    assert verdict.decision is Decision.INCONCLUSIVE and verdict.metrics[0].status is MetricStatus.DRIFT
    assert verdict.reasons[0].startswith(f"{DECODE.name} undecided: controls drift 5.8 % > 2 %")


def two_metric_window(decode_arm: float, ttft_arm: float) -> ArmEvidence:
    """One arm boot between two controls; decode's controls 2.8 % apart, the chat's TTFT's 0.5 %."""
    def boot(label: str, at: float, decode: float, ttft: float) -> BootValues:
        return BootValues(label, {DECODE.name: decode, TTFT.name: ttft}, at=at)
    noise = {DECODE.name: Noise(sd_log=0.004, df=5, source="calibration cal-1"),
             TTFT.name: Noise(sd_log=0.004, df=5, source="calibration cal-1")}
    return ArmEvidence(arm=[boot("A#1", 1.0, decode_arm, ttft_arm)], opening_control=boot("C#0", 0.0, 36096.0, 1.000),
                       closing_control=boot("C#2", 2.0, 35096.0, 1.005), noise=noise)


def test_a_drift_beyond_one_metrics_calibration_leaves_that_metric_undecided_and_the_others_decide() -> None:
    rule = KeepRule(2.0, [DECODE, TTFT])
    # The chat's TTFT 10 % slower, its controls agreeing: a regression whatever decode's controls did.
    slower = judge(rule, two_metric_window(35500.0, 1.11))
    assert slower.decision is Decision.REJECT
    assert slower.reasons[0].startswith(f"{TTFT.name} -9.")
    assert [row.status for row in slower.metrics] == [MetricStatus.DRIFT, MetricStatus.REGRESSED]
    assert any(r.startswith(f"{DECODE.name} undecided: controls drift 2.8 % > 2 %") and
               "beyond the 1.1 % its calibrated noise explains" in r for r in slower.reasons)
    # The same TTFT 10 % faster is not a keep: the drifting metric could hide a regression.
    faster = judge(rule, two_metric_window(35500.0, 0.90))
    assert faster.decision is Decision.INCONCLUSIVE
    assert faster.reasons[0].startswith(f"{DECODE.name} undecided")
    assert faster.metrics[1].status is MetricStatus.IMPROVED


def test_one_boot_in_a_window_that_drifts_as_much_as_its_calibration_says_is_judged_by_the_interval() -> None:
    # Controls 6.4 % apart on a metric whose calibrated boots scatter by 4.5 % (SD): a drift that
    # noise explains, so the single boot is judged by its (wide) interval instead of voiding the window.
    noise = {DECODE.name: Noise(sd_log=0.045, df=2, source="calibration cal-1")}
    regressed = judge(RULE, interleaved([11002.0, 11735.0], [6000.0], noise=noise))
    assert regressed.decision is Decision.REJECT
    assert not any("window inconclusive" in r for r in regressed.reasons)
    assert regressed.metrics[0].status is MetricStatus.REGRESSED
    unchanged = judge(RULE, interleaved([11002.0, 11735.0], [11400.0], noise=noise))
    assert unchanged.decision is Decision.INCONCLUSIVE
    assert not any("window inconclusive" in r for r in unchanged.reasons)
    # The same drift against a calibration of 0.5 % says the window itself moved: voided, and why.
    tight = {DECODE.name: Noise(sd_log=0.005, df=10, source="calibration cal-1")}
    voided = judge(RULE, interleaved([11002.0, 11735.0], [6000.0], noise=tight))
    assert voided.decision is Decision.INCONCLUSIVE
    assert voided.reasons[0].endswith("beyond the 1.4 % its calibrated noise explains")


@pytest.mark.parametrize("controls,arm,noise", [
    ([100.0, 101.0], [103.0], None),
    ([100.0, 101.0, 100.0], [103.0, 104.0], None),
    ([100.0, 101.0], [103.0], {DECODE.name: Noise(0.01, 5, "calibration c")}),
], ids=["one boot, no noise model", "two boots", "one boot, calibrated"])
def test_every_verdict_states_its_minimum_detectable_effect(controls, arm, noise) -> None:
    verdict = judge(RULE, interleaved(controls, arm, noise=noise))
    assert sum(r.startswith(f"{DECODE.name}: minimum detectable effect") for r in verdict.reasons) == 1


PREFILL = KeyMetric("prefill.prefill_tok_s_median[length=32000]", higher_is_better=True)
CALIBRATED = {DECODE.name: Noise(sd_log=0.005, df=5, source="calibration cal-1"),
              PREFILL.name: Noise(sd_log=0.005, df=5, source="calibration cal-1")}


def two_metrics(decode: float, prefill: float) -> ArmEvidence:
    """One arm boot between two controls at 100 on both metrics, with the calibration above."""
    controls = [BootValues(f"C#{i}", {DECODE.name: 100.0, PREFILL.name: 100.0}, at=float(i)) for i in (0, 2)]
    return ArmEvidence(arm=[BootValues("A#1", {DECODE.name: decode, PREFILL.name: prefill}, at=1.0)],
                       opening_control=controls[0], closing_control=controls[1], noise=CALIBRATED)


def test_an_interval_straddling_only_plus_threshold_does_not_block_another_metrics_keep() -> None:
    # fp8 KV on the H200: C64 +13 % [+11, +15] beside 32K prefill +1.3 % [-0.2, +2.7]: the second
    # cannot be a regression beyond 2 %, so the first keeps.
    verdict = judge(KeepRule(2.0, [DECODE, PREFILL]), two_metrics(113.0, 101.3))
    rows = {row.name: row for row in verdict.metrics}
    assert rows[PREFILL.name].status is MetricStatus.UNDECIDED
    assert rows[PREFILL.name].interval.low_pct >= -2 and rows[PREFILL.name].interval.high_pct > 2
    assert verdict.decision is Decision.KEEP
    assert any("straddles +2 %" in r for r in verdict.reasons)


def test_an_interval_straddling_minus_threshold_still_blocks_a_keep() -> None:
    # The same improvement beside a metric that may regress by more than 2 %: not kept.
    verdict = judge(KeepRule(2.0, [DECODE, PREFILL]), two_metrics(113.0, 98.7))
    assert verdict.metrics[1].interval.low_pct < -2 < verdict.metrics[1].interval.high_pct
    assert verdict.decision is Decision.INCONCLUSIVE
    assert "straddles ±2 %" in verdict.reasons[0]


def test_a_possible_gain_alone_is_inconclusive_not_a_reject() -> None:
    # Nothing established, but more boots could show a gain: say so rather than reject.
    verdict = judge(KeepRule(2.0, [DECODE, PREFILL]), two_metrics(100.2, 101.3))
    assert verdict.decision is Decision.INCONCLUSIVE
    assert "straddles +2 %" in verdict.reasons[0] and "boots" in verdict.reasons[0]

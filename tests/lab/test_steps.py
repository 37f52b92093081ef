"""Step detection on constructed series: what `lab history` calls a step, an outlier, or noise."""

from __future__ import annotations

import random

from lab.analysis.steps import analyse, regressed_since

LABELS = [f"n{i:02d}" for i in range(12)]


def noisy(levels: list[float], sd_pct: float = 0.5, seed: int = 7) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.gauss(0, sd_pct / 100)) for level in levels]


def test_a_clean_step_down_is_a_regression_named_by_its_first_label() -> None:
    values = noisy([100.0] * 7 + [90.0] * 5)
    found = analyse(values, higher_is_better=True, threshold_pct=2)
    assert [s.index for s in found.steps] == [7] and found.outliers == [] and found.pending == []
    step = found.steps[0]
    assert step.regression and -11 < step.delta_pct < -9 and (step.n_before, step.n_after) == (7, 5)
    assert step.p is not None and step.p < 0.01
    first, total = regressed_since(found)
    assert first.index == 7 and -11 < total < -9
    assert step.describe(LABELS, "tok/s", found.limit_pct).startswith("regression of -")
    assert "from label n07" in step.describe(LABELS, "tok/s", found.limit_pct)


def test_a_single_outlier_is_no_step() -> None:
    values = noisy([100.0] * 12)
    values[5] = 80.0
    found = analyse(values, higher_is_better=True, threshold_pct=2)
    assert found.steps == [] and found.outliers == [5] and regressed_since(found) is None


def test_drift_within_the_noise_is_no_step() -> None:
    # 0.15 % a label, 1.7 % over the series, under 1 % noise: slower than any threshold can call.
    values = noisy([100.0 * (1 + 0.0015 * i) for i in range(12)], sd_pct=1.0, seed=3)
    found = analyse(values, higher_is_better=True, threshold_pct=2)
    assert found.steps == [] and found.pending == []


def test_a_step_in_the_good_direction_is_an_improvement_not_a_regression() -> None:
    # Lower is better here (TTFT): the level falls by 15 %.
    values = noisy([0.40] * 6 + [0.34] * 6)
    found = analyse(values, higher_is_better=False, threshold_pct=2)
    assert [s.index for s in found.steps] == [6] and not found.steps[0].regression
    assert regressed_since(found) is None


def test_one_departing_label_at_the_end_is_pending_until_the_next() -> None:
    values = noisy([100.0] * 8 + [85.0])
    found = analyse(values, higher_is_better=True, threshold_pct=2)
    assert found.steps == [] and found.pending == [8] and found.pending_regression
    confirmed = analyse(values + [85.5], higher_is_better=True, threshold_pct=2)
    assert [s.index for s in confirmed.steps] == [8] and confirmed.pending == []


def test_a_change_inside_the_controls_own_drift_is_no_step() -> None:
    # 4 % is past the 2 % threshold, but two controls of one label already disagree by 6 %.
    values = noisy([100.0] * 6 + [96.0] * 6, sd_pct=0.2)
    found = analyse(values, higher_is_better=True, threshold_pct=2, within_drift_pct=[6.0] * 12)
    assert found.steps == [] and found.band_pct == 6.0
    assert [s.index for s in analyse(values, higher_is_better=True, threshold_pct=2).steps] == [6]


def test_a_regression_then_a_recovery_leaves_nothing_to_flag() -> None:
    values = noisy([100.0] * 4 + [90.0] * 4 + [100.0] * 4)
    found = analyse(values, higher_is_better=True, threshold_pct=2)
    assert [(s.index, s.regression) for s in found.steps] == [(4, True), (8, False)]
    assert regressed_since(found) is None


def history_of(values: list[float], drift_pct: float | None = None, bases: tuple[int, ...] = (0,)):
    """A one-metric History of `values` (decode tok/s, higher is better), its base changing at the label
    indexes `bases`, each label's two controls disagreeing by `drift_pct`."""
    from lab.report.history import Base, History, MetricHistory, Point, Segment

    history = History("nightly@host", 2.0, list(LABELS[:len(values)]),
                      [Base(i, LABELS[i], f"hash{i:04d}", "" if i == 0 else "flags +x=1") for i in bases])
    points = [Point(label, f"run-{label}", v, [v], drift_pct, sum(i >= b for b in bases) - 1)
              for i, (label, v) in enumerate(zip(LABELS, values))]
    mh = MetricHistory("decode.agg_tok_s[level=4]", "tok/s", True, points)
    for base in range(len(bases)):
        mine = [p for p in points if p.base == base]
        mh.segments.append(Segment(base, mine, analyse([p.value for p in mine], True, 2.0,
                                                       [drift_pct] * len(points) if drift_pct else ())))
    history.metrics.append(mh)
    return history


def test_history_check_names_the_metric_the_change_and_the_first_label_of_the_regression() -> None:
    from lab.report.history import Outcome

    history = history_of(noisy([200.0] * 6 + [180.0] * 3))
    [line] = history.regressions()
    assert line.startswith("decode.agg_tok_s[level=4] regressed -9.") and "since label n06 (run run-n06)" in line
    assert history.pending() == []
    check = history.check()
    assert check.outcome is Outcome.REGRESSION and check.regressions == [line]
    assert check.summary.startswith("series nightly@host: 1 metric(s) regressed (labels n00 … n08)")


def test_a_regression_under_an_earlier_base_is_not_compared_with_the_new_one() -> None:
    from lab.report.history import Outcome

    # 200 → 180 is a 10 % fall, but the base changed at n06: the levels before it are another config's.
    history = history_of(noisy([200.0] * 6 + [180.0] * 3), bases=(0, 6))
    check = history.check()
    assert check.outcome is Outcome.OK and check.regressions == []
    assert check.summary == ("series nightly@host: no regression in 1 metric(s) over 3 labels (n06 … n08) since "
                             "the base changed at label n06")
    only_new = history_of(noisy([200.0] * 6 + [180.0]), bases=(0, 6)).check()
    assert only_new.outcome is Outcome.BASE_CHANGED and only_new.outcome == 4
    assert "the base changed at label n06 (flags +x=1); nothing under it to compare with yet" in only_new.summary
    assert history_of([200.0]).check().outcome is Outcome.NO_DATA == 3


def test_the_detectable_change_is_stated_from_the_noise_the_gate_uses() -> None:
    # A busy host: each label's two controls disagree by 11 %, so a 10 % regression is inside the noise.
    busy = history_of(noisy([200.0] * 6 + [180.0] * 3), drift_pct=11.0)
    assert busy.regressions() == []
    [line] = busy.detectable()
    assert line == ("decode.agg_tok_s[level=4]: changes larger than ±11.0 %, set by the controls' median drift "
                    "within a label (11.00 %)")
    [quiet] = history_of(noisy([200.0] * 9)).detectable()
    assert quiet.startswith("decode.agg_tok_s[level=4]: changes larger than ±2.0 %, set by the KEEP threshold (2 %)")
    [jumpy] = history_of(noisy([200.0] * 9, sd_pct=3)).detectable()
    assert "set by the label-to-label noise (3 × " in jumpy and "robust SD, from 8 differences)" in jumpy
    [young] = history_of(noisy([200.0] * 3)).detectable()
    assert young.endswith("the label-to-label noise is not estimated yet (2 of the 3 differences it needs), so this "
                          "is a floor")

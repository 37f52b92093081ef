"""The KEEP rule: judge one arm against the warm controls that bracket its window.

Keep an arm when at least one key metric improves by more than the threshold, no key metric
regresses by more than the threshold, and every gate holds (docs/keep.md).

How figures are formed:
- a boot's value for a metric is the median of its repeats;
- the reference is the mean of the warm controls' values (opening and closing: drift-corrected
  bracketing); the arm's value is the mean over its warm boots;
- delta % is the signed improvement in the metric's good direction: the relative change
  (arm - reference) / reference for a higher-is-better metric, its negation for lower-is-better;
- "more than the threshold" is strict: exactly 2 % with a 2 % threshold neither keeps nor rejects,
  and controls exactly 2 % apart leave the metric decided.

Precedence when several findings apply (first match decides):
1. a failed gate rejects: it is a fact about the arm that no other measurement can undo;
2. the window is inconclusive when no warm control remains;
3. a key metric regressing beyond the threshold rejects, even if another figure is missing or
   undecided, because that figure cannot rescue it;
4. a missing or unusable figure (no warm arm boot, an absent or non-finite value, a zero
   reference, a gate without a result) or an undecided metric makes the verdict inconclusive:
   nothing passes silently. With one arm boot, a metric is undecided when its own controls drift
   apart beyond the drift limit and no calibration explains that drift, or when it has one warm
   control and no calibration: nothing then shows how far its boots scatter. Each metric is judged
   on its own controls: a drift on one leaves the others to decide (docs/keep.md re-judges stored
   runs under this rule and the one before it, which voided the whole window);
5. an improvement beyond the threshold keeps;
6. an interval that straddles +threshold only (it may improve, it cannot regress) is undecided:
   inconclusive when nothing else improves, since more boots could make it a keep;
7. otherwise reject: a change that improves nothing is not kept.

Interval verdicts. When the spread of a boot is known, from two or more warm boots of the arm
(a ladder's `repeats:`) or from a calibration of the metric (`lab calibrate`), a metric is judged
by the confidence interval of its drift-corrected effect (`lab.analysis.effects`: each arm boot against the
controls interpolated at its place) instead of by its point figure:
- the interval above +threshold is an improvement; below -threshold a regression;
- entirely inside ±threshold is "no effect larger than the threshold", which rejects like a change
  that improves nothing;
- straddling -threshold is undecided (it may regress): inconclusive, with the repeats that would
  resolve it at the measured noise (precedence 4, like a missing figure);
- straddling +threshold alone rules a regression out, so it does not stand in the way of another
  metric's improvement; with no improvement elsewhere it is inconclusive (precedence 6).
With two or more arm boots the controls' drift is interpolated, not a reason to hold a metric back;
a single arm boot keeps the drift limit, so a drifting metric never gives a keep: a drift its
calibration explains is judged by the (wide) interval, one beyond it leaves that metric undecided.
Every metric states the minimum detectable effect its design has, or that it has none.

Cold boots never enter a figure; each exclusion is stated in the reasons. When both sides have at
least two repeats, each metric row also carries a bootstrap interval of the ratio of medians and a
Mann-Whitney p. They are information only: the decision is exactly the rule above, and an
improvement or regression whose interval straddles the threshold is flagged in its reason.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import IntEnum, StrEnum
from typing import Any, NamedTuple

from lab.analysis import effects
from lab.analysis.effects import Interval, Noise
from lab.analysis.stats import MIN_INTERVAL_SAMPLES, median_of_repeats, noise_band, ratio_summary, relative_delta

DEFAULT_THRESHOLD_PCT = 2.0
CI_CONFIDENCE = 0.95
# A fixed seed makes a stored verdict reproducible from the same data.
CI_SEED = 0


class Decision(StrEnum):
    KEEP = "keep"
    REJECT = "reject"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class KeyMetric:
    name: str
    higher_is_better: bool


@dataclass(frozen=True)
class KeepRule:
    threshold_pct: float
    metrics: Sequence[KeyMetric]
    gates: Sequence[str] = ()
    # How far apart a metric's controls may be before it is undecided (one arm boot); None = threshold_pct.
    max_drift_pct: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", tuple(self.metrics))
        object.__setattr__(self, "gates", tuple(self.gates))
        if not self.metrics:
            raise ValueError("a KEEP rule needs at least one key metric")
        names = [m.name for m in self.metrics]
        if len(set(names)) != len(names):
            raise ValueError(f"key metrics are listed twice: {sorted({n for n in names if names.count(n) > 1})}")
        if len(set(self.gates)) != len(self.gates):
            raise ValueError("a gate is listed twice in the KEEP rule")
        for label, value in (("threshold_pct", self.threshold_pct), ("max_drift_pct", self.max_drift_pct)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{label} must be a finite non-negative percentage, got {value}")

    @property
    def drift_limit_pct(self) -> float:
        return self.threshold_pct if self.max_drift_pct is None else self.max_drift_pct


@dataclass(frozen=True)
class BootValues:
    """What one boot measured: metric name -> its repeats (one value when not repeated)."""

    label: str
    values: Mapping[str, Sequence[float] | float]
    cold: bool = False
    at: float | None = None  # its place in the window's boot order; None: opening, arms, closing as listed

    def __post_init__(self) -> None:
        # A single figure is the common case; accept it bare rather than fail on len(float).
        object.__setattr__(self, "values", {
            name: (float(v),) if isinstance(v, numbers.Real) else tuple(float(x) for x in v)
            for name, v in self.values.items()})


class GateResult(NamedTuple):
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class ArmEvidence:
    """Everything the rule needs about one arm: its boots, its window's controls, gate outcomes.

    A control that did not run is None. A gate absent from `gates` (or None) has no result.
    Plain (passed, detail) tuples are accepted for gate results.
    """

    arm: Sequence[BootValues]
    opening_control: BootValues | None
    closing_control: BootValues | None
    gates: Mapping[str, GateResult | tuple[bool, str] | None] = field(default_factory=dict)
    # Controls booted between the arm's repeats (C A B C A B C), each with its `at`.
    between_controls: Sequence[BootValues] = ()
    # Calibrated boot-to-boot noise per key metric name, when `lab calibrate` measured it.
    noise: Mapping[str, Noise] = field(default_factory=dict)


class MetricStatus(StrEnum):
    IMPROVED = "improved"
    REGRESSED = "regressed"
    WITHIN = "within"
    DRIFT = "drift"
    MISSING = "missing"
    INVALID = "invalid"
    UNDECIDED = "undecided"  # its interval straddles a threshold edge


@dataclass(frozen=True)
class RepeatsEvidence:
    """Informational statistics over the pooled repeats of the warm arm and warm control boots."""

    n_arm: int
    n_control: int
    ci_low_pct: float  # bootstrap bounds of the median ratio, as improvement % in the good direction
    ci_high_pct: float
    ci_confidence: float
    ci_method: str
    mann_whitney_p: float
    mann_whitney_method: str
    min_reachable_p: float


@dataclass(frozen=True)
class MetricRow:
    name: str
    higher_is_better: bool
    status: MetricStatus
    arm_value: float | None = None
    control_values: tuple[float, ...] = ()  # warm controls' values, opening first
    reference: float | None = None
    delta_pct: float | None = None  # signed improvement in the good direction
    drift_pct: float | None = None
    repeats: RepeatsEvidence | None = None
    interval: Interval | None = None  # the drift-corrected effect over boots, when its noise is known
    repeats_needed: int | None = None  # arm boots that would resolve an undecided interval


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reasons: list[str]  # the deciding reasons first, then everything else that was found
    metrics: list[MetricRow]
    gates: dict[str, GateResult | None]
    excluded_boots: list[str]  # labels of cold boots left out of every figure
    threshold_pct: float
    drift_limit_pct: float | None = None  # the controls' drift beyond which a one-boot metric is undecided

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: plain strings, numbers, lists and dicts; no NaN."""
        return {
            "decision": str(self.decision),
            "reasons": list(self.reasons),
            "threshold_pct": self.threshold_pct,
            "drift_limit_pct": self.drift_limit_pct,
            "excluded_boots": list(self.excluded_boots),
            "metrics": [{**asdict(row), "status": str(row.status), "control_values": list(row.control_values)}
                        for row in self.metrics],
            "gates": {name: None if result is None else result._asdict() for name, result in self.gates.items()},
        }


class _Kind(IntEnum):
    """What a finding means for the decision; lower values take precedence."""

    GATE_FAILED = 1
    WINDOW_VOID = 2
    REGRESSION = 3
    MISSING = 4
    IMPROVEMENT = 5
    POSSIBLE_GAIN = 6  # an interval straddling +threshold only: no regression, no established gain
    INFO = 7


class _Finding(NamedTuple):
    kind: _Kind
    text: str


def judge(rule: KeepRule, evidence: ArmEvidence) -> Verdict:
    """Apply `rule` to one arm; see the module docstring for the figures and the precedence."""
    findings: list[_Finding] = []
    excluded: list[str] = []

    controls: list[BootValues] = []
    listed = [("opening control", evidence.opening_control)]
    listed += [("control", boot) for boot in evidence.between_controls]
    listed += [("closing control", evidence.closing_control)]
    for role, boot in listed:
        if boot is None:
            findings.append(_Finding(_Kind.INFO, f"no {role} in this window"))
        elif boot.cold:
            excluded.append(boot.label)
            findings.append(_Finding(_Kind.INFO, f"{role} {boot.label} booted cold: excluded from the verdict"))
        else:
            controls.append(boot)
    if len(controls) == 1:
        findings.append(_Finding(_Kind.INFO, f"only one warm control ({controls[0].label}): "
                                             "drift between the controls cannot be checked"))

    arm_boots: list[BootValues] = []
    for boot in evidence.arm:
        if boot.cold:
            excluded.append(boot.label)
            findings.append(_Finding(_Kind.INFO, f"arm boot {boot.label} booted cold: excluded from the verdict"))
        else:
            arm_boots.append(boot)

    if not controls:
        findings.append(_Finding(_Kind.WINDOW_VOID, "no warm control left in the window: inconclusive"))
    if not arm_boots:
        findings.append(_Finding(_Kind.MISSING, "no warm boot of the arm: nothing to judge"))

    arm_boots, controls = _placed(evidence, arm_boots, controls)
    rows: list[MetricRow] = []
    mde: list[_Finding] = []  # after every other finding: they qualify the figures, they decide nothing
    for metric in rule.metrics:
        if controls and arm_boots:
            row, finding = _judge_metric(rule, metric, arm_boots, controls, evidence.noise.get(metric.name))
            findings.append(finding)
            if row.arm_value is not None:
                mde.append(_Finding(_Kind.INFO, _mde_text(row)))
        else:
            row = MetricRow(metric.name, metric.higher_is_better, MetricStatus.MISSING)
        rows.append(row)

    gates: dict[str, GateResult | None] = {}
    for name in rule.gates:
        raw = evidence.gates.get(name)
        result = None if raw is None else GateResult(*raw)
        gates[name] = result
        if result is None:
            findings.append(_Finding(_Kind.MISSING, f"gate {name}: no result (not run or not recorded)"))
        else:
            outcome = "passed" if result.passed else "failed"
            text = f"gate {name} {outcome}" + (f": {result.detail}" if result.detail else "")
            findings.append(_Finding(_Kind.INFO if result.passed else _Kind.GATE_FAILED, text))
    for name in evidence.gates:
        if name not in gates:
            findings.append(_Finding(_Kind.INFO, f"gate {name} has a result but is not in the rule: not used"))

    findings += mde
    deciding = min((f.kind for f in findings), default=_Kind.INFO)
    decision = {_Kind.GATE_FAILED: Decision.REJECT, _Kind.WINDOW_VOID: Decision.INCONCLUSIVE,
                _Kind.REGRESSION: Decision.REJECT, _Kind.MISSING: Decision.INCONCLUSIVE,
                _Kind.IMPROVEMENT: Decision.KEEP, _Kind.POSSIBLE_GAIN: Decision.INCONCLUSIVE,
                _Kind.INFO: Decision.REJECT}[deciding]
    if deciding is _Kind.INFO:
        findings.insert(0, _Finding(_Kind.INFO, f"no key metric improves by more than "
                                                f"{rule.threshold_pct:g} %: a change that improves "
                                                "nothing is not kept"))
    # Stable sort: the deciding findings lead, everything else keeps the order it was found in.
    reasons = [f.text for f in sorted(findings, key=lambda f: f.kind != deciding)]
    return Verdict(decision=decision, reasons=reasons, metrics=rows, gates=gates,
                   excluded_boots=excluded, threshold_pct=rule.threshold_pct,
                   drift_limit_pct=rule.drift_limit_pct)


def _placed(evidence: ArmEvidence, arm_boots: list[BootValues],
            controls: list[BootValues]) -> tuple[list[BootValues], list[BootValues]]:
    """Boots with their place in the window: as given, or opening control, arm boots, closing control."""
    if all(b.at is not None for b in arm_boots + controls):
        return arm_boots, controls
    order = {id(b): i for i, b in enumerate([evidence.opening_control, *evidence.arm, evidence.closing_control])}
    if evidence.between_controls:
        raise ValueError("controls between arm boots need their `at` in the window")
    return ([replace(b, at=float(order[id(b)])) for b in arm_boots],
            [replace(b, at=float(order[id(b)])) for b in controls])


def _judge_metric(rule: KeepRule, metric: KeyMetric, arm_boots: list[BootValues],
                  controls: list[BootValues], noise: Noise | None) -> tuple[MetricRow, _Finding]:
    name = metric.name
    missing = [boot.label for boot in arm_boots + controls if len(boot.values.get(name, ())) == 0]
    if missing:
        return (MetricRow(name, metric.higher_is_better, MetricStatus.MISSING),
                _Finding(_Kind.MISSING, f"{name}: no value from {', '.join(missing)}"))
    broken = [boot.label for boot in arm_boots + controls
              if not all(math.isfinite(v) for v in boot.values[name])]
    if broken:
        return (MetricRow(name, metric.higher_is_better, MetricStatus.INVALID),
                _Finding(_Kind.MISSING, f"{name}: non-finite value from {', '.join(broken)}"))

    arm_value = _mean([median_of_repeats(boot.values[name]) for boot in arm_boots])
    control_values = tuple(median_of_repeats(boot.values[name]) for boot in controls)
    reference = _mean(list(control_values))
    shown_controls = ("controls " if len(control_values) > 1 else "control ") + "/".join(
        figure_text(v) for v in control_values)
    base = MetricRow(name, metric.higher_is_better, MetricStatus.INVALID, arm_value=arm_value,
                     control_values=control_values, reference=reference)

    if reference == 0:
        return base, _Finding(_Kind.MISSING, f"{name}: {shown_controls} give a reference of 0; "
                                             "a relative change is undefined")
    change = relative_delta(arm_value, reference)
    # Adding 0.0 turns the -0.0 of an unchanged lower-is-better metric into 0.0 for display.
    delta = (change if metric.higher_is_better else -change) + 0.0
    # The widest disagreement among the warm controls (the two of a plain window: their band).
    drift = noise_band(max(control_values), min(control_values)) * 100 if len(control_values) >= 2 else None
    repeats = _repeats_evidence(metric, arm_boots, controls)
    found = effects.interval(
        effects.log_effects([(b.at, median_of_repeats(b.values[name])) for b in arm_boots],
                            [(b.at, median_of_repeats(b.values[name])) for b in controls], metric.higher_is_better),
        noise) if min(control_values) > 0 and arm_value > 0 and all(
            median_of_repeats(b.values[name]) > 0 for b in arm_boots) else None
    row_fields = dict(delta_pct=delta, drift_pct=drift, repeats=repeats, interval=found)
    # Two or more arm boots interpolate the drift. One boot against a drifting pair is trusted only
    # when a calibration of this metric says its boots scatter that much (its interval is then as
    # wide as that scatter); a drift beyond what the calibration explains, or any drift beyond the
    # limit with no calibration, leaves this metric undecided.
    explained = effects.drift_expected_pct(found.sd_log) if found is not None and found.n < 2 else None
    drift_undecides = drift is not None and drift > rule.drift_limit_pct and (
        found is None or (found.n < 2 and drift > explained))

    if found is not None and not drift_undecides:
        return _judge_interval(rule, metric, base, found, shown_controls, drift, row_fields)

    if found is None and len(control_values) == 1:
        # One boot against one control, with no noise model: nothing shows that this metric's boots
        # agree, so its point figure decides nothing (docs/keep.md counts what judging it cost).
        return (replace(base, status=MetricStatus.UNDECIDED, **row_fields),
                _Finding(_Kind.MISSING, f"{name} undecided: one warm {shown_controls}, one boot of the arm and "
                                        f"no calibration: nothing shows how far its boots scatter "
                                        f"(arm {figure_text(arm_value)}, "
                                        f"{pct_text(delta, rule.threshold_pct, signed=True)} %)"))

    if drift_undecides:
        # Each metric's own controls vouch for it: a drift on this one leaves it undecided (it can
        # never keep) while metrics whose controls agree still decide (docs/keep.md measures this).
        shown_drift = (f"controls drift {pct_text(drift, rule.drift_limit_pct, signed=False)} % > "
                       f"{rule.drift_limit_pct:g} %")
        row = replace(base, status=MetricStatus.DRIFT, **row_fields)
        why = ("no calibration says how far its boots scatter" if explained is None else
               f"beyond the {explained:.1f} % its calibrated noise explains")
        return row, _Finding(_Kind.MISSING, f"{name} undecided: {shown_drift} ({shown_controls}), {why}")

    threshold = rule.threshold_pct
    shown_delta = pct_text(delta, threshold, signed=True)
    tail = f" vs {shown_controls}: arm {figure_text(arm_value)}" + ("" if metric.higher_is_better else " (lower is better)")
    if delta > threshold:
        status, kind = MetricStatus.IMPROVED, _Kind.IMPROVEMENT
        text = f"{name} {shown_delta} % (> {threshold:g} %){tail}"
    elif delta < -threshold:
        status, kind = MetricStatus.REGRESSED, _Kind.REGRESSION
        text = f"{name} {shown_delta} % regresses beyond {threshold:g} %{tail}"
    else:
        status, kind = MetricStatus.WITHIN, _Kind.INFO
        text = f"{name} {shown_delta} % (within ±{threshold:g} %){tail}"
    if repeats is not None:
        text += _repeats_text(repeats, status, threshold)
    return replace(base, status=status, **row_fields), _Finding(kind, text)


def _judge_interval(rule: KeepRule, metric: KeyMetric, base: MetricRow, found: Interval, shown_controls: str,
                    drift: float | None, row_fields: dict[str, Any]) -> tuple[MetricRow, _Finding]:
    """A metric judged by where its interval lies against ±threshold (module docstring)."""
    name, threshold = metric.name, rule.threshold_pct
    shown = (f"{name} {pct_text(found.effect_pct, threshold, signed=True)} % "
             f"[{pct_text(found.low_pct, threshold, signed=True)}, "
             f"{pct_text(found.high_pct, threshold, signed=True)}] % "
             f"({found.confidence * 100:g} % CI, better is positive)")
    needed = None
    if found.low_pct > threshold:
        status, kind, what = MetricStatus.IMPROVED, _Kind.IMPROVEMENT, f"improves by more than {threshold:g} %"
    elif found.high_pct < -threshold:
        status, kind, what = MetricStatus.REGRESSED, _Kind.REGRESSION, f"regresses beyond {threshold:g} %"
    elif found.low_pct >= -threshold and found.high_pct <= threshold:
        status, kind, what = MetricStatus.WITHIN, _Kind.INFO, f"no effect larger than {threshold:g} %"
    else:
        needed = effects.repeats_needed(found, threshold)
        # Straddling +threshold alone cannot hide a regression: it does not block another metric's keep.
        kind = _Kind.POSSIBLE_GAIN if found.low_pct >= -threshold else _Kind.MISSING
        status = MetricStatus.UNDECIDED
        edge = f"+{threshold:g}" if kind is _Kind.POSSIBLE_GAIN else f"±{threshold:g}"
        what = (f"undecided: the interval straddles {edge} %; "
                + (f"about {needed} boots of the arm would resolve it at the measured noise" if needed else
                   f"more than {effects.MAX_SUGGESTED_REPEATS} boots would be needed at the measured noise"))
    drift_text = (f"; controls drift {pct_text(drift, rule.drift_limit_pct, signed=False)} % ({shown_controls}), "
                  "interpolated at each arm boot" if drift else "")
    text = f"{shown}: {what}{drift_text}"
    return replace(base, status=status, repeats_needed=needed, **row_fields), _Finding(kind, text)


def _mde_text(row: MetricRow) -> str:
    """What the design could resolve on this metric; every judged metric says it."""
    found = row.interval
    if found is None:
        return (f"{row.name}: minimum detectable effect unknown: one boot of the arm and no calibration of this "
                "metric (`repeats: 2` or more, or `lab calibrate`, measures it)")
    return (f"{row.name}: minimum detectable effect ±{found.mde_pct:.2g} % at {found.power * 100:g} % power "
            f"and {found.confidence * 100:g} % confidence ({found.n} boot{'s' if found.n > 1 else ''}; "
            f"noise from {found.source})")


def _repeats_evidence(metric: KeyMetric, arm_boots: list[BootValues],
                      controls: list[BootValues]) -> RepeatsEvidence | None:
    arm_samples = [v for boot in arm_boots for v in boot.values[metric.name]]
    control_samples = [v for boot in controls for v in boot.values[metric.name]]
    # A ratio of medians needs positive figures; rates and latencies are, counts of zero are not.
    if min(len(arm_samples), len(control_samples)) < MIN_INTERVAL_SAMPLES or min(arm_samples + control_samples) <= 0:
        return None
    summary = ratio_summary(arm_samples, control_samples, metric.higher_is_better, CI_CONFIDENCE, CI_SEED)
    return RepeatsEvidence(n_arm=summary.n_new, n_control=summary.n_reference, ci_low_pct=summary.low_pct,
                           ci_high_pct=summary.high_pct, ci_confidence=summary.interval.confidence,
                           ci_method=summary.interval.method, mann_whitney_p=summary.test.p,
                           mann_whitney_method=summary.test.method, min_reachable_p=summary.min_reachable_p)


def _repeats_text(repeats: RepeatsEvidence, status: MetricStatus, threshold: float) -> str:
    interval = (f"{repeats.ci_confidence * 100:g} % CI [{repeats.ci_low_pct:+.1f}, "
                f"{repeats.ci_high_pct:+.1f}] %")
    text = (f"; repeats {repeats.n_arm} vs {repeats.n_control}: median ratio {interval} (percentile "
            f"bootstrap), Mann-Whitney p={repeats.mann_whitney_p:.2g} ({repeats.mann_whitney_method})")
    if status is MetricStatus.IMPROVED and repeats.ci_low_pct <= threshold:
        text += f"; the CI straddles {threshold:g} %: the repeats do not establish this improvement"
    elif status is MetricStatus.REGRESSED and repeats.ci_high_pct >= -threshold:
        text += f"; the CI straddles -{threshold:g} %: the repeats do not establish this regression"
    return text


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def figure_text(value: float) -> str:
    """A figure as the KEEP lines and `lab compare` print it: every digit before the point and one
    after it from 10 up (a piped table must not round 1098765432.25 to 1.099e+09); four
    significant digits below."""
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.4g}"


def pct_text(value: float, threshold: float, signed: bool) -> str:
    """A percentage with one decimal, or more when one would print a value as the threshold itself.

    "+2.0 % (> 2 %)" would read as a contradiction when the value is 2.04; show "+2.04" instead.
    Compare and the report print drift and Δ % with it too, so they show what the rule compared.
    """
    for digits in range(1, 7):
        text = f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"
        if abs(value) == threshold or abs(float(text)) != threshold:
            break
    return text

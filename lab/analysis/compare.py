"""`lab compare A B`: two arms side by side, metric by metric, with the KEEP verdicts behind them.

A is the baseline and B the candidate. Δ % is B's change from A with one sign convention, the
KEEP rule's: better is positive, also for a lower-is-better metric ((A − B) / |A| for a latency), so
the table and the KEEP lines never show opposite signs for the same pair. A metric with no declared
direction shows (B − A) / |A| and is never called better or worse. A side's value is the mean over
its warm, finished boots of each boot's median of repeats (a control has two boots, the window's
opening and closing one), the same figure the KEEP rule uses.

A change is "better" or "worse" only outside the noise band: the widest of the KEEP threshold, the
controls' drift of each window involved, and the minimum detectable effect of the verdict on
that metric; inside it the row says "within noise" and names what set the band.

Numbers are never cut short: a table wider than the terminal (or than 80 columns when piped) is
printed at the width it needs, and `--json` gives the same comparison for machines.

Statistics only where there are repeats, and the table says which was used:
- a percentile bootstrap 95 % interval of the ratio of medians when each side has ≥ 3 values
  (`stats.MIN_INTERVAL_SAMPLES`; two a side give a difference, never an interval); a change is
  "established" only when the whole interval lies beyond the threshold (the rule criterion.rs
  uses; docs/keep.md);
- an exact (or normal-approximation) Mann-Whitney p only when the sample sizes can reach
  p < 0.05 at all (4 vs 4 or more: 3 vs 3 never can); otherwise it says so;
- none where a side is a one-boot run's only boot (a ladder with no arms): its repeats say nothing of
  how far another boot would move, so Δ % is a difference between boots, and the table says so.

Verdicts are judged again in memory from the stored cells for every run involved (the newest
calibration included), so the table shows exactly what the rule decides on the data as it is now;
nothing is written, so a read-only store compares as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from lab.analysis import keep, verdicts
from lab.analysis.stats import MIN_INTERVAL_SAMPLES, median_of_repeats, noise_band, ratio_summary, relative_delta
from lab.instruments.paired import paired_counts
from lab.store import reader
from lab.store.db import Store

ALPHA = 0.05
ONE_BOOT = ("one boot has no control beside it and no boot-to-boot spread, so Δ % is a difference between "
            "single boots, with no interval")
CONFIDENCE = 0.95
CI_SEED = 0


class CompareError(LookupError):
    """An arm reference that cannot be compared; one line a person can act on."""


@dataclass(frozen=True)
class Side:
    """One of the two arms: where it lives and the boots its figures come from."""

    ref: str  # as shown: ARM, or RUN:ARM when the two sides come from different runs
    arm: str
    evidence: verdicts.RunEvidence

    @property
    def role(self) -> str:
        return self.evidence.role(self.arm)

    @property
    def window(self) -> str:
        return self.evidence.window(self.arm)

    @property
    def slots(self) -> list[verdicts.SlotCells]:
        """Finished, warm boots only: a cold boot is never a figure, a failed one has none."""
        return [s for s in self.evidence.arm_slots(self.arm) if s.measured and not s.cold]

    @property
    def lone(self) -> bool:
        """Whether this side is the only measured boot of its window (a one-boot run's control): nothing
        beside it says how far another boot of the same config would move."""
        return self.role == "control" and sum(s.window == self.window and s.role != "warmup"
                                               for s in self.evidence.slots) == 1

    def left_out(self) -> list[str]:
        return [f"{s.label}: {'booted cold' if s.cold and s.measured else 'no finished boot'}, left out"
                for s in self.evidence.arm_slots(self.arm) if not s.measured or s.cold]

    def why_missing(self, selector: verdicts.Selector) -> str:
        """Why this side has no value for `selector`: its boots' invalid cells' commonest reason,
        or that no warm boot finished."""
        if not self.slots:
            return "; ".join(self.left_out()) or "no boot"
        reasons = [note for slot in self.slots for note in self.evidence.select(slot, selector).notes]
        return "; ".join(dict.fromkeys(reasons)) or "no cell of it was stored"

    def samples(self, selector: verdicts.Selector) -> tuple[list[float], list[float], str]:
        """(each boot's median, every repeat pooled, unit)."""
        medians, pooled, unit = [], [], ""
        for slot in self.slots:
            found = self.evidence.select(slot, selector)
            if found.values:
                medians.append(median_of_repeats(found.values))
                pooled += found.values
                unit = unit or found.unit
        return medians, pooled, unit


@dataclass(frozen=True)
class Statistics:
    test: str  # "none" | "bootstrap" | "bootstrap + mann-whitney"
    text: str  # the full statement
    short: str  # for a table cell
    n_a: int
    n_b: int
    ci_low_pct: float | None = None  # of median B / median A in percent, better positive like Δ %
    ci_high_pct: float | None = None
    ci_method: str | None = None
    mann_whitney_p: float | None = None
    mann_whitney_method: str | None = None


@dataclass(frozen=True)
class Row:
    metric: str
    kind: str  # key | gate | metric (every metric, when the ladder names no key metric)
    rule: str  # "higher is better", "≥ 1", …
    unit: str
    higher_is_better: bool | None
    a: float | None
    b: float | None
    delta_pct: float | None  # B's change from A in percent, better positive (raw (B − A) / |A| without a direction)
    change: str  # better | worse | within noise | changed (no direction) | "" (no figure)
    noise_band_pct: dict[str, float | None]  # window label -> controls' relative difference in percent
    statistics: Statistics | None
    band_pct: float = 0.0  # the widest of threshold, drift and MDE: "better"/"worse" only beyond it
    band_source: str = ""  # what set the band, in words
    mde_pct: float | None = None  # the verdict's minimum detectable effect on this metric
    note: str = ""
    gate: dict[str, bool | None] | None = None  # for a gate: {"a": holds?, "b": holds?}


@dataclass(frozen=True)
class Quality:
    qeval: dict[str, Any] | None
    agreement: list[dict[str, Any]]


@dataclass
class Comparison:
    a: Side
    b: Side
    threshold_pct: float
    rows: list[Row]
    quality: Quality
    verdicts: dict[str, dict[str, Any] | None]  # side ref -> its verdict (None: a control, or no rule)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        def side(s: Side) -> dict[str, Any]:
            return {"ref": s.ref, "run": s.evidence.run_name, "arm": s.arm, "role": s.role, "window": s.window,
                    "boots": [slot.label for slot in s.slots]}

        return _finite({
            "a": side(self.a), "b": side(self.b), "threshold_pct": self.threshold_pct,
            "rows": [{**{k: v for k, v in row.__dict__.items() if k != "statistics"},
                      "statistics": None if row.statistics is None else dict(row.statistics.__dict__)}
                     for row in self.rows],
            "qeval": self.quality.qeval, "agreement": self.quality.agreement,
            "verdicts": self.verdicts, "notes": self.notes,
        })


def resolve(store: Store, ref: str, latest: int | None = None) -> tuple[int, str]:
    """ARM in the latest run, or RUN:ARM; (run id, arm name)."""
    run_ref, _, arm = ref.rpartition(":")
    if run_ref:
        run_id = reader.find_run(store, run_ref).id
    elif latest is not None:
        run_id = latest
    else:
        raise CompareError("this store has no runs; `lab run LADDER.yaml` makes one")
    arms = [a.name for a in reader.arms(store, run_id)]
    if arm not in arms:
        name = reader.find_run(store, str(run_id)).name
        raise CompareError(f"run {name} has no arm {arm!r}; its arms are {', '.join(arms)}")
    return run_id, arm


def compare(store: Store, a_ref: str, b_ref: str) -> Comparison:
    latest = reader.latest_run_id(store)
    (a_run, a_arm), (b_run, b_arm) = resolve(store, a_ref, latest), resolve(store, b_ref, latest)
    runs = {run_id: verdicts.load(store, run_id) for run_id in (a_run, b_run)}
    for evidence in runs.values():
        if not any(slot.cells for slot in evidence.slots):
            raise CompareError(f"run {evidence.run_name} has no stored cells yet; `lab ls {evidence.run_name}` "
                               "shows its boots")
    same_run = a_run == b_run
    a = Side(a_arm if same_run else f"{runs[a_run].run_name}:{a_arm}", a_arm, runs[a_run])
    b = Side(b_arm if same_run else f"{runs[b_run].run_name}:{b_arm}", b_arm, runs[b_run])
    if a.ref == b.ref:
        raise CompareError(f"both sides are {a.ref}; name two different arms")

    judged = {run_id: verdicts.judge(evidence) for run_id, evidence in runs.items()}
    spec = b.evidence.spec
    threshold = spec.rule.threshold_pct if spec.rule else keep.DEFAULT_THRESHOLD_PCT
    notes = a.left_out() + b.left_out()
    if not same_run:
        notes.append(f"{a.ref} and {b.ref} come from different runs: the comparison crosses windows"
                     + ("" if a.lone and b.lone else ", and each window's noise band is shown"))
    elif a.window != b.window:
        notes.append(f"{a.arm} and {b.arm} are in different windows ({a.window}, {b.window}): the comparison "
                     "crosses windows, and each window's noise band is shown")
    lone = [side.ref for side in (a, b) if side.lone]
    if lone:
        notes.append(f"{' and '.join(lone)} {'is a one-boot run' if len(lone) == 1 else 'are one-boot runs'}: "
                     f"{ONE_BOOT} (`lab calibrate` of the ladder measures the boot-to-boot noise)")
    verdicts_by_side = {side.ref: _verdict(side, judged[side.evidence.run_id]) for side in (a, b)}
    rows = _rows(a, b, threshold, _mdes(verdicts_by_side[b.ref], verdicts_by_side[a.ref]))
    if spec.rule is None:
        notes.append(f"the ladder of run {b.evidence.run_name} names no key metric: every metric both sides "
                     "measured is shown, and nothing is judged")
    return Comparison(a=a, b=b, threshold_pct=threshold, rows=rows, quality=_quality(store, a, b),
                      verdicts=verdicts_by_side, notes=notes)


def _verdict(side: Side, judged: dict[str, keep.Verdict]) -> dict[str, Any] | None:
    verdict = judged.get(side.arm)
    if verdict is None:
        return None
    control = side.evidence.control_of(side.window)
    return {"decision": str(verdict.decision), "against": control, "window": side.window,
            "reasons": list(verdict.reasons), "detail": verdict.to_dict()}


def _mdes(*stored: dict[str, Any] | None) -> dict[str, float]:
    """Metric label -> the minimum detectable effect its verdict states (B's verdict first, then A's)."""
    found: dict[str, float] = {}
    for verdict in stored:
        for row in (verdict or {}).get("detail", {}).get("metrics", []):
            interval = row.get("interval")
            if interval and interval.get("mde_pct") is not None:
                found.setdefault(row["name"], interval["mde_pct"])
    return found


def _rows(a: Side, b: Side, threshold: float, mdes: dict[str, float]) -> list[Row]:
    """Key metrics and gates of both ladders (B's first), or every shared metric without a rule."""
    wanted: dict[verdicts.Selector, verdicts.GateSpec | None] = {}
    for spec in (b.evidence.spec, a.evidence.spec):
        if spec.rule is None:
            continue
        for selector in spec.metrics:
            wanted.setdefault(selector, None)
        for gate in spec.gates:
            wanted.setdefault(gate.selector, gate)
    if not wanted:
        shared = _measured(a) & _measured(b) or _measured(a) | _measured(b)
        return [_row(a, b, selector, "metric", None, threshold, None)
                for selector in sorted(shared, key=lambda s: s.label)]
    return [_row(a, b, selector, "key" if gate is None else "gate", gate, threshold, mdes.get(selector.label))
            for selector, gate in wanted.items()]


def _measured(side: Side) -> set[verdicts.Selector]:
    return {verdicts.Selector.of(c) for slot in side.slots for c in slot.cells if c.valid and c.value is not None}


def _row(a: Side, b: Side, selector: verdicts.Selector, kind: str, gate: verdicts.GateSpec | None,
         threshold: float, mde: float | None) -> Row:
    higher = b.evidence.higher_is_better(selector)
    if higher is None:
        higher = a.evidence.higher_is_better(selector)
    rule = gate.bounds if gate else "" if higher is None else "higher is better" if higher else "lower is better"
    a_medians, a_pooled, a_unit = a.samples(selector)
    b_medians, b_pooled, b_unit = b.samples(selector)
    a_value = _mean(a_medians)
    b_value = _mean(b_medians)
    noise = {}
    for side in (a, b):
        label = side.window if a.evidence is b.evidence else f"{side.evidence.run_name}:{side.window}"
        noise.setdefault(label, _noise(side, selector))
    band, source = _band(threshold, noise, mde)
    delta, change, note = None, "", ""
    if a_value is None or b_value is None:
        missing = [f"{s.ref} ({s.why_missing(selector)})" for s, v in ((a, a_value), (b, b_value)) if v is None]
        note = f"no value from {' and '.join(missing)}"
    elif a_value == 0:
        note = "A is 0: a relative change is undefined"
    else:
        raw = relative_delta(b_value, a_value)
        # Adding 0.0 turns the -0.0 of an unchanged lower-is-better metric into 0.0.
        delta = (raw if higher is not False else -raw) + 0.0
        if abs(delta) <= band:
            change = "within noise"
        elif higher is None:
            change = "changed"
        else:
            change = "better" if delta > 0 else "worse"
    stats = None
    if delta is not None and (a.lone or b.lone):
        # Repeats within one boot say nothing of how far the next boot would move: no interval from them.
        stats = Statistics("none", f"n {len(a_medians)} vs {len(b_medians)} boots: {ONE_BOOT}",
                           "one boot a side: a difference, no interval" if len(a_medians) == len(b_medians) == 1
                           else "a one-boot run: no interval", len(a_medians), len(b_medians))
    elif delta is not None:
        stats = _statistics(a_pooled, b_pooled, higher, threshold, (len(a_medians), len(b_medians)))
    holds = None if gate is None else {side: None if value is None else gate.check(value, "").passed
                                       for side, value in (("a", a_value), ("b", b_value))}
    return Row(metric=selector.label, kind=kind, rule=rule, unit=b_unit or a_unit, higher_is_better=higher,
               a=a_value, b=b_value, delta_pct=delta, change=change, noise_band_pct=noise, statistics=stats, note=note,
               gate=holds, band_pct=band, band_source=source, mde_pct=mde)


def _band(threshold: float, drifts: dict[str, float | None], mde: float | None) -> tuple[float, str]:
    """The noise band a change must clear to be called better or worse, and what set it."""
    candidates = [(threshold, f"KEEP threshold {threshold:g} %")]
    candidates += [(drift, f"controls' drift in {window}") for window, drift in drifts.items() if drift is not None]
    if mde is not None:
        candidates.append((mde, "minimum detectable effect"))
    return max(candidates, key=lambda c: c[0])


def _noise(side: Side, selector: verdicts.Selector) -> float | None:
    """How far the window's two warm controls differ on this metric, in percent; None if they cannot say."""
    values = []
    for slot in side.evidence.controls(side.window):
        if slot is None or not slot.measured or slot.cold:
            return None
        found = side.evidence.select(slot, selector)
        if not found.values:
            return None
        values.append(median_of_repeats(found.values))
    try:
        return noise_band(*values) * 100
    except ValueError:  # controls averaging to 0
        return None


def _statistics(a: list[float], b: list[float], higher: bool | None, threshold: float,
                boots: tuple[int, int]) -> Statistics:
    """`a` and `b`: every repeat of each side's boots, pooled; `boots`: how many boots gave them."""
    n_a, n_b = len(a), len(b)
    sizes = f"n {n_a} vs {n_b}"
    if min(n_a, n_b) < MIN_INTERVAL_SAMPLES:
        what = "boots" if (n_a, n_b) == boots else "values"
        counts = f"{n_a} {what} a side" if n_a == n_b else f"{n_a} vs {n_b} {what}"
        return Statistics("none", f"{counts} give a difference, not an interval: {MIN_INTERVAL_SAMPLES} or more a "
                          "side, or a calibration (`lab calibrate`), give one",
                          f"{sizes}: no CI (needs {MIN_INTERVAL_SAMPLES} a side)", n_a, n_b)
    if min(a + b) <= 0:
        return Statistics("none", f"{sizes}, not all positive: no ratio interval", f"{sizes}: no CI", n_a, n_b)
    # The same sign as Δ %: better is positive.
    summary = ratio_summary(b, a, higher, CONFIDENCE, CI_SEED)
    low, high = summary.low_pct, summary.high_pct
    of = "of median B/A" + ("" if higher is None else ", better positive")
    shown = f"{CONFIDENCE * 100:g} % CI [{low:+.1f}, {high:+.1f}] %"
    text = f"{sizes}: {shown} {of} (percentile bootstrap)"
    if low > threshold or high < -threshold:
        positive = low > threshold
        finding = (f"B {'higher' if positive else 'lower'}" if higher is None
                   else "improvement" if positive else "regression")
        text += f": {finding} established (the whole CI is beyond ±{threshold:g} %)"
        short = f"{shown} bootstrap: established"
    else:
        text += f": not established beyond ±{threshold:g} %"
        short = f"{shown} bootstrap: not established"
    floor, test = summary.min_reachable_p, summary.test
    if floor >= ALPHA:
        text += f"; Mann-Whitney not used: {n_a} vs {n_b} cannot reach p < {ALPHA:g} (smallest p {floor:.2g})"
        return Statistics("bootstrap", text, short, n_a, n_b, low, high, summary.interval.method)
    text += f"; Mann-Whitney p={test.p:.2g} ({test.method})"
    return Statistics("bootstrap + mann-whitney", text, f"{short}; MW p={test.p:.2g}", n_a, n_b, low, high,
                      summary.interval.method, test.p, test.method)


def _quality(store: Store, a: Side, b: Side) -> Quality:
    return Quality(qeval=_qeval(store, a, b), agreement=_agreement(a, b))


def _qeval(store: Store, a: Side, b: Side) -> dict[str, Any] | None:
    """Task by task, A as the reference: broke = passed on A, failed on B; exact McNemar p."""
    a_slot, a_items = _qeval_items(store, a)
    b_slot, b_items = _qeval_items(store, b)
    if a_slot is None and b_slot is None:
        return None
    if a_slot is None or b_slot is None:
        return {"note": f"qeval ran on only one side ({(a_slot or b_slot).label})"}
    counts = paired_counts(a_items, b_items)
    return {"a_boot": a_slot.label, "b_boot": b_slot.label, "n": counts.n, "both_pass": counts.both_pass,
            "both_fail": counts.both_fail, "broke": counts.broke, "fixed": counts.fixed,
            "mcnemar_p": counts.p_value, "a_passed": sum(a_items.values()), "b_passed": sum(b_items.values()),
            "broke_tasks": sorted(t for t in a_items.keys() & b_items.keys() if a_items[t] and not b_items[t]),
            "fixed_tasks": sorted(t for t in a_items.keys() & b_items.keys() if b_items[t] and not a_items[t]),
            "one_side_only": list(counts.missing)}


def _qeval_items(store: Store, side: Side) -> tuple[verdicts.SlotCells | None, dict[str, bool]]:
    """The first warm finished boot of the side with qeval items (a control's opening one first)."""
    for slot in side.slots:
        passes = reader.qeval_passes(store, slot.id)
        if passes:
            return slot, passes
    return None, {}


def _agreement(a: Side, b: Side) -> list[dict[str, Any]]:
    """The agreement instrument's summary figures on each side (not its per-prompt cells), each measured
    against its own window's control."""
    selectors = {sel for sel in _measured(a) | _measured(b) if sel.instrument == "agreement" and not sel.where}
    rows = []
    for selector in sorted(selectors, key=lambda sel: sel.label):
        a_medians, _, a_unit = a.samples(selector)
        b_medians, _, b_unit = b.samples(selector)
        rows.append({"metric": selector.label, "unit": b_unit or a_unit, "a": _mean(a_medians),
                     "b": _mean(b_medians)})
    return rows


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such a figure is reported as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def print_comparison(console: Console, c: Comparison) -> None:
    """The table, then quality, then the verdicts with their reasons."""
    runs = c.a.evidence.run_name
    if c.a.evidence is not c.b.evidence:
        runs += f" → {c.b.evidence.run_name}"
    console.print(f"[bold]{escape(c.a.ref)}[/] (A, {c.a.role}, window {c.a.window}) → [bold]{escape(c.b.ref)}[/] "
                  f"(B, {c.b.role}, window {c.b.window}) · run {escape(runs)} · KEEP threshold "
                  f"{c.threshold_pct:g} %", highlight=False)
    table = Table(title_justify="left")
    table.add_column("metric", overflow="fold")
    table.add_column("rule", overflow="fold")
    # Figures are never wrapped or cut: their columns keep their full width (see _wide).
    for name in ("A", "B"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("Δ % (better +)", overflow="fold")
    table.add_column("noise band (controls' drift · MDE)", overflow="fold")
    table.add_column("statistics", overflow="fold")
    for row in c.rows:
        delta = "–" if row.delta_pct is None else f"{_delta(row)} {row.change}"
        if row.change == "within noise":
            delta += f" ±{_pct(row.band_pct, row.band_pct)} %"
        style = {"better": "green", "worse": "red"}.get(row.change)
        noise = ", ".join(f"{w} {'–' if v is None else f'{_pct(v, c.threshold_pct)} %'}"
                          for w, v in row.noise_band_pct.items())
        noise += " · MDE " + ("unknown" if row.mde_pct is None else f"±{_pct(row.mde_pct, c.threshold_pct)} %")
        stats = row.statistics.short if row.statistics else row.note
        unit = f" ({row.unit})" if row.unit else ""
        rule = f"{row.kind}: {row.rule}" if row.rule else row.kind
        if row.gate is not None:
            rule += " (" + ", ".join(f"{side.upper()} {_holds(ok)}" for side, ok in row.gate.items()) + ")"
        table.add_row(escape(row.metric + unit), rule,
                      _num(row.a), _num(row.b), f"[{style}]{delta}[/]" if style else delta, noise, escape(stats))
    _wide(console, table).print(table)
    for row in c.rows:
        if row.change == "within noise" and row.delta_pct is not None:
            console.print(f"{escape(row.metric)}: {_delta(row)} % is within the noise band "
                          f"±{_pct(row.band_pct, row.band_pct)} % ({row.band_source})", highlight=False)
        if row.statistics is not None:
            console.print(f"{escape(row.metric)}: {escape(row.statistics.text)}", highlight=False)
    qeval = c.quality.qeval
    if qeval is not None:
        if "note" in qeval:
            console.print(f"qeval: {qeval['note']}")
        else:
            table = Table(f"qeval, {qeval['n']} tasks paired", f"B {escape(qeval['b_boot'])} passed",
                          "B failed", title_justify="left")
            table.add_row(f"A {escape(qeval['a_boot'])} passed", str(qeval["both_pass"]),
                          f"[red]{qeval['broke']} broke[/]")
            table.add_row("A failed", f"[green]{qeval['fixed']} fixed[/]", str(qeval["both_fail"]))
            console.print(table)
            console.print(f"exact McNemar p={qeval['mcnemar_p']:.3g} (broke vs fixed)", highlight=False)
            for label in ("broke", "fixed"):
                if qeval[f"{label}_tasks"]:
                    console.print(f"  {label}: {', '.join(qeval[f'{label}_tasks'])}", highlight=False)
    if c.quality.agreement:
        table = Table("agreement (each against its window's control)", "unit", "A", "B", title_justify="left")
        for row in c.quality.agreement:
            table.add_row(escape(row["metric"]), row["unit"], _num(row["a"]), _num(row["b"]))
        console.print(table)
    for side in (c.a, c.b):
        verdict = c.verdicts[side.ref]
        if verdict is None:
            why = ("a one-boot run: no control to compare it with" if side.lone
                   else "a control: the reference of its window" if side.role == "control" else "no key metric")
            console.print(f"KEEP {escape(side.ref)}: not judged ({why})", highlight=False)
            continue
        colour = {"keep": "green", "reject": "red"}.get(verdict["decision"], "yellow")
        console.print(f"KEEP {escape(side.ref)}: [bold {colour}]{verdict['decision']}[/] against "
                      f"{verdict['against']} (window {verdict['window']})", highlight=False)
        for reason in verdict["reasons"]:
            console.print(f"  · {escape(reason)}", highlight=False)
    for note in c.notes:
        console.print(f"note: {escape(note)}", style="dim", highlight=False)


def _wide(console: Console, table: Table) -> Console:
    """`console`, or one as wide as the table needs when it is narrower: rich would otherwise shrink
    the figure columns and cut their digits ("107…"), which a piped `lab compare` then keeps."""
    needed = Measurement.get(console, console.options.update(max_width=10_000), table).minimum
    if needed <= console.width:
        return console
    colours = console.color_system  # the name rich resolved ("truecolor", ...) or None when it writes none
    return Console(file=console.file, width=needed, force_terminal=console.is_terminal,
                   color_system=colours, no_color=console.no_color, highlight=False)  # type: ignore[arg-type]


def _delta(row: Row) -> str:
    assert row.delta_pct is not None
    return _pct(row.delta_pct, row.band_pct, signed=True)


def _pct(value: float, edge: float, signed: bool = False) -> str:
    """A percentage with the precision the rule needs: one decimal, or more where one decimal would
    print a value on the wrong side of (or exactly at) the edge it is compared with."""
    return keep.pct_text(value, edge, signed=signed)


def _holds(ok: bool | None) -> str:
    return "–" if ok is None else "[green]holds[/]" if ok else "[red]fails[/]"


def _num(value: float | None) -> str:
    return "–" if value is None else keep.figure_text(value)

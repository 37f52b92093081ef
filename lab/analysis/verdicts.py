"""A run's KEEP verdicts, judged from its stored cells exactly as its ladder's `keep:` section states.

Each planned boot (a slot) becomes one `lab.analysis.keep.BootValues`: every cell it stored, whichever boot
attempt wrote it (a resumed slot stores each step once). Only slots whose boot finished count:
a failed, refused, died, interrupted or not-yet-booted slot contributes no values, so any key
metric it should have provided is missing and the arm is inconclusive, with the slot's status in
the reason. A slot is cold when a boot that stored its cells was cold; `lab.analysis.keep.judge` leaves it
out and says so. Invalid cells (a prefill served from cache, say) are never a figure.

A key metric or gate names `instrument.metric` and optionally `where` params; the cells it
selects must share one set of params (their repeats are the boot's values). Cells of several
params sets are ambiguous: the figure is missing and the reason asks for a narrower `where`.

Judging is `judge`, a pure function of a run's evidence (`load`: its stored cells and the newest
calibration of its ladder on the host it booted on); this module never writes. `lab run` stores each
window's verdicts when the window closes (`lab.runner.run.store_verdicts`, table `verdict`): the
run's record of what it decided, for exports, notebooks and SQL. Every other command that shows or
acts on a verdict (`lab report`, `lab compare`, `lab serve --best`, a tune study's confirmation)
judges again in memory and writes nothing, never reading the stored verdict: judging is
deterministic on the evidence, so it gives the stored verdict while nothing changed and the current
one after the evidence did (a newer `lab calibrate` of the ladder, a resumed window), and a store
on a read-only path, a read-only database user or a notebook gets the same answer.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lab.analysis import keep
from lab.analysis.stats import median_of_repeats
from lab.instruments import REGISTRY
from lab.ladder.ladder import Ladder
from lab.ladder.validate import parse_ladder
from lab.store import reader
from lab.store.db import Store

# A failed boot's reason can be a log line; the verdict needs only its gist.
_REASON_CHARS = 100
# Units that read worse than the bare number in a sentence ("passed: 1 bool").
_UNITLESS = ("", "bool", "fraction")


@dataclass(frozen=True)
class Selector:
    """Which cells a key metric or gate reads: `instrument.metric` with params equal to `where`."""

    instrument: str
    metric: str
    where: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        text = f"{self.instrument}.{self.metric}"
        if self.where:
            text += "[" + ",".join(f"{k}={v}" for k, v in self.where) + "]"
        return text

    @classmethod
    def of(cls, cell: StoredCell) -> Selector:
        """The selector of exactly this cell's instrument, metric and params."""
        return cls(cell.instrument, cell.metric, tuple(sorted((k, _frozen(v)) for k, v in cell.params.items())))

    def matches(self, cell: StoredCell) -> bool:
        return (cell.instrument == self.instrument and cell.metric == self.metric
                and all(k in cell.params and _frozen(cell.params[k]) == v for k, v in self.where))


def _frozen(value: Any) -> Any:
    """A params value as something hashable: lists and mappings from JSON become tuples."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


@dataclass(frozen=True)
class GateSpec:
    selector: Selector
    min: float | None
    max: float | None
    arms: frozenset[str] = frozenset()  # empty: every arm

    def judges(self, arm: str) -> bool:
        return not self.arms or arm in self.arms

    @property
    def bounds(self) -> str:
        """"≥ 1", "≤ 0.05", "≥ 0 and ≤ 2"."""
        parts = []
        if self.min is not None:
            parts.append(f"≥ {self.min:g}")
        if self.max is not None:
            parts.append(f"≤ {self.max:g}")
        return " and ".join(parts)

    @property
    def label(self) -> str:
        return f"{self.selector.label} {self.bounds}"

    def check(self, value: float, unit: str) -> keep.GateResult:
        shown = f"{value:.4g}" + ("" if unit in _UNITLESS else f" {unit}")
        if self.min is not None and not value >= self.min:
            return keep.GateResult(False, f"{shown} is below the minimum {self.min:g}")
        if self.max is not None and not value <= self.max:
            return keep.GateResult(False, f"{shown} is above the maximum {self.max:g}")
        return keep.GateResult(True, shown)


@dataclass(frozen=True)
class RuleSpec:
    """The ladder's KEEP section resolved: the rule for `lab.analysis.keep` plus what each name selects.

    `rule` is None when the ladder names no key metric: such a run is measured, never judged.
    """

    rule: keep.KeepRule | None
    metrics: tuple[Selector, ...]
    gates: tuple[GateSpec, ...]


def metric_directions(ladder: Ladder) -> dict[str, dict[str, str]]:
    """instrument -> metric -> "higher" | "lower", as the ladder's instruments declare them."""
    return {name: dict(REGISTRY[name]().metrics(params)) for name, params in ladder.instruments.sections()}


def rule_spec(ladder: Ladder) -> RuleSpec:
    """Directions come from the instruments' declared metrics, as the ladder validator checked."""
    directions = metric_directions(ladder)
    selectors, key_metrics = [], []
    for ref in ladder.keep.metric_refs():
        selector = _selector(ref.metric, ref.where)
        selectors.append(selector)
        key_metrics.append(keep.KeyMetric(selector.label,
                                          directions[selector.instrument][selector.metric] == "higher"))
    gates = tuple(GateSpec(_selector(g.metric, g.where), g.min, g.max, frozenset(g.arms)) for g in ladder.keep.gates)
    rule = keep.KeepRule(ladder.keep.threshold_pct, key_metrics, [g.label for g in gates],
                         ladder.keep.max_drift_pct) if key_metrics else None
    return RuleSpec(rule, tuple(selectors), gates)


def _selector(metric: str, where: dict[str, Any]) -> Selector:
    instrument, _, name = metric.partition(".")
    return Selector(instrument, name, tuple(sorted(where.items())))


@dataclass(frozen=True)
class StoredCell:
    instrument: str
    metric: str
    params: dict[str, Any]
    repeat: int
    value: float | None
    unit: str
    valid: bool
    boot_id: int
    note: str = ""  # why an invalid cell is invalid


@dataclass(frozen=True)
class SlotCells:
    """One planned boot of the run and everything it stored."""

    id: int
    idx: int
    arm: str
    role: str  # warmup | control | arm
    position: str  # warmup | open | arm | close
    window: str | None
    status: str  # pending | done | failed (the slot's)
    boot_statuses: tuple[str, ...]
    reason: str | None  # why its last boot did not finish
    cold: bool
    cells: tuple[StoredCell, ...]

    @property
    def label(self) -> str:
        base = f"{self.arm}/{self.position}" if self.role == "control" else self.arm
        if len(self.boot_statuses) > 1:
            base += f" ({len(self.boot_statuses)} boots)"
        if self.status == "done":
            return base
        if not self.boot_statuses:
            return f"{base} [not booted]"
        reason = f": {self.reason}" if self.reason else ""
        return f"{base} [{self.boot_statuses[-1]}{reason}]"

    @property
    def measured(self) -> bool:
        """Whether its figures may be used: the boot finished."""
        return self.status == "done"


@dataclass(frozen=True)
class Selected:
    """What a selector finds in one slot: the usable repeats, and why anything was left out."""

    values: tuple[float, ...]
    unit: str
    notes: tuple[str, ...] = ()


@dataclass
class RunEvidence:
    """A run's ladder, rule and stored slots: everything a verdict or a comparison reads."""

    run_id: int
    run_name: str
    ladder: Ladder
    spec: RuleSpec
    slots: list[SlotCells]
    arm_roles: dict[str, tuple[str, str]]  # arm -> (role, window), in ladder order
    directions: dict[str, dict[str, str]]  # metric_directions(ladder)
    noise: dict[str, keep.Noise] = field(default_factory=dict)  # key metric label -> calibrated noise

    def higher_is_better(self, selector: Selector) -> bool | None:
        """None for a metric no instrument of this ladder declares."""
        direction = self.directions.get(selector.instrument, {}).get(selector.metric)
        return None if direction is None else direction == "higher"

    def arms(self, role: str | None = None) -> list[str]:
        return [name for name, (r, _) in self.arm_roles.items() if role is None or r == role]

    def role(self, arm: str) -> str:
        return self.arm_roles[arm][0]

    def window(self, arm: str) -> str:
        return self.arm_roles[arm][1]

    def arm_slots(self, arm: str) -> list[SlotCells]:
        """The measured (non-warm-up) slots of an arm; a control has its opening and closing one."""
        return [s for s in self.slots if s.arm == arm and s.role != "warmup"]

    def controls(self, window: str) -> tuple[SlotCells | None, SlotCells | None]:
        """The opening and closing control slots of a window."""
        def at(position: str) -> SlotCells | None:
            return next((s for s in self.slots if s.window == window and s.role == "control"
                         and s.position == position), None)
        return at("open"), at("close")

    def between_controls(self, window: str) -> list[SlotCells]:
        """The control slots booted between a window's arm repeats (`repeats:` above 1)."""
        return [s for s in self.slots if s.window == window and s.role == "control" and s.position == "between"]

    def control_of(self, window: str) -> str:
        return next(name for name, (role, w) in self.arm_roles.items() if role == "control" and w == window)

    def select(self, slot: SlotCells, selector: Selector) -> Selected:
        if not slot.measured:
            return Selected((), "")
        matching = [c for c in slot.cells if selector.matches(c)]
        usable = [c for c in matching if c.valid and c.value is not None]
        notes = []
        if len(usable) < len(matching):
            why = Counter(c.note for c in matching if not (c.valid and c.value is not None) and c.note)
            notes.append(f"{selector.label}: {len(matching) - len(usable)} invalid cell(s) from {slot.label} "
                         "left out" + (f" ({why.most_common(1)[0][0]})" if why else ""))
        params_sets = {json.dumps(c.params, sort_keys=True, default=str) for c in usable}
        if len(params_sets) > 1:
            shown = "; ".join(sorted(params_sets))
            notes.append(f"{selector.label} selects cells of {len(params_sets)} different params in {slot.label} "
                         f"({shown}): narrow it with `where` in the ladder's keep section")
            return Selected((), usable[0].unit, tuple(notes))
        usable.sort(key=lambda c: c.repeat)
        return Selected(tuple(c.value for c in usable), usable[0].unit if usable else "", tuple(notes))

    def boot_values(self, slot: SlotCells, selectors: Iterable[Selector]) -> tuple[keep.BootValues, list[str]]:
        values, notes = {}, []
        for selector in selectors:
            found = self.select(slot, selector)
            notes += found.notes
            if found.values:
                values[selector.label] = found.values
        return keep.BootValues(slot.label, values, cold=slot.cold, at=float(slot.idx)), notes

    def evidence(self, arm: str) -> tuple[keep.ArmEvidence, list[str]]:
        """The arm's boots, its window's controls and its gate results, with notes for the reasons."""
        keys = self.spec.metrics
        notes: list[str] = []
        arm_boots = []
        repeated = len(self.arm_slots(arm)) > 1
        for slot in self.arm_slots(arm):
            boot, found = self.boot_values(slot, keys)
            # Repeats of one arm share its name: the slot number tells their boots apart.
            arm_boots.append(replace(boot, label=f"{boot.label} #{slot.idx}") if repeated else boot)
            notes += found
        controls = []
        for slot in self.controls(self.window(arm)):
            if slot is None:
                controls.append(None)
                continue
            boot, found = self.boot_values(slot, keys)
            controls.append(boot)
            notes += found
        between = []
        for slot in self.between_controls(self.window(arm)):
            boot, found = self.boot_values(slot, keys)
            between.append(replace(boot, label=f"{boot.label} #{slot.idx}"))
            notes += found
        gates = {}
        warm = [s for s in self.arm_slots(arm) if s.measured and not s.cold]
        for gate in self.spec.gates:
            if not gate.judges(arm):
                continue
            result, found = self._gate(gate, warm)
            gates[gate.label] = result
            notes += found
        return (keep.ArmEvidence(arm_boots, controls[0], controls[1], gates, between_controls=between,
                                 noise=self.noise),
                list(dict.fromkeys(notes)))

    def _gate(self, gate: GateSpec, slots: Sequence[SlotCells]) -> tuple[keep.GateResult | None, list[str]]:
        """A gate holds when every warm boot of the arm satisfies it; no value from one is no result."""
        if not slots:
            return None, []
        details, notes = [], []
        for slot in slots:
            found = self.select(slot, gate.selector)
            notes += [n for n in found.notes if n not in notes]
            if not found.values:
                return None, notes + [f"gate {gate.label}: no value from {slot.label}"]
            value = median_of_repeats(found.values)
            result = gate.check(value, found.unit)
            if not result.passed:
                return keep.GateResult(False, result.detail + (f" ({slot.label})" if len(slots) > 1 else "")), notes
            details.append(result.detail)
        return keep.GateResult(True, ", ".join(details)), notes


def key_figure_missing(store: Store, run_id: int) -> str | None:
    """Why no measured boot of the run stored a valid cell of any key metric (with the commonest
    reason its cells of them are invalid), or None when one did or the ladder names no key metric."""
    evidence = load(store, run_id)
    if not evidence.spec.metrics:
        return None
    measured = [slot for slot in evidence.slots if slot.role != "warmup"]
    keys = [c for slot in measured for c in slot.cells if any(sel.matches(c) for sel in evidence.spec.metrics)]
    if any(c.valid and c.value is not None for c in keys):
        return None
    notes = Counter(c.note for c in keys if c.note)
    labels = ", ".join(sel.label for sel in evidence.spec.metrics)
    if notes:
        return f"every key-metric cell ({labels}) is invalid; commonest reason: {notes.most_common(1)[0][0]}"
    finished = sum(slot.status == "done" for slot in measured)
    return f"no measured boot stored a cell of a key metric ({labels}); {finished} of {len(measured)} finished"


def load(store: Store, run_id: int) -> RunEvidence:
    """Read a run's ladder, arms, slots, boots and cells."""
    rows = reader.run_rows(store, run_id)
    run = rows.run
    ladder = parse_ladder(run.ladder_text, f"{run.name} (stored ladder)")
    by_slot: dict[int, list[StoredCell]] = {}
    for c in rows.cells:
        by_slot.setdefault(c.slot_id, []).append(StoredCell(c.instrument, c.metric, dict(c.params), c.repeat,
                                                            c.value, c.unit, c.valid, c.boot_id,
                                                            c.note or ""))
    stored = []
    for slot in rows.slots:
        slot_cells = tuple(by_slot.get(slot.id, ()))
        producing = {c.boot_id for c in slot_cells}
        last = slot.boots[-1] if slot.boots else None
        reason = None
        if last is not None and last.reason:
            reason = last.reason.strip().splitlines()[0][:_REASON_CHARS]
        stored.append(SlotCells(
            id=slot.id, idx=slot.idx, arm=slot.arm, role=slot.role, position=slot.position,
            window=slot.window, status=slot.status, boot_statuses=tuple(b.status for b in slot.boots),
            reason=reason, cold=any(b.cold for b in slot.boots if b.id in producing), cells=slot_cells))
    return RunEvidence(run_id, run.name, ladder, rule_spec(ladder), stored,
                       {a.name: (a.role, a.window) for a in rows.arms}, metric_directions(ladder),
                       _noise(store, run.ladder_name, run_id))


def _noise(store: Store, ladder_name: str, run_id: int) -> dict[str, keep.Noise]:
    """The newest `lab calibrate` noise model of this ladder on the host the run booted on."""
    host = reader.boot_host(store, run_id)
    if host is None:
        return {}
    return {row.metric: keep.Noise(row.sd_log, row.df, f"calibration run {row.run_id} ({row.boots} control boots)")
            for row in reader.latest_noise(store, ladder_name, host) if row.run_id != run_id}


def judge_arm(evidence: RunEvidence, rule: keep.KeepRule, arm: str) -> keep.Verdict:
    """`lab.analysis.keep.judge` on the arm's stored evidence; notes on left-out cells follow its reasons."""
    arm_evidence, notes = evidence.evidence(arm)
    # A gate scoped to other arms is not part of this arm's rule.
    rule = replace(rule, gates=[g.label for g in evidence.spec.gates if g.judges(arm)])
    verdict = keep.judge(rule, arm_evidence)
    return replace(verdict, reasons=verdict.reasons + [n for n in notes if n not in verdict.reasons])


def judge(evidence: RunEvidence, window: str | None = None) -> dict[str, keep.Verdict]:
    """The KEEP verdict of every arm of the run (or of one window), in ladder order; nothing is written.

    A ladder without key metrics has nothing to judge, and a `compare_only` ladder is measured to be
    compared, not to choose: no verdicts.
    """
    rule = evidence.spec.rule
    if rule is None or evidence.ladder.compare_only:
        return {}
    return {arm: judge_arm(evidence, rule, arm) for arm in evidence.arms("arm")
            if window is None or evidence.window(arm) == window}


def detail(evidence: RunEvidence, arm: str, verdict: keep.Verdict) -> dict[str, Any]:
    """A verdict as the store keeps it and the report tabulates it: `keep.Verdict.to_dict()` with the
    window, its control and the boots it was judged on."""
    window = evidence.window(arm)
    opening, closing = evidence.controls(window)
    return {**verdict.to_dict(), "window": window, "control": evidence.control_of(window),
            "boots": {"arm": [s.label for s in evidence.arm_slots(arm)],
                      "opening_control": opening.label if opening else None,
                      "closing_control": closing.label if closing else None}}

"""One tune trial = one measured boot, stored as a run of its own: the base engine with the trial's
values, measured by the tune file's instruments through the same slot runner as `lab run`.

The trial's ladder is rendered into ordinary ladder text (stored with the run, so `lab ls`,
`lab report` and `lab export` read a trial like any run) with one window whose control is the
trial's configuration; only its opening slot is planned, because a trial is a single boot. A boot
that came up cold is booted again once, as the window's closing control. The warm-up before a
process's first trial is a run of its own too (`<study>-tNNN-warmup`, the base configuration's
warm-up slot alone).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.analysis import verdicts
from lab.analysis.stats import median_of_repeats
from lab.instruments import REGISTRY
from lab.ladder import render
from lab.ladder.ladder import Ladder
from lab.ladder.validate import parse_ladder
from lab.runner import fingerprint
from lab.runner.slot import RunContext, run_slot
from lab.store import reader, writer
from lab.store.db import Store
from lab.store.rows import BootRecord, RunRecord
from lab.tune import ladders
from lab.tune.constraints import violation
from lab.tune.spec import TuneFile

log = logging.getLogger("lab.tune")


@dataclass(frozen=True)
class Measured:
    run: RunRecord
    boot_id: int | None
    values: list[float] | None  # one per objective; None when the boot failed or a value is missing
    constraints: list[float]  # one per constraint: how far it is violated (<= 0: satisfied)
    constraint_values: list[float | None]  # one per constraint: the measured figure
    reason: str | None  # why there are no values
    cold: str | None = None  # why the measured boot is cold, when booting again left it cold too
    rebooted: str | None = None  # why the first boot was cold, when the trial was booted again
    booted: bool = False  # an engine answered (on this host: the next boot is not its first)


def run_trial(store: Store, tune: TuneFile, data: dict[str, Any], study: str, number: int, params: dict[str, Any],
              tune_path: str | Path, runs_dir: str | Path) -> tuple[RunRecord, Ladder, render.Plan]:
    """Store the trial's one-boot run (not yet booted); a config the engine refuses raises LadderError."""
    flags, env = ladders.changes(tune.space, params)
    control = f"t{number:03d}"
    text = f"# trial {number} of study {study}\n" + ladders.ladder_text(tune, data, control, flags, env)
    return _create(store, tune, text, f"{tune_path} (trial {number})", f"{study}-t{number:03d}",
                   f"{tune.name}-trials", tune_path, runs_dir)


def warmup_run(store: Store, tune: TuneFile, data: dict[str, Any], study: str, number: int, tune_path: str | Path,
               runs_dir: str | Path) -> tuple[RunRecord, Ladder, render.Plan]:
    """Store the run of the base configuration's warm-up boot (unmeasured) before trial `number`."""
    text = (f"# warm-up before trial {number} of study {study}\n"
            + ladders.ladder_text(tune, data, ladders.CONTROL, {}, {}, warmup=True))
    return _create(store, tune, text, f"{tune_path} (warm-up)", f"{study}-t{number:03d}-warmup", f"{tune.name}-warmup",
                   tune_path, runs_dir)


def _create(store: Store, tune: TuneFile, text: str, label: str, name: str, ladder_name: str, tune_path: str | Path,
            runs_dir: str | Path) -> tuple[RunRecord, Ladder, render.Plan]:
    ladder = parse_ladder(text, label)
    full = render.plan(ladder)
    plan = render.Plan(full.arms, full.slots[:1])  # one boot: the trial's control opening, or the warm-up
    logs_dir = (Path(runs_dir) / name).resolve()
    run_id = writer.create_run(store, name=name, ladder_name=ladder_name,
                               ladder_path=str(Path(tune_path).resolve()), ladder_text=text,
                               sha256=hashlib.sha256(text.encode()).hexdigest(), engine_kind=ladder.engine.kind,
                               logs_dir=str(logs_dir), plan=plan)
    return reader.find_run(store, str(run_id)), ladder, plan


def boot_once(store: Store, run: RunRecord, ladder: Ladder, plan: render.Plan, engine_warmed: bool,
              status: Any = None) -> tuple[str, str | None]:
    """Boot the run's one slot (a warm-up: nothing measured); (outcome, reason when not done)."""
    rc = _context(store, run, ladder, plan, engine_warmed, status)
    writer.set_run_status(store, run.id, "running")
    [slot] = reader.slots(store, run.id)
    outcome = run_slot(rc, slot)
    writer.set_run_status(store, run.id, "done")
    [slot] = reader.slots(store, run.id)
    last = slot.boots[-1] if slot.boots else None
    return outcome, None if outcome == "done" else (last.reason if last else "never started")


def boot(store: Store, tune: TuneFile, run: RunRecord, ladder: Ladder, plan: render.Plan, engine_warmed: bool,
         status: Any = None) -> Measured:
    """Boot and measure the trial, then read its objectives and constraints. A boot that came up
    cold (it built a cache every later boot reuses, so its figures include that work) is booted
    once more in a slot of its own, and the trial takes that boot's figures; if it is cold again,
    the trial says so (`Measured.cold`)."""
    rc = _context(store, run, ladder, plan, engine_warmed, status)
    writer.set_run_status(store, run.id, "running")
    [slot] = reader.slots(store, run.id)
    outcome = run_slot(rc, slot)
    last = _last_boot(store, run.id)
    rebooted = None
    if outcome == "done" and last is not None and last.cold:
        rebooted = last.reason or "cold"
        log.info("%s booted cold (%s): booting it again", run.name, rebooted)
        first = plan.slots[0]  # the same configuration again, as the window's closing control
        again = render.SlotSpec(first.idx + 1, first.arm, "control", "close", first.window)
        writer.add_slot(store, run.id, again)
        rc.engine_warmed = True
        outcome = run_slot(rc, reader.slots(store, run.id)[-1])
        last = _last_boot(store, run.id)
    writer.set_run_status(store, run.id, "done")
    booted = any(b.ready_at is not None for s in reader.slots(store, run.id) for b in s.boots)
    boot_id = last.id if last else None
    if outcome != "done":
        tail = (last.log_tail or "").strip().splitlines()[-5:] if last else []
        reason = f"boot {outcome}: {last.reason if last else 'never started'}"
        return Measured(run, boot_id, None, [], [], reason + ("; log tail: " + " | ".join(tail) if tail else ""),
                        rebooted=rebooted, booted=booted)
    evidence = verdicts.load(store, run.id)
    [measured] = [s for s in evidence.slots if s.id == last.slot_id]
    values, missing = [], []
    for objective in tune.objectives:
        value = _value(evidence, measured, objective.metric, objective.where)
        if value is None:
            missing.append(objective.metric)
        values.append(value)
    constraints, figures = [], []
    for gate in tune.constraints:
        value = _value(evidence, measured, gate.metric, gate.where)
        figures.append(value)
        if value is None:
            missing.append(gate.metric)
            constraints.append(1.0)
        else:
            constraints.append(violation(gate, value))
    cold = (last.reason or "cold") if last.cold else None
    if missing:
        return Measured(run, boot_id, None, constraints, figures, f"no valid value for {', '.join(missing)} "
                                                                  f"(`lab ls {run.name}` shows the boot)",
                        cold, rebooted, booted)
    return Measured(run, boot_id, values, constraints, figures, None, cold, rebooted, booted)


def _context(store: Store, run: RunRecord, ladder: Ladder, plan: render.Plan, engine_warmed: bool,
             status: Any) -> RunContext:
    rc = RunContext(store=store, run_id=run.id, run_name=run.name, logs_dir=Path(run.logs_dir), ladder=ladder,
                    plan=plan, fingerprint=fingerprint.collect(),
                    instruments={name: REGISTRY[name]() for name, _ in ladder.instruments.sections()},
                    engine_warmed=engine_warmed)
    if status is not None:
        rc.status = status
    return rc


def _last_boot(store: Store, run_id: int) -> BootRecord | None:
    boots = [b for slot in reader.slots(store, run_id) for b in slot.boots]
    return boots[-1] if boots else None


def _value(evidence: verdicts.RunEvidence, slot: verdicts.SlotCells, metric: str, where: dict[str, Any]) -> float | None:
    instrument, _, name = metric.partition(".")
    found = evidence.select(slot, verdicts.Selector(instrument, name, tuple(sorted(where.items()))))
    return median_of_repeats(found.values) if found.values else None

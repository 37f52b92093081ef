"""One tune trial = one boot, stored as a run of its own: the base engine with the trial's values,
measured by the tune file's instruments through the same slot runner as `lab run`.

The trial's ladder is rendered into ordinary ladder text (stored with the run, so `lab ls`,
`lab report` and `lab export` read a trial like any run) with one window whose control is the
trial's configuration; only its opening slot is planned, because a trial is a single boot.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

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
from lab.store.rows import RunRecord
from lab.tune.spec import Param, TuneFile

log = logging.getLogger("lab.tune")


@dataclass(frozen=True)
class Measured:
    run: RunRecord
    boot_id: int | None
    values: list[float] | None  # one per objective; None when the boot failed or a value is missing
    constraints: list[float]  # one per constraint: <= 0 satisfied
    reason: str | None  # why there are no values


def changes(space: list[Param], params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Optuna's params (`flag:NAME`, `env:NAME`) as ladder flags and env."""
    flags = {p.flag: params[p.name] for p in space if p.flag and p.name in params}
    env = {p.env: params[p.name] for p in space if p.env and p.name in params}
    return flags, env


def ladder_text(tune: TuneFile, data: dict[str, Any], control: str, flags: dict[str, Any], env: dict[str, Any],
                arms: list[dict[str, Any]] | None = None, repeats: int = 1, name: str | None = None,
                warmup: bool = False) -> str:
    """A ladder of the tune file's engine (its flags and env updated), instruments and rule."""
    engine = dict(data["engine"])
    engine["flags"] = {**(engine.get("flags") or {}), **flags}
    engine["env"] = {**(engine.get("env") or {}), **env}
    keep = {"threshold_pct": tune.confirm.threshold_pct,
            "metrics": [{"metric": o.metric, "where": dict(o.where)} for o in tune.objectives],
            "gates": [g.model_dump(exclude_defaults=True) for g in tune.constraints] if arms else []}
    window: dict[str, Any] = {"name": "W", "control": control}
    if arms:
        window["arms"] = arms
    ladder = {"name": name or tune.name, "engine": engine, "windows": [window], "repeats": repeats,
              "instruments": data.get("instruments") or {}, "keep": keep,
              "hygiene": {**(data.get("hygiene") or {}), "warmup_boot": warmup}}
    return yaml.safe_dump(ladder, sort_keys=False)


def run_trial(store: Store, tune: TuneFile, data: dict[str, Any], study: str, number: int, params: dict[str, Any],
              tune_path: str | Path, runs_dir: str | Path) -> tuple[RunRecord, Ladder, render.Plan]:
    """Store the trial's one-boot run (not yet booted); a config the engine refuses raises LadderError."""
    flags, env = changes(tune.space, params)
    control = f"t{number:03d}"
    text = f"# trial {number} of study {study}\n" + ladder_text(tune, data, control, flags, env)
    ladder = parse_ladder(text, f"{tune_path} (trial {number})")
    full = render.plan(ladder)
    plan = render.Plan(full.arms, full.slots[:1])  # a trial is its control's opening boot alone
    name = f"{study}-t{number:03d}"
    logs_dir = (Path(runs_dir) / name).resolve()
    run_id = writer.create_run(store, name=name, ladder_name=f"{tune.name}-trials",
                               ladder_path=str(Path(tune_path).resolve()), ladder_text=text,
                               sha256=hashlib.sha256(text.encode()).hexdigest(), engine_kind=ladder.engine.kind,
                               logs_dir=str(logs_dir), plan=plan)
    return reader.find_run(store, str(run_id)), ladder, plan


def boot(store: Store, tune: TuneFile, run: RunRecord, ladder: Ladder, plan: render.Plan,
         status: Any = None) -> Measured:
    """Boot and measure the trial's one slot, then read its objectives and constraints."""
    rc = RunContext(store=store, run_id=run.id, run_name=run.name, logs_dir=Path(run.logs_dir), ladder=ladder,
                    plan=plan, fingerprint=fingerprint.collect(),
                    instruments={name: REGISTRY[name]() for name, _ in ladder.instruments.sections()})
    if status is not None:
        rc.status = status
    writer.set_run_status(store, run.id, "running")
    [slot] = reader.slots(store, run.id)
    outcome = run_slot(rc, slot)
    writer.set_run_status(store, run.id, "done")
    [slot] = reader.slots(store, run.id)
    last = slot.boots[-1] if slot.boots else None
    boot_id = last.id if last else None
    if outcome != "done":
        tail = (last.log_tail or "").strip().splitlines()[-5:] if last else []
        reason = f"boot {outcome}: {last.reason if last else 'never started'}"
        return Measured(run, boot_id, None, [], reason + ("; log tail: " + " | ".join(tail) if tail else ""))
    evidence = verdicts.load(store, run.id)
    [measured] = [s for s in evidence.slots if s.id == slot.id]
    values, missing = [], []
    for objective in tune.objectives:
        value = _value(evidence, measured, objective.metric, objective.where)
        if value is None:
            missing.append(objective.metric)
        values.append(value)
    constraints = []
    for gate in tune.constraints:
        value = _value(evidence, measured, gate.metric, gate.where)
        if value is None:
            missing.append(gate.metric)
            constraints.append(1.0)
        else:
            constraints.append(max(gate.min - value if gate.min is not None else float("-inf"),
                                   value - gate.max if gate.max is not None else float("-inf")))
    if missing:
        return Measured(run, boot_id, None, constraints, f"no valid value for {', '.join(missing)} "
                                                         f"(`lab ls {run.name}` shows the boot)")
    return Measured(run, boot_id, values, constraints, None)


def _value(evidence: verdicts.RunEvidence, slot: verdicts.SlotCells, metric: str, where: dict[str, Any]) -> float | None:
    instrument, _, name = metric.partition(".")
    found = evidence.select(slot, verdicts.Selector(instrument, name, tuple(sorted(where.items()))))
    return median_of_repeats(found.values) if found.values else None

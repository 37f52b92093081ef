"""Questions the lab asks the store. Every answer is a record of `lab.store.rows` or a plain value,
read in full inside the session: nothing handed out is attached to the database."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from lab.store import models as m
from lab.store.db import Store
from lab.store.rows import (ArmRecord, BootRecord, CellHealth, CellRecord, NoiseRecord, RunRecord, RunSummary,
                            SeriesPointRecord, SlotRecord, VerdictRecord, record, series_name)

LIVE = ("starting", "ready")  # a boot in one of these states has a process the lab may still own
OK = ("done",)


def cell_health(store: Store, run_id: int) -> dict[int, CellHealth]:
    """Per boot of the run: its valid and invalid cells, and why most of the invalid ones are."""
    with store.session() as s:
        rows = s.execute(select(m.Cell.boot_id, m.Cell.valid, m.Cell.note, func.count())
                         .join(m.Boot, m.Boot.id == m.Cell.boot_id).where(m.Boot.run_id == run_id)
                         .group_by(m.Cell.boot_id, m.Cell.valid, m.Cell.note)).all()
    counts: dict[int, list] = {}
    for boot_id, valid, note, n in rows:
        entry = counts.setdefault(boot_id, [0, 0, None, 0])
        if valid:
            entry[0] += n
        else:
            entry[1] += n
            if n > entry[3]:
                entry[2], entry[3] = note, n
    return {boot_id: CellHealth(*entry) for boot_id, entry in counts.items()}


def find_run(store: Store, ref: str) -> RunRecord:
    """A run by name, id, or ladder name (its latest run); LookupError says what to do when none."""
    with store.session() as s:
        run = s.scalar(select(m.Run).where(m.Run.name == ref))
        if run is None and ref.isdigit():
            run = s.get(m.Run, int(ref))
        if run is None:
            run = s.scalar(select(m.Run).where(m.Run.ladder_name == ref).order_by(m.Run.id.desc()).limit(1))
        if run is None:
            raise LookupError(f"no run {ref!r} in this store; `lab ls` lists the runs")
        return record(RunRecord, run)


def list_runs(store: Store) -> list[RunSummary]:
    with store.session() as s:
        runs = s.scalars(select(m.Run).order_by(m.Run.id)).all()
        out = []
        for run in runs:
            statuses = s.scalars(select(m.Boot.status).where(m.Boot.run_id == run.id)).all()
            slots = s.scalar(select(func.count()).select_from(m.Slot).where(m.Slot.run_id == run.id)) or 0
            out.append(RunSummary(run.id, run.name, run.ladder_name, run.engine_kind, run.created_at, run.status,
                                  slots, sum(st in OK for st in statuses),
                                  sum(st not in OK and st not in LIVE for st in statuses)))
        return out


def slots(store: Store, run_id: int) -> list[SlotRecord]:
    """The run's slots by index, each with its arm's name and its boots."""
    with store.session() as s:
        return _slots(s, run_id)


def _slots(s: Session, run_id: int) -> list[SlotRecord]:
    rows = s.scalars(select(m.Slot).where(m.Slot.run_id == run_id).order_by(m.Slot.idx)
                     .options(selectinload(m.Slot.arm), selectinload(m.Slot.boots))).all()
    return [record(SlotRecord, row, arm=row.arm.name, boots=tuple(record(BootRecord, b) for b in row.boots))
            for row in rows]


def arms(store: Store, run_id: int) -> list[ArmRecord]:
    with store.session() as s:
        return _arms(s, run_id)


def _arms(s: Session, run_id: int) -> list[ArmRecord]:
    return [record(ArmRecord, a) for a in s.scalars(select(m.Arm).where(m.Arm.run_id == run_id)
                                                    .order_by(m.Arm.id)).all()]


def stored_verdicts(store: Store, run_id: int) -> dict[str, VerdictRecord]:
    """The verdicts `lab run` stored, by arm name: what it decided when each window closed (reading
    commands judge again in memory, with the newest calibration)."""
    with store.session() as s:
        rows = s.execute(select(m.Verdict, m.Arm.name).join(m.Arm, m.Arm.id == m.Verdict.arm_id)
                         .where(m.Verdict.run_id == run_id).order_by(m.Arm.id)).all()
        return {name: VerdictRecord(name, v.decision, list(v.reasons), dict(v.detail or {}), v.created_at)
                for v, name in rows}


def stored_steps(store: Store, slot_id: int) -> set[tuple[str, str]]:
    with store.session() as s:
        return set(s.execute(select(m.Step.instrument, m.Step.key).where(m.Step.slot_id == slot_id)).tuples())


def live_boots(store: Store, run_id: int) -> list[BootRecord]:
    with store.session() as s:
        return [record(BootRecord, b) for b in s.scalars(select(m.Boot).where(m.Boot.run_id == run_id,
                                                                              m.Boot.status.in_(LIVE))).all()]


def any_ready_boot(store: Store, run_id: int) -> bool:
    """Whether an engine of this run has answered a completion before (JIT caches warmed)."""
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(m.Boot)
                        .where(m.Boot.run_id == run_id, m.Boot.ready_at.is_not(None))) > 0


def longest_boot_s(store: Store, run_id: int, warmup: bool) -> float | None:
    """Seconds from start to stop of this run's longest finished boot, warm-ups or measured ones
    (`warmup`); None when none has finished."""
    with store.session() as s:
        role = m.Slot.role == "warmup" if warmup else m.Slot.role != "warmup"
        rows = s.execute(select(m.Boot.started_at, m.Boot.stopped_at).join(m.Slot, m.Boot.slot_id == m.Slot.id)
                         .where(m.Boot.run_id == run_id, m.Boot.status == "done", m.Boot.stopped_at.is_not(None),
                                role)).tuples()
        spans = [(stopped - started).total_seconds() for started, stopped in rows]
    return max(spans) if spans else None


def warm_control_boots(store: Store, run_id: int, window: str, before_idx: int) -> list[int]:
    """Boots of this window's control that were measured warm before slot `before_idx`."""
    with store.session() as s:
        query = (select(m.Boot.id).join(m.Slot, m.Boot.slot_id == m.Slot.id)
                 .where(m.Slot.run_id == run_id, m.Slot.window == window, m.Slot.role == "control",
                        m.Slot.idx < before_idx, m.Boot.status == "done", m.Boot.cold.is_(False))
                 .order_by(m.Slot.idx, m.Boot.attempt))
        return list(s.scalars(query).all())


def latest_noise(store: Store, ladder_name: str, host: str) -> list[NoiseRecord]:
    """The newest calibration of this ladder on this host, one row per metric; [] when never calibrated."""
    with store.session() as s:
        newest = s.scalar(select(func.max(m.NoiseModel.run_id)).where(m.NoiseModel.ladder_name == ladder_name,
                                                                       m.NoiseModel.host == host))
        if newest is None:
            return []
        return [record(NoiseRecord, row) for row in s.scalars(select(m.NoiseModel).where(m.NoiseModel.run_id == newest)
                                                              .order_by(m.NoiseModel.id)).all()]


def boot_host(store: Store, run_id: int) -> str | None:
    """The host a run's first boot ran on (its environment fingerprint); None before any boot."""
    with store.session() as s:
        fingerprint = s.scalar(select(m.Boot.fingerprint).where(m.Boot.run_id == run_id).order_by(m.Boot.id).limit(1))
    return fingerprint.get("host") if isinstance(fingerprint, dict) else None


def series_points(store: Store, series: str | None = None) -> list[SeriesPointRecord]:
    """Sweep runs in the order they were filed, of one series (`series_name`) or of all."""
    with store.session() as s:
        rows = s.scalars(select(m.SeriesPoint).order_by(m.SeriesPoint.id)).all()
        points = [record(SeriesPointRecord, row, series=series_name(row.ladder_name, row.host)) for row in rows]
    return [p for p in points if series is None or p.series == series]


@dataclass(frozen=True)
class RunRows:
    """A run with its arms (in order), slots (by index, each with its boots) and cells (as stored)."""

    run: RunRecord
    arms: list[ArmRecord]
    slots: list[SlotRecord]
    cells: list[CellRecord]


def run_rows(store: Store, run_id: int) -> RunRows:
    with store.session() as s:
        run = record(RunRecord, s.get_one(m.Run, run_id))
        cells = s.scalars(select(m.Cell).join(m.Slot, m.Cell.slot_id == m.Slot.id)
                          .where(m.Slot.run_id == run_id).order_by(m.Cell.id)).all()
        return RunRows(run=run, arms=_arms(s, run_id), slots=_slots(s, run_id),
                       cells=[record(CellRecord, c) for c in cells])


def latest_run_id(store: Store) -> int | None:
    with store.session() as s:
        return s.scalar(select(func.max(m.Run.id)))


def run_name(store: Store, run_id: int) -> str:
    with store.session() as s:
        return s.get_one(m.Run, run_id).name


def cell_count(store: Store, run_id: int) -> int:
    """How many cells the run stored, valid or not."""
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(m.Cell).join(m.Slot, m.Cell.slot_id == m.Slot.id)
                        .where(m.Slot.run_id == run_id)) or 0


def qeval_passes(store: Store, slot_id: int) -> dict[str, bool]:
    """Whether each qeval task passed on the slot; {} when it stored no qeval items."""
    with store.session() as s:
        rows = s.execute(select(m.QevalItem.task, m.QevalItem.passed).where(m.QevalItem.slot_id == slot_id)).tuples()
        return {task: bool(passed) for task, passed in rows}

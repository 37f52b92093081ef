"""The read-only view of the store an instrument gets (`BootContext.stored`): rows this run already
stored that a measurement builds on, as records, and nothing else of the database."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from lab.store import models as m
from lab.store.db import Store
from lab.store.rows import CellRecord, QevalItemRecord, RequestRecord, StepRecord, record


@dataclass(frozen=True)
class SlotSteps:
    """One instrument's rows on one slot: its steps in order, and the qeval items and requests of
    those that completed."""

    steps: list[StepRecord]
    items: list[QevalItemRecord]
    requests: list[RequestRecord]


class StoredRows:
    def __init__(self, store: Store) -> None:
        self._store = store

    def slot_cells(self, slot_id: int, instrument: str, metric: str) -> list[CellRecord]:
        """Every `metric` cell of `instrument` on the slot, an earlier attempt of a resumed slot included."""
        with self._store.session() as s:
            return [record(CellRecord, c)
                    for c in s.scalars(select(m.Cell).where(m.Cell.slot_id == slot_id, m.Cell.instrument == instrument,
                                                            m.Cell.metric == metric)).all()]

    def boot_slot_steps(self, boot_id: int, instrument: str) -> SlotSteps:
        """`instrument`'s rows on the slot of this boot; read by slot, not boot, because a resumed slot
        keeps the steps an earlier attempt of it stored."""
        with self._store.session() as s:
            slot_id = s.get_one(m.Boot, boot_id).slot_id
            steps = [record(StepRecord, step)
                     for step in s.scalars(select(m.Step).where(m.Step.slot_id == slot_id,
                                                                m.Step.instrument == instrument)
                                           .order_by(m.Step.id)).all()]
            ok = [step.id for step in steps if step.status == "ok"]
            if not ok:
                return SlotSteps(steps, [], [])
            items = s.scalars(select(m.QevalItem).where(m.QevalItem.step_id.in_(ok)).order_by(m.QevalItem.id)).all()
            requests = s.scalars(select(m.Request).where(m.Request.step_id.in_(ok))
                                 .order_by(m.Request.step_id, m.Request.idx)).all()
            return SlotSteps(steps, [record(QevalItemRecord, i) for i in items],
                             [record(RequestRecord, r) for r in requests])

"""A run's stored rows as pandas frames, table by table, columns exactly as stored (JSON columns as
Python objects, times as UTC timestamps): what `lab export` writes, what the report joins and what
notebooks/analysis.ipynb reads. A SQLite store and a PostgreSQL one give the same frames."""

from __future__ import annotations

from typing import Any

import pandas as pd
from sqlalchemy import DateTime, Table, select

from lab.store import models as m
from lab.store.db import Store

# Export order: each table after the ones it refers to.
TABLES: dict[str, Table] = {
    "runs": m.Run.__table__, "arms": m.Arm.__table__, "slots": m.Slot.__table__, "boots": m.Boot.__table__,
    "steps": m.Step.__table__, "cells": m.Cell.__table__, "requests": m.Request.__table__,
    "qeval_items": m.QevalItem.__table__, "verdicts": m.Verdict.__table__,
}


def run_tables(store: Store, run_id: int, include: tuple[str, ...] = tuple(TABLES)) -> dict[str, pd.DataFrame]:
    """The rows of each named table that belong to the run."""
    slot_ids = select(m.Slot.id).where(m.Slot.run_id == run_id)
    step_ids = select(m.Step.id).where(m.Step.slot_id.in_(slot_ids))
    where: dict[str, Any] = {
        "runs": m.Run.id == run_id, "arms": m.Arm.run_id == run_id, "slots": m.Slot.run_id == run_id,
        "boots": m.Boot.run_id == run_id, "steps": m.Step.slot_id.in_(slot_ids),
        "cells": m.Cell.slot_id.in_(slot_ids), "requests": m.Request.step_id.in_(step_ids),
        "qeval_items": m.QevalItem.slot_id.in_(slot_ids), "verdicts": m.Verdict.run_id == run_id,
    }
    frames = {}
    with store.engine.connect() as connection:
        for name in include:
            table = TABLES[name]
            query = select(table).where(where[name]).order_by(table.c.id)
            frames[name] = _utc(pd.read_sql(query, connection), table)
    return frames


def runs(store: Store) -> pd.DataFrame:
    """Every run of the store, oldest first: its id, name, ladder, engine kind, status and creation time."""
    table = m.Run.__table__
    columns = [table.c[name] for name in ("id", "name", "ladder_name", "engine_kind", "status", "created_at")]
    with store.engine.connect() as connection:
        return _utc(pd.read_sql(select(*columns).order_by(table.c.id), connection), table)


def _utc(frame: pd.DataFrame, table: Table) -> pd.DataFrame:
    """SQLite keeps no time zone: its times come back naive, PostgreSQL's aware. The lab writes every
    time in UTC (writer.now), so both become UTC timestamps."""
    for column in table.columns:
        if isinstance(column.type, DateTime) and column.name in frame:
            frame[column.name] = pd.to_datetime(frame[column.name], utc=True)
    return frame

"""`lab export RUN`: a run's stored rows for people who work in other tools.

csv and parquet: one file per table (runs, arms, slots, boots, steps, cells, requests, qeval_items,
verdicts), columns exactly as stored; JSON-typed columns (params, receipts' token times, verdict
details…) are written as JSON text so every file is flat. json: one document, a list of row
objects per table, nested values kept as they are. Times are UTC in ISO 8601.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from lab.store import reader
from lab.store.db import Store
from lab.store.frames import run_tables



def export_run(store: Store, ref: str, fmt: str, out: str | Path = "exports") -> Path:
    """Write the run's tables under `out/<run name>/` and return that directory."""
    run = reader.find_run(store, ref)
    frames = run_tables(store, run.id)
    directory = Path(out) / run.name.replace("/", "_")
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "json":
        document = {"format": "lab export", "run": run.name,
                    "tables": {name: [_plain_row(row) for row in frame.to_dict(orient="records")]
                               for name, frame in frames.items()}}
        (directory / f"{directory.name}.json").write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
        return directory
    for name, frame in frames.items():
        flat = _flat(frame)
        if fmt == "csv":
            flat.to_csv(directory / f"{name}.csv", index=False)
        else:
            flat.to_parquet(directory / f"{name}.parquet", index=False)
    return directory


def _flat(frame: pd.DataFrame) -> pd.DataFrame:
    """Nested values (dicts, lists) as JSON text, so CSV and Parquet columns hold one type each."""
    flat = frame.copy()
    for column in flat.columns:
        # Only object columns hold them (an empty frame's times are datetime64, which `any` refuses).
        if flat[column].dtype == object and flat[column].map(lambda v: isinstance(v, (dict, list))).any():
            flat[column] = flat[column].map(lambda v: None if v is None else json.dumps(v, ensure_ascii=False))
    return flat


def _plain_row(row: dict[str, Any]) -> dict[str, Any]:
    return {key: _plain(value) for key, value in row.items()}


def _plain(value: Any) -> Any:
    """JSON has no NaN, NaT or numpy scalars: missing becomes null, times ISO text, numbers plain."""
    if isinstance(value, (dict, list, str, bool)) or value is None:
        return value
    if value is pd.NaT:
        return None
    if isinstance(value, datetime):  # pandas' Timestamp is one too
        return value.isoformat()
    if hasattr(value, "item"):  # a numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value

"""Borrowed figures in the report (lab/ladder/borrowed.py): a column `borrowed: SOURCE (DATE)` beside
the run's own figures wherever a row names the same metric and params, and a table of them all.
They are never part of a verdict; every place that shows one says "borrowed" and where it is from.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from lab.report import document as doc


def rows_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The borrowed figures stored with the run (none for a run, or a store, from before them)."""
    rows = run.get("borrowed")
    return rows if isinstance(rows, list) else []


def column(row: dict[str, Any]) -> str:
    return f"borrowed: {row['source']} ({row['date']})"


def beside(table: pd.DataFrame, rows: list[dict[str, Any]]) -> pd.DataFrame:
    """`table` (a `metric` column, `instrument.metric` or beside an `instrument` column, and `params`
    as `k=v, …`) with a column per borrowed source holding its figure on the rows it matches."""
    if not rows or table.empty:
        return table
    table = table.copy()
    names = (table["instrument"] + "." + table["metric"]) if "instrument" in table.columns else table["metric"]
    params = table["params"].map(_parts)
    for row in rows:
        name = column(row)
        if name not in table.columns:
            table[name] = ""
        match = (names == row["metric"]) & (params == _parts(_params(row["params"])))
        table.loc[match, name] = _value(row)
    return table


def blocks(rows: list[dict[str, Any]]) -> list[doc.Block]:
    """The report's section listing every borrowed figure; none without any."""
    if not rows:
        return []
    table = pd.DataFrame([{"metric": row["metric"], "params": _params(row["params"]), "value": _value(row),
                           "source": f"borrowed: {row['source']}", "date": row["date"]} for row in rows])
    return [doc.Heading("Borrowed figures"),
            doc.Paragraph("Measured elsewhere and named by the ladder (`borrowed:`): shown beside this run's "
                          "figures for reference, never judged and never part of a KEEP verdict."),
            doc.TableBlock(table)]


def _value(row: dict[str, Any]) -> str:
    value = row["value"]
    text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return f"{text} {row['unit']}".strip() + " (borrowed)"


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _parts(text: str) -> frozenset[str]:
    return frozenset(part for part in str(text).split(", ") if part)

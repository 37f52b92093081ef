"""Borrowed figures: numbers measured elsewhere (a vendor's blog, a paper, last year's host) that a
ladder names (`borrowed: figures.yaml` or `.csv`) so its report draws them beside its own, labelled
`borrowed: SOURCE (DATE)`. They are stored with the run and never judged: no KEEP metric or gate may
name one (`lab.ladder.validate`).

A row: `metric` (<instrument>.<metric>, as the lab names its own), `params` (the cell params it
stands beside; a CSV gives them as `k=v` pairs split by `;`), `value`, `source`, `date`, and an
optional `unit`. YAML: a list of such mappings. CSV: a header row naming those columns.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# What a KEEP metric would start with to name a borrowed series; such a rule is refused.
SERIES = "borrowed"
# A borrowed file is a small table.
MAX_BYTES = 1_000_000


class BorrowedRow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metric: str = Field(pattern=r"^[A-Za-z0-9_]+\.[A-Za-z0-9_]+$", description="<instrument>.<metric>")
    params: dict[str, Union[bool, int, float, str]] = Field(default_factory=dict)
    value: float = Field(allow_inf_nan=False)
    unit: str = ""
    source: str = Field(min_length=1)
    date: str = Field(min_length=1)

    @field_validator("date", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return str(value) if value is not None else value  # YAML reads 2026-01-02 as a date


class BorrowedError(ValueError):
    """The borrowed file cannot be read; the message is one line."""


def path_of(name: str, ladder_path: str | Path) -> Path:
    """The file a ladder's `borrowed:` names, relative to the ladder's own folder."""
    path = Path(name)
    return path if path.is_absolute() else Path(ladder_path).resolve().parent / path


def load(path: Path) -> list[dict[str, Any]]:
    """The rows of a borrowed file, validated, as JSON-able dicts; raises BorrowedError."""
    try:
        if path.stat().st_size > MAX_BYTES:
            raise BorrowedError(f"borrowed: {path} is larger than {MAX_BYTES:,} bytes")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BorrowedError(f"borrowed: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    raw = _csv(text) if path.suffix.lower() == ".csv" else _yaml(text, path)
    rows = []
    for n, item in enumerate(raw, start=1):
        try:
            rows.append(BorrowedRow.model_validate(item).model_dump())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "the row"
            raise BorrowedError(f"borrowed: {path.name} row {n}: {where}: {first['msg']}") from None
    if not rows:
        raise BorrowedError(f"borrowed: {path.name} holds no rows")
    return rows


def _yaml(text: str, path: Path) -> list[Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise BorrowedError(f"borrowed: {path.name} is not YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, list):
        raise BorrowedError(f"borrowed: {path.name} must be a list of rows (metric, params, value, source, date)")
    return data


def _csv(text: str) -> list[dict[str, Any]]:
    rows = []
    for row in csv.DictReader(io.StringIO(text)):
        pairs = [part.partition("=") for part in (row.pop("params", None) or "").split(";") if part.strip()]
        rows.append({**{k: v for k, v in row.items() if v not in (None, "")},
                     "params": {k.strip(): _scalar(v.strip()) for k, _, v in pairs}})
    return rows


def _scalar(text: str) -> Any:
    """A CSV param as YAML reads a plain value: `128` is an int, `true` a bool."""
    value = yaml.safe_load(text) if text else text
    return value if isinstance(value, (bool, int, float)) else text

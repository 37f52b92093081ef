"""What the store hands out: each stored row as a plain frozen record, read in full while the
session was open, so a caller never meets a database session, a detached ORM object or a lazy load.

A record's fields are its table's columns (`lab.store.models`), same names, same values; a slot
also carries its arm's name and its boots. The JSON columns (params, flags, capabilities, ...) are
the plain dicts and lists the store decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, TypeVar

R = TypeVar("R")


def record(cls: type[R], row: Any, **given: Any) -> R:
    """A `cls` record of a row: each field read from the row's attribute of the same name, unless `given`."""
    return cls(**{f.name: given[f.name] if f.name in given else getattr(row, f.name)
                  for f in fields(cls)})  # type: ignore[arg-type]


@dataclass(frozen=True)
class RunRecord:
    id: int
    name: str
    ladder_name: str
    ladder_path: str
    ladder_text: str
    ladder_sha256: str
    engine_kind: str
    logs_dir: str
    status: str  # running | done | interrupted | failed
    reason: str | None
    owner_pid: int | None
    owner_started: float | None
    created_at: datetime
    finished_at: datetime | None
    warnings: list[str] | None = None  # what the first measured boot showed about the ladder
    borrowed: list[dict[str, Any]] | None = None  # the ladder's borrowed figures (lab/ladder/borrowed.py)


@dataclass(frozen=True)
class ArmRecord:
    id: int
    run_id: int
    name: str
    role: str  # control | arm
    window: str
    change: dict[str, Any]
    multi: bool
    flags: dict[str, Any]
    env: dict[str, Any]
    config: dict[str, Any]
    config_hash: str


@dataclass(frozen=True)
class BootRecord:
    id: int
    run_id: int
    slot_id: int
    attempt: int
    status: str  # starting | ready | done | failed | refused | died | interrupted
    reason: str | None
    cold: bool
    port: int | None
    pid: int | None
    pid_started: float | None
    argv: list[Any]
    env: dict[str, Any]
    env_removed: list[Any]
    api_base: str | None
    log_path: str | None
    started_at: datetime
    ready_at: datetime | None
    ready_s: float | None
    stopped_at: datetime | None
    exit_status: int | None
    stopped_by: str | None
    expected_config_hash: str | None
    booted_config_hash: str | None
    engine_stats: dict[str, Any] | None
    capabilities: dict[str, Any] | None
    mem_available_start: int | None
    mem_available_floor: int | None
    fingerprint: dict[str, Any]
    log_tail: str | None


@dataclass(frozen=True)
class SlotRecord:
    """A planned boot with its arm's name and its boots, in attempt order."""

    id: int
    run_id: int
    idx: int
    arm_id: int
    arm: str  # the arm's name
    role: str  # warmup | control | arm
    position: str  # warmup | open | between | arm | close
    window: str | None
    status: str  # pending | done | failed
    boots: tuple[BootRecord, ...]


@dataclass(frozen=True)
class StepRecord:
    id: int
    slot_id: int
    boot_id: int
    instrument: str
    key: str
    params: dict[str, Any]
    status: str  # ok | error
    error: str | None
    started_at: datetime
    finished_at: datetime


@dataclass(frozen=True)
class CellRecord:
    id: int
    step_id: int
    slot_id: int
    boot_id: int
    instrument: str
    metric: str
    params: dict[str, Any]
    repeat: int
    value: float | None
    unit: str
    valid: bool
    note: str
    request_ids: list[Any]
    unvouched_streams: int | None


@dataclass(frozen=True)
class RequestRecord:
    """A stored receipt (`lab.instruments.receipt.Receipt`), as the client saw the request."""

    id: int
    step_id: int
    boot_id: int
    idx: int
    endpoint: str
    status: int | None
    error: str | None
    t_queued_ns: int | None
    t_sent_ns: int | None
    t_first_ns: int | None
    t_last_ns: int | None
    t_done_ns: int | None
    token_times_ns: list[Any] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    text: str | None
    finish_reason: str | None
    payload: Any
    response: Any
    request_id: str | None
    response_id: str | None
    chunk_tokens: list[Any] | None
    usage_present: bool | None
    cached_tokens_present: bool | None
    reasoning_text: str | None
    logprobs: list[Any] | None
    opened_connection: bool | None
    read_lag_max_ns: int | None
    unvouched: str | None
    usage_counted_by: str | None


@dataclass(frozen=True)
class QevalItemRecord:
    id: int
    step_id: int
    slot_id: int
    boot_id: int
    request_id: int | None
    task: str
    category: str
    scorer: str
    passed: bool
    score: float | None
    output: str | None
    expected: str | None
    detail: dict[str, Any]


@dataclass(frozen=True)
class VerdictRecord:
    """The KEEP decision `lab run` stored for one arm when its window closed."""

    arm: str
    decision: str  # keep | reject | inconclusive
    reasons: list[Any]
    detail: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class NoiseRecord:
    """One key metric's boot-to-boot noise from a `lab calibrate` run."""

    id: int
    run_id: int
    ladder_name: str
    host: str
    metric: str
    boots: int
    sd_log: float
    df: int
    drift_pct: float
    mde_pct: float
    repeats: int
    power: float
    created_at: datetime


def series_name(ladder_name: str, host: str) -> str:
    """A series is one ladder on one host; its base config may change from label to label."""
    return f"{ladder_name}@{host}"


@dataclass(frozen=True)
class SeriesPointRecord:
    """A `lab sweep` run filed under its series with its label. `series` is `series_name` of its
    ladder and host, also for points an earlier lab filed under `<ladder>@<host>:<config hash>`."""

    id: int
    series: str
    label: str
    run_id: int
    ladder_name: str
    host: str
    identity: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class RunSummary:
    """A run as `lab ls` lists it."""

    id: int
    name: str
    ladder: str
    engine_kind: str
    created_at: datetime
    status: str
    slots: int
    boots_ok: int
    boots_failed: int


@dataclass(frozen=True)
class CellHealth:
    """One boot's cells: how many are valid, and why most of the invalid ones are not."""

    valid: int
    invalid: int
    top_reason: str | None  # the commonest note of the invalid cells
    top_count: int

"""The store's tables. Every figure traces to the requests behind it: cell -> step -> request.

A *slot* is one planned boot of a run (window position + arm); a *boot* is one launch for a slot.
A slot normally has one boot; a resumed run gives an interrupted slot a fresh boot that runs only
the steps not yet stored, so steps, cells and receipts are unique per slot, never duplicated.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: DateTime(timezone=True)}


class Meta(Base):
    __tablename__ = "meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Run(Base):
    __tablename__ = "run"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    ladder_name: Mapped[str] = mapped_column(String(64))
    ladder_path: Mapped[str] = mapped_column(Text)
    ladder_text: Mapped[str] = mapped_column(Text)
    ladder_sha256: Mapped[str] = mapped_column(String(64))
    engine_kind: Mapped[str] = mapped_column(String(16))
    logs_dir: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # running | done | interrupted | failed
    reason: Mapped[str | None] = mapped_column(Text)  # why it failed: the exception, in one line
    # The `lab run` process working on it, so a second `--resume` cannot stop engines a live run owns.
    owner_pid: Mapped[int | None]
    owner_started: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    # What the first measured boot showed about the ladder (a key figure that is mostly ramp, a probe
    # that measures nothing): one line each, naming the ladder line and the fix; None: nothing found.
    warnings: Mapped[list[Any] | None]
    # Figures measured elsewhere that the ladder names (`borrowed:`), as read when the run was created:
    # drawn beside the run's own, never judged (lab/ladder/borrowed.py).
    borrowed: Mapped[list[Any] | None]

    arms: Mapped[list["Arm"]] = relationship(back_populates="run", order_by="Arm.id")
    slots: Mapped[list["Slot"]] = relationship(back_populates="run", order_by="Slot.idx")


class Arm(Base):
    __tablename__ = "arm"
    __table_args__ = (UniqueConstraint("run_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id"))
    name: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16))  # control | arm
    window: Mapped[str] = mapped_column(String(64))
    change: Mapped[dict[str, Any]]  # {"flags": {...}, "env": {...}}; {} for a control
    multi: Mapped[bool]
    flags: Mapped[dict[str, Any]]
    env: Mapped[dict[str, Any]]
    config: Mapped[dict[str, Any]]  # bundled: effective knobs; command: the command recipe
    config_hash: Mapped[str] = mapped_column(String(64))

    run: Mapped[Run] = relationship(back_populates="arms")


class Slot(Base):
    __tablename__ = "slot"
    __table_args__ = (UniqueConstraint("run_id", "idx"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id"))
    idx: Mapped[int]
    arm_id: Mapped[int] = mapped_column(ForeignKey("arm.id"))
    role: Mapped[str] = mapped_column(String(16))  # warmup | control | arm
    position: Mapped[str] = mapped_column(String(16))  # warmup | open | arm | close
    window: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # pending | done | failed

    run: Mapped[Run] = relationship(back_populates="slots")
    arm: Mapped[Arm] = relationship()
    boots: Mapped[list["Boot"]] = relationship(back_populates="slot", order_by="Boot.attempt")


class Boot(Base):
    __tablename__ = "boot"
    __table_args__ = (UniqueConstraint("slot_id", "attempt"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id"), index=True)
    slot_id: Mapped[int] = mapped_column(ForeignKey("slot.id"))
    attempt: Mapped[int]
    # starting | ready | done | failed (no ready) | refused (wrong config) | died (mid-arm) | interrupted
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    cold: Mapped[bool] = mapped_column(default=False)
    port: Mapped[int | None]
    pid: Mapped[int | None]
    pid_started: Mapped[float | None] = mapped_column(Float)  # process create time: pid reuse guard on resume
    argv: Mapped[list[Any]] = mapped_column(default=list)
    env: Mapped[dict[str, Any]] = mapped_column(default=dict)  # exactly what the lab set for the child
    env_removed: Mapped[list[Any]] = mapped_column(default=list)  # inherited LAB_ENGINE_* names taken out
    api_base: Mapped[str | None] = mapped_column(Text)  # the OpenAI root the instruments talked to
    log_path: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime]
    ready_at: Mapped[datetime | None]
    ready_s: Mapped[float | None] = mapped_column(Float)  # process start to first answered completion
    stopped_at: Mapped[datetime | None]
    exit_status: Mapped[int | None]  # negative: killed by that signal
    stopped_by: Mapped[str | None] = mapped_column(String(16))  # exited (on its own) | SIGTERM | SIGKILL
    expected_config_hash: Mapped[str | None] = mapped_column(String(64))
    booted_config_hash: Mapped[str | None] = mapped_column(String(64))
    engine_stats: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # /v1/stats (or /v1/models) at ready
    # What the capability probe found at ready (lab/instruments/capabilities.py)
    capabilities: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    mem_available_start: Mapped[int | None] = mapped_column(BigInteger)  # bytes, before start
    mem_available_floor: Mapped[int | None] = mapped_column(BigInteger)  # bytes, lowest seen during the boot
    fingerprint: Mapped[dict[str, Any]] = mapped_column(default=dict)
    log_tail: Mapped[str | None] = mapped_column(Text)

    slot: Mapped[Slot] = relationship(back_populates="boots")


class Step(Base):
    __tablename__ = "step"
    __table_args__ = (UniqueConstraint("slot_id", "instrument", "key"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    slot_id: Mapped[int] = mapped_column(ForeignKey("slot.id"))
    boot_id: Mapped[int] = mapped_column(ForeignKey("boot.id"), index=True)
    instrument: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(200))
    params: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16))  # ok | error
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime]


class Cell(Base):
    __tablename__ = "cell"
    __table_args__ = (UniqueConstraint("step_id", "metric", "params_key", "repeat"),
                      Index("ix_cell_slot_metric", "slot_id", "instrument", "metric"))
    id: Mapped[int] = mapped_column(primary_key=True)
    step_id: Mapped[int] = mapped_column(ForeignKey("step.id"))
    slot_id: Mapped[int] = mapped_column(ForeignKey("slot.id"))
    boot_id: Mapped[int] = mapped_column(ForeignKey("boot.id"), index=True)
    instrument: Mapped[str] = mapped_column(String(64))
    metric: Mapped[str] = mapped_column(String(128))
    params: Mapped[dict[str, Any]]
    params_key: Mapped[str] = mapped_column(Text)  # canonical JSON of params, for the unique key
    repeat: Mapped[int]
    value: Mapped[float | None] = mapped_column(Float)
    unit: Mapped[str] = mapped_column(String(32))
    valid: Mapped[bool]
    note: Mapped[str] = mapped_column(Text, default="")
    request_ids: Mapped[list[Any]] = mapped_column(default=list)
    # Streams behind it whose timing the client cannot vouch for (request.unvouched); NULL in a
    # store written before they were counted.
    unvouched_streams: Mapped[int | None]


class Request(Base):
    """The receipt (`lab.instruments.receipt.Receipt`): one request as the client saw it, with the
    server's token counts."""

    __tablename__ = "request"
    __table_args__ = (UniqueConstraint("step_id", "idx"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    step_id: Mapped[int] = mapped_column(ForeignKey("step.id"))
    boot_id: Mapped[int] = mapped_column(ForeignKey("boot.id"), index=True)
    idx: Mapped[int]
    endpoint: Mapped[str] = mapped_column(String(128))
    status: Mapped[int | None]
    error: Mapped[str | None] = mapped_column(Text)
    t_queued_ns: Mapped[int | None] = mapped_column(BigInteger)
    t_sent_ns: Mapped[int | None] = mapped_column(BigInteger)
    t_first_ns: Mapped[int | None] = mapped_column(BigInteger)
    t_last_ns: Mapped[int | None] = mapped_column(BigInteger)
    t_done_ns: Mapped[int | None] = mapped_column(BigInteger)
    token_times_ns: Mapped[list[Any] | None] = mapped_column(JSON)
    prompt_tokens: Mapped[int | None]
    completion_tokens: Mapped[int | None]
    cached_tokens: Mapped[int | None]
    text: Mapped[str | None] = mapped_column(Text)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    payload: Mapped[Any] = mapped_column(JSON, nullable=True)
    response: Mapped[Any] = mapped_column(JSON, nullable=True)
    request_id: Mapped[str | None] = mapped_column(String(128))
    response_id: Mapped[str | None] = mapped_column(String(128))
    chunk_tokens: Mapped[list[Any] | None] = mapped_column(JSON)  # tokens per chunk, from a running usage
    usage_present: Mapped[bool | None]
    cached_tokens_present: Mapped[bool | None]
    reasoning_text: Mapped[str | None] = mapped_column(Text)
    logprobs: Mapped[list[Any] | None] = mapped_column(JSON)  # [{token, logprob, top: {token: logprob}}]
    opened_connection: Mapped[bool | None]
    read_lag_max_ns: Mapped[int | None] = mapped_column(BigInteger)  # how far the client fell behind
    unvouched: Mapped[str | None] = mapped_column(Text)  # why the client cannot vouch for its timing
    usage_counted_by: Mapped[str | None] = mapped_column(String(64))  # tokenizer route, where no usage came


class QevalItem(Base):
    __tablename__ = "qeval_item"
    __table_args__ = (UniqueConstraint("step_id", "task"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    step_id: Mapped[int] = mapped_column(ForeignKey("step.id"))
    slot_id: Mapped[int] = mapped_column(ForeignKey("slot.id"))
    boot_id: Mapped[int] = mapped_column(ForeignKey("boot.id"), index=True)
    request_id: Mapped[int | None] = mapped_column(ForeignKey("request.id"))
    task: Mapped[str] = mapped_column(String(128))
    category: Mapped[str] = mapped_column(String(64), default="")
    scorer: Mapped[str] = mapped_column(String(64), default="")
    passed: Mapped[bool]
    score: Mapped[float | None] = mapped_column(Float)
    output: Mapped[str | None] = mapped_column(Text)
    expected: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


class Verdict(Base):
    """The KEEP rule's decision for one arm against its window's controls (`lab.analysis.keep.Verdict`)."""

    __tablename__ = "verdict"
    __table_args__ = (UniqueConstraint("run_id", "arm_id"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id"))
    arm_id: Mapped[int] = mapped_column(ForeignKey("arm.id"))
    decision: Mapped[str] = mapped_column(String(16))  # keep | reject | inconclusive
    reasons: Mapped[list[Any]]  # deciding reasons first
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)  # Verdict.to_dict(): metric rows, gates, ...
    created_at: Mapped[datetime]


class NoiseModel(Base):
    """One key metric's boot-to-boot noise on one host, from a `lab calibrate` run (`lab.runner.calibrate`)."""

    __tablename__ = "noise_model"
    __table_args__ = (UniqueConstraint("run_id", "metric"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id"))
    ladder_name: Mapped[str] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(200))
    metric: Mapped[str] = mapped_column(Text)  # the key metric's label, instrument.metric[where]
    boots: Mapped[int]  # control boots measured
    sd_log: Mapped[float] = mapped_column(Float)  # SD of an A/A effect (log ratio against interpolated controls)
    df: Mapped[int]
    drift_pct: Mapped[float] = mapped_column(Float)  # widest disagreement among the controls
    mde_pct: Mapped[float] = mapped_column(Float)  # at `repeats` boots per arm, `power`, 95 % confidence
    repeats: Mapped[int]
    power: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime]


class SeriesPoint(Base):
    """One `lab sweep` run filed under its series (ladder and host, `<ladder>@<host>`; an earlier lab
    added the control's config hash to the name) with the user's label and the base config it ran."""

    __tablename__ = "series_point"
    __table_args__ = (UniqueConstraint("series", "label"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    series: Mapped[str] = mapped_column(String(300), index=True)
    label: Mapped[str] = mapped_column(String(200))
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id"), unique=True)
    ladder_name: Mapped[str] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(200))
    identity: Mapped[dict[str, Any]]  # engine kind, model, the control's config hash, flags, env and config
    created_at: Mapped[datetime]


class TuneTrial(Base):
    """One `lab tune` trial: an Optuna trial and the one-boot run that measured it (`lab.tune`)."""

    __tablename__ = "tune_trial"
    __table_args__ = (UniqueConstraint("study", "number"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    study: Mapped[str] = mapped_column(String(200), index=True)
    number: Mapped[int]  # the Optuna trial number
    optuna_trial_id: Mapped[int]
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id"), unique=True)
    boot_id: Mapped[int | None] = mapped_column(ForeignKey("boot.id"))
    params: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16))  # running | complete | failed
    values: Mapped[list[Any] | None] = mapped_column(JSON)
    constraints: Mapped[list[Any] | None] = mapped_column(JSON)  # <= 0 is feasible, as Optuna reads them
    reason: Mapped[str | None] = mapped_column(Text)  # why it failed, with the boot's log tail
    created_at: Mapped[datetime]

"""Everything the lab writes, each call in its own transaction.

A step's cells, receipts and qeval items are written together or not at all, so a run killed at
any moment leaves whole steps only, and the unique keys make a second copy of a step impossible.
A write a PostgreSQL restart cut is run again whole; any other failure to write (a full disk, a
read-only store) is a one-line StoreError (lab/store/reconnect.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from lab.store import models as m
from lab.store.db import Store
from lab.store.reconnect import writes
from lab.store.records import Step as PlannedStep
from lab.store.records import RECEIPT_FIELDS, PlannedSlot, RunPlan, StepResult


def now() -> datetime:
    return datetime.now(timezone.utc)


def params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)


class NameTaken(ValueError):
    """Another run already has this name (another `lab run` may have stored it a moment ago)."""


@writes
def create_run(store: Store, *, name: str, ladder_name: str, ladder_path: str, ladder_text: str, sha256: str,
               engine_kind: str, logs_dir: str, plan: RunPlan, borrowed: list[dict[str, Any]] | None = None) -> int:
    """The run with its arms and planned slots, in one transaction; NameTaken if the name is."""
    try:
        with store.session() as s, s.begin():
            run = m.Run(name=name, ladder_name=ladder_name, ladder_path=ladder_path, ladder_text=ladder_text,
                        ladder_sha256=sha256, engine_kind=engine_kind, logs_dir=logs_dir, status="running",
                        created_at=now(), borrowed=borrowed)
            s.add(run)
            s.flush()
            arm_ids = {}
            for spec in plan.arms:
                arm = m.Arm(run_id=run.id, name=spec.name, role=spec.role, window=spec.window, change=spec.change,
                            multi=spec.multi, flags=spec.flags, env=spec.env, config=spec.config,
                            config_hash=spec.config_hash)
                s.add(arm)
                s.flush()
                arm_ids[spec.name] = arm.id
            for slot in plan.slots:
                s.add(m.Slot(run_id=run.id, idx=slot.idx, arm_id=arm_ids[slot.arm], role=slot.role,
                             position=slot.position, window=slot.window, status="pending"))
            return run.id
    except IntegrityError as exc:  # the run's name is its one unique key that another process can take
        raise NameTaken(name) from exc


@writes
def add_slot(store: Store, run_id: int, slot: PlannedSlot) -> None:
    """One more planned slot of a run's arm (a tune trial booted again after a cold boot)."""
    with store.session() as s, s.begin():
        arm_id = s.scalars(select(m.Arm.id).where(m.Arm.run_id == run_id, m.Arm.name == slot.arm)).one()
        s.add(m.Slot(run_id=run_id, idx=slot.idx, arm_id=arm_id, role=slot.role, position=slot.position,
                     window=slot.window, status="pending"))


@writes
def claim_run(store: Store, run_id: int, pid: int, started: float | None) -> None:
    with store.session() as s, s.begin():
        run = s.get_one(m.Run, run_id)
        run.owner_pid, run.owner_started = pid, started


@writes
def set_run_status(store: Store, run_id: int, status: str, reason: str | None = None) -> None:
    with store.session() as s, s.begin():
        run = s.get_one(m.Run, run_id)
        run.status = status
        run.reason = reason
        run.finished_at = now() if status == "done" else None


@writes
def add_run_warnings(store: Store, run_id: int, texts: list[str]) -> None:
    """Add warnings about the run's ladder, each once."""
    with store.session() as s, s.begin():
        run = s.get_one(m.Run, run_id)
        run.warnings = list(dict.fromkeys([*(run.warnings or []), *texts]))


@writes
def start_boot(store: Store, *, run_id: int, slot_id: int, **fields: Any) -> tuple[int, int]:
    """A new boot row for the slot, numbered after any earlier attempt: (boot id, attempt)."""
    with store.session() as s, s.begin():
        attempts = s.scalars(select(m.Boot.attempt).where(m.Boot.slot_id == slot_id)).all()
        boot = m.Boot(run_id=run_id, slot_id=slot_id, attempt=max(attempts, default=0) + 1, status="starting",
                      started_at=now(), **fields)
        s.add(boot)
        s.flush()
        return boot.id, boot.attempt


@writes
def update_boot(store: Store, boot_id: int, **fields: Any) -> None:
    with store.session() as s, s.begin():
        boot = s.get_one(m.Boot, boot_id)
        for key, value in fields.items():
            setattr(boot, key, value)


@writes
def set_slot_status(store: Store, slot_id: int, status: str) -> None:
    with store.session() as s, s.begin():
        s.get_one(m.Slot, slot_id).status = status


@writes
def write_step(store: Store, *, slot_id: int, boot_id: int, instrument: str, step: PlannedStep,
               result: StepResult | None, error: str | None, started_at: datetime) -> int:
    """One step with all its cells, receipts and qeval items, in one transaction."""
    with store.session() as s, s.begin():
        row = m.Step(slot_id=slot_id, boot_id=boot_id, instrument=instrument, key=step.key, params=_json(step.params),
                     status="error" if error else "ok", error=error, started_at=started_at, finished_at=now())
        s.add(row)
        s.flush()
        if result is None:
            return row.id
        request_ids = []
        for idx, receipt in enumerate(result.receipts):
            fields = {f: _json(getattr(receipt, f, None)) for f in RECEIPT_FIELDS}
            fields["payload"] = stored_payload(fields["payload"])
            request = m.Request(step_id=row.id, boot_id=boot_id, idx=idx, **fields)
            s.add(request)
            s.flush()
            request_ids.append(request.id)
        for cell in result.cells:
            indexes = range(len(request_ids)) if cell.requests is None else cell.requests
            ids = [request_ids[i] for i in indexes]
            unvouched = sum(getattr(result.receipts[i], "unvouched", None) is not None for i in indexes)
            params = _json(cell.params)
            s.add(m.Cell(step_id=row.id, slot_id=slot_id, boot_id=boot_id, instrument=instrument, metric=cell.metric,
                         params=params, params_key=params_key(params), repeat=cell.repeat,
                         value=None if cell.value is None else float(cell.value), unit=cell.unit, valid=cell.valid,
                         note=cell.note, request_ids=ids, unvouched_streams=unvouched))
        for item in result.items:
            s.add(m.QevalItem(step_id=row.id, slot_id=slot_id, boot_id=boot_id,
                              request_id=None if item.request is None else request_ids[item.request], task=item.task,
                              category=item.category, scorer=item.scorer, passed=item.passed, score=item.score,
                              output=item.output, expected=item.expected, detail=_json(item.detail)))
        return row.id


@writes
def write_verdict(store: Store, *, run_id: int, arm: str, decision: str, reasons: list[str],
                  detail: dict[str, Any]) -> None:
    """The KEEP decision for an arm; a later decision for the same arm replaces the earlier one."""
    with store.session() as s, s.begin():
        arm_id = s.scalar(select(m.Arm.id).where(m.Arm.run_id == run_id, m.Arm.name == arm))
        if arm_id is None:
            raise KeyError(f"run {run_id} has no arm {arm!r}")
        s.execute(delete(m.Verdict).where(m.Verdict.run_id == run_id, m.Verdict.arm_id == arm_id))
        s.add(m.Verdict(run_id=run_id, arm_id=arm_id, decision=decision, reasons=list(reasons), detail=_json(detail),
                        created_at=now()))


# A prompt longer than this (characters of text, or token ids) is stored by digest: a 131K-token
# prefill, or a conversation resumed at 110K tokens turn after turn, would otherwise make each
# receipt megabytes. Instruments build their prompts from the boot's salt, so the digest, the
# length and the head identify the prompt, and the run's code regenerates it.
LONG_PROMPT = 8192


def stored_payload(payload: Any) -> Any:
    """The request body as stored: long prompts (`prompt`, a message's `content`) replaced by
    `{"sha256", "length", "head"}`; everything else exactly as sent."""
    if not isinstance(payload, dict):
        return payload
    out = dict(payload)
    if "prompt" in out:
        out["prompt"] = _digest_if_long(out["prompt"])
    if isinstance(out.get("messages"), list):
        out["messages"] = [{**msg, "content": _digest_if_long(msg.get("content"))} if isinstance(msg, dict) else msg
                           for msg in out["messages"]]
    return out


def _digest_if_long(value: Any) -> Any:
    if not isinstance(value, (str, list)) or len(value) <= LONG_PROMPT:
        return value
    blob = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    return {"sha256": hashlib.sha256(blob).hexdigest(), "length": len(value), "head": value[:256]}


def _json(value: Any) -> Any:
    """Round-trip through JSON so what is stored is exactly what a reader will get back."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.loads(json.dumps(value, default=_plain))


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return str(value)


@writes
def write_noise(store: Store, *, run_id: int, ladder_name: str, host: str, rows: list[dict[str, Any]]) -> None:
    """A calibration's noise model, one row per key metric; calibrating the run again replaces them."""
    with store.session() as s, s.begin():
        for old in s.scalars(select(m.NoiseModel).where(m.NoiseModel.run_id == run_id)).all():
            s.delete(old)
        s.flush()
        for row in rows:
            s.add(m.NoiseModel(run_id=run_id, ladder_name=ladder_name, host=host, created_at=now(), **row))


@writes
def add_series_point(store: Store, *, series: str, label: str, run_id: int, ladder_name: str, host: str,
                     identity: dict[str, Any]) -> None:
    """File a sweep run under its series; a label already in the series is refused (ValueError), also
    one an earlier lab filed under the same ladder and host with its config hash in the series name."""
    with store.session() as s, s.begin():
        taken = s.scalar(select(m.SeriesPoint).where(m.SeriesPoint.ladder_name == ladder_name,
                                                     m.SeriesPoint.host == host, m.SeriesPoint.label == label))
        if taken is not None:
            raise ValueError(f"label {label!r} is already in series {series} (run id {taken.run_id}); pick another")
        s.add(m.SeriesPoint(series=series, label=label, run_id=run_id, ladder_name=ladder_name, host=host,
                            identity=_json(identity), created_at=now()))


@writes
def add_trial(store: Store, *, study: str, number: int, optuna_trial_id: int, run_id: int,
              params: dict[str, Any]) -> None:
    with store.session() as s, s.begin():
        s.add(m.TuneTrial(study=study, number=number, optuna_trial_id=optuna_trial_id, run_id=run_id,
                          params=_json(params), state="running", created_at=now()))


@writes
def finish_trial(store: Store, study: str, number: int, **fields: Any) -> None:
    """State, values, constraints, boot and reason of a trial once its boot ended."""
    with store.session() as s, s.begin():
        row = s.scalars(select(m.TuneTrial).where(m.TuneTrial.study == study, m.TuneTrial.number == number)).one()
        for key, value in fields.items():
            setattr(row, key, _json(value))

"""The store keeps one copy of everything: a step, a cell, a receipt can only be written once."""

from __future__ import annotations

import dataclasses
import sqlite3
from contextlib import closing

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from lab.instruments.receipt import Receipt, TokenLogprob
from lab.ladder.render import plan
from lab.ladder.validate import parse_ladder
from lab.store import models as m
from lab.store import reader, rows, writer
from lab.store.db import StoreError, open_store, resolve_url
from lab.store.records import Cell, Step, StepResult
from lab.store.stored_rows import StoredRows

LADDER = """\
name: s
engine: {kind: bundled}
windows:
  - name: W1
    arms:
      - {name: A1, flags: {seed: 1}}
"""


def planned_run(store) -> tuple[int, int, int]:
    p = plan(parse_ladder(LADDER, "s.yaml"))
    run_id = writer.create_run(store, name="r", ladder_name="s", ladder_path="s.yaml", ladder_text=LADDER,
                               sha256="0" * 64, engine_kind="bundled", logs_dir="/tmp", plan=p)
    with store.session() as s:
        slot_id = s.scalar(select(m.Slot.id).where(m.Slot.idx == 1))
    boot_id, attempt = writer.start_boot(store, run_id=run_id, slot_id=slot_id)
    assert attempt == 1
    return run_id, slot_id, boot_id


def test_a_step_is_stored_whole_and_only_once(store) -> None:
    _, slot_id, boot_id = planned_run(store)
    result = StepResult(cells=[Cell("tok_s", 12.5, "tok/s", params={"len": 512}, requests=[1]),
                               Cell("tok_s", 13.0, "tok/s", params={"len": 512}, repeat=1)],
                        receipts=[Receipt("a", "/v1/completions", {"prompt": "x"}, 0, status=200, prompt_tokens=512),
                                  Receipt("b", "/v1/completions", {"prompt": "y"}, 1, t_first_token_ns=5,
                                          status=200, prompt_tokens=512, token_times_ns=[5, 7],
                                          logprobs=[TokenLogprob("a", -0.5, {"a": -0.5, "b": -1.5})])])
    step = Step("len=512", {"len": 512})
    writer.write_step(store, slot_id=slot_id, boot_id=boot_id, instrument="prefill", step=step, result=result,
                      error=None, started_at=writer.now())
    with pytest.raises(IntegrityError):  # a second copy of the step: refused, nothing half-written
        writer.write_step(store, slot_id=slot_id, boot_id=boot_id, instrument="prefill", step=step, result=result,
                          error=None, started_at=writer.now())
    with store.session() as s:
        cells = s.scalars(select(m.Cell).order_by(m.Cell.repeat)).all()
        requests = s.scalars(select(m.Request).order_by(m.Request.idx)).all()
        assert len(cells) == 2 and len(requests) == 2
        assert cells[0].request_ids == [requests[1].id] and cells[1].request_ids == [r.id for r in requests]
        assert (requests[1].token_times_ns, requests[1].t_first_ns, requests[1].request_id) == ([5, 7], 5, "b")
        assert requests[1].logprobs == [{"token": "a", "logprob": -0.5, "top": {"a": -0.5, "b": -1.5}}]
        assert requests[0].payload == {"prompt": "x"}
    # a second boot of the same slot (after a resume) cannot store the same step either
    boot2, attempt = writer.start_boot(store, run_id=1, slot_id=slot_id)
    assert attempt == 2
    with pytest.raises(IntegrityError):
        writer.write_step(store, slot_id=slot_id, boot_id=boot2, instrument="prefill", step=step, result=None,
                          error="x", started_at=writer.now())


def test_duplicate_cells_within_a_step_are_refused_with_the_whole_step(store) -> None:
    _, slot_id, boot_id = planned_run(store)
    twice = StepResult(cells=[Cell("tok_s", 1.0, "tok/s"), Cell("tok_s", 2.0, "tok/s")])
    with pytest.raises(IntegrityError):
        writer.write_step(store, slot_id=slot_id, boot_id=boot_id, instrument="x", step=Step("k"), result=twice,
                          error=None, started_at=writer.now())
    with store.session() as s:
        assert s.scalars(select(m.Step)).all() == []


def test_verdict_for_an_arm_is_replaced_not_duplicated(store) -> None:
    run_id, _, _ = planned_run(store)
    writer.write_verdict(store, run_id=run_id, arm="A1", decision="inconclusive", reasons=["no data"], detail={})
    writer.write_verdict(store, run_id=run_id, arm="A1", decision="keep", reasons=["+3%"], detail={"x": 1})
    with store.session() as s:
        assert [(v.decision, v.reasons) for v in s.scalars(select(m.Verdict))] == [("keep", ["+3%"])]


def test_db_takes_a_path_or_a_url_and_refuses_another_schema(tmp_path) -> None:
    assert resolve_url("lab.db").startswith("sqlite:////")
    # PostgreSQL through psycopg 3, the driver the lab installs, unless the URL names another.
    assert resolve_url("postgresql://u@h/db") == resolve_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert resolve_url("postgresql+psycopg2://h/db") == "postgresql+psycopg2://h/db"
    url_store = open_store(f"sqlite:///{tmp_path / 'u.db'}")
    url_store.close()
    assert (tmp_path / "u.db").exists()
    with pytest.raises(StoreError, match="no store at"):
        open_store(str(tmp_path / "missing.db"), read_only=True)
    store = open_store(str(tmp_path / "v.db"))
    with store.session() as s, s.begin():
        s.get_one(m.Meta, "schema_version").value = "0"
    store.close()
    with pytest.raises(StoreError, match="has store schema 0"):
        open_store(str(tmp_path / "v.db"))


def test_processes_creating_one_new_store_at_once_all_open_it(tmp_path) -> None:
    """`lab run` creates its store while `lab ls` (or a test) may open it: SQLite commits each
    CREATE TABLE on its own, so concurrent creators see each other's half-made schema."""
    import subprocess
    import sys

    import time

    # Each process imports first and says so; once all have, they get one shared start time just
    # ahead, so they really collide however long the imports took.
    opener = ("import sys, time; from lab.store.db import open_store; print('ready', flush=True); "
              "time.sleep(max(0.0, float(sys.stdin.readline()) - time.time())); open_store(sys.argv[1]).close()")
    for i in range(3):
        db = tmp_path / f"race-{i}.db"
        procs = [subprocess.Popen([sys.executable, "-c", opener, str(db)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(6)]
        # One that died importing gets no start time: the others read an empty line and fail with it.
        if [p.stdout.readline() for p in procs] == [b"ready\n"] * 6:
            start = f"{time.time() + 0.5}\n".encode()
            for p in procs:
                p.stdin.write(start)
                p.stdin.flush()
        errors = [p.communicate(timeout=120)[1].decode() for p in procs]
        assert [p.returncode for p in procs] == [0] * 6, "\n".join(e for e in errors if e)[-2000:]


RECORDS = {rows.RunRecord: m.Run, rows.ArmRecord: m.Arm, rows.SlotRecord: m.Slot, rows.BootRecord: m.Boot,
           rows.StepRecord: m.Step, rows.CellRecord: m.Cell, rows.RequestRecord: m.Request,
           rows.QevalItemRecord: m.QevalItem, rows.NoiseRecord: m.NoiseModel, rows.SeriesPointRecord: m.SeriesPoint}


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.__name__)
def test_a_record_holds_every_column_of_its_table(record: type) -> None:
    """A column added to a table reaches the readers' callers only through its record."""
    columns = {c.name for c in RECORDS[record].__table__.columns} - {"params_key"}  # the cell's unique key only
    extra = {"arm", "boots"} if record is rows.SlotRecord else set()
    assert {f.name for f in dataclasses.fields(record)} == columns | extra


def test_readers_hand_out_frozen_records_that_outlive_the_store(store, tmp_path) -> None:
    run_id, slot_id, boot_id = planned_run(store)
    writer.update_boot(store, boot_id, status="done", cold=True, capabilities={"answered": True})
    result = StepResult(cells=[Cell("tok_s", 12.5, "tok/s", params={"len": 512})],
                        receipts=[Receipt("a", "/v1/completions", {"prompt": "x"}, 0, status=200, text="hi")])
    writer.write_step(store, slot_id=slot_id, boot_id=boot_id, instrument="prefill", step=Step("k", {"len": 512}),
                      result=result, error=None, started_at=writer.now())
    run = reader.find_run(store, "r")
    slots = reader.slots(store, run_id)
    steps = StoredRows(store).boot_slot_steps(boot_id, "prefill")
    [cell] = StoredRows(store).slot_cells(slot_id, "prefill", "tok_s")
    store.close()
    (tmp_path / "lab.db").unlink()  # nothing below may reach the database
    assert (run.name, run.status, run.ladder_text) == ("r", "running", LADDER)
    assert [(s.idx, s.arm, s.role, [b.status for b in s.boots]) for s in slots] == \
        [(0, "W1ctl", "control", []), (1, "A1", "arm", ["done"]), (2, "W1ctl", "control", [])]
    assert slots[1].boots[0].cold and slots[1].boots[0].capabilities == {"answered": True}
    assert [s.key for s in steps.steps] == ["k"] and [r.text for r in steps.requests] == ["hi"]
    assert (cell.value, cell.params, cell.request_ids) == (12.5, {"len": 512}, [steps.requests[0].id])
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.status = "done"  # type: ignore[misc]


def test_a_store_opened_read_only_reads_and_refuses_every_write(store, tmp_path) -> None:
    run_id, _, _ = planned_run(store)
    store.close()
    before = (tmp_path / "lab.db").read_bytes()
    reading = open_store(str(tmp_path / "lab.db"), read_only=True)
    try:
        assert [r.name for r in reader.list_runs(reading)] == ["r"]
        with pytest.raises(StoreError, match=r"^cannot write the store \S*lab\.db: OperationalError: attempt to "
                                             r"write a readonly database$"):
            writer.set_run_status(reading, run_id, "done")
    finally:
        reading.close()
    assert (tmp_path / "lab.db").read_bytes() == before


def test_a_reader_never_upgrades_an_older_store_and_says_what_it_lacks(tmp_path) -> None:
    db = tmp_path / "old.db"
    open_store(str(db)).close()
    with closing(sqlite3.connect(db)) as con:
        con.execute("ALTER TABLE run DROP COLUMN reason")  # the table as an earlier lab created it
    with pytest.raises(StoreError, match=r"old.db was written by an earlier lab and lacks run.reason; a command "
                                         r"that writes \(`lab run`, `lab calibrate`\) adds it"):
        open_store(str(db), read_only=True)
    with closing(sqlite3.connect(db)) as con:
        assert "reason" not in [row[1] for row in con.execute("PRAGMA table_info(run)")]
    open_store(str(db)).close()  # a writer adds it in place
    open_store(str(db), read_only=True).close()

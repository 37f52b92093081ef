"""A `lab run` killed at any moment resumes with `--resume` and ends with exactly the cells of an
uninterrupted run: none lost, none twice."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import func, select

from lab.store import models as m
from lab.store.db import Store, open_store
from tests.lab.conftest import lab_process, stub_ladder

BODY = """\
windows:
  - name: W1
    control: C0ctl
    arms:
      - {name: A1, flags: {seqs: 2}}
      - {name: A2, flags: {seqs: 3}}
instruments:
  ping: {steps: 4, delay_s: 0.6}  # margin for the kill to land mid-boot on a loaded machine
  memory:
"""


def cell_keys(store: Store) -> list[tuple]:
    with store.session() as s:
        rows = s.execute(select(m.Slot.idx, m.Cell.instrument, m.Step.key, m.Cell.metric, m.Cell.params_key,
                                m.Cell.repeat)
                         .join(m.Step, m.Cell.step_id == m.Step.id).join(m.Slot, m.Cell.slot_id == m.Slot.id)).all()
    return sorted(tuple(r) for r in rows)


def finish(proc, timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode()


def wait_for_steps(proc, db: Path, slot_idx: int, count: int, timeout: float = 60) -> m.Boot:
    """Block until slot `slot_idx` has `count` steps stored; return its live boot."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"lab run ended early ({proc.returncode}): {proc.stdout.read().decode()}")
        if db.exists():
            store = open_store(str(db))
            try:
                with store.session() as s:
                    stored = s.scalar(select(func.count()).select_from(m.Step).join(m.Slot)
                                      .where(m.Slot.idx == slot_idx))
                    if stored >= count:
                        return s.scalar(select(m.Boot).join(m.Slot).where(m.Slot.idx == slot_idx))
            finally:
                store.close()
        time.sleep(0.05)
    raise TimeoutError(f"slot {slot_idx} never stored {count} steps")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_left_engines(db: Path) -> None:
    """Stop every engine a run recorded that is still alive: a failing assertion must not leave the
    engines of a killed `lab run` behind (each runs in its own process group)."""
    if not db.exists():
        return
    store = open_store(str(db))
    try:
        with store.session() as s:
            boots = s.execute(select(m.Boot.pid, m.Boot.pid_started)).all()
    finally:
        store.close()
    for pid, started in boots:
        # Only the process the run started: a pid reused since then has another create time.
        if pid and alive(pid) and started and abs(psutil.Process(pid).create_time() - started) < 1e-3:
            os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def cleanup(tmp_path: Path):
    yield
    for db in tmp_path.rglob("lab.db"):
        stop_left_engines(db)


@pytest.mark.usefixtures("cleanup")
def test_kill_9_then_resume_gives_exactly_the_cells_of_an_uninterrupted_run(tmp_path: Path) -> None:
    ladder = stub_ladder(tmp_path, BODY)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir(), cut.mkdir()
    # The uninterrupted run gives the cells to expect; no kill lands in it, so its pings need no
    # margin (the delay is in no cell's key).
    unpaced = stub_ladder(whole, BODY.replace("delay_s: 0.6", "delay_s: 0"))
    code, out = finish(lab_process(["run", str(unpaced), "--name", "r"], whole, with_ping=True))
    assert code == 0, out

    victim = lab_process(["run", str(ladder), "--name", "r"], cut, with_ping=True)
    wait_for_steps(victim, cut / "lab.db", slot_idx=0, count=1)
    code, out = finish(lab_process(["run", "--resume", "r"], cut, with_ping=True))
    assert code == 1 and "is still running in process" in out  # a live run's engines are not touched
    boot = wait_for_steps(victim, cut / "lab.db", slot_idx=1, count=2)  # A1 is half measured
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    # The kernel sends the engine SIGTERM when the lab that started it dies (lab/runner/parent_death.py).
    deadline = time.monotonic() + 10
    while alive(boot.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(boot.pid), "the engine outlived a kill -9 of the lab run that started it"

    code, out = finish(lab_process(["run", "--resume", "r"], cut, with_ping=True))
    assert code == 0, out

    expected = cell_keys(open_store(str(whole / "lab.db")))
    got = cell_keys(open_store(str(cut / "lab.db")))
    assert got == expected
    assert len(got) == len(set(got)) == 4 * (4 + 1)  # four boots: four pings and a memory floor each

    store = open_store(str(cut / "lab.db"))
    with store.session() as s:
        a1 = s.scalars(select(m.Boot).join(m.Slot).where(m.Slot.idx == 1).order_by(m.Boot.attempt)).all()
        assert [b.status for b in a1] == ["interrupted", "done"]
        assert a1[0].reason == "lab run was killed during this boot"
        steps = s.scalars(select(m.Step).join(m.Slot).where(m.Slot.idx == 1).order_by(m.Step.id)).all()
        by_boot = [(st.key, st.boot_id) for st in steps]
        assert by_boot[:2] == [("ping-0", a1[0].id), ("ping-1", a1[0].id)]
        assert {b for _, b in by_boot[2:]} == {a1[1].id}  # the rest ran on the fresh boot
        assert s.scalar(select(m.Run.status)) == "done"
        # every cell points at the receipts behind it
        cell = s.scalar(select(m.Cell).where(m.Cell.instrument == "ping").limit(1))
        request = s.get_one(m.Request, cell.request_ids[0])
        assert request.step_id == cell.step_id and request.status == 200 and request.prompt_tokens == 1


@pytest.mark.usefixtures("cleanup")
def test_sigterm_stops_the_engine_and_leaves_the_run_resumable(tmp_path: Path) -> None:
    ladder = stub_ladder(tmp_path, BODY)
    victim = lab_process(["run", str(ladder), "--name", "t"], tmp_path, with_ping=True)
    boot = wait_for_steps(victim, tmp_path / "lab.db", slot_idx=0, count=1)
    victim.send_signal(signal.SIGTERM)
    code, out = finish(victim)
    assert code == 130 and "lab run --resume t" in out, out
    assert not alive(boot.pid)
    store = open_store(str(tmp_path / "lab.db"))
    with store.session() as s:
        assert s.scalar(select(m.Run.status)) == "interrupted"
        assert s.get_one(m.Boot, boot.id).status == "interrupted"
    code, out = finish(lab_process(["run", "--resume", "t"], tmp_path, with_ping=True))
    assert code == 0, out
    assert len(cell_keys(store)) == 20
    code, out = finish(lab_process(["run", "--resume", "t"], tmp_path, with_ping=True))
    assert code == 1 and "already complete" in out
    assert os.path.exists(tmp_path / "runs" / "t" / "boots" / "00-C0ctl-open-a2.log")


@pytest.mark.usefixtures("cleanup")
def test_a_time_budget_stops_before_a_boot_it_cannot_hold_and_resume_finishes_the_run(tmp_path: Path) -> None:
    body = BODY.replace("delay_s: 0.6", "delay_s: 0.2") + "hygiene:\n  warmup_boot: true\n"
    ladder = stub_ladder(tmp_path, body)
    # One second holds no boot: the warm-up and the first control start anyway (no boot of their
    # kind has finished to say how long one takes), and the run stops before the first arm.
    code, out = finish(lab_process(["run", str(ladder), "--name", "b", "--time-budget", "1"], tmp_path,
                                   with_ping=True))
    assert code == 75, out
    assert "measured boot took" in out and "stopped before slot 2 (A1)" in out and "lab run --resume b" in out
    store = open_store(str(tmp_path / "lab.db"))
    with store.session() as s:
        run = s.scalar(select(m.Run))
        assert run.status == "interrupted" and "time budget" in run.reason
        slots = s.scalars(select(m.Slot).order_by(m.Slot.idx)).all()
        assert [sl.status for sl in slots] == ["done", "done", "pending", "pending", "pending"]
        assert s.scalar(select(func.count()).select_from(m.Boot)) == 2

    # A budget that holds every boot runs the rest to the end.
    code, out = finish(lab_process(["run", "--resume", "b", "--time-budget", "600"], tmp_path, with_ping=True))
    assert code == 0, out
    with store.session() as s:
        assert s.scalar(select(m.Run.status)) == "done"
        assert s.scalar(select(func.count()).select_from(m.Boot)) == 5
    assert len(cell_keys(store)) == 4 * (4 + 1)  # the four measured boots' pings and memory floors


def test_a_time_budget_that_is_not_a_positive_number_is_refused(tmp_path: Path) -> None:
    ladder = stub_ladder(tmp_path, BODY)
    for bad in ("0", "ten"):
        code, out = finish(lab_process(["run", str(ladder), "--time-budget", bad], tmp_path))
        assert code == 2 and "--time-budget" in out, out
    assert not (tmp_path / "lab.db").exists()

"""Faults of the engine while `lab run` boots and measures it: each boot ends in a status that says
what happened, the run goes on to its next boot, and no stored cell is lost or stored twice."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from lab.runner import boot as engine_boot
from lab.runner.parent_death import dies_with_parent
from lab.store import models as m
from tests.faults.conftest import (boot_of, finish, gone_within, keys, ladder, query, run, start, steps_stored,
                                   wait_for)
from tests.lab.conftest import REPO, STUB


def slot_boots(db: Path, idx: int) -> list[m.Boot]:
    rows = query(db, select(m.Boot).join(m.Slot).where(m.Slot.idx == idx).order_by(m.Boot.attempt))
    return [row[0] for row in rows]


def assert_only_a1_short(db: Path, expected: list[tuple], a1_steps: set[str]) -> None:
    """Every slot but A1's (idx 1) has all its cells; A1 has those of `a1_steps`; none twice."""
    got = keys(db)
    assert len(got) == len(set(got))
    assert [k for k in got if k[0] != 1] == [k for k in expected if k[0] != 1]
    assert [k for k in got if k[0] == 1] == [k for k in expected if k[0] == 1 and k[2] in a1_steps]


def test_engine_killed_mid_instrument_ends_its_boot_as_died_and_keeps_what_it_measured(
        tmp_path: Path, expected_keys: list[tuple]) -> None:
    lab = start(["run", str(ladder(tmp_path)), "--name", "r"], tmp_path)
    db = tmp_path / "lab.db"
    wait_for("A1 has two steps stored", lambda: steps_stored(db, 1) >= 2, lab)
    engine = boot_of(db, 1)
    os.kill(engine.pid, signal.SIGKILL)
    code, out = finish(lab)
    assert code == 0, out
    [boot] = slot_boots(db, 1)
    assert boot.status == "died" and boot.exit_status == -9
    assert boot.reason.startswith("engine was killed by SIGKILL during ping ping-")
    stored = {row[0] for row in query(db, select(m.Step.key).join(m.Slot).where(m.Slot.idx == 1))}
    assert {"ping-0", "ping-1"} <= stored and "memory" not in " ".join(stored)
    assert_only_a1_short(db, expected_keys, stored)
    assert [row[0] for row in query(db, select(m.Run.status))] == ["done"]


def test_engine_that_hangs_past_the_request_deadline_is_stopped_as_hung(tmp_path: Path,
                                                                         expected_keys: list[tuple]) -> None:
    hang = tmp_path / "hang"
    path = ladder(tmp_path, f"hang-file: {hang}", request_timeout_s=1.5)
    lab = start(["run", str(path), "--name", "r"], tmp_path)
    db = tmp_path / "lab.db"
    wait_for("A1 has a step stored", lambda: steps_stored(db, 1) >= 1, lab)
    hang.touch()  # from now on A1's engine takes every request and answers nothing
    began = time.monotonic()
    wait_for("A1's boot ended", lambda: boot_of(db, 1, "hung"), lab)
    # The step's request waits 1.5 s, the 1-token check after it 1.5 s more; then the boot ends.
    assert time.monotonic() - began < 15
    code, out = finish(lab)
    assert code == 0, out
    [boot] = slot_boots(db, 1)
    assert boot.reason.startswith("engine stopped answering during ping ping-")
    assert boot.reason.endswith("a 1-token completion got no answer in 1.5 s")
    assert boot.stopped_by in ("SIGTERM", "SIGKILL") and gone_within(boot.pid, 1)
    assert "hanging as asked" in boot.log_tail
    stored = {row[0] for row in query(db, select(m.Step.key).join(m.Slot).where(m.Slot.idx == 1))}
    assert_only_a1_short(db, expected_keys, stored)  # the hung step is not stored: the next boot has it all


def test_engine_exiting_during_the_readiness_probe_fails_its_boot_at_once(tmp_path: Path,
                                                                         expected_keys: list[tuple]) -> None:
    code, out = run(["run", str(ladder(tmp_path, "exit-on-completion: 5", ready_timeout_s=60)), "--name", "r"],
                    tmp_path)
    assert code == 0, out
    db = tmp_path / "lab.db"
    [boot] = slot_boots(db, 1)
    assert (boot.status, boot.exit_status) == ("failed", 5)
    assert boot.reason == "engine exited with status 5 before it was ready"
    assert boot.ready_s is None and (boot.stopped_at - boot.started_at).total_seconds() < 10  # not the 60 s timeout
    assert "exiting with 5 in the middle of a completion" in boot.log_tail
    assert_only_a1_short(db, expected_keys, set())


def _thief(kind: str) -> tuple[subprocess.Popen[bytes], int]:
    """A process holding a loopback port: `silent` listens and never accepts, `server` is another
    stub engine that answers every completion. Its port, once it listens."""
    port = engine_boot.free_port()
    if kind == "silent":
        argv = [sys.executable, "-c", "import socket, sys, time; s = socket.socket(); "
                "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', int(sys.argv[1]))); "
                "s.listen(64); time.sleep(600)", str(port)]
    else:
        argv = [sys.executable, str(STUB), "--port", str(port), "--model", "stub"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=dies_with_parent(signal.SIGTERM))

    def listening() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    wait_for("the thief listens", listening)
    return proc, port


@pytest.mark.parametrize("kind", ["silent", "server"])
def test_a_port_taken_before_the_engine_listens_is_a_failed_attempt_and_the_slot_boots_again(
        kind: str, tmp_path: Path, expected_keys: list[tuple]) -> None:
    thief, port = _thief(kind)
    try:
        began = time.monotonic()
        lab = subprocess.Popen([sys.executable, "-m", "tests.faults.lab_port_race", "run",
                                str(ladder(tmp_path, ready_timeout_s=60)), "--name", "r"],
                               cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO),
                                                  "LAB_TEST_TAKEN_PORT": str(port)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               preexec_fn=dies_with_parent(signal.SIGTERM))
        code, out = finish(lab)
        assert code == 0, out
        assert time.monotonic() - began < 45  # nothing waited for the 60 s ready timeout
        db = tmp_path / "lab.db"
        first, second = slot_boots(db, 1)
        assert (first.port, first.status) == (port, "failed")
        assert first.reason.startswith(f"port {port} was taken by another process (pid {thief.pid}, ")
        assert first.reason.endswith(") before the engine could listen on it")
        assert second.status == "done" and second.port != port
        assert keys(db) == expected_keys  # the second attempt measured A1 in full, once
        assert thief.poll() is None  # the lab never signals a process it did not start
    finally:
        thief.kill()
        thief.wait()

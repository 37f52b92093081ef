"""`hygiene.neighbour`: a process beside every measured boot, pinned where the ladder says, stored
with the boot, and gone when the boot ends, however it ends, even when `lab run` is killed outright."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from lab.store import models as m
from lab.store.db import open_store
from tests.lab.conftest import lab_process, stub_ladder
from tests.lab.test_resume import alive, finish, stop_left_engines, wait_for_steps

SPIN = [sys.executable, "-c", "while True: pass"]
BODY = f"""\
windows:
  - name: W1
    control: C0ctl
    arms:
      - {{name: A1, flags: {{seqs: 2}}}}
      - {{name: A2, flags: {{exit: 3}}}}  # the engine exits at once: the boot fails
instruments:
  ping: {{steps: 3, delay_s: 0.3}}
hygiene:
  warmup_boot: true
  neighbour: {{command: [{SPIN[0]}, -c, "while True: pass"], cpus: [0]}}
"""


@pytest.fixture
def cleanup(tmp_path: Path):
    yield
    store_path = tmp_path / "lab.db"
    stop_left_engines(store_path)
    if store_path.exists():  # and any neighbour a failing assertion left behind
        for pid in neighbour_pids(store_path):
            if alive(pid):
                psutil.Process(pid).kill()


def neighbours(db: Path) -> dict[int, dict | None]:
    """Slot index -> the neighbour its last boot stored (None: none)."""
    store = open_store(str(db))
    try:
        with store.session() as s:
            rows = s.execute(select(m.Slot.idx, m.Boot.fingerprint).join(m.Boot, m.Boot.slot_id == m.Slot.id)
                             .order_by(m.Boot.id)).all()
    finally:
        store.close()
    return {idx: fingerprint.get("neighbour") for idx, fingerprint in rows}


def neighbour_pids(db: Path) -> list[int]:
    return [n["pid"] for n in neighbours(db).values() if n]


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


@pytest.mark.usefixtures("cleanup")
def test_a_neighbour_runs_pinned_beside_each_measured_boot_and_is_gone_after_it(tmp_path: Path) -> None:
    ladder = stub_ladder(tmp_path, BODY)
    proc = lab_process(["run", str(ladder), "--name", "n"], tmp_path, with_ping=True)
    boot = wait_for_steps(proc, tmp_path / "lab.db", slot_idx=1, count=1, timeout=120)
    spinning = boot.fingerprint["neighbour"]
    assert spinning["argv"] == SPIN and spinning["cpus"] == [0]
    neighbour = psutil.Process(spinning["pid"])
    assert neighbour.cmdline() == SPIN and neighbour.cpu_affinity() == [0]
    code, out = finish(proc, timeout=180)
    assert code == 0, out
    assert "✗ 03 A2: failed" in out

    stored = neighbours(tmp_path / "lab.db")
    assert stored[0] is None  # the warm-up boots alone
    assert sorted(stored) == [0, 1, 2, 3, 4]
    pids = [stored[idx]["pid"] for idx in (1, 2, 3, 4)]
    assert len(set(pids)) == 4  # one neighbour per measured boot, the failed one's included
    assert not any(alive(pid) for pid in pids)
    for idx in (1, 2, 3, 4):
        assert Path(stored[idx]["log_path"]).exists() and stored[idx]["log_path"].endswith("-neighbour.log")


@pytest.mark.usefixtures("cleanup")
def test_a_killed_lab_run_takes_its_neighbour_along(tmp_path: Path) -> None:
    ladder = stub_ladder(tmp_path, BODY.replace("delay_s: 0.3", "delay_s: 2"))
    victim = lab_process(["run", str(ladder), "--name", "k"], tmp_path, with_ping=True)
    boot = wait_for_steps(victim, tmp_path / "lab.db", slot_idx=1, count=1, timeout=120)
    pid = boot.fingerprint["neighbour"]["pid"]
    assert alive(pid)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert gone_within(pid, 10), "the neighbour outlived a kill -9 of lab run"

"""The fault-injection suite's helpers: a ladder of the stub engine whose every boot stores a known
set of cells, `lab` started as a real process, and the checks every fault ends with (the cells
stored, none twice, the engines gone). docs/faults.md lists each fault with the test behind it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest
from sqlalchemy import select

from lab.store import models as m
from lab.store.db import open_store
from tests.lab.conftest import STUB, lab_process, stub_ladder
from tests.lab.test_resume import cell_keys, stop_left_engines

# Three measured boots (C0ctl, A1, C0ctl), each three pings and a memory floor: 12 cells. A ping
# waits 0.5 s first, so a fault injected once a boot has stored a step lands before it is done.
BODY = """\
windows:
  - name: W1
    control: C0ctl
    arms:
      - {name: A1, flags: {seqs: 2}}
instruments:
  ping: {steps: 3, delay_s: 0.5}
  memory:
"""
CELLS = 3 * (3 + 1)


def ladder(tmp_path: Path, a1: str = "seqs: 2", **engine: object) -> Path:
    """BODY's ladder with A1's flags replaced by `a1` (the fault an arm carries)."""
    return stub_ladder(tmp_path, BODY.replace("{seqs: 2}", "{" + a1 + "}"), bool_style="switch", **engine)


def start(args: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    """`lab ARGS` as a process of its own, with the test-only ping instrument."""
    return lab_process(args, cwd, with_ping=True)


def finish(proc: subprocess.Popen[bytes], timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode()


def run(args: list[str], cwd: Path, timeout: float = 120) -> tuple[int, str]:
    return finish(start(args, cwd), timeout)


def wait_for(what: str, found: Callable[[], object], proc: subprocess.Popen[bytes] | None = None,
             timeout: float = 60) -> object:
    """Poll `found()` until it returns something true; fail if `proc` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"lab ended ({proc.returncode}) before {what}: {proc.stdout.read().decode()}")
        value = found()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"never: {what}")


def query(db: Path, statement):  # -> list of rows
    if not db.exists():
        return []
    store = open_store(str(db))
    try:
        with store.session() as s:
            return s.execute(statement).all()
    finally:
        store.close()


def boot_of(db: Path, slot_idx: int, status: str | None = None, run: str | None = None) -> m.Boot | None:
    """The latest boot of slot `slot_idx` (of run `run`, else of any run) with a process, in `status` if given."""
    statement = select(m.Boot).join(m.Slot).join(m.Run, m.Run.id == m.Boot.run_id).where(
        m.Slot.idx == slot_idx, m.Boot.pid.is_not(None)).order_by(m.Boot.id.desc())
    if status:
        statement = statement.where(m.Boot.status == status)
    if run:
        statement = statement.where(m.Run.name == run)
    rows = query(db, statement.limit(1))
    return rows[0][0] if rows else None


def steps_stored(db: Path, slot_idx: int) -> int:
    return len(query(db, select(m.Step.id).join(m.Slot).where(m.Slot.idx == slot_idx)))


def keys(db: Path) -> list[tuple]:
    store = open_store(str(db))
    try:
        return cell_keys(store)
    finally:
        store.close()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="session")
def unfaulted_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The store of BODY run once as run `r`, without a fault."""
    cwd = tmp_path_factory.mktemp("unfaulted")
    path = stub_ladder(cwd, BODY.replace("delay_s: 0.5", "delay_s: 0"))
    code, out = run(["run", str(path), "--name", "r"], cwd)
    assert code == 0, out
    return cwd / "lab.db"


@pytest.fixture(scope="session")
def expected_keys(unfaulted_db: Path) -> list[tuple]:
    """The cell keys every faulted run of BODY must end with."""
    got = keys(unfaulted_db)
    assert len(got) == len(set(got)) == CELLS
    return got


@pytest.fixture(autouse=True)
def no_engine_left(tmp_path: Path) -> Iterator[None]:
    """A failing assertion must not leave an engine of a test's store running."""
    yield
    for db in tmp_path.rglob("lab.db"):
        stop_left_engines(db)


STUB_TUNE = """\
    name: NAME
    engine:
      kind: command
      command: [PYTHON, STUB, --port, "{port}", --model, "{model}"]
      model: stub
      bool_style: switch
      ready_timeout_s: READY
      stop_grace_s: 2
      flags: {listen-after: GATE}
    space:
      - {flag: seqs, choices: ["1", "2", "3"]}
    objectives:
      - {metric: ping.latency_ms, where: {i: 0}}
    instruments:
      ping: {steps: 2, delay_s: 0}
    budget: {trials: 2}
    seed: 1
    """


def stub_tune(tmp_path: Path, name: str, ready_timeout_s: int = 30) -> tuple[Path, Path]:
    """(the tune file, its gate): a two-trial study of the stub engine, whose engines wait before they
    listen for as long as the gate file exists."""
    gate = tmp_path / "gate"
    gate.touch()
    text = textwrap.dedent(STUB_TUNE)
    for key, value in {"NAME": name, "PYTHON": sys.executable, "STUB": str(STUB), "READY": str(ready_timeout_s),
                       "GATE": str(gate)}.items():
        text = text.replace(key, value, 1)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path, gate

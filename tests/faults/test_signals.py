"""`lab run`, `lab calibrate` and `lab tune` told to stop (SIGTERM, SIGINT) while an engine boots:
the engine is stopped, the run or trial is stored interrupted, the command exits 130, and resuming
ends with every cell once. Killed outright (SIGKILL, as a CI timeout does), the lab takes its
engine with it: the kernel sends the engine SIGTERM (lab/runner/parent_death.py)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from sqlalchemy import select

from lab.store import models as m
from lab.store.db import open_store
from tests.faults.conftest import (BODY, boot_of, finish, gone_within, keys, ladder, query, run, start, stub_tune,
                                   wait_for)
from tests.lab.conftest import stub_ladder

SIGNALS = [signal.SIGTERM, signal.SIGINT]


def interrupt_mid_boot(lab: subprocess.Popen[bytes], db: Path, slot_idx: int, sig: int) -> tuple[m.Boot, str]:
    """Wait for slot `slot_idx`'s engine to be started and not yet ready, then send `sig` to `lab`."""
    engine = wait_for(f"slot {slot_idx} booting", lambda: boot_of(db, slot_idx, "starting"), lab)
    time.sleep(0.3)  # the lab is now polling the engine for its first completion
    lab.send_signal(sig)
    code, out = finish(lab)
    assert code == 130, out
    assert gone_within(engine.pid, 1), "the engine outlived the interrupted lab"
    [[boot]] = query(db, select(m.Boot).where(m.Boot.id == engine.id))
    assert boot.status == "interrupted" and boot.stopped_by in ("SIGTERM", "SIGKILL")
    return boot, out


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_lab_run_stopped_mid_boot_resumes_with_every_cell_once(sig: int, tmp_path: Path,
                                                               expected_keys: list[tuple]) -> None:
    gate = tmp_path / "gate"
    gate.touch()  # A1's engine waits while it exists before it listens
    db = tmp_path / "lab.db"
    lab = start(["run", str(ladder(tmp_path, f"listen-after: {gate}")), "--name", "r"], tmp_path)
    boot, out = interrupt_mid_boot(lab, db, 1, sig)
    assert "interrupted; finish it with `lab run --resume r`" in " ".join(out.split())
    assert [row[0] for row in query(db, select(m.Run.status))] == ["interrupted"]
    before = keys(db)
    assert before == [k for k in expected_keys if k[0] == 0]  # the opening control's cells, stored once
    gate.unlink()
    code, out = run(["run", "--resume", "r"], tmp_path)
    assert code == 0, out
    assert keys(db) == expected_keys


def calibration_ladder(tmp_path: Path, gate: Path) -> Path:
    body = BODY + "keep:\n  metrics: [{metric: ping.latency_ms, where: {i: 0}}]\n"
    return stub_ladder(tmp_path, body, flags=f"{{listen-after: {gate}}}", bool_style="switch")


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_lab_calibrate_stopped_mid_boot_resumes_and_measures_its_noise(sig: int, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    db = tmp_path / "lab.db"
    lab = start(["calibrate", str(calibration_ladder(tmp_path, gate)), "--boots", "3", "--name", "cal"], tmp_path)
    interrupt_mid_boot(lab, db, 0, sig)  # the warm-up boot
    assert [row[0] for row in query(db, select(m.Run.status))] == ["interrupted"]
    gate.unlink()
    code, out = run(["calibrate", "--resume", "cal"], tmp_path)
    assert code == 0, out
    assert "ping.latency_ms" in out
    got = keys(db)
    assert len(got) == len(set(got)) == 3 * 4  # three measured control boots: three pings and a memory floor each
    assert len(query(db, select(m.NoiseModel.id))) == 1




@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_lab_tune_stopped_mid_boot_fails_that_trial_and_goes_on_when_run_again(sig: int, tmp_path: Path) -> None:
    _, gate = stub_tune(tmp_path, "stubtune")
    db = tmp_path / "lab.db"
    lab = start(["tune", "stubtune.yaml"], tmp_path)
    boot, out = interrupt_mid_boot(lab, db, 0, sig)
    assert "study stubtune goes on when `lab tune stubtune.yaml` is run again" in " ".join(out.split())
    store = open_store(str(db))
    try:
        [trial] = optuna.load_study(study_name="stubtune", storage=store.url).trials
        assert trial.state == optuna.trial.TrialState.FAIL  # not left running for a waiting `lab tune`
        assert trial.user_attrs["reason"] == "interrupted: lab tune was stopped during this trial"
        with store.session() as s:
            row = s.scalar(select(m.TuneTrial))
            assert (row.state, row.boot_id) == ("failed", boot.id)
            assert s.get_one(m.Run, row.run_id).status == "interrupted"
    finally:
        store.close()
    gate.unlink()
    code, out = run(["tune", "stubtune.yaml", "--worker"], tmp_path)
    assert code == 0, out
    store = open_store(str(db))
    try:
        trials = optuna.load_study(study_name="stubtune", storage=store.url).trials
        # The stopped trial does not spend the budget of two: two more were measured.
        assert [t.state for t in trials] == [optuna.trial.TrialState.FAIL] + [optuna.trial.TrialState.COMPLETE] * 2
        with store.session() as s:
            boots = s.scalars(select(m.Boot).order_by(m.Boot.id)).all()
            # The worker's first trial boots cold (a command engine's first boot in a process), so it is
            # booted once more and measured warm; every other trial is one boot, none booted twice.
            assert [(b.status, b.cold) for b in boots] == [("interrupted", False), ("done", True), ("done", False),
                                                          ("done", False)]
    finally:
        store.close()
    # Two pings for each finished boot, the stopped one's none; keys name slots, and each trial is its own run.
    assert len(keys(db)) == 3 * 2


def test_lab_run_killed_outright_takes_its_engine_with_it(tmp_path: Path, expected_keys: list[tuple]) -> None:
    db = tmp_path / "lab.db"
    lab = start(["run", str(ladder(tmp_path)), "--name", "r"], tmp_path)
    engine = wait_for("A1 measured in part", lambda: boot_of(db, 1, "ready"), lab)
    lab.send_signal(signal.SIGKILL)
    lab.wait()
    assert gone_within(engine.pid, 10), "the engine outlived a kill -9 of the lab run that started it"
    code, out = run(["run", "--resume", "r"], tmp_path)
    assert code == 0, out
    assert keys(db) == expected_keys
    [[status, reason]] = query(db, select(m.Boot.status, m.Boot.reason).where(m.Boot.id == engine.id))
    assert (status, reason) == ("interrupted", "lab run was killed during this boot")


def test_a_stop_signal_while_a_child_starts_waits_until_the_lab_holds_the_child() -> None:
    # The child sleeps before its exec, so the signal comes while Popen waits for it: raised there,
    # it would leave a child no caller holds (and raised in the fork's own callbacks, Python drops it).
    import os
    import sys
    import threading

    from lab.runner.errors import Interrupted, signals_held, stop_on_sigterm

    proc: subprocess.Popen[bytes] | None = None
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        with pytest.raises(Interrupted), stop_on_sigterm():
            with signals_held():
                timer.start()
                proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                        preexec_fn=lambda: time.sleep(1.0))
                assert timer.finished.is_set()  # the signal came before Popen returned, and waited
            pytest.fail("the held SIGTERM was not raised when the block ended")
        assert proc is not None and proc.poll() is None
    finally:
        timer.cancel()
        if proc is not None:
            proc.kill()
            proc.wait()

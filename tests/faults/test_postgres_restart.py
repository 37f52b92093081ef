"""A PostgreSQL store restarted under a `lab tune --worker` (a real server, from the `pgserver`
wheel): while the worker waits on an engine, holding only idle connections, and while it writes a
trial's cells. The worker waits for the server and goes on: every trial is measured, each boot and
each cell stored once. Skipped, saying why, where the server cannot start."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Iterator

import optuna
import psycopg
import pytest
from sqlalchemy import select

from lab.store import models as m
from lab.store.db import open_store
from tests.faults.conftest import finish, start, stub_tune, wait_for
from tests.postgres import Server, postgres

PASSWORD = "Pw-faults-4c1e"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with postgres(PASSWORD) as running:
        yield running


def sql(server: Server, statement: str) -> list[tuple]:
    with psycopg.connect(server.url(), autocommit=True) as connection:
        return connection.execute(statement).fetchall()


def worker(tmp_path: Path, url: str, study: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`lab tune --worker` on the server, its engines held before they listen until the gate goes."""
    tune, gate = stub_tune(tmp_path, "pgfault", ready_timeout_s=120)
    return start(["tune", tune.name, "--worker", "--name", study, "--db", url], tmp_path), gate


def booting(server: Server, study: str) -> bool:
    """Whether a trial of `study` has an engine started and not yet ready."""
    try:
        return bool(sql(server, f"SELECT 1 FROM boot JOIN tune_trial ON tune_trial.run_id = boot.run_id WHERE "
                               f"tune_trial.study = '{study}' AND boot.status = 'starting' AND boot.pid IS NOT NULL"))
    except psycopg.Error:
        return False  # the lab has not created its tables yet


def measured(url: str, study: str) -> tuple[list[optuna.trial.TrialState], list[tuple], list[tuple]]:
    """The study's trial states, its boots' statuses and cold flags, and the cell keys of its trials' boots."""
    store = open_store(url)
    try:
        trials = optuna.load_study(study_name=study, storage=store.url).trials
        with store.session() as s:
            runs = s.scalars(select(m.TuneTrial.run_id).where(m.TuneTrial.study == study)).all()
            boots = s.execute(select(m.Boot.status, m.Boot.cold).where(m.Boot.run_id.in_(runs))
                              .order_by(m.Boot.id)).all()
            cells = s.execute(select(m.Cell.boot_id, m.Step.key, m.Cell.metric, m.Cell.params_key)
                              .join(m.Step, m.Step.id == m.Cell.step_id).join(m.Boot, m.Boot.id == m.Cell.boot_id)
                              .where(m.Boot.run_id.in_(runs))).all()
        return [t.state for t in trials], [tuple(b) for b in boots], [tuple(c) for c in cells]
    finally:
        store.close()


def assert_every_trial_measured_once(url: str, study: str) -> None:
    states, boots, cells = measured(url, study)
    assert states == [optuna.trial.TrialState.COMPLETE] * 2
    # The first trial boots cold (a command engine's first boot in the worker) and is booted once more,
    # measured warm; the second is one boot.
    assert boots == [("done", True), ("done", False), ("done", False)]
    assert len(cells) == len(set(cells)) == 3 * 2  # two pings per boot, each once


@pytest.mark.slow
def test_a_server_restarted_while_the_worker_waits_on_an_engine_is_waited_for(server: Server,
                                                                              tmp_path: Path) -> None:
    lab, gate = worker(tmp_path, server.url(), "idle")
    wait_for("a trial's engine booting", lambda: booting(server, "idle"), lab)
    server.stop()
    gate.unlink()  # the engine answers now: the worker's next write finds the server gone
    time.sleep(3)
    assert lab.poll() is None, "the worker gave up while the server was down"
    server.start()
    code, out = finish(lab, timeout=180)
    assert code == 0, out
    assert_every_trial_measured_once(server.url(), "idle")


@pytest.mark.slow
def test_a_server_restarted_while_the_worker_writes_a_trials_cells_costs_a_retried_write(server: Server,
                                                                                        tmp_path: Path) -> None:
    # Holding the cell table (reads still pass, inserts wait), the test stops the worker inside
    # the transaction that writes a step: its step and request rows are in, its cells not yet.
    lab, gate = worker(tmp_path, server.url(), "writing")
    wait_for("a trial's engine booting", lambda: booting(server, "writing"), lab)
    holder = psycopg.connect(server.url())
    try:
        holder.execute("LOCK TABLE cell IN EXCLUSIVE MODE")
        gate.unlink()
        wait_for("the worker waiting to insert cells", lambda: sql(server, 
            "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE 'INSERT INTO cell%'"), lab)
        server.stop()  # ends the worker's transaction and the test's lock alike
    finally:
        holder.close()
    time.sleep(1)
    server.start()
    code, out = finish(lab, timeout=180)
    assert code == 0, out
    assert_every_trial_measured_once(server.url(), "writing")

"""Two processes share one study in a real PostgreSQL server on loopback (the server of the
`pgserver` wheel): a `lab tune --worker` and a plain `lab tune` take trials side by side; every
trial is taken once, each is one stored boot, the budget is not overrun, and the plain one waits
for the worker's last trial before it confirms. Skipped, saying why, where the server cannot start."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import optuna
import pytest
from sqlalchemy import func, select, text

from lab.cli import main as lab_main
from lab.runner.parent_death import dies_with_parent
from lab.runner.boot import free_port
from lab.store import models as m
from lab.store.db import open_store
from tests.instruments.ladder_run import REPO

TUNE = """\
    name: pgtune
    engine:
      kind: bundled
      model: dummy:tiny  # what is tested is the shared study, not the model
      flags: {device: cpu, max-model-len: 128, kv-cache-memory-bytes: 16777216, max-num-seqs: 4}
    space:
      - {flag: kv-cache-memory-bytes, int: {low: 8388608, high: 33554432, log: true}}
      - {flag: max-num-seqs, choices: [2, 4, 8]}
    objectives:
      - {metric: memory.kv_pool_tokens}
    instruments:
      memory:
    budget: {trials: 3}
    seed: 3
    confirm: {top: 1}
    """


@pytest.fixture(scope="module")
def postgres(tmp_path_factory: pytest.TempPathFactory):
    """A PostgreSQL server listening on 127.0.0.1 only; its URL."""
    pgserver = pytest.importorskip("pgserver", reason="the pgserver wheel (test extra) is not installed: "
                                                      "pip install -e '.[test]'")
    # Outside pytest's own temporary tree, whose permissions a concurrent pytest tightens.
    root = Path(tempfile.mkdtemp(prefix="lab-pg-"))
    pgdata = root / "data"
    try:
        # initdb (as an unprivileged user when run as root), then restart it on loopback TCP: pgserver
        # itself listens on a Unix socket only.
        server = pgserver.get_server(pgdata, cleanup_mode=None)
        user = server.system_user
        pgserver.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user)
        port = free_port()
        pgserver.pg_ctl(["-w", "-o", f"-h 127.0.0.1 -p {port} -k {pgdata}", "-l", str(pgdata / "log"), "start"],
                        pgdata=pgdata, user=user, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"PostgreSQL (pgserver) did not start here: {exc}")
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        pgserver.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user)
        shutil.rmtree(root, ignore_errors=True)


def lab(cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "lab", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=dies_with_parent(signal.SIGTERM),
                            env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"})


@pytest.fixture(scope="module")
def shared_study(postgres: str, tmp_path_factory: pytest.TempPathFactory):
    cwd = tmp_path_factory.mktemp("pgtune")
    (cwd / "pgtune.yaml").write_text(textwrap.dedent(TUNE))
    both = [lab(cwd, "tune", "pgtune.yaml", *extra, "--storage", postgres) for extra in (["--worker"], [])]
    worker, plain = [p.communicate(timeout=600)[0] for p in both]
    assert both[0].returncode == 0, worker
    assert both[1].returncode == 0, plain
    return [p.pid for p in both], worker, plain


@pytest.mark.slow
def test_two_processes_take_every_trial_once_and_store_each_boot_once(postgres: str, shared_study) -> None:
    pids, worker, plain = shared_study
    store = open_store(postgres)
    try:
        study = optuna.load_study(study_name="pgtune", storage=store.url)
        assert sorted(t.number for t in study.trials) == [0, 1, 2]  # the budget, not one more
        assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials), worker + plain
        assert {t.user_attrs["pid"] for t in study.trials} == set(pids)  # both took trials
        with store.session() as s:
            rows = s.scalars(select(m.TuneTrial).where(m.TuneTrial.study == "pgtune")).all()
            assert sorted(r.number for r in rows) == [0, 1, 2]
            for row in rows:
                boots = s.scalars(select(m.Boot).where(m.Boot.run_id == row.run_id)).all()
                assert [b.id for b in boots] == [row.boot_id]  # one trial, one boot, stored once
                assert boots[0].status == "done"
                stats = boots[0].engine_stats["config"]
                assert stats["kv_cache_memory_bytes"] == row.params["flag:kv-cache-memory-bytes"]
                assert stats["max_num_seqs"] == row.params["flag:max-num-seqs"]
                trial = study.trials[row.number]
                assert trial.user_attrs["boot_id"] == row.boot_id and trial.values == row.values
            trial_boots = s.scalar(select(func.count()).select_from(m.Boot).join(m.Run, m.Run.id == m.Boot.run_id)
                                   .where(m.Run.ladder_name == "pgtune-trials"))
            assert trial_boots == 3
    finally:
        store.close()


@pytest.mark.slow
def test_the_plain_tune_waits_for_the_workers_trials_then_confirms(postgres: str, shared_study) -> None:
    _, worker, plain = shared_study
    assert "a plain `lab tune` on the same store confirms" in worker and "confirmation" not in worker
    # Printed after the wait: a plain tune that did not wait would count the worker's trial as running.
    assert "3 trials measured, 0 failed" in plain and "confirmation pgtune-confirm" in plain
    store = open_store(postgres)
    try:
        with store.session() as s:
            confirm = s.scalar(select(m.Run).where(m.Run.name == "pgtune-confirm"))
            assert confirm is not None and confirm.status == "done"
            arms = s.scalars(select(m.Arm.name).where(m.Arm.run_id == confirm.id, m.Arm.role == "arm")).all()
            verdicts = s.scalars(select(m.Verdict).where(m.Verdict.run_id == confirm.id)).all()
            assert len(arms) == 1 and len(verdicts) == 1 and f"{arms[0]}" in plain
            assert f"winner: {arms[0]}" in plain or verdicts[0].decision != "keep"
    finally:
        store.close()


@pytest.mark.slow
def test_the_study_and_its_runs_are_read_back_from_postgresql(postgres: str, shared_study, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert lab_main(["ls", "--db", postgres]) == 0
    listed = capsys.readouterr().out
    assert all(f"pgtune-t00{n}" in listed for n in range(3)) and "pgtune-confirm" in listed
    assert lab_main(["report", "--study", "pgtune", "--db", postgres, "--out", str(tmp_path)]) == 0
    md = (tmp_path / "pgtune" / "index.md").read_text()
    assert md.count("| complete |") == 3 and "pgtune-confirm" in md


@pytest.mark.slow
def test_a_database_user_who_may_only_read_lists_reports_and_compares(postgres: str, shared_study, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The reading commands write nothing, so SELECT is all the right they need."""
    monkeypatch.setenv("COLUMNS", "250")
    store = open_store(postgres)
    try:
        with store.engine.begin() as connection:
            connection.execute(text("CREATE ROLE reader LOGIN"))
            connection.execute(text("GRANT SELECT ON ALL TABLES IN SCHEMA public TO reader"))
        with store.session() as s:
            confirm = s.scalar(select(m.Run.id).where(m.Run.name == "pgtune-confirm"))
            [arm] = s.scalars(select(m.Arm.name).where(m.Arm.run_id == confirm, m.Arm.role == "arm")).all()
            stored = s.scalar(select(m.Verdict.decision).where(m.Verdict.run_id == confirm))
            rows = s.scalar(select(func.count()).select_from(m.Verdict))
    finally:
        store.close()
    reader = postgres.replace("postgres@", "reader@", 1)
    assert lab_main(["ls", "pgtune-confirm", "--db", reader]) == 0
    assert f"{arm}" in capsys.readouterr().out
    assert lab_main(["compare", "pgtune-confirm:C0base", f"pgtune-confirm:{arm}", "--db", reader]) == 0
    assert f"KEEP {arm}: {stored} against C0base" in capsys.readouterr().out
    assert lab_main(["report", "pgtune-confirm", "--db", reader, "--out", str(tmp_path)]) == 0
    assert lab_main(["report", "--study", "pgtune", "--db", reader, "--out", str(tmp_path)]) == 0
    assert f"| {arm} |" in (tmp_path / "pgtune-confirm" / "index.md").read_text()
    store = open_store(postgres)
    try:
        with store.session() as s:
            assert s.scalar(select(func.count()).select_from(m.Verdict)) == rows
    finally:
        store.close()


def test_an_unreachable_postgresql_store_is_refused_in_one_line(capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    url = f"postgresql://lab@127.0.0.1:{free_port()}/lab"  # nothing listens there
    assert lab_main(["ls", "--db", url]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"lab: cannot open store {url}: OperationalError: ") and "refused" in line

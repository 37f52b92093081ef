"""`lab tune` as a user meets it: the documented quickstart commands run as written (and `lab serve
--best` serves the winner the tune named, or refuses for the same reasons); a fresh host's first
boot is warmed up or booted again, never measured cold; a failure every boot meets stops the study
without spending its budget; a study whose trials all break a constraint ends with the base kept
(exit status 3, not an error)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import optuna
import pytest
from sqlalchemy import select

from lab.runner.boot import free_port
from lab.store import models as m
from lab.store.db import open_store
from tests.lab.conftest import REPO
from tests.lab.test_resume import stop_left_engines

pytestmark = pytest.mark.slow


def lab(cwd: Path, *args: str, env: dict[str, str] | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lab", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250", **(env or {})},
                          timeout=timeout)


def documented_commands() -> list[list[str]]:
    """The `lab ...` lines of docs/loop.md's quickstart tune block, comments dropped."""
    docs = (REPO / "docs" / "loop.md").read_text()
    block = next(b for b in docs.split("```")[1::2] if "lab tune tunes/quickstart.yaml" in b)
    return [shlex.split(line.split(" #")[0]) for line in block.splitlines() if line.startswith("lab ")]


def test_the_documented_quickstart_commands_run_as_written_and_serve_what_the_tune_named(tmp_path: Path) -> None:
    commands = documented_commands()
    assert [c[:2] for c in commands] == [["lab", "tune"], ["lab", "tune"], ["lab", "report"], ["lab", "serve"]]
    assert "--trials N" in (REPO / "docs" / "loop.md").read_text()  # the flag that shrinks the study here
    (tmp_path / "tunes").mkdir()
    shutil.copy(REPO / "tunes" / "quickstart.yaml", tmp_path / "tunes")
    dry, tune, report, serve = commands
    checked = lab(tmp_path, *dry[1:])
    assert checked.returncode == 0, checked.stderr
    assert "study quicktune: a new study" in checked.stdout and not (tmp_path / "lab.db").exists()
    tuned = lab(tmp_path, *tune[1:], "--trials", "2")
    assert tuned.returncode in (0, 3), tuned.stdout + tuned.stderr  # a winner, or the base stays
    assert "study quicktune: 0 of 2 trials taken; TPE (seed 10) draws the first measured trial at random" \
        in tuned.stderr
    reported = lab(tmp_path, *report[1:])
    assert reported.returncode == 0, reported.stderr
    md = (tmp_path / "reports" / "quicktune" / "index.md").read_text()
    assert "| memory.kv_pool_gib (<= 0.0015) |" in md
    port = free_port()
    if tuned.returncode == 3:  # the base stays: serve refuses, for the reasons the tune gave
        refused = lab(tmp_path, *serve[1:], "--port", str(port))
        assert refused.returncode == 1
        told = " ".join(tuned.stderr.split())
        if "nothing to confirm" in told:  # no feasible trial differed from the base: no confirmation run
            assert "no run 'quicktune-confirm' in this store" in refused.stderr
            return
        why = told.split("the confirmation (quicktune-confirm) ")[1].split(" (exit status")[0]
        assert f"run quicktune-confirm {why}; serve one anyway with --arm NAME" in " ".join(refused.stderr.split())
        return
    winner = tuned.stdout.split("winner: ")[1].split()[0]
    proc = subprocess.Popen([sys.executable, "-m", "lab", *serve[1:], "--port", str(port)], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stats = _stats_when_up(proc, port)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert f"arm {winner} of run quicktune-confirm (window W): keep" in out
    assert stats["config_hash"] == _config_hash(tmp_path / "lab.db", "quicktune-confirm", winner)


def _stats_when_up(proc: subprocess.Popen[str], port: int) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/v1/stats", timeout=5)
            if answer.status_code == 200:
                return answer.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"`lab serve --best` never answered (exit {proc.poll()})")


def _config_hash(db: Path, run: str, arm: str) -> str:
    store = open_store(str(db))
    try:
        with store.session() as s:
            run_id = s.scalar(select(m.Run.id).where(m.Run.name == run))
            return s.scalar(select(m.Arm.config_hash).where(m.Arm.run_id == run_id, m.Arm.name == arm))
    finally:
        store.close()


# The real model: its first load on a fresh cache directory builds the dequantized-weights cache,
# which makes that boot cold (deterministically; cpu-products linear times no layouts).
SMOLLM2 = """\
    name: coldtune
    engine:
      kind: bundled
      model: smollm2-135m
      flags: {device: cpu, max-model-len: 256, kv-cache-memory-bytes: 16777216, cpu-products: linear}
    space:
      - {flag: max-num-seqs, choices: [2, 4]}
    objectives:
      - {metric: memory.kv_pool_tokens}
    instruments:
      memory:
    budget: {trials: 1}
    hygiene: {warmup_boot: WARMUP}
    """


@pytest.mark.parametrize("warmup", [True, False])
def test_a_fresh_hosts_first_trial_is_never_measured_cold(tmp_path: Path, warmup: bool) -> None:
    """With the warm-up, the base boots first (cold, unmeasured) and the trial is warm; without it,
    the trial's cold boot is booted again and the trial takes the warm boot's figures."""
    (tmp_path / "cold.yaml").write_text(textwrap.dedent(SMOLLM2).replace("WARMUP", str(warmup).lower()))
    caches = {"LAB_CACHE_DIR": str(tmp_path / "cache"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    try:
        done = lab(tmp_path, "tune", "cold.yaml", "--worker", env=caches)  # the trial alone, no confirmation
    finally:
        stop_left_engines(tmp_path / "lab.db")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"warm-up boot: {'on' if warmup else 'off'} (hygiene.warmup_boot: {str(warmup).lower()})" in done.stderr
    boots = _boots_by_run(tmp_path / "lab.db")
    study = optuna.load_study(study_name="coldtune", storage=f"sqlite:///{tmp_path / 'lab.db'}")
    [trial] = study.trials
    assert trial.state == optuna.trial.TrialState.COMPLETE and "cold" not in trial.user_attrs
    if warmup:
        assert list(boots) == ["coldtune-t000-warmup", "coldtune-t000"]
        [(warm_up, cold, reason)] = boots["coldtune-t000-warmup"]
        assert cold and "weights cache" in reason
        assert [c for _, c, _ in boots["coldtune-t000"]] == [False]
        assert "✓ warm-up coldtune-t000-warmup: the base configuration booted once, unmeasured" in done.stderr
    else:
        assert list(boots) == ["coldtune-t000"]
        (first, first_cold, reason), (second, second_cold, _) = boots["coldtune-t000"]
        assert first_cold and "weights cache" in reason and not second_cold
        assert trial.user_attrs["boot_id"] == second and trial.user_attrs["rebooted"] == reason
        assert f"measured on a second boot, the first was {reason}" in done.stderr


def _boots_by_run(db: Path) -> dict[str, list[tuple[int, bool, str]]]:
    store = open_store(str(db))
    try:
        with store.session() as s:
            rows = s.execute(select(m.Run.name, m.Boot.id, m.Boot.cold, m.Boot.reason, m.Boot.status)
                             .join(m.Boot, m.Boot.run_id == m.Run.id).order_by(m.Boot.id)).all()
    finally:
        store.close()
    found: dict[str, list[tuple[int, bool, str]]] = {}
    for name, boot, cold, reason, status in rows:
        assert status == "done", (name, reason)
        found.setdefault(name, []).append((boot, cold, reason or ""))
    return found


BROKEN = f"""\
    name: broken
    engine:
      kind: command
      command: [{sys.executable}, -c, "import sys; sys.exit(3)", "{{port}}"]
      model: none
      ready_timeout_s: 30
    space:
      - {{flag: threads, choices: [1, 2, 4]}}
    objectives:
      - {{metric: memory.host_mem_available_floor_gib}}
    instruments:
      memory:
    budget: {{trials: 4}}
    """


def test_two_boots_failing_the_same_way_stop_the_study_without_spending_its_budget(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text(textwrap.dedent(BROKEN))
    done = lab(tmp_path, "tune", "broken.yaml")
    assert done.returncode == 1
    err = " ".join(done.stderr.split())
    assert re.search(r"lab: study broken stopped: trials 0 and 1 failed the same way, so every trial would: boot "
                     r"failed: engine exited with status 3 before it was ready.*Fix that, then run the same `lab tune` "
                     r"again: the study goes on, and these two trials do not spend its budget", err), err
    assert "confirmation" not in done.stdout
    study = optuna.load_study(study_name="broken", storage=f"sqlite:///{tmp_path / 'lab.db'}")
    assert [t.number for t in study.trials] == [0, 1]  # stopped after the second: two of four, not four
    for number in (0, 1):
        assert study.user_attrs[f"not_counted:{number}"].startswith("it stopped the study")
    again = lab(tmp_path, "tune", "broken.yaml", "--dry-run")
    assert again.returncode == 0 and "study broken: resumes: 0 of its 4 trials taken" in again.stdout


ALL_INFEASIBLE = """\
    name: toobig
    engine:
      kind: bundled
      model: dummy:tiny
      flags: {device: cpu, max-model-len: 256, kv-cache-memory-bytes: 2097152, cpu-products: linear}
    space:
      - {flag: kv-cache-memory-bytes, int: {low: 4194304, high: 8388608}}
    objectives:
      - {metric: memory.kv_pool_tokens}
    constraints:
      - {metric: memory.kv_pool_gib, max: 0.003}   # 3 MiB: every drawn pool is larger
    instruments:
      memory:
    budget: {trials: 2}
    """


def test_a_study_whose_trials_all_break_a_constraint_keeps_the_base_with_its_own_exit_status(tmp_path: Path) -> None:
    (tmp_path / "toobig.yaml").write_text(textwrap.dedent(ALL_INFEASIBLE))
    try:
        done = lab(tmp_path, "tune", "toobig.yaml")
    finally:
        stop_left_engines(tmp_path / "lab.db")
    assert done.returncode == 3, done.stdout + done.stderr
    err = " ".join(done.stderr.split())
    assert re.search(r"✓ trial 0 \(kv-cache-memory-bytes=\d+\): memory.kv_pool_tokens=\d+ \(infeasible: "
                     r"memory.kv_pool_gib = 0.00\d+ > max 0.003\); best so far none feasible", err), err
    assert "lab: study toobig: the base stays: no feasible trial differs from it, so there is nothing to confirm " \
           "(exit status 3)" in err

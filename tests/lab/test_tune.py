"""`lab tune` on the CPU: dummy:tiny, two knobs, a budget of five trials (the first killed with kill -9,
then resumed without spending the budget on it; the engine refuses some drawn values), then the
confirmation ladder and `lab serve --best`, which serves the winner the tune named; every trial is one
stored boot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest
from sqlalchemy import select

from lab.cli import main as lab_main
from lab.runner.parent_death import dies_with_parent
from lab.store import models as m
from lab.store.db import open_store
from tests.instruments.ladder_run import REPO
from tests.lab.test_resume import alive, stop_left_engines

# max-num-seqs 0 is refused by the engine's config check: a trial that draws it fails alone.
# cpu-products linear: no product layouts to time, so no boot is cold on a host that never timed them.
TUNE = """\
    name: quicktest
    engine:
      kind: bundled
      model: dummy:tiny
      flags: {device: cpu, max-model-len: 512, kv-cache-memory-bytes: 8388608, max-num-seqs: 4, cpu-products: linear}
    space:
      - {flag: kv-cache-memory-bytes, int: {low: 4194304, high: 33554432, log: true}}
      - {flag: max-num-seqs, choices: [0, 2, 8]}
    objectives:
      - {metric: memory.kv_pool_tokens}
    constraints:
      - {metric: memory.kv_pool_gib, max: 0.02}
    instruments:
      memory:
    budget: {trials: 5}
    seed: 4
    confirm: {top: 2}
    """


def lab(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lab", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"}, timeout=timeout)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory):
    """The study killed (-9) while its first trial's engine runs, then resumed to the end."""
    cwd = tmp_path_factory.mktemp("tune")
    (cwd / "quicktest.yaml").write_text(textwrap.dedent(TUNE))
    db = cwd / "lab.db"
    first = subprocess.Popen([sys.executable, "-m", "lab", "tune", "quicktest.yaml"], cwd=cwd,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, preexec_fn=dies_with_parent(signal.SIGTERM))
    try:
        orphan = _wait_for_engine(first, db)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        # The engine, in a process group of its own, gets SIGTERM from the kernel as lab tune dies.
        deadline = time.monotonic() + 30
        while alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.1)
        done = lab(cwd, "tune", "quicktest.yaml")
        yield cwd, done, orphan
    finally:
        stop_left_engines(db)


def _wait_for_engine(proc: subprocess.Popen[bytes], db: Path, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "lab tune ended before its first engine started"
        if db.exists():
            store = open_store(str(db))
            try:
                with store.session() as s:
                    pid = s.scalar(select(m.Boot.pid).where(m.Boot.pid.is_not(None)))
            finally:
                store.close()
            if pid:
                return pid
        time.sleep(0.1)
    raise TimeoutError("no engine started")


@pytest.mark.slow
def test_every_trial_is_one_stored_boot_and_they_point_at_each_other(tuned) -> None:
    cwd, done, orphan = tuned
    assert done.returncode == 0, done.stdout + done.stderr
    store = open_store(str(cwd / "lab.db"))
    try:
        study = optuna.load_study(study_name="quicktest", storage=store.url)
        with store.session() as s:
            rows = s.scalars(select(m.TuneTrial).order_by(m.TuneTrial.number)).all()
            by_number = {t.number: t for t in study.trials}
            assert all(t.state.is_finished() for t in study.trials)
            for row in rows:
                boots = s.scalars(select(m.Boot).where(m.Boot.run_id == row.run_id)).all()
                assert len(boots) == 1 and boots[0].id == row.boot_id  # one trial, one boot
                assert by_number[row.number].user_attrs["boot_id"] == row.boot_id
                assert by_number[row.number].user_attrs["run"] == s.get(m.Run, row.run_id).name
            complete = [r for r in rows if r.state == "complete"]
            assert complete
            for row in complete:
                assert by_number[row.number].values == row.values
                kv = row.params["flag:kv-cache-memory-bytes"]
                assert s.get(m.Boot, row.boot_id).engine_stats["config"]["kv_cache_memory_bytes"] == kv
    finally:
        store.close()


@pytest.mark.slow
def test_the_killed_trial_fails_its_engine_is_stopped_and_it_does_not_spend_the_budget(tuned) -> None:
    cwd, done, orphan = tuned
    assert not alive(orphan)
    store = open_store(str(cwd / "lab.db"))
    try:
        study = optuna.load_study(study_name="quicktest", storage=store.url)
    finally:
        store.close()
    killed, *rest = study.trials
    assert killed.state == optuna.trial.TrialState.FAIL
    assert killed.user_attrs["reason"].startswith("interrupted: lab tune was killed")
    assert study.user_attrs["not_counted:0"].startswith("abandoned")
    # The budget of five is spent on five trials after the abandoned one, refused ones included.
    assert len(rest) == 5 and not [key for key in study.user_attrs if key.startswith("not_counted:")][1:]
    refused = [t for t in rest if t.state == optuna.trial.TrialState.FAIL]
    assert refused and all("max-num-seqs must be positive" in t.user_attrs["reason"] for t in refused)
    assert "study quicktest: 0 of 5 trials taken" in done.stderr  # the killed one is not counted


@pytest.mark.slow
def test_the_tune_says_how_many_trials_tpe_draws_at_random(tuned) -> None:
    _, done, _ = tuned
    # A third of the budget of 5, so the model draws the other three (Optuna's default, 10, would
    # leave all five random).
    assert "TPE (seed 4) draws the first 2 measured trials at random, then each from a model of the trials so far " \
           "and their constraints" in done.stderr
    assert "warm-up boot: off (the engine runs on the CPU" in done.stderr


@pytest.mark.slow
def test_serve_best_serves_the_winner_the_tune_named(tuned) -> None:
    cwd, done, _ = tuned
    assert "confirmation quicktest-confirm" in done.stdout
    assert "winner: T" in done.stdout and "kept by the confirmation" in done.stdout
    winner = done.stdout.split("winner: ")[1].split()[0]
    why = done.stdout.split("kept by the confirmation (")[1].split("); serve it")[0]
    # Two trials were kept (each against the base alone): the rule picks the one that gained most,
    # where `lab serve --best` once refused to pick.
    assert why.startswith("best of 2 kept arms on memory.kv_pool_tokens: +")
    assert "serve it with `lab serve --best quicktest-confirm`" in done.stdout
    # The KEEP verdicts are the confirmation run's; memory figures do not move between boots.
    assert "→" in done.stdout and "(+0.0 %)" in done.stdout
    served = lab(cwd, "serve", "--best", "quicktest-confirm", "--print")  # no --arm: the same rule picks it
    assert served.returncode == 0, served.stderr
    arm_flags = _confirmation_arms(cwd)[winner]
    assert f"--kv-cache-memory-bytes {arm_flags['kv-cache-memory-bytes']}" in served.stdout
    boots_before = _boots(cwd)
    again = lab(cwd, "tune", "quicktest.yaml")  # a finished study: no trial, no boot runs again
    assert again.returncode == 0 and f"winner: {winner}" in again.stdout and why in again.stdout
    assert _boots(cwd) == boots_before


def _confirmation_arms(cwd: Path) -> dict[str, dict]:
    store = open_store(str(cwd / "lab.db"))
    try:
        with store.session() as s:
            run = s.scalar(select(m.Run.id).where(m.Run.name == "quicktest-confirm"))
            return {a.name: a.flags for a in s.scalars(select(m.Arm).where(m.Arm.run_id == run))}
    finally:
        store.close()


def _boots(cwd: Path) -> int:
    store = open_store(str(cwd / "lab.db"))
    try:
        with store.session() as s:
            return len(s.scalars(select(m.Boot.id)).all())
    finally:
        store.close()


def test_a_tune_file_is_refused_with_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    bad = TUNE.replace("{flag: max-num-seqs, choices: [0, 2, 8]}", "{flag: max-num-sequences, choices: [2, 8]}") \
        .replace("metric: memory.kv_pool_tokens", "metric: decode.agg_tok_s")
    path = tmp_path / "bad.yaml"
    path.write_text(textwrap.dedent(bad))
    assert lab_main(["tune", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:8: space[1].flag: unknown flag 'max-num-sequences' for the bundled engine" in err
    assert f"{path}:10: objectives[0].metric: no listed instrument produces decode.agg_tok_s" in err


def test_the_base_engine_is_checked_as_a_ladder_before_any_trial(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo in the base flags, a where that picks no cell, a request longer than the context: each
    refused once, at the tune file's own line, by --dry-run and by the tune itself, before any
    study or boot exists."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "250")
    bad = TUNE.replace("max-num-seqs: 4, cpu-products", "max-num-seq: 4, cpu-products")
    (tmp_path / "typo.yaml").write_text(textwrap.dedent(bad))
    for extra in (["--dry-run"], []):
        assert lab_main(["tune", "typo.yaml", *extra]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert err == "lab: typo.yaml:5: unknown flag 'max-num-seq' for the bundled engine (`lab engine serve --help` " \
                      "lists them)"
    assert not (tmp_path / "lab.db").exists()  # nothing was created: fixing the file leaves the name free
    unrunnable = textwrap.dedent(TUNE).replace("max-model-len: 512", "max-model-len: 64").replace(
        "  memory:\n", "  memory:\n  decode: {levels: [1], max_tokens: 100}\n").replace(
        "{metric: memory.kv_pool_gib, max: 0.02}", "{metric: decode.ttft_s, where: {level: 2}, max: 1}")
    (tmp_path / "unrunnable.yaml").write_text(unrunnable)
    assert lab_main(["tune", "unrunnable.yaml", "--dry-run"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "unrunnable.yaml:12: constraints[0]: decode.ttft_s: where {level: 2} matches no cell (level: 1)" in err
    assert "unrunnable.yaml:15: instruments.decode.max_tokens: a request of 356 tokens does not fit the context " \
           "of 64 that the base engine boots with" in err


@pytest.mark.slow
def test_a_changed_tune_file_says_how_to_resume_or_start_afresh(tuned, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cwd, _, _ = tuned
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("COLUMNS", "250")
    text = textwrap.dedent(TUNE)
    (cwd / "more.yaml").write_text(text.replace("budget: {trials: 5}", "budget: {trials: 7}"))
    assert lab_main(["tune", "more.yaml", "--dry-run"]) == 0  # only the budget changed: the study goes on
    assert "study quicktest: resumes: 5 of its 7 trials taken" in capsys.readouterr().out
    (cwd / "other.yaml").write_text(text.replace("choices: [0, 2, 8]", "choices: [2, 8]"))
    assert lab_main(["tune", "other.yaml", "--dry-run"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert ("study quicktest in this store was started from another version of this tune file (line 8 was "
            "'- {flag: max-num-seqs, choices: [0, 2, 8]}', is '- {flag: max-num-seqs, choices: [2, 8]}'; only budget "
            "and description may change): restore that version to resume it, or start a new study beside it with "
            "`lab tune other.yaml --name quicktest-2`") in err
    assert lab_main(["tune", "other.yaml", "--name", "quicktest-2", "--dry-run"]) == 0
    assert "study quicktest-2: a new study" in capsys.readouterr().out


def test_the_warm_up_boot_is_on_by_default_where_the_engine_runs_on_cuda(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = textwrap.dedent(TUNE)
    for device, said in (("cuda", "on (the engine runs on CUDA)"), ("cpu", "off (the engine runs on the CPU")):
        (tmp_path / "t.yaml").write_text(text.replace("device: cpu", f"device: {device}"))
        assert lab_main(["tune", "t.yaml", "--dry-run"]) == 0  # boots nothing, so a CUDA tune is checked anywhere
        assert f"warm-up boot: {said}" in capsys.readouterr().out
    (tmp_path / "t.yaml").write_text(text + "hygiene: {warmup_boot: true}\n")
    assert lab_main(["tune", "t.yaml", "--dry-run"]) == 0
    assert "warm-up boot: on (hygiene.warmup_boot: true)" in capsys.readouterr().out


def test_the_published_schema_is_current_and_the_example_tune_file_is_valid() -> None:
    import json

    from lab.tune.spec import json_schema, load_tune

    # Instruments come and go with their own params, so only the tune file's own part is compared here;
    # `lab tune --schema > tunes/tune.schema.json` regenerates the whole.
    committed = json.loads((REPO / "tunes" / "tune.schema.json").read_text())
    current = json_schema()
    assert committed["properties"] == current["properties"]
    for part in ("Param", "IntRange", "FloatRange", "Objective", "Budget", "Confirm"):
        assert committed["$defs"][part] == current["$defs"][part], f"regenerate it: {part} changed"
    tune, text = load_tune(REPO / "tunes" / "quickstart.yaml")
    assert text.startswith("# yaml-language-server: $schema=./tune.schema.json") and len(tune.space) == 2


@pytest.mark.slow
def test_the_study_report_shows_history_trials_and_how_far_the_confirmation_moved(tuned) -> None:
    cwd, done, _ = tuned
    winner = done.stdout.split("winner: ")[1].split()[0]
    made = lab(cwd, "report", "--study", "quicktest")
    assert made.returncode == 0, made.stdout + made.stderr
    folder = cwd / "reports" / "quicktest"
    assert (folder / "history.png").read_bytes().startswith(b"\x89PNG")
    assert not (folder / "pareto.png").exists()  # one objective: no front to draw
    md = (folder / "index.md").read_text()
    assert f"Winner: {winner}" in md and "`lab serve --best quicktest-confirm` serves it" in md
    confirmation = md.split("## Confirmation")[1].split("##")[0]
    assert "| +0.0 % | keep |" in confirmation  # memory figures do not move between boots
    rows = _table(md, "## Trials")
    assert any("max-num-seqs must be positive" in r["why"] for r in rows)
    assert rows[0]["why"].startswith("interrupted: lab tune was killed · not counted against the budget: abandoned")
    for row in rows:  # each trial's constraint figure, and what made an infeasible one infeasible
        if row["state"] != "complete":
            continue
        figure = float(row["memory.kv_pool_gib (<= 0.02)"])
        assert row["feasible"] == ("yes" if figure <= 0.02 else "no")
        if figure > 0.02:
            assert row["why"] == f"infeasible: memory.kv_pool_gib = {figure:.4g} > max 0.02"
    assert "optuna-dashboard sqlite:///lab.db" in md
    rated = {line.split("|")[1].strip(): float(line.split("|")[2]) for line in
             md.split("## Parameter importances")[1].split("##")[0].splitlines() if line.startswith("| flag:")}
    # Only the KV budget sets the KV pool's size; the batch width does not.
    assert rated["flag:kv-cache-memory-bytes"] > rated["flag:max-num-seqs"]
    assert "<img" in (folder / "index.html").read_text()


def test_a_two_objective_study_report_draws_its_pareto_front(tmp_path: Path) -> None:
    from optuna.distributions import IntDistribution

    from lab.report.tune import write_tune_report
    from lab.store.study_storage import study_storage

    text = textwrap.dedent(TUNE).replace("objectives:\n  - {metric: memory.kv_pool_tokens}",
                                         "objectives:\n  - {metric: memory.kv_pool_tokens}\n"
                                         "  - {metric: memory.kv_pool_gib, direction: minimize}")
    store = open_store(str(tmp_path / "lab.db"))
    try:
        with pytest.raises(LookupError, match="no study 'two'"):  # a store no tune wrote to: no Optuna tables yet
            write_tune_report(store, "two", tmp_path / "reports")
        study = optuna.create_study(storage=study_storage(store), study_name="two",
                                    directions=["maximize", "minimize"])
        study.set_user_attr("tune_text", text)
        kv = IntDistribution(4194304, 33554432, log=True)
        seqs = optuna.distributions.CategoricalDistribution([0, 2, 8])
        # (tokens, GiB): 0 and 2 trade off, 1 is beaten by 2 on both, 3 breaks the 0.02 GiB constraint.
        for number, (tokens, gib, violation) in enumerate([(100, 0.004, -0.016), (150, 0.012, -0.008),
                                                          (200, 0.010, -0.010), (400, 0.030, 0.010)]):
            study.add_trial(optuna.trial.create_trial(
                params={"flag:kv-cache-memory-bytes": 4194304 * (number + 1), "flag:max-num-seqs": 2},
                distributions={"flag:kv-cache-memory-bytes": kv, "flag:max-num-seqs": seqs},
                values=[tokens, gib], user_attrs={"constraints": [violation]},
                system_attrs={"constraints": [violation]}))
        folder = write_tune_report(store, "two", tmp_path / "reports")
        with pytest.raises(LookupError, match="no study 'nope'"):
            write_tune_report(store, "nope", tmp_path / "reports")
    finally:
        store.close()
    assert (folder / "pareto.png").read_bytes().startswith(b"\x89PNG")
    md = (folder / "index.md").read_text()
    assert "No confirmation yet" in md
    rows = _table(md, "## Trials")
    assert [r["trial"] for r in rows if r["Pareto front"] == "yes"] == ["0", "2"]  # 1 is beaten, 3 infeasible
    assert [r["feasible"] for r in rows] == ["yes", "yes", "yes", "no"]
    # A study stored before trials kept their constraint figures: still infeasible, figure unknown.
    assert rows[3]["why"] == "infeasible: a constraint is violated" and rows[3]["memory.kv_pool_gib (<= 0.02)"] == ""


def _table(md: str, heading: str) -> list[dict[str, str]]:
    lines = [line for line in md.split(heading)[1].split("##")[0].splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    return [dict(zip(header, (c.strip() for c in line.split("|")[1:-1]))) for line in lines[2:]]

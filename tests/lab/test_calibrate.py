"""`lab calibrate`: A/A boots of a ladder's control give each key metric a stored noise model that
the KEEP rule then uses for the ladder's runs on the same host."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from lab.store import models as m
from tests.lab.conftest import stub_ladder

# The stub engine's memory cells: the host's MemAvailable floor moves a little from boot to boot.
BODY = """\
windows:
  - name: W1
    control: C0ctl
    arms:
      - {name: A1, flags: {seqs: 2}}
repeats: 2
instruments:
  memory:
keep:
  metrics: [memory.host_mem_available_floor_gib]
  gates:
    - {metric: memory.host_mem_available_floor_gib, min: 0.1, arms: [A1]}
"""


def test_calibration_boots_the_control_alone_and_stores_a_noise_model_keep_uses(tmp_path: Path, lab, store,
                                                                                capsys) -> None:
    path = stub_ladder(tmp_path, BODY)
    assert lab("calibrate", str(path), "--boots", "4", "--name", "cal") == 0
    out = capsys.readouterr().out
    assert "memory.host_mem_available_floor_gib" in out and "MDE % (2 repeats, 80 % power)" in out
    with store.session() as s:
        run = s.scalars(select(m.Run).where(m.Run.name == "cal")).one()
        slots = s.scalars(select(m.Slot).where(m.Slot.run_id == run.id).order_by(m.Slot.idx)).all()
        assert [(sl.arm.name, sl.position) for sl in slots] == [
            ("C0ctl", "warmup"), ("C0ctl", "open"), ("C0ctl", "between"), ("C0ctl", "between"), ("C0ctl", "close")]
        noise = s.scalars(select(m.NoiseModel)).one()
        assert (noise.ladder_name, noise.metric, noise.boots, noise.df, noise.repeats) == (
            "stub", "memory.host_mem_available_floor_gib", 4, 2, 2)
        assert noise.sd_log >= 0 and noise.mde_pct >= 0 and noise.drift_pct >= 0
    assert lab("run", str(path), "--name", "r") == 0
    with store.session() as s:
        verdict = s.scalars(select(m.Verdict)).one()
    assert any(f"noise from 2 boots pooled with calibration run {run.id} (4 control boots)" in reason
               for reason in verdict.reasons), verdict.reasons


def test_fewer_than_three_boots_is_a_usage_error(tmp_path: Path, lab) -> None:
    import pytest
    with pytest.raises(SystemExit) as caught:
        lab("calibrate", str(stub_ladder(tmp_path, BODY)), "--boots", "2")
    assert caught.value.code == 2


def test_a_calibration_cut_short_keeps_the_noise_of_the_controls_it_finished(tmp_path: Path) -> None:
    import signal

    from lab.store.db import open_store
    from tests.lab.conftest import lab_process
    from tests.lab.test_resume import finish, stop_left_engines, wait_for_steps

    path = stub_ladder(tmp_path, BODY)
    victim = lab_process(["calibrate", str(path), "--boots", "8", "--name", "cut"], tmp_path)
    try:
        wait_for_steps(victim, tmp_path / "lab.db", slot_idx=5, count=1)  # four warm controls done
        victim.send_signal(signal.SIGTERM)
        code, out = finish(victim)
    finally:
        stop_left_engines(tmp_path / "lab.db")
    assert code == 130, out
    assert "interrupted: the noise above is from the control boots that finished" in " ".join(out.split()), out
    store = open_store(str(tmp_path / "lab.db"))
    try:
        with store.session() as s:
            noise = s.scalars(select(m.NoiseModel)).one()
            assert noise.metric == "memory.host_mem_available_floor_gib"
            assert 4 <= noise.boots < 8 and noise.df == noise.boots - 2
            assert s.scalar(select(m.Run.status)) == "interrupted"
    finally:
        store.close()


def test_run_with_calibrate_boots_the_calibration_first_and_judges_with_its_noise(tmp_path: Path, lab, store,
                                                                                   capsys) -> None:
    path = stub_ladder(tmp_path, BODY)
    assert lab("run", str(path), "--calibrate", "3", "--name", "r") == 0
    captured = capsys.readouterr()
    assert "a warm-up, then 3 boots of the control" in captured.err
    assert "MDE % (2 repeats, 80 % power)" in captured.out  # the noise table, before the ladder ran
    with store.session() as s:
        runs = s.scalars(select(m.Run).order_by(m.Run.id)).all()
        assert [r.name for r in runs][1] == "r" and runs[0].name.startswith("stub-calibration-")
        slots = s.scalars(select(m.Slot).where(m.Slot.run_id == runs[0].id).order_by(m.Slot.idx)).all()
        assert [(sl.arm.name, sl.position) for sl in slots] == [
            ("C0ctl", "warmup"), ("C0ctl", "open"), ("C0ctl", "between"), ("C0ctl", "close")]
        noise = s.scalars(select(m.NoiseModel)).one()
        assert (noise.run_id, noise.boots, noise.df) == (runs[0].id, 3, 1)
        verdict = s.scalars(select(m.Verdict)).one()
    assert any(f"pooled with calibration run {runs[0].id} (3 control boots)" in r for r in verdict.reasons), \
        verdict.reasons


def test_the_ladder_can_ask_for_the_calibration_and_a_dry_run_says_so(tmp_path: Path, lab, store, capsys) -> None:
    path = stub_ladder(tmp_path, BODY.replace("keep:\n", "keep:\n  calibrate: 3\n"))
    assert lab("run", str(path), "--dry-run") == 0
    assert "first a calibration: a warm-up, then 3 boots of C0ctl (`lab calibrate --boots 3`); then:" in " ".join(
        capsys.readouterr().out.split())
    assert lab("run", str(path), "--name", "r") == 0
    with store.session() as s:
        calibration, run = s.scalars(select(m.Run).order_by(m.Run.id)).all()
        assert "calibrate" not in calibration.ladder_text.split("keep:")[1]  # the A/A run does not ask again
        assert s.scalars(select(m.NoiseModel)).one().run_id == calibration.id
        assert run.name == "r"


def test_calibrate_needs_three_to_twenty_one_boots_and_a_new_run(tmp_path: Path, lab, capsys) -> None:
    import pytest

    path = stub_ladder(tmp_path, BODY)
    for args in (["--calibrate", "2"], ["--calibrate", "22"], ["--resume", "r", "--calibrate", "3"]):
        with pytest.raises(SystemExit) as caught:
            lab("run", *([str(path)] if "--resume" not in args else []), *args)
        assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "--calibrate 2: a calibration boots the control 3 to 21 times" in err
    assert "--calibrate starts a new run" in err
    assert not (tmp_path / "lab.db").exists()  # refused before anything was stored


def test_an_inconclusive_verdict_a_calibration_would_decide_names_the_commands(tmp_path: Path, lab, store) -> None:
    from lab.analysis.keep import ArmEvidence, BootValues, KeepRule, KeyMetric, judge
    from lab.store import reader
    from lab.runner.run import how_to_decide

    assert lab("run", str(stub_ladder(tmp_path, BODY)), "--name", "r") == 0
    run = reader.find_run(store, "r")
    rule = KeepRule(2.0, [KeyMetric("decode", True), KeyMetric("prefill", True)])
    drifting = judge(rule, ArmEvidence([BootValues("A1", {"decode": 100.0, "prefill": 100.0})],
                                       BootValues("C/open", {"decode": 95.0, "prefill": 100.0}),
                                       BootValues("C/close", {"decode": 105.0, "prefill": 100.0})))
    assert how_to_decide(run, drifting, "x.db") == (
        f"to decide it: `lab calibrate {run.ladder_path} --boots 7 --db x.db` then `lab report r --db x.db`, "
        f"or `lab run {run.ladder_path} --calibrate 7` next time")
    regressed = judge(rule, ArmEvidence([BootValues("A1", {"decode": 100.0, "prefill": 90.0})],
                                        BootValues("C/open", {"decode": 95.0, "prefill": 100.0}),
                                        BootValues("C/close", {"decode": 105.0, "prefill": 100.0})))
    assert str(regressed.decision) == "reject" and how_to_decide(run, regressed, "x.db") is None


def test_a_calibration_out_of_time_runs_no_ladder_and_says_what_it_kept(tmp_path: Path, lab, store, capsys) -> None:
    # A boot of a kind not yet finished always starts: the warm-up and one control, then the budget
    # cannot hold another control.
    path = stub_ladder(tmp_path, BODY)
    assert lab("run", str(path), "--calibrate", "3", "--time-budget", "1") == 75
    err = " ".join(capsys.readouterr().err.split())
    assert "stopped: " in err and "of the time budget left" in err
    assert "the ladder was not run; no noise was stored" in err
    with store.session() as s:
        [calibration] = s.scalars(select(m.Run)).all()  # no run of the ladder itself
        assert calibration.name.startswith("stub-calibration-") and calibration.status == "interrupted"
        assert s.scalars(select(m.NoiseModel)).all() == []


def test_an_arm_judged_against_one_warm_control_is_told_of_the_warm_up_boot(tmp_path: Path, lab, store) -> None:
    from lab.analysis.keep import ArmEvidence, BootValues, KeepRule, KeyMetric, judge
    from lab.runner.run import how_to_decide
    from lab.store import reader

    assert lab("run", str(stub_ladder(tmp_path, BODY)), "--name", "r") == 0
    verdict = judge(KeepRule(2.0, [KeyMetric("decode", True)]),
                    ArmEvidence([BootValues("A1", {"decode": 110.0})], BootValues("C/open", {"decode": 50.0}, cold=True),
                                BootValues("C/close", {"decode": 100.0})))
    hint = how_to_decide(reader.find_run(store, "r"), verdict, "lab.db")
    assert hint.endswith("; a warm-up boot (`hygiene.warmup_boot: true`) keeps the first control from booting cold")

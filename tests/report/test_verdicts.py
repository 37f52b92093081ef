"""KEEP verdicts judged from stored cells exactly as the ladder states the rule: one test per branch."""

from __future__ import annotations

from sqlalchemy import select

from lab.analysis import keep
from lab.analysis.compare import compare
from lab.analysis.verdicts import judge, load
from lab.report.build import write_report
from lab.runner.run import store_verdicts
from lab.store import models as m
from lab.store import writer
from lab.store.records import Cell
from tests.report.conftest import LADDER, Boot, build_run

KEY = "memory.kv_pool_tokens"
FLOOR = "memory.host_mem_available_floor_gib"


def boot(kv: float | list[float], floor: float = 5.0, **kwargs) -> Boot:
    return Boot(values={KEY: kv, FLOOR: floor}, **kwargs)


def judge_now(store, run_id: int) -> dict[str, keep.Verdict]:
    return judge(load(store, run_id))


def stored(store, run_id: int) -> dict[str, tuple[str, list[str], dict]]:
    with store.session() as s:
        rows = s.execute(select(m.Arm.name, m.Verdict.decision, m.Verdict.reasons, m.Verdict.detail)
                         .join(m.Arm, m.Verdict.arm_id == m.Arm.id).where(m.Verdict.run_id == run_id)).all()
    return {name: (decision, reasons, detail) for name, decision, reasons, detail in rows}


def test_an_arm_improving_the_key_metric_beyond_the_threshold_is_kept_and_stored_with_its_reasons(store) -> None:
    run_id = build_run(store, {"C0ctl/open": boot(1000), "A1": boot(1050), "A2": boot(1010),
                               "C0ctl/close": boot(1000)})
    judged = store_verdicts(store, run_id, "W1")
    assert {arm: str(v.decision) for arm, v in judged.items()} == {"A1": "keep", "A2": "reject"}
    decision, reasons, detail = stored(store, run_id)["A1"]
    assert decision == "keep"
    assert reasons[0] == "memory.kv_pool_tokens +5.0 % (> 2 %) vs controls 1000.0/1000.0: arm 1050.0"
    assert "gate memory.host_mem_available_floor_gib ≥ 1 passed: 5 GiB" in reasons
    assert detail["window"] == "W1" and detail["control"] == "C0ctl"
    assert detail["boots"] == {"arm": ["A1"], "opening_control": "C0ctl/open", "closing_control": "C0ctl/close"}
    assert stored(store, run_id)["A2"][1][0].startswith("no key metric improves by more than 2 %")


def test_a_key_metric_regressing_beyond_the_threshold_rejects(store) -> None:
    run_id = build_run(store, {"C0ctl/open": boot(1000), "A1": boot(950), "C0ctl/close": boot(1000)})
    store_verdicts(store, run_id, "W1")
    decision, reasons, _ = stored(store, run_id)["A1"]
    assert decision == "reject"
    assert reasons[0] == "memory.kv_pool_tokens -5.0 % regresses beyond 2 % vs controls 1000.0/1000.0: arm 950.0"


def test_a_failed_gate_rejects_an_arm_that_improves(store) -> None:
    run_id = build_run(store, {"C0ctl/open": boot(1000), "A1": boot(1100, floor=0.5), "C0ctl/close": boot(1000)})
    verdict = judge_now(store, run_id)["A1"]
    assert str(verdict.decision) == "reject"
    assert verdict.reasons[0] == "gate memory.host_mem_available_floor_gib ≥ 1 failed: 0.5 GiB is below the minimum 1"


def test_controls_drifting_apart_beyond_the_threshold_leave_the_metric_undecided(store) -> None:
    run_id = build_run(store, {"C0ctl/open": boot(1000), "A1": boot(1200), "A2": boot(900),
                               "C0ctl/close": boot(1100)})
    judged = store_verdicts(store, run_id, "W1")
    assert {arm: str(v.decision) for arm, v in judged.items()} == {"A1": "inconclusive", "A2": "inconclusive"}
    assert judged["A1"].reasons[0] == ("memory.kv_pool_tokens undecided: controls drift 9.5 % > 2 % (controls "
                                       "1000.0/1100.0), no calibration says how far its boots scatter")
    assert stored(store, run_id)["A2"][0] == "inconclusive"


def test_a_cold_control_is_never_used_and_the_reason_says_so(store) -> None:
    # The cold opening control reads 20 % low: used, it would make the metric drift. Against the one
    # warm control left, one uncalibrated boot shows nothing of how far the boots scatter.
    run_id = build_run(store, {"C0ctl/open": boot(800, cold=True), "A1": boot(1050), "C0ctl/close": boot(1000)})
    verdict = judge_now(store, run_id)["A1"]
    assert str(verdict.decision) == "inconclusive"
    assert verdict.reasons[0].startswith("memory.kv_pool_tokens undecided: one warm control 1000.0, one boot of "
                                         "the arm and no calibration")
    assert "opening control C0ctl/open booted cold: excluded from the verdict" in verdict.reasons
    assert verdict.excluded_boots == ["C0ctl/open"]


def test_a_cold_arm_boot_is_never_judged(store) -> None:
    run_id = build_run(store, {"C0ctl/open": boot(1000), "A1": boot(1200, cold=True), "C0ctl/close": boot(1000)})
    verdict = judge_now(store, run_id)["A1"]
    assert str(verdict.decision) == "inconclusive"
    assert verdict.reasons[0] == "no warm boot of the arm: nothing to judge"
    assert "arm boot A1 booted cold: excluded from the verdict" in verdict.reasons


def test_a_failed_boot_counts_as_missing_values_and_names_the_failure(store) -> None:
    run_id = build_run(store, {"C0ctl/open": boot(1000),
                               "A1": Boot(status="failed", reason="engine exited with status 1\nTraceback…"),
                               "C0ctl/close": boot(1000)})
    verdict = judge_now(store, run_id)["A1"]
    assert str(verdict.decision) == "inconclusive"
    assert verdict.reasons[0] == "memory.kv_pool_tokens: no value from A1 [failed: engine exited with status 1]"


def test_a_failed_control_leaves_its_window_inconclusive(store) -> None:
    run_id = build_run(store, {"C0ctl/open": boot(1000), "A1": boot(1100),
                               "C0ctl/close": boot(1000, status="died", reason="engine exited with status -9")})
    verdict = judge_now(store, run_id)["A1"]
    assert str(verdict.decision) == "inconclusive"
    assert verdict.reasons[0] == ("memory.kv_pool_tokens: no value from C0ctl/close [died: engine exited with "
                                  "status -9]")


def test_a_window_whose_closing_control_has_not_run_is_not_judged_yet(store) -> None:
    run_id = build_run(store, {"C0ctl/open": boot(1000), "A1": boot(1100)})
    verdict = judge_now(store, run_id)["A1"]
    assert str(verdict.decision) == "inconclusive"
    assert verdict.reasons[0] == "memory.kv_pool_tokens: no value from C0ctl/close [not booted]"


WHERE_LADDER = """\
name: where
engine: {kind: bundled, model: smollm2-135m, flags: {device: cpu}}
windows:
  - name: W1
    control: C0ctl
    arms:
      - {name: A1, flags: {max-num-seqs: 4}}
instruments:
  memory:
keep:
  metrics:
    - {metric: memory.kv_pool_tokens, where: {pool: main}}
"""


def pools(main: float, draft: float) -> Boot:
    return Boot(cells={"memory": [Cell("kv_pool_tokens", main, "tokens", params={"pool": "main"}, requests=[]),
                                  Cell("kv_pool_tokens", draft, "tokens", params={"pool": "draft"}, requests=[])]})


def test_where_selects_the_cells_a_key_metric_names(store) -> None:
    run_id = build_run(store, {"C0ctl/open": pools(1000, 10), "A1": pools(1000, 50), "C0ctl/close": pools(1000, 10)},
                       ladder=WHERE_LADDER)
    verdict = judge_now(store, run_id)["A1"]
    # The draft pool grew fivefold; the main pool, the one the ladder names, did not move.
    assert str(verdict.decision) == "reject"
    assert verdict.metrics[0].name == "memory.kv_pool_tokens[pool=main]" and verdict.metrics[0].delta_pct == 0.0


def test_a_key_metric_selecting_cells_of_several_params_is_inconclusive_and_asks_for_where(store) -> None:
    ladder = WHERE_LADDER.replace("    - {metric: memory.kv_pool_tokens, where: {pool: main}}",
                                  "    - memory.kv_pool_tokens")
    run_id = build_run(store, {"C0ctl/open": pools(1000, 10), "A1": pools(1100, 50), "C0ctl/close": pools(1000, 10)},
                       ladder=ladder)
    verdict = judge_now(store, run_id)["A1"]
    assert str(verdict.decision) == "inconclusive"
    assert any("selects cells of 2 different params in A1" in r and "narrow it with `where`" in r
               for r in verdict.reasons)


def test_an_invalid_cell_is_never_a_figure(store) -> None:
    invalid = Boot(values={FLOOR: 5.0}, cells={"memory": [Cell("kv_pool_tokens", 2000, "tokens", valid=False,
                                                               note="cached", requests=[])]})
    run_id = build_run(store, {"C0ctl/open": boot(1000), "A1": invalid, "C0ctl/close": boot(1000)})
    verdict = judge_now(store, run_id)["A1"]
    assert str(verdict.decision) == "inconclusive"
    # the reason names why, from the cell's note
    assert "memory.kv_pool_tokens: 1 invalid cell(s) from A1 left out (cached)" in verdict.reasons


def test_judging_again_replaces_the_stored_verdicts(store) -> None:
    run_id = build_run(store, {"C0ctl/open": boot(1000), "A1": boot(1050), "C0ctl/close": boot(1000)})
    store_verdicts(store, run_id, "W1")
    store_verdicts(store, run_id, "W1")
    with store.session() as s:
        # A1, and A2 (never booted)
        assert s.scalars(select(m.Verdict.decision).order_by(m.Verdict.id)).all() == ["keep", "inconclusive"]


def test_a_ladder_without_key_metrics_is_measured_but_never_judged(store) -> None:
    ladder = WHERE_LADDER.replace("keep:\n  metrics:\n    - {metric: memory.kv_pool_tokens, where: {pool: main}}\n", "")
    run_id = build_run(store, {"C0ctl/open": pools(1000, 10), "A1": pools(1100, 50)}, ladder=ladder)
    assert judge_now(store, run_id) == {}


def test_a_gate_scoped_to_some_arms_judges_only_those(store) -> None:
    ladder = LADDER_SCOPED_GATE
    run_id = build_run(store, {"C0ctl/open": boot(1000), "A1": boot(1100, floor=0.5), "A2": boot(1100, floor=0.5),
                               "C0ctl/close": boot(1000)}, ladder=ladder)
    judged = judge_now(store, run_id)
    assert str(judged["A1"].decision) == "reject"
    assert judged["A1"].reasons[0].startswith("gate memory.host_mem_available_floor_gib ≥ 1 failed")
    # A2 is not one of the gate's arms: its floor is not judged, its improvement keeps it.
    assert str(judged["A2"].decision) == "keep"
    assert not any("host_mem_available_floor_gib" in reason for reason in judged["A2"].reasons)


LADDER_SCOPED_GATE = LADDER.replace("    - {metric: memory.host_mem_available_floor_gib, min: 1}",
                                    "    - {metric: memory.host_mem_available_floor_gib, min: 1, arms: [A1]}")


def test_a_report_and_a_comparison_after_a_calibration_judge_with_it_and_write_nothing(store, tmp_path) -> None:
    boots = {label: boot(1000) for label in ("C0ctl/open", "C0ctl/close")} | {"A1": boot(1050)}
    run_id = build_run(store, boots)
    store_verdicts(store, run_id, "W1")  # lab run, before any calibration
    calibration = build_run(store, boots, name="cal")
    writer.write_noise(store, run_id=calibration, ladder_name="built", host="test", rows=[
        {"metric": KEY, "boots": 5, "sd_log": 0.05, "df": 3, "drift_pct": 2.5, "mde_pct": 20.0, "repeats": 1,
         "power": 0.8}])
    before = stored(store, run_id)

    markdown = (write_report(store, "built", tmp_path) / "index.md").read_text()
    comparison = compare(store, "built:C0ctl", "built:A1")

    assert before["A1"][0] == "keep" and "calibration run" not in " ".join(before["A1"][1])
    judged = judge_now(store, run_id)["A1"]
    assert "calibration run 2 (5 control boots)" in " ".join(judged.reasons)
    assert str(judged.decision) != "keep"  # a 5 % gain inside a 5 % boot-to-boot noise is not established
    assert comparison.verdicts["A1"]["decision"] == str(judged.decision)
    assert f"A1: {judged.reasons[0]}" in markdown
    assert stored(store, run_id) == before

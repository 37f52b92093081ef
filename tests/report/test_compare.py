"""`lab compare A B`: the table people read, its statistics, the qeval pairing, and its errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from sqlalchemy import select

from lab.analysis.compare import CompareError, compare
from lab.store import models as m
from lab.store.db import open_store
from lab.store.records import Cell
from tests.report.conftest import Boot, Quickstart, build_run, lab_cli

KEY = "memory.kv_pool_tokens"
FLOOR = "memory.host_mem_available_floor_gib"


def boot(kv: float | list[float], floor: float = 5.0, items: dict[str, bool] | None = None) -> Boot:
    return Boot(values={KEY: kv, FLOOR: floor}, items=items or {})


def test_repeats_on_both_sides_give_a_bootstrap_interval_of_the_median_ratio(store) -> None:
    build_run(store, {"C0ctl/open": boot(100), "A1": boot([100.0] * 4), "A2": boot([110.0] * 4),
                      "C0ctl/close": boot(100)})
    row = compare(store, "A1", "A2").rows[0]
    assert (row.metric, row.a, row.b, row.delta_pct, row.change) == (KEY, 100.0, 110.0, 10.0, "better")
    stats = row.statistics
    # Every resample of four equal values has the same median: the interval is exactly the ratio.
    assert (stats.ci_low_pct, stats.ci_high_pct) == (pytest.approx(10.0), pytest.approx(10.0))
    assert stats.text.startswith("n 4 vs 4: 95 % CI [+10.0, +10.0] % of median B/A, better positive "
                                 "(percentile bootstrap): "
                                 "improvement established (the whole CI is beyond ±2 %)")
    assert stats.mann_whitney_method == "normal approximation, tie-corrected"  # all values tie within a side


def test_four_distinct_repeats_a_side_reach_the_exact_mann_whitney_test(store) -> None:
    build_run(store, {"C0ctl/open": boot(100), "A1": boot([100.0, 100.5, 99.5, 100.2]),
                      "A2": boot([97.0, 97.5, 96.5, 97.2]), "C0ctl/close": boot(100)})
    row = compare(store, "A1", "A2").rows[0]
    assert row.change == "worse" and row.statistics.test == "bootstrap + mann-whitney"
    # 4 vs 4 completely separated: the smallest exact two-sided p, 2 / C(8, 4).
    assert row.statistics.mann_whitney_p == pytest.approx(2 / 70) and row.statistics.mann_whitney_method == "exact"
    assert "regression established" in row.statistics.text
    assert row.statistics.text.endswith("Mann-Whitney p=0.029 (exact)")


def test_three_repeats_a_side_get_an_interval_but_no_rank_test_and_say_why(store) -> None:
    build_run(store, {"C0ctl/open": boot(100), "A1": boot([100.0, 101.0, 99.0]), "A2": boot([101.0, 100.5, 102.0]),
                      "C0ctl/close": boot(100)})
    stats = compare(store, "A1", "A2").rows[0].statistics
    assert stats.test == "bootstrap" and stats.mann_whitney_p is None
    assert "Mann-Whitney not used: 3 vs 3 cannot reach p < 0.05 (smallest p 0.1)" in stats.text
    assert "not established beyond ±2 %" in stats.text  # a +1 % median shift with overlapping repeats


def test_single_values_carry_no_interval(store) -> None:
    build_run(store, {"C0ctl/open": boot(1000), "A1": boot(1050), "C0ctl/close": boot(1010)})
    comparison = compare(store, "C0ctl", "A1")
    row = comparison.rows[0]
    assert row.a == 1005.0 and row.noise_band_pct == {"W1": pytest.approx(10 / 1005 * 100)}
    assert row.statistics.test == "none"
    assert row.statistics.text == ("2 vs 1 boots give a difference, not an interval: 3 or more a side, or a "
                                   "calibration (`lab calibrate`), give one")
    assert comparison.verdicts["C0ctl"] is None and comparison.verdicts["A1"]["decision"] == "keep"


def test_qeval_is_paired_task_by_task_with_an_exact_mcnemar_p(store) -> None:
    control = {f"t{i}": True for i in range(10)}
    five_broke = {**control, **{f"t{i}": False for i in range(5)}}
    one_broke_plus_extra = {**control, "t0": False} | {"extra": True}
    build_run(store, {"C0ctl/open": boot(1000, items=control), "A1": boot(1000, items=five_broke),
                      "A2": boot(1000, items=one_broke_plus_extra), "C0ctl/close": boot(1000, items=control)})
    qeval = compare(store, "C0ctl", "A1").quality.qeval
    assert (qeval["broke"], qeval["fixed"], qeval["both_pass"], qeval["n"]) == (5, 0, 5, 10)
    assert qeval["mcnemar_p"] == 0.0625  # 2 * (1/2)^5
    assert qeval["broke_tasks"] == ["t0", "t1", "t2", "t3", "t4"] and qeval["a_boot"] == "C0ctl/open"
    qeval = compare(store, "A1", "A2").quality.qeval
    assert (qeval["broke"], qeval["fixed"], qeval["mcnemar_p"]) == (0, 4, 0.125)
    assert qeval["one_side_only"] == ["extra"]


def test_arms_of_two_runs_are_compared_as_run_colon_arm_and_the_crossing_is_said(store) -> None:
    build_run(store, {"C0ctl/open": boot(1000), "A1": boot(1000), "C0ctl/close": boot(1000)}, name="first")
    build_run(store, {"C0ctl/open": boot(1100), "A1": boot(1100), "C0ctl/close": boot(1100)}, name="second")
    comparison = compare(store, "first:A1", "second:A1")
    assert comparison.rows[0].delta_pct == pytest.approx(10.0)
    assert set(comparison.rows[0].noise_band_pct) == {"first:W1", "second:W1"}
    assert any("come from different runs" in note for note in comparison.notes)
    assert compare(store, "C0ctl", "A1").a.evidence.run_name == "second"  # a bare arm is the latest run's


@pytest.mark.parametrize(("a", "b", "message"), [
    ("A1", "nope", "run built has no arm 'nope'; its arms are C0ctl, A1, A2"),
    ("zzz:A1", "A2", "no run 'zzz' in this store; `lab ls` lists the runs"),
    ("A1", "A1", "both sides are A1; name two different arms"),
])
def test_a_reference_that_names_nothing_is_refused_in_one_line(store, a: str, b: str, message: str) -> None:
    build_run(store, {"C0ctl/open": boot(1000)})
    with pytest.raises(LookupError) as caught:
        compare(store, a, b)
    assert str(caught.value) == message


def test_a_run_with_no_cells_is_refused(store) -> None:
    build_run(store, {})
    with pytest.raises(CompareError, match="run built has no stored cells yet; `lab ls built` shows its boots"):
        compare(store, "C0ctl", "A1")


def label_of(ref) -> str:
    """How compare names a ladder's key metric: `instrument.metric[k=v,...]` with its `where`."""
    where = ",".join(f"{k}={v}" for k, v in sorted(ref.where.items()))
    return f"{ref.metric}[{where}]" if where else ref.metric


@pytest.mark.slow
def test_lab_compare_prints_the_table_and_the_stored_verdict(quickstart: Quickstart) -> None:
    done = lab_cli(["compare", "C0ctl", "C1mnbt256", "--db", str(quickstart.db)], quickstart.directory)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    store = open_store(str(quickstart.db), read_only=True)
    with store.session() as s:
        decision, reasons = s.execute(select(m.Verdict.decision, m.Verdict.reasons).join(m.Arm)
                                      .where(m.Arm.name == "C1mnbt256")).one()
    header = next(line for line in out.splitlines() if "metric" in line and "Δ %" in line)
    for column in ("rule", "A", "B", "noise band", "statistics"):
        assert column in header
    for ref in quickstart.ladder.keep.metric_refs():
        assert label_of(ref) in out  # every key metric the ladder names is a row
    assert "key: higher is better" in out and "key: lower is better" in out
    assert "memory.host_mem_available_floor_gib (GiB)" in out and "gate: ≥ 1" in out
    assert f"KEEP C1mnbt256: {decision} against C0ctl (window W1)" in out
    assert f"· {reasons[0]}" in out
    assert "KEEP C0ctl: not judged (a control: the reference of its window)" in out
    measured = {name for name, _ in quickstart.ladder.instruments.sections()}
    if "qeval" in measured:
        assert re.search(r"qeval, \d+ tasks paired .* B C1mnbt256 passed .* B failed", out)
        assert re.search(r"A C0ctl/open passed .* \d+ broke", out) and "exact McNemar p=" in out
    if "agreement" in measured:
        assert "agreement (each against its window's control)" in out and "agreement.exact_match_rate" in out


@pytest.mark.slow
def test_lab_compare_json_is_the_same_comparison_for_machines(quickstart: Quickstart) -> None:
    done = lab_cli(["compare", "qs:C0ctl", "qs:C2nopc", "--json", "--db", str(quickstart.db)], quickstart.directory)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    keep = quickstart.ladder.keep
    assert [(row["metric"], row["kind"]) for row in data["rows"]] == (
        [(label_of(ref), "key") for ref in keep.metric_refs()] + [(gate.metric, "gate") for gate in keep.gates])
    row = data["rows"][0]
    change = (row["b"] - row["a"]) / row["a"] * 100
    # Better is positive: a lower-is-better metric's change is turned around.
    assert row["a"] > 0 and row["b"] > 0 and row["delta_pct"] == pytest.approx(
        change if row["higher_is_better"] else -change)
    assert data["verdicts"]["C2nopc"]["decision"] in ("keep", "reject", "inconclusive")
    assert data["a"]["boots"] == ["C0ctl/open", "C0ctl/close"] and data["b"]["boots"] == ["C2nopc"]


@pytest.mark.slow
def test_lab_compare_says_what_went_wrong_and_exits_non_zero(quickstart: Quickstart, tmp_path: Path) -> None:
    done = lab_cli(["compare", "C0ctl", "C9", "--db", str(quickstart.db)], quickstart.directory)
    assert done.returncode == 1 and "has no arm 'C9'; its arms are C0ctl, C1mnbt256, C2nopc" in done.stderr
    done = lab_cli(["compare", "C0ctl", "C2nopc", "--db", str(tmp_path / "absent.db")], tmp_path)
    assert done.returncode == 1 and "no store at" in done.stderr


def test_without_key_metrics_every_shared_metric_is_a_row_and_nothing_is_judged(store) -> None:
    ladder = """\
    name: free
    engine: {kind: bundled, model: smollm2-135m, flags: {device: cpu}}
    windows:
      - name: W1
        control: C0ctl
        arms:
          - {name: A1, flags: {max-num-seqs: 4}}
    instruments:
      memory:
    """
    def pools(value: float) -> Boot:
        return Boot(values={"memory.kv_pool_tokens": value},
                    cells={"memory": [Cell("kv_pool_gib", value / 1000, "GiB", params={"sizes": [1, 2]},
                                           requests=[])]})

    build_run(store, {"C0ctl/open": pools(1000), "A1": pools(1100), "C0ctl/close": pools(1000)}, ladder=ladder)
    comparison = compare(store, "C0ctl", "A1")
    assert [(row.metric, row.kind) for row in comparison.rows] == [
        ("memory.kv_pool_gib[sizes=(1, 2)]", "metric"), ("memory.kv_pool_tokens", "metric")]
    assert comparison.rows[1].delta_pct == pytest.approx(10.0) and comparison.rows[1].change == "better"
    assert comparison.verdicts == {"C0ctl": None, "A1": None}
    assert any("names no key metric" in note for note in comparison.notes)


def test_an_arm_without_a_value_says_why(store) -> None:
    # An engine whose streams carry no usage: every cell of the key metric is invalid, with its reason.
    unusable = Boot(values={FLOOR: 5.0}, cells={"memory": [Cell("kv_pool_tokens", None, "tokens", valid=False,
                                                                note="the response carried no usage",
                                                                requests=[])]})
    build_run(store, {"C0ctl/open": boot(100), "A1": unusable, "A2": boot(100), "C0ctl/close": boot(100)})
    row = compare(store, "A1", "A2").rows[0]
    assert row.a is None and row.note == ("no value from A1 (memory.kv_pool_tokens: 1 invalid cell(s) from A1 "
                                          "left out (the response carried no usage))")


TWO_BOOTS_A_SIDE = """\
name: twice
engine:
  kind: bundled
  model: dummy:tiny  # what is tested is the statistics of two boots a side, not the model
  flags: {device: cpu, max-model-len: 512, kv-cache-memory-bytes: 8388608}
repeats: 2
windows:
  - name: W1
    control: C0ctl
    arms:
      - {name: A1kv16m, flags: {kv-cache-memory-bytes: 16777216}}
      - {name: A2kv32m, flags: {kv-cache-memory-bytes: 33554432}}
instruments:
  memory:
keep:
  metrics: [memory.kv_pool_tokens]
"""


@pytest.mark.slow
def test_two_boots_a_side_give_a_difference_and_say_what_would_give_an_interval(tmp_path: Path) -> None:
    (tmp_path / "twice.yaml").write_text(TWO_BOOTS_A_SIDE)
    done = lab_cli(["run", "twice.yaml", "--db", "lab.db"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = lab_cli(["compare", "A1kv16m", "A2kv32m", "--db", "lab.db"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    out = " ".join(shown.stdout.split())
    assert ("memory.kv_pool_tokens: 2 boots a side give a difference, not an interval: 3 or more a side, or a "
            "calibration (`lab calibrate`), give one") in out
    assert "n 2 vs 2: no CI (needs 3 a side)" in out and "established" not in out and "CI [" not in out
    data = json.loads(lab_cli(["compare", "A1kv16m", "A2kv32m", "--json", "--db", "lab.db"], tmp_path).stdout)
    row = data["rows"][0]
    assert data["a"]["boots"] == ["A1kv16m", "A1kv16m"] and data["b"]["boots"] == ["A2kv32m", "A2kv32m"]
    assert row["delta_pct"] > 50 and row["change"] == "better"  # twice the KV memory: a difference, stated
    stats = row["statistics"]
    assert (stats["test"], stats["n_a"], stats["n_b"], stats["ci_low_pct"], stats["ci_high_pct"]) == (
        "none", 2, 2, None, None)

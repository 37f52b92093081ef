"""Compare and report cannot be misread: one sign convention (better is positive) in the table and
the KEEP lines, every digit of a figure when piped, "better"/"worse" only beyond the noise band,
drift at the precision the rule compared it, a decode legend that fits many boots, and the
calibration a run's verdicts used."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from lab.analysis.compare import compare, print_comparison
from lab.analysis import verdicts
from lab.report import figures
from lab.report.build import write_report
from lab.report.data import load
from lab.store import writer
from lab.store.records import Cell
from tests.report.conftest import LADDER, Boot, build_run, lab_cli

PEAK = "memory.peak_memory_gib"  # lower is better
POOL = "memory.kv_pool_tokens"  # higher is better

# The built ladder judged on a lower-is-better metric, without the gate.
LOWER_IS_BETTER = LADDER[:LADDER.index("keep:")] + "keep:\n  threshold_pct: 2\n  metrics: [memory.peak_memory_gib]\n"


def peak(value: float) -> Boot:
    return Boot(values={PEAK: value})


def printed(comparison, width: int = 80) -> str:
    """What `lab compare` prints to a pipe: no terminal, `width` columns, no colour."""
    console = Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)
    print_comparison(console, comparison)
    return console.file.getvalue()


def test_a_lower_is_better_gain_is_positive_in_the_table_and_in_the_keep_line(store) -> None:
    build_run(store, {"C0ctl/open": peak(10.0), "A1": peak(9.0), "A2": peak(11.0), "C0ctl/close": peak(10.0)},
              ladder=LOWER_IS_BETTER)
    comparison = compare(store, "C0ctl", "A1")
    [row] = comparison.rows
    assert (row.delta_pct, row.change) == (pytest.approx(10.0), "better")
    reasons = comparison.verdicts["A1"]["reasons"]
    assert reasons[0].startswith(f"{PEAK} +10.0 % (> 2 %)")
    out = printed(comparison, width=200)
    assert "+10.0 better" in out and "-10.0" not in out
    [worse] = compare(store, "C0ctl", "A2").rows
    assert (worse.delta_pct, worse.change) == (pytest.approx(-10.0), "worse")
    assert compare(store, "C0ctl", "A2").verdicts["A2"]["reasons"][0].startswith(f"{PEAK} -10.0 % regresses")


def test_piped_compare_prints_every_digit_of_large_figures(store, tmp_path: Path) -> None:
    build_run(store, {"C0ctl/open": Boot(values={POOL: 1073741824.5, "memory.host_mem_available_floor_gib": 5.0}),
                      "A1": Boot(values={POOL: 1098765432.25, "memory.host_mem_available_floor_gib": 5.0}),
                      "C0ctl/close": Boot(values={POOL: 1073741999.5, "memory.host_mem_available_floor_gib": 5.0})})
    done = lab_cli(["compare", "C0ctl", "A1", "--db", str(tmp_path / "lab.db")], tmp_path, columns=80)
    assert done.returncode == 0, done.stderr
    assert "1073741912.0" in done.stdout and "1098765432.2" in done.stdout  # the controls' mean and the arm
    assert "…" not in done.stdout


def test_a_change_inside_the_controls_drift_is_within_noise_not_better(store) -> None:
    floor = {"memory.host_mem_available_floor_gib": 5.0}
    # Controls 9.4 % apart; A1 +3.9 % above their mean; A2 +12 %.
    build_run(store, {"C0ctl/open": Boot(values={POOL: 955.0, **floor}), "A1": Boot(values={POOL: 1039.0, **floor}),
                      "A2": Boot(values={POOL: 1120.0, **floor}), "C0ctl/close": Boot(values={POOL: 1045.0, **floor})})
    [key, _gate] = compare(store, "C0ctl", "A1").rows
    assert key.delta_pct == pytest.approx(3.9) and key.change == "within noise"
    assert key.band_pct == pytest.approx(9.0) and key.band_source == "controls' drift in W1"
    out = printed(compare(store, "C0ctl", "A1"), width=200)
    assert "+3.9 within noise ±9.0 %" in out and "+3.9 better" not in out
    assert f"{POOL}: +3.9 % is within the noise band ±9.0 % (controls' drift in W1)" in out
    [beyond, _] = compare(store, "C0ctl", "A2").rows
    assert beyond.change == "better" and beyond.delta_pct == pytest.approx(12.0)


def test_the_minimum_detectable_effect_widens_the_band_and_is_printed(store) -> None:
    floor = {"memory.host_mem_available_floor_gib": 5.0}
    boots = {label: Boot(values={POOL: 1000.0, **floor}) for label in ("C0ctl/open", "A1", "A2", "C0ctl/close")}
    calibration = build_run(store, boots, name="cal")
    writer.write_noise(store, run_id=calibration, ladder_name="built", host="test", rows=[
        {"metric": POOL, "boots": 5, "sd_log": 0.03, "df": 3, "drift_pct": 2.5, "mde_pct": 12.0, "repeats": 1,
         "power": 0.8}])
    build_run(store, {**boots, "A1": Boot(values={POOL: 1030.0, **floor})}, name="r")
    comparison = compare(store, "C0ctl", "A1")
    [key, _gate] = comparison.rows
    mde = comparison.verdicts["A1"]["detail"]["metrics"][0]["interval"]["mde_pct"]
    assert mde > 3.0 and key.mde_pct == mde
    assert (key.band_pct, key.band_source, key.change) == (mde, "minimum detectable effect", "within noise")
    assert f"MDE ±{mde:.1f} %" in printed(comparison, width=250)


def test_the_report_shows_drift_at_the_precision_that_voided_the_window(store, tmp_path: Path) -> None:
    floor = {"memory.host_mem_available_floor_gib": 5.0}
    # 20.41 / 1010.205: the controls are 2.02 % apart, just beyond the 2 % limit.
    build_run(store, {"C0ctl/open": Boot(values={POOL: 1000.0, **floor}), "A1": Boot(values={POOL: 1010.0, **floor}),
                      "A2": Boot(values={POOL: 1010.0, **floor}),
                      "C0ctl/close": Boot(values={POOL: 1020.41, **floor})})
    markdown = (write_report(store, None, tmp_path / "reports") / "index.md").read_text()
    assert re.search(r"\| A1 \| W1 \| max-num-seqs=4 \| inconclusive \| -?0\.0\d* \| 2\.02 \| unknown \|", markdown)
    assert "controls drift 2.02 % > 2 %" in markdown


def test_the_decode_legend_names_each_arm_once_and_fits_a_ladder_of_many_boots(store) -> None:
    arms = [f"A{i}" for i in range(1, 37)]
    ladder = ("name: many\nengine: {kind: bundled, model: smollm2-135m, flags: {device: cpu}}\n"
              "windows:\n  - name: W1\n    control: C0ctl\n    arms:\n"
              + "".join(f"      - {{name: {a}, flags: {{max-num-seqs: {i + 2}}}}}\n" for i, a in enumerate(arms))
              + "instruments:\n  decode:\n")

    def decode(scale: float) -> Boot:
        return Boot(cells={"decode": [Cell(metric, scale * c * 10, "tok/s", params={"level": c}, requests=[])
                                      for c in (1, 2, 4) for metric in ("agg_tok_s", "stream_tok_s")]})

    build_run(store, {"C0ctl/open": decode(1.0), **{a: decode(1 + i / 100) for i, a in enumerate(arms)},
                      "C0ctl/close": decode(1.01)}, ladder=ladder, name="many")
    data = load(store, 1)
    figure = figures.decode_ladder(data.instrument_cells("decode"), figures.slot_styles(data.slots))
    legend = figure.axes[1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["controls (2 boots)"] + [f"{a} (1 boot)" for a in arms]
    colours = {line.get_color() for line in figure.axes[0].get_lines()}
    assert len(colours) == 37 and figures.CONTROL_COLOUR in colours  # one per arm, one grey for both controls
    figure.canvas.draw()
    box, canvas = legend.get_window_extent(), figure.bbox
    assert box.x0 >= canvas.x0 and box.x1 <= canvas.x1 and box.y0 >= canvas.y0 and box.y1 <= canvas.y1


def test_the_report_has_a_calibration_section_when_a_noise_model_exists(store, tmp_path: Path) -> None:
    floor = {"memory.host_mem_available_floor_gib": 5.0}
    boots = {label: Boot(values={POOL: 1000.0, **floor}) for label in ("C0ctl/open", "A1", "A2", "C0ctl/close")}
    build_run(store, boots)
    without = (write_report(store, None, tmp_path / "before") / "index.md").read_text()
    assert "## Calibration" in without and "No calibration of this ladder on this host" in without
    calibration = build_run(store, boots, name="cal")
    writer.write_noise(store, run_id=calibration, ladder_name="built", host="test", rows=[
        {"metric": POOL, "boots": 5, "sd_log": 0.0123, "df": 3, "drift_pct": 2.5, "mde_pct": 4.56, "repeats": 2,
         "power": 0.8}])
    build_run(store, boots, name="after")
    judged = verdicts.judge(verdicts.load(store, 3))
    assert any("calibration run 2 (5 control boots)" in r for r in judged["A1"].reasons)
    markdown = (write_report(store, "after", tmp_path / "after") / "index.md").read_text()
    assert f"| {POOL} | cal | 5 | 1.23 | 2.50 | ±4.56 at 2 repeats, 80 % power |" in markdown

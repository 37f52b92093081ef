"""A ladder with a control and no arms: one measured boot (after the warm-up), stored, listed,
reported and compared with another such run, and nothing judged (the real bundled engine on SmolLM2)."""

from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import select

from lab.cli import main as lab_main
from lab.store import models as m
from lab.store.db import open_store
from tests.lab.conftest import lab_process
from tests.lab.test_resume import finish

pytestmark = pytest.mark.slow

LADDER = """\
    name: once
    engine:
      kind: bundled
      model: smollm2-135m
      flags: {device: cpu, max-model-len: 1024, kv-cache-memory-bytes: 67108864}
    windows:
      - name: W1
        control: C0ctl
    instruments:
      decode: {levels: [1], max_tokens: 4}
      memory:
    keep:
      metrics: [{metric: decode.stream_tok_s, where: {level: 1}}]
    hygiene: {warmup_boot: true}
    """


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs of the one-boot ladder, `first` and `second`, in ./lab.db, by `lab run` as a process."""
    cwd = tmp_path_factory.mktemp("once")
    (cwd / "once.yaml").write_text(textwrap.dedent(LADDER))
    for name in ("first", "second"):
        code, out = finish(lab_process(["run", "once.yaml", "--name", name], cwd), timeout=600)
        assert code == 0, out
        assert "✓ 00 C0ctl (warmup): done" in out and "✓ 01 C0ctl (open): done" in out
        assert "KEEP" not in out and "judged nothing" not in out
    return cwd


def lab(cwd: Path, *args: str) -> int:
    return lab_main([*args, "--db", str(cwd / "lab.db")])


def test_dry_run_plans_the_warm_up_and_one_measured_boot_and_says_nothing_is_judged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    (tmp_path / "once.yaml").write_text(textwrap.dedent(LADDER))
    assert lab_main(["run", "--dry-run", str(tmp_path / "once.yaml")]) == 0
    out = capsys.readouterr().out
    rows = [line.split("│")[1:6] for line in out.splitlines() if line.startswith("│")]
    assert [[cell.strip() for cell in row] for row in rows] == [["0", "-", "C0ctl", "warmup", "warmup"],
                                                                ["1", "W1", "C0ctl", "control", "open"]]
    assert ("window W1 has no arms: C0ctl is measured once and nothing is judged (keep.metrics are measured, "
            "not judged)") in out


def test_the_run_stores_one_measured_boot_with_its_figures_and_no_verdict(runs: Path) -> None:
    store = open_store(str(runs / "lab.db"), read_only=True)
    try:
        with store.session() as s:
            run = s.scalar(select(m.Run).where(m.Run.name == "first"))
            assert run.status == "done"
            slots = s.scalars(select(m.Slot).where(m.Slot.run_id == run.id).order_by(m.Slot.idx)).all()
            assert [(x.role, x.position, x.status) for x in slots] == [("warmup", "warmup", "done"),
                                                                      ("control", "open", "done")]
            speed = s.scalars(select(m.Cell).where(m.Cell.slot_id == slots[1].id,
                                                   m.Cell.metric == "stream_tok_s")).all()
            assert len(speed) == 2 and all(c.valid and c.value > 0 for c in speed)  # C1 runs twice
            assert not s.scalars(select(m.Verdict)).all()
    finally:
        store.close()


def test_lab_ls_lists_the_control_and_its_two_boots(runs: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert lab(runs, "ls", "first") == 0
    out = capsys.readouterr().out
    assert "verdicts:" not in out
    boots = [[cell.strip() for cell in line.split("│")[1:7]] for line in out.splitlines() if "C0ctl" in line
             and "│" in line and ("warmup" in line or "control/open" in line)]
    assert boots == [["0", "-", "C0ctl", "warmup", "1", "done"], ["1", "W1", "C0ctl", "control/open", "1", "done"]]


def test_the_report_shows_the_figures_says_there_is_no_control_and_draws_no_keep_table(
        runs: Path, tmp_path: Path) -> None:
    assert lab(runs, "report", "first", "--out", str(tmp_path)) == 0
    report = tmp_path / "first"
    text = (report / "index.md").read_text()
    assert "a one-boot run has no control to compare with, so nothing is judged" in text
    assert "| verdict |" not in text and not (report / "keep.png").exists()
    assert "## Calibration" not in text  # nothing is judged, so nothing a calibration would sharpen
    assert (report / "decode_ladder.png").exists()
    figures = text[text.index("## Every stored figure"):text.index("## Ladder")]
    assert "| decode | stream_tok_s | level=1 | tok/s |" in figures and "C0ctl/open" in figures
    assert "one-boot run has no control" in (report / "index.html").read_text()


def test_compare_across_two_one_boot_runs_gives_a_difference_and_no_interval(
        runs: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert lab(runs, "compare", "first:C0ctl", "second:C0ctl") == 0
    out = capsys.readouterr().out
    assert "one boot a side: a difference, no interval" in out
    assert "CI [" not in out and "bootstrap" not in out
    assert "KEEP first:C0ctl: not judged (a one-boot run: no control to compare it with)" in out
    assert lab(runs, "compare", "first:C0ctl", "second:C0ctl", "--json") == 0
    [row] = json.loads(capsys.readouterr().out)["rows"]
    assert row["metric"] == "decode.stream_tok_s[level=1]" and row["a"] > 0 and row["b"] > 0
    assert row["delta_pct"] is not None
    assert row["statistics"]["test"] == "none" and row["statistics"]["ci_low_pct"] is None
    assert (row["statistics"]["n_a"], row["statistics"]["n_b"]) == (1, 1)


def test_export_writes_the_boot_and_an_empty_verdict_table(runs: Path, tmp_path: Path) -> None:
    assert lab(runs, "export", "first", "--format", "csv", "--out", str(tmp_path)) == 0
    with open(tmp_path / "first" / "slots.csv") as f:
        assert [(row["role"], row["position"]) for row in csv.DictReader(f)] == [("warmup", "warmup"),
                                                                              ("control", "open")]
    with open(tmp_path / "first" / "verdicts.csv") as f:
        assert list(csv.DictReader(f)) == []

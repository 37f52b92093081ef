"""Borrowed figures: a ladder's `borrowed:` file is stored with the run and drawn in its report,
labelled with its source and date, and never judged."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from lab.ladder.errors import LadderError
from lab.ladder.validate import load_ladder
from lab.store import models as m
from lab.store.db import open_store
from tests.lab.test_engine_arms import scripted

LADDER = """\
name: lent
engine:
%s
windows:
  - name: W1
    control: C0ctl
    arms:
      - name: E1slower
        engine:
%s
borrowed: figures.csv
instruments:
  prefill: {lengths: [128], reps: 1}
keep:
  metrics: [{metric: prefill.ttft_s, where: {length: 128}}]
""" % (scripted(indent=2).rstrip("\n"), scripted(step_ms=20, indent=10).rstrip("\n"))
FIGURES = """\
metric,params,value,unit,source,date
prefill.ttft_s,length=128,0.0421,s,vendor blog,2026-01-02
prefill.prefill_tok_s,length=128,2500,tok/s,a paper,2025-11-30
"""


@pytest.mark.slow
def test_a_report_draws_borrowed_figures_marked_with_their_source_and_judges_without_them(
        tmp_path: Path, lab) -> None:
    (tmp_path / "lent.yaml").write_text(LADDER)
    (tmp_path / "figures.csv").write_text(FIGURES)
    assert lab("run", "lent.yaml", "--name", "lent") == 0
    (tmp_path / "figures.csv").write_text("changed after the run\n")  # the run keeps what it read
    store = open_store(str(tmp_path / "lab.db"))
    with store.session() as s:
        run = s.scalar(select(m.Run))
        assert [(r["metric"], r["params"], r["value"], r["source"]) for r in run.borrowed] == [
            ("prefill.ttft_s", {"length": 128}, 0.0421, "vendor blog"),
            ("prefill.prefill_tok_s", {"length": 128}, 2500.0, "a paper")]
        verdict = s.scalar(select(m.Verdict))
        assert "borrowed" not in str(verdict.detail) and "0.0421" not in str(verdict.detail)
    store.close()
    assert lab("report", "lent", "--out", "reports") == 0
    report = (tmp_path / "reports" / "lent" / "index.md").read_text()
    figures = report.split("## Every stored figure")[1].split("\n## ")[0]
    header = next(line for line in figures.splitlines() if line.startswith("| instrument |"))
    assert header.endswith("| borrowed: vendor blog (2026-01-02) | borrowed: a paper (2025-11-30) |")
    ttft = next(line for line in figures.splitlines() if line.startswith("| prefill | ttft_s | length=128 |"))
    assert ttft.endswith("| 0.0421 s (borrowed) |  |")
    side = report.split("## Engines side by side")[1].split("\n## ")[0]
    assert "| 2,500 tok/s (borrowed) |" in side
    listed = report.split("## Borrowed figures")[1].split("\n## ")[0]
    assert "| prefill.ttft_s | length=128 | 0.0421 s (borrowed) | borrowed: vendor blog | 2026-01-02 |" in listed


def refused(tmp_path: Path, text: str, figures: str = FIGURES) -> list[str]:
    (tmp_path / "figures.csv").write_text(figures)
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(LadderError) as error:
        load_ladder(tmp_path / "r.yaml")
    return [line.split(": ", 1)[1] for line in error.value.lines()]


def test_a_keep_rule_that_names_a_borrowed_series_is_refused(tmp_path: Path) -> None:
    text = LADDER.replace("metrics: [{metric: prefill.ttft_s, where: {length: 128}}]",
                          "metrics: [borrowed.prefill.ttft_s]")
    assert refused(tmp_path, text) == ["KEEP metric 'borrowed.prefill.ttft_s': borrowed figures are shown, never "
                                       "judged; key on a figure this ladder measures"]


def test_a_borrowed_file_that_cannot_be_used_is_refused_at_its_line(tmp_path: Path) -> None:
    line = LADDER.splitlines().index("borrowed: figures.csv") + 1
    assert refused(tmp_path, LADDER, FIGURES.replace("0.0421", "fast")) == [
        "borrowed: figures.csv row 1: value: Input should be a valid number, unable to parse string as a number"]
    assert refused(tmp_path, LADDER, FIGURES.replace("prefill.prefill_tok_s,", "decode.agg_tok_s,")) == [
        "borrowed: figures.csv row 2: decode.agg_tok_s is not a figure this ladder's instruments produce; nothing "
        "of the run would stand beside it"]
    (tmp_path / "r.yaml").write_text(LADDER.replace("figures.csv", "missing.yaml"))
    with pytest.raises(LadderError) as error:
        load_ladder(tmp_path / "r.yaml")
    assert error.value.lines() == [f"{tmp_path / 'r.yaml'}:{line}: borrowed: cannot read "
                                   f"{tmp_path / 'missing.yaml'}: No such file or directory"]

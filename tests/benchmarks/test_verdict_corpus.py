"""`benchmarks/verdict_corpus.py` re-judges the stores in results/ as docs/keep.md quotes them: the
no-op arms give no keep, the injected slowdowns are all rejected, under the rule before and after."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.scripts import ROOT, run_script


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # where the compressed stores are decompressed


def totals(out: str) -> dict[tuple[str, str, str], list[str]]:
    """(design, truth, rule) -> the cells of its **all** row, from `verdicts` on."""
    rows = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| **all** |")]
    return {(r[1], r[2], r[3]): r[4:] for r in rows}


def test_the_corpus_of_results_is_re_judged_under_both_rules(cache: None) -> None:
    out = run_script("verdict_corpus.py", str(ROOT / "results/cpu-c480be3-bundled-noop.db.xz") + ":noop",
                     str(ROOT / "results/h200-57d1fcf-h200-inject3.db.xz") + ":inject", "--inject-pct", "3")
    found = totals(out)
    header = ["verdicts", "keep", "regressed", "no effect", "gate", "inconclusive", "decided %", "false keep",
              "false reject", "miss"]
    assert out.splitlines()[0] == "| store | design | truth | rule | " + " | ".join(header) + " |"
    for rule in ("old", "new"):
        # The runs as stored: 10 no-op arms, 3 repeats and a calibration; 10 true 3 % slowdowns.
        assert found[("stored", "noop", rule)] == ["10", "0", "0", "10", "0", "0", "100", "0", "0", "0"]
        assert found[("stored", "inject", rule)] == ["10", "0", "10", "0", "0", "0", "100", "0", "0", "0"]
        assert found[("first", "inject", rule)][:3] == ["10", "0", "10"]
        # One boot each, no calibration: the quiet CPU's no-op boots keep nothing; one outlier boot of
        # a calibration (-8.5 % at a 5 % threshold) is a false reject.
        first = dict(zip(header, found[("first", "noop", rule)]))
        assert (first["false keep"], first["false reject"]) == ("0", "1")
    # At a 5 % threshold a 3 % slowdown is rightly "no effect": only the inject3 calibration's
    # 2 % ladder gets a synthetic one.
    assert found[("first", "synthetic", "new")][:3] == ["1", "0", "1"]


def test_one_rule_one_design_and_the_listing(cache: None) -> None:
    out = run_script("verdict_corpus.py", str(ROOT / "results/h200-63e5d3d-h200-long.db.xz") + ":real",
                     "--rule", "new", "--design", "stored", "--list")
    assert "| **all** | stored | real | new | 1 | 0 | 1 | 0 | 0 | 0 | 100 | 0 | 0 | 0 |" in out
    assert "| old |" not in out and "| first |" not in out
    assert "L1mnbt4k (stored, real): new regressed" not in out  # one rule: nothing to disagree on


def test_a_store_without_its_truth_is_refused() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "verdict_corpus.py"),
                           str(ROOT / "results/h200-63e5d3d-h200-long.db.xz")], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    assert "write STORE:TRUTH with TRUTH one of noop, inject, real" in done.stderr

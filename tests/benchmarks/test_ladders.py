"""The ladders that measure the lab itself (`benchmarks/ladders/`: no-op arms and arms with a known,
injected effect) stay runnable: each is valid as written and `lab run --dry-run` plans every arm."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.cli import main as lab_main
from lab.ladder.validate import load_ladder
from tests.benchmarks.scripts import BENCHMARKS

LADDERS = sorted((BENCHMARKS / "ladders").glob("*.yaml"))


def test_there_are_ladders_to_check() -> None:
    assert {p.name for p in LADDERS} >= {"bundled-noop.yaml", "scripted-noop.yaml", "scripted-inject5.yaml"}


@pytest.mark.parametrize("path", LADDERS, ids=lambda p: p.name)
def test_a_benchmark_ladder_dry_runs_every_arm_and_points_at_the_schema(
        path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps tables at 80 columns when not on a terminal
    assert lab_main(["run", str(path), "--dry-run"]) == 0, capsys.readouterr().err
    plan = capsys.readouterr().out
    ladder, _ = load_ladder(path)
    for window in ladder.windows:
        for arm in window.arms:
            assert f"│ {arm.name} " in plan, arm.name
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing
    assert path.read_text().startswith("# yaml-language-server: $schema=../../ladders/ladder.schema.json")

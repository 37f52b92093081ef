"""`benchmarks/scripted_engine.py` under `lab run`: its decode figures follow from its scripted step,
and an arm that doubles the step is measured at half the rate and rejected."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from lab.cli import main as lab_main
from lab.store import models as m
from lab.store.db import open_store
from tests.benchmarks.scripts import BENCHMARKS

STEP_MS = 20
LADDER = f"""\
name: scripted-tiny
engine:
  kind: command
  command: [{sys.executable}, {BENCHMARKS / "scripted_engine.py"}, --port, "{{port}}", --model, "{{model}}"]
  model: scripted
  flags: {{step-ms: {STEP_MS}}}
  ready_timeout_s: 60
  stop_grace_s: 5
windows:
  - name: W1
    control: C0ctl
    arms:
      - {{name: A1slow, flags: {{inject-step-delay-ms: {STEP_MS}}}}}
instruments:
  decode: {{levels: [1], max_tokens: 16}}
keep:
  metrics:
    - {{metric: decode.stream_tok_s, where: {{level: 1}}}}
hygiene: {{warmup_boot: true, min_mem_available_gib: 0.1}}  # both controls warm: the rule needs two
"""


@pytest.mark.slow
def test_a_ladder_on_the_scripted_engine_measures_its_step_and_rejects_a_doubled_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(LADDER)
    assert lab_main(["run", "tiny.yaml", "--db", "lab.db", "--name", "tiny"]) == 0
    store = open_store(str(tmp_path / "lab.db"))
    try:
        with store.session() as s:
            rates: dict[str, list[float]] = {}
            for cell, arm in s.execute(select(m.Cell, m.Arm).join(m.Slot, m.Cell.slot_id == m.Slot.id)
                                       .join(m.Arm, m.Slot.arm_id == m.Arm.id)
                                       .where(m.Cell.metric == "stream_tok_s")):
                assert cell.valid, cell.note
                rates.setdefault(arm.name, []).append(cell.value)
            (verdict,) = s.scalars(select(m.Verdict)).all()
            decision = verdict.decision
    finally:
        store.close()
    # One token per step: 1000 / 20 ms a second for the control (a busy host only slows it), half
    # that with the step doubled.
    assert len(rates["C0ctl"]) == 4 and len(rates["A1slow"]) == 2
    assert all(30 < rate <= 1000 / STEP_MS * 1.02 for rate in rates["C0ctl"]), rates
    assert 0.4 < statistics.median(rates["A1slow"]) / statistics.median(rates["C0ctl"]) < 0.6, rates
    assert decision == "reject"

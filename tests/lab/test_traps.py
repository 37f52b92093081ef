"""Ladder traps the first measured boot shows (`lab.analysis.traps`): a key figure that is mostly ramp,
a mixed probe whose chat is sent after the long prefill ended, a request longer than the engine's
context, a key metric whose repeats in one boot already spread beyond the threshold. Each is printed
once with its ladder line and fix, stored with the run and shown by `lab ls` and the report; a
request the engine's context cannot hold at all stops the run after its first boot."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

from lab.analysis import traps
from lab.analysis.verdicts import RunEvidence, SlotCells, StoredCell, metric_directions, rule_spec
from lab.instruments.decode import NO_TOKEN_TIMING
from lab.ladder.validate import parse_ladder
from lab.ladder.yaml_lines import load
from lab.store import reader

# The bundled engine started as a command engine: its context is known only once it has booted.
LADDER = """\
name: traps
engine:
  kind: command
  command: [{python}, -m, lab.engine, serve, --port, "{{port}}", --model, "{{model}}", --device, cpu,
            --max-model-len, "{context}", --kv-cache-memory-bytes, "8388608"]
  model: dummy:tiny
windows:
  - name: W1
    control: C0ctl
    arms:
      - {{name: A1, flags: {{max-num-seqs: 8}}}}
instruments:
  decode: {{levels: [1], max_tokens: 4, context_tokens: 200}}
  mixed: {{long_tokens: 128, delay_s: 3.0, short_max_tokens: 4}}
  prefill: {{lengths: [64, 600], reps: 1, warmup_reps: 0}}
keep:
  threshold_pct: 0.001
  metrics:
    - {{metric: decode.agg_tok_s, where: {{level: 1}}}}
hygiene: {{probe_prompt_tokens: 400}}
"""


def ladder(tmp_path: Path, context: int) -> Path:
    path = tmp_path / "traps.yaml"
    path.write_text(LADDER.format(python=sys.executable, context=context))
    return path


def test_the_first_boot_warns_of_each_trap_once_and_the_run_keeps_them(tmp_path: Path, lab, store, capsys) -> None:
    assert lab("run", str(ladder(tmp_path, 512)), "--name", "t") == 0
    err = " ".join(capsys.readouterr().err.split())
    expected = [
        r"ladder line 19 \(keep\.metrics\[0\]\): decode\.agg_tok_s\[level=1\] is \d+% ramp: in C0ctl/open a "
        r"stream's first token came [\d.]+ s into its [\d.]+ s, .* key decode\.steady_agg_tok_s \(the rate while its "
        r"stream decodes\) or raise instruments\.decode\.max_tokens \(line 13\)",
        r"ladder line 14 \(instruments\.mixed\.delay_s\): the long prefill of 128 tokens took [\d.]+ s on this engine "
        r"in C0ctl/open, over before the short chat was sent 3 s after it, .* lower delay_s below [\d.]+ s or raise "
        r"instruments\.mixed\.long_tokens \(line 14\)",
        r"ladder line 15 \(instruments\.prefill\.lengths\): a request of 601 tokens exceeds the context of 512 tokens "
        r"this engine reported in C0ctl/open, so its cells are invalid at every boot",
        r"ladder line 19 \(keep\.metrics\[0\]\): decode\.agg_tok_s\[level=1\]'s 2 repeats in C0ctl/open are [\d.]+ % "
        r"apart, more than the 0\.001 % threshold: .* or raise keep\.threshold_pct \(line 17\)",
    ]
    for pattern in expected:
        assert len(re.findall("warning: " + pattern, err)) == 1, pattern
    stored = reader.find_run(store, "t").warnings
    assert len(stored) == 4 and all(re.match(p, w) for p, w in zip(expected, stored)), stored

    assert lab("ls", "t") == 0
    listed = " ".join(capsys.readouterr().out.split())
    assert all(re.search("warning: " + p, listed) for p in expected)
    assert lab("report", "t") == 0
    markdown = (tmp_path / "reports" / "t" / "index.md").read_text()
    assert "## Warnings" in markdown and "a request of 601 tokens exceeds the context of 512 tokens" in markdown


def test_a_request_longer_than_the_engines_context_stops_the_run_after_its_first_boot(tmp_path: Path, lab, store,
                                                                                       capsys) -> None:
    path = ladder(tmp_path, 256)
    path.write_text(path.read_text().replace("hygiene: {probe_prompt_tokens: 400}\n", ""))
    assert lab("run", str(path), "--name", "t") == 1
    err = " ".join(capsys.readouterr().err.split())
    assert ("run t stopped after its first boot: ladder line 13 (instruments.decode.max_tokens): a request of 460 "
            "tokens; ladder line 15 (instruments.prefill.lengths): a request of 601 tokens does not fit the context "
            "of 256 tokens the engine reported in C0ctl (open), so every boot would fail its readiness probe; "
            "shorten it or boot the engine with a longer context, then start a new run") in err
    run = reader.find_run(store, "t")
    assert run.status == "failed" and run.reason.startswith("ladder line 13")
    assert [len(s.boots) for s in reader.slots(store, run.id)] == [1, 0, 0]


QUIET = """\
name: quiet
engine: {kind: bundled, model: dummy:tiny, flags: {device: cpu}}
windows:
  - name: W1
    control: C0ctl
    arms: [{name: A1, flags: {max-num-seqs: 8}}]
instruments:
  decode: {levels: [1, 8], max_tokens: 256}
  mixed: {long_tokens: 1000, delay_s: 0.05}
keep:
  threshold_pct: 2
  metrics:
    - {metric: decode.agg_tok_s, where: {level: 8}}
    - {metric: decode.steady_agg_tok_s, where: {level: 1}}
"""


def first_boot(text: str, cells: list[StoredCell]) -> list[str]:
    parsed = parse_ladder(text, "test")
    slot = SlotCells(id=1, idx=0, arm="C0ctl", role="control", position="open", window="W1", status="done",
                     boot_statuses=("done",), reason=None, cold=False, cells=tuple(cells))
    evidence = RunEvidence(1, "t", parsed, rule_spec(parsed), [slot], {"C0ctl": ("control", "W1")},
                           metric_directions(parsed))
    located, _ = load(text)
    return traps.first_boot(evidence, slot, located)


def cell(instrument: str, metric: str, value: float | None, repeat: int = 0, valid: bool = True, note: str = "",
         **params: object) -> StoredCell:
    return StoredCell(instrument, metric, dict(params), repeat, value, "", valid, 1, note)


def test_a_boot_that_shows_no_trap_warns_of_nothing() -> None:
    cells = [cell("decode", "ttft_s", 0.05, level=8), cell("decode", "stream_tok_s", 100.0, level=8),
             cell("decode", "agg_tok_s", 790.0, level=8),
             cell("decode", "steady_agg_tok_s", 101.0, 0, level=1), cell("decode", "steady_agg_tok_s", 100.0, 1, level=1),
             cell("mixed", "long_prefill_s", 0.4)]
    assert first_boot(QUIET, cells) == []


def test_each_trap_is_measured_against_its_own_limit() -> None:
    # 0.3 s of a 0.3 + 255 / 100 s stream: 10.5 % ramp; repeats 2.5 % apart at 2 %; delay 0.05 s on a
    # 0.04 s prefill; a prefill cell that the engine's context refused.
    cells = [cell("decode", "ttft_s", 0.3, level=8), cell("decode", "stream_tok_s", 100.0, level=8),
             cell("decode", "steady_agg_tok_s", 101.25, 0, level=1),
             cell("decode", "steady_agg_tok_s", 98.75, 1, level=1), cell("mixed", "long_prefill_s", 0.04)]
    found = first_boot(QUIET, cells)
    assert [w.split(":")[0] for w in found] == ["ladder line 13 (keep.metrics[0])",
                                                "ladder line 9 (instruments.mixed.delay_s)",
                                                "ladder line 14 (keep.metrics[1])"]
    assert "decode.agg_tok_s[level=8] is 11% ramp" in found[0] and "all 8 streams decode" in found[0]
    assert "are 2.5 % apart, more than the 2 % threshold" in found[2]
    # Just inside each limit: nothing.
    cells = [cell("decode", "ttft_s", 0.28, level=8), cell("decode", "stream_tok_s", 100.0, level=8),
             cell("decode", "steady_agg_tok_s", 101.0, 0, level=1),
             cell("decode", "steady_agg_tok_s", 99.0, 1, level=1), cell("mixed", "long_prefill_s", 0.06)]
    assert first_boot(QUIET, cells) == []


def test_streams_whose_tokens_all_came_with_the_first_are_all_ramp() -> None:
    # A fast engine behind a slower HTTP layer sends a short stream in one chunk: no stream rate,
    # and the aggregate is nothing but the wait for that chunk.
    cells = [cell("decode", "ttft_s", 0.007, level=8),
             cell("decode", "stream_tok_s", None, valid=False, note=NO_TOKEN_TIMING, level=8)]
    found = first_boot(QUIET, cells)
    assert len(found) == 1 and "decode.agg_tok_s[level=8] is 100% ramp" in found[0]
    assert "first token came 0.007 s into its 0.007 s" in found[0]
    # A rate missing because every stream was unvouched and excluded says nothing about the ramp.
    cells[1] = cell("decode", "stream_tok_s", None, valid=False, note="every stream was unvouched and excluded",
                    level=8)
    assert first_boot(QUIET, cells) == []

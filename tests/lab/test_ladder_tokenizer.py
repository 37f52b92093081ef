"""`engine.tokenizer:` end to end: a command engine with no tokenizer route (the bundled engine on
SmolLM2 started as a command, its tokenizer routes hidden from the lab) measured with exact prompt
lengths from the tokenizer the ladder names, checked at each boot."""

from __future__ import annotations

import sys
from pathlib import Path

from sqlalchemy import select

from lab.instruments import engine_extras
from lab.store import models as m

LADDER = f"""\
name: tok
engine:
  kind: command
  command: [{sys.executable}, -m, lab.engine, serve, --model, "{{model}}", --port, "{{port}}", --device, cpu,
            --max-model-len, "1024"]
  model: smollm2-135m
  tokenizer: smollm2-135m
  ready_timeout_s: 120
windows:
  - name: W1
    arms:
      - {{name: A1, flags: {{max-num-seqs: 4}}}}
instruments:
  prefill: {{lengths: [150, 300], reps: 1}}
hygiene: {{min_mem_available_gib: 0.5}}
"""


def test_a_command_engine_without_a_tokenizer_route_gets_exact_lengths_from_the_ladders_tokenizer(
        tmp_path: Path, lab, store, monkeypatch, capsys) -> None:
    monkeypatch.setattr(engine_extras, "TOKENIZER_ROUTES", ("/no-tokenize", "/extras/no-tokenize"))
    (tmp_path / "tok.yaml").write_text(LADDER)
    assert lab("run", "tok.yaml", "--name", "tok") == 0, capsys.readouterr().err
    with store.session() as s:
        boots = s.scalars(select(m.Boot).order_by(m.Boot.id)).all()
        cells = s.scalars(select(m.Cell).where(m.Cell.metric == "prefill_tok_s")).all()
        prompts = {r.id: r.prompt_tokens for r in s.scalars(select(m.Request)).all()}
        assert len(boots) == 3 and all(b.status == "done" for b in boots)
        assert all(b.capabilities["ladder_tokenizer"] == "smollm2-135m" and b.capabilities["token_count"]["ok"]
                   for b in boots)
        assert len(cells) == 6 and all(c.valid for c in cells), [c.note for c in cells]
        assert all("prompt sized by the ladder's tokenizer smollm2-135m" in c.note for c in cells)
        assert sorted(prompts[c.request_ids[0]] for c in cells) == [150] * 3 + [300] * 3
    capsys.readouterr()
    assert lab("ls", "tok") == 0
    assert "tokenizer ✗, the ladder's smollm2-135m ✓" in capsys.readouterr().out

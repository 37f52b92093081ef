"""Streams that must run to `max_tokens` on an engine that ignores `ignore_eos`: the probe bans
the end-of-sequence ids with `logit_bias` and checks the ban works, decode and prefill's tail send
it and say so. The engine is the real bundled one on SmolLM2, behind a proxy (eos_proxy.py) that
drops `ignore_eos` as llama-cpp-python's server ignores it (and `logit_bias` too, for an engine
that honours neither), with a model that ends every reply after 4 tokens by itself."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.instruments import local_tokenizer
from lab.instruments.capabilities import Endpoint, probe, summary
from lab.instruments.decode import DecodeInstrument
from lab.instruments.prefill import PrefillInstrument
from tests.instruments.eos_proxy import eos_proxy
from tests.instruments.speed_boot import MODEL, SpeedBench

IM_END, ENDOFTEXT = 2, 0  # SmolLM2's `<|im_end|>` (the id its engine stops on) and `<|endoftext|>`
END_AFTER = ("--end-after", "4", "--eos-id", str(IM_END))
BANNED = "EOS banned by logit_bias (the engine ignores ignore_eos)"


@pytest.fixture
def ignores_eos(bench: SpeedBench, tmp_path: Path) -> Iterator[str]:
    with eos_proxy(bench.server.url, tmp_path / "proxy.log", "--drop", "ignore_eos", *END_AFTER) as url:
        yield url


@pytest.fixture
def ignores_both(bench: SpeedBench, tmp_path: Path) -> Iterator[str]:
    with eos_proxy(bench.server.url, tmp_path / "proxy.log", "--drop", "ignore_eos", "--drop", "logit_bias",
                   *END_AFTER) as url:
        yield url


def _probe(url: str, salt: str, tokenizer: str | None = None) -> dict:
    return asyncio.run(probe(Endpoint(url, f"{url}/v1", MODEL, None), 300, salt=salt, tokenizer=tokenizer))


def test_the_ladders_tokenizer_names_the_ids_that_end_a_generation(tmp_path: Path) -> None:
    # The GGUF's eos_token_id, then its control tokens whose text ends a generation.
    assert local_tokenizer.load("smollm2-135m").eos_ids == (IM_END, ENDOFTEXT)
    # A tokenizer.json: tokenizer_config's eos_token, generation_config's eos ids, then the special end texts.
    local_tokenizer.load("smollm2-135m").backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2]}))
    assert local_tokenizer.load(str(tmp_path)).eos_ids == (ENDOFTEXT, 5, IM_END)


@pytest.mark.slow
def test_the_bundled_engine_honours_ignore_eos_so_nothing_is_banned(bench: SpeedBench) -> None:
    caps = _probe(bench.server.url, "eos-honoured")
    assert caps["ignore_eos"] == "honoured" and "eos_ban" not in caps, caps
    assert "ignore_eos honoured · " in summary(caps)
    stored = bench.measure(DecodeInstrument(), {"levels": [2], "max_tokens": 6}, salt="eos-honoured-decode",
                           capabilities=caps)
    cell = stored.cell("agg_tok_s", level=2)
    assert cell.valid and cell.note == "8 streams of 6 tokens", cell.note
    assert all("logit_bias" not in r.payload and r.payload["ignore_eos"] for r in stored.requests_of(cell))


@pytest.mark.slow
def test_an_engine_that_ignores_ignore_eos_runs_to_max_tokens_with_the_eos_ban(
        bench: SpeedBench, ignores_eos: str) -> None:
    caps = _probe(ignores_eos, "eos-ban")
    assert caps["ignore_eos"] == "ignored", caps
    # /tokenize reads `<|im_end|>` and `<|endoftext|>` as one token each; `</s>` and the rest are text.
    assert caps["eos_ban"] == {"ok": True, "ids": [IM_END, ENDOFTEXT], "via": "/tokenize"}, caps
    assert "ignore_eos ignored, EOS banned by logit_bias ✓ · logprobs ✓" in summary(caps), summary(caps)

    stored = bench.measure(DecodeInstrument(), {"levels": [2], "max_tokens": 12}, salt="eos-ban-decode",
                           base_url=ignores_eos, capabilities=caps)
    assert all(c.valid for c in stored.cells), [c.note for c in stored.cells if not c.valid]
    cell = stored.cell("agg_tok_s", level=2)
    assert cell.note == f"8 streams of 12 tokens; {BANNED}", cell.note
    requests = stored.requests_of(cell)
    assert all(r.payload["logit_bias"] == {"2": -100, "0": -100} for r in requests)
    assert [r.completion_tokens for r in requests] == [12] * 8

    # prefill's tail: the same ban, and its cell says so.
    stored = bench.measure(PrefillInstrument(), {"lengths": [64], "reps": 1, "tail_tokens": 10},
                           salt="eos-ban-prefill", base_url=ignores_eos, capabilities=caps)
    tail = stored.cell("tail_tok_s", length=64)
    assert tail.valid and tail.note.endswith(f"; {BANNED}"), tail.note
    [request] = stored.requests_of(tail)
    assert request.payload["logit_bias"] == {"2": -100, "0": -100} and request.completion_tokens == 11


@pytest.mark.slow
def test_without_a_tokenizer_route_the_ladders_tokenizer_names_the_ids_to_ban(
        bench: SpeedBench, ignores_eos: str, monkeypatch) -> None:
    from lab.instruments import engine_extras

    monkeypatch.setattr(engine_extras, "TOKENIZER_ROUTES", ("/no-tokenize", "/extras/no-tokenize"))
    caps = _probe(ignores_eos, "eos-ban-ladder", tokenizer="smollm2-135m")
    assert caps["tokenizer"] is None and caps["ignore_eos"] == "ignored", caps
    assert caps["eos_ban"] == {"ok": True, "ids": [IM_END, ENDOFTEXT],
                               "via": "the ladder's tokenizer smollm2-135m"}, caps


@pytest.mark.slow
def test_where_neither_works_the_probe_says_so_once_and_streams_end_early_flagged(
        bench: SpeedBench, ignores_both: str) -> None:
    caps = _probe(ignores_both, "eos-neither")
    assert caps["ignore_eos"] == "ignored" and not caps["eos_ban"]["ok"], caps
    why = caps["eos_ban"]["why"]
    assert why.startswith("the chat still ended after ") and why.endswith(" of 32 tokens"), why
    line = summary(caps)
    assert f"ignore_eos ignored, EOS ban by logit_bias ✗ ({why}) · logprobs" in line and line.count("logit_bias") == 1

    # Decode keeps today's behaviour: no ban sent, the streams end early and the cells count them.
    stored = bench.measure(DecodeInstrument(), {"levels": [2], "max_tokens": 12}, salt="eos-neither-decode",
                           base_url=ignores_both, capabilities=caps)
    cell = stored.cell("agg_tok_s", level=2)
    requests = stored.requests_of(cell)
    assert all("logit_bias" not in r.payload for r in requests)
    assert all(r.completion_tokens < 12 for r in requests), [r.completion_tokens for r in requests]
    assert cell.note == ("8 streams of 12 tokens; ignore_eos ignored by the engine; 8 streams did not produce "
                         "exactly max_tokens (they ended early: fewer tokens, same figures per token)"), cell.note


def test_the_probe_asks_about_ignore_eos_where_an_instrument_sends_it() -> None:
    # lab/runner/slot.py asks the probe for ignore_eos (and the ban) only where one does.
    prefill, decode = PrefillInstrument(), DecodeInstrument()
    assert decode.sends_ignore_eos(decode.Params())
    assert prefill.sends_ignore_eos(prefill.Params(lengths=[64], tail_tokens=4))
    assert not prefill.sends_ignore_eos(prefill.Params(lengths=[64]))

"""The capability probe and the token counting it vouches for, against the real bundled engine,
whose own `usage` is the reference."""

from __future__ import annotations

import asyncio
import dataclasses

import tokenizers

from lab.instruments import engine_extras
from lab.instruments.capabilities import Endpoint, probe, refusal, summary
from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.prefill import PrefillInstrument
from lab.instruments.token_count import count_missing_usage
from tests.instruments.speed_boot import MODEL, SpeedBench


def endpoint(bench: SpeedBench, capabilities: dict | None = None) -> Endpoint:
    return Endpoint(bench.server.url, f"{bench.server.url}/v1", MODEL, None, capabilities)


def test_probe_finds_what_the_bundled_engine_does(bench: SpeedBench) -> None:
    caps = asyncio.run(probe(endpoint(bench), 300, salt="caps-probe"))
    assert caps["answered"] and caps["largest_prompt"] == {"tokens": 292, "exact": True}, caps
    assert (caps["streamed_usage"], caps["ignore_eos"], caps["logprobs"], caps["tokenizer"]) == (
        True, "honoured", True, "/tokenize"), caps
    assert caps["metrics"] and caps["stats"] and caps["prefix_cache_reset"]
    # /tokenize's counts agree with the engine's usage on the 292-token prompt (+ 8 generated) and the reply
    assert caps["token_count"]["ok"] and caps["token_count"]["checked"] == "prompt 292 (usage 292), reply 1 8 (usage 8)", \
        caps
    assert refusal("decode", caps) is None


def test_a_stream_without_usage_is_counted_as_the_engine_counts_it(bench: SpeedBench) -> None:
    async def go() -> tuple:
        async with StreamingClient(bench.server.url) as client:
            streamed = await client.request({"model": MODEL, "prompt": "Session caps-count. The river and the",
                                             "max_tokens": 9, "temperature": 0, "ignore_eos": True})
        bare = dataclasses.replace(streamed, usage_present=False, prompt_tokens=0, completion_tokens=0)
        caps = {"streamed_usage": False, "tokenizer": "/tokenize", "token_count": {"ok": True, "via": "/tokenize"}}
        async with EngineExtras(endpoint(bench, caps)) as extras:
            note = await count_missing_usage(extras, caps, [bare])
        return streamed, bare, note

    streamed, bare, note = asyncio.run(go())
    assert streamed.usage_present and streamed.completion_tokens == 9
    assert (bare.prompt_tokens, bare.completion_tokens) == (streamed.prompt_tokens, streamed.completion_tokens)
    assert bare.usage_counted_by == "/tokenize" and note == "tokens counted by /tokenize"
    # Without the probe's check, nothing counts them: the instruments refuse.
    assert refusal("prefill", {"streamed_usage": False, "token_count": {"ok": False, "why": "no tokenizer"}}) == \
        "the engine streams no usage and its tokens cannot be counted: no tokenizer"


def _no_tokenizer_route(monkeypatch) -> None:
    """The engine as one without `/tokenize` or `/extras/tokenize` looks to the lab: the routes
    the probe tries answer 404."""
    monkeypatch.setattr(engine_extras, "TOKENIZER_ROUTES", ("/no-tokenize", "/extras/no-tokenize"))


def test_the_ladders_tokenizer_sizes_exact_prompts_where_the_engine_has_no_tokenizer_route(
        bench: SpeedBench, monkeypatch) -> None:
    _no_tokenizer_route(monkeypatch)
    caps = asyncio.run(probe(endpoint(bench), 300, salt="caps-ladder-tok", tokenizer="smollm2-135m"))
    assert (caps["tokenizer"], caps["ladder_tokenizer"]) == (None, "smollm2-135m"), caps
    assert caps["largest_prompt"] == {"tokens": 292, "exact": True}, caps
    count = caps["token_count"]
    assert count["ok"] and count["via"] == "the ladder's tokenizer smollm2-135m" and count["chat"], count
    assert count["checked"] == "prompt 292 (usage 292), reply 1 8 (usage 8)", count
    assert refusal("prefill", caps) is None and refusal("decode", caps) is None
    assert "tokenizer ✗, the ladder's smollm2-135m ✓" in summary(caps)

    # Prefill reaches its lengths exactly, as the engine's own usage counts them.
    stored = bench.measure(PrefillInstrument(), {"lengths": [200, 333], "reps": 1}, salt="caps-ladder-prefill",
                           capabilities=caps)
    for length in (200, 333):
        cell = stored.cell("prefill_tok_s", length=length)
        assert cell.valid and "prompt sized by the ladder's tokenizer smollm2-135m" in cell.note, cell.note
        assert [r.prompt_tokens for r in stored.requests_of(cell)] == [length]

    # A stream without usage is counted with it, as the engine counts it, and its cells say so.
    async def go() -> tuple:
        async with StreamingClient(bench.server.url) as client:
            streamed = await client.request({"model": MODEL, "messages": [{"role": "user", "content": "Name a river."}],
                                             "max_tokens": 7, "temperature": 0, "ignore_eos": True})
        bare = dataclasses.replace(streamed, usage_present=False, prompt_tokens=0, completion_tokens=0)
        no_usage = {**caps, "streamed_usage": False}
        async with EngineExtras(endpoint(bench, no_usage)) as extras:
            note = await count_missing_usage(extras, no_usage, [bare])
        return streamed, bare, note

    streamed, bare, note = asyncio.run(go())
    assert streamed.usage_present and streamed.completion_tokens == 7
    assert (bare.prompt_tokens, bare.completion_tokens) == (streamed.prompt_tokens, streamed.completion_tokens)
    assert note == "tokens counted by the ladder's tokenizer smollm2-135m"


def test_a_ladder_tokenizer_that_counts_otherwise_makes_the_exact_length_instruments_refuse(
        bench: SpeedBench, monkeypatch, tmp_path) -> None:
    _no_tokenizer_route(monkeypatch)
    # A real tokenizer, but not this model's: one token per whitespace-separated word.
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "tokenizer.json"))
    caps = asyncio.run(probe(endpoint(bench), 300, salt="caps-ladder-bad", tokenizer=str(tmp_path / "tokenizer.json")))
    why = caps["token_count"]["why"]
    assert not caps["token_count"]["ok"] and why.startswith(
        f"the ladder's tokenizer {tmp_path / 'tokenizer.json'} counts differ from the engine's usage: prompt "), why
    assert refusal("prefill", caps) == refusal("mixed", caps) == (
        f"prompts of an exact length need the ladder's tokenizer, which cannot be used: {why}")
    # The engine streams its own usage, so decode needs no tokenizer to count.
    assert refusal("decode", caps) is None
    assert refusal("decode", {**caps, "streamed_usage": False}) == (
        f"the engine streams no usage and its tokens cannot be counted: {why}")


def test_an_engine_that_streams_one_token_per_chunk_has_its_completions_counted_by_chunks(
        bench: SpeedBench, tmp_path) -> None:
    """llama-cpp-python's server streams no usage and one token per chunk; re-tokenizing a stream's
    text undercounts where the tokenizer merges what the model generated as separate tokens. The
    probe checks the chunks against the same request's usage, and then counting uses them."""
    from tests.instruments.eos_proxy import eos_proxy

    # Without stream_options the bundled engine streams no usage, as llama-cpp-python's server.
    with eos_proxy(bench.server.url, tmp_path / "proxy.log", "--drop", "stream_options") as url:
        caps = asyncio.run(probe(Endpoint(url, f"{url}/v1", MODEL, None), 300, salt="caps-chunks"))
    assert caps["streamed_usage"] is False and caps["chunk_count"] == {"ok": True, "checked": "8 chunks, usage 8"}, caps
    assert "one token per chunk ✓" in summary(caps)

    async def count(caps: dict) -> tuple:
        async with StreamingClient(bench.server.url) as client:
            streamed = await client.request({"model": MODEL, "prompt": "Session caps-chunk-count. The river and the",
                                             "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        # Sixteen chunks whose text re-tokenizes as one token: what merging looks like to the lab.
        bare = dataclasses.replace(streamed, usage_present=False, prompt_tokens=0, completion_tokens=0, text="river")
        async with EngineExtras(endpoint(bench, caps)) as extras:
            note = await count_missing_usage(extras, caps, [bare])
        return streamed, bare, note

    streamed, bare, note = asyncio.run(count(caps))
    assert len(streamed.token_times_ns) == 16 and bare.completion_tokens == 16
    assert bare.prompt_tokens == streamed.prompt_tokens
    assert note == "prompt tokens counted by /tokenize, completion tokens as stream chunks (one token each, checked)"
    unchecked = {**caps, "chunk_count": {"ok": False, "why": "not one token per chunk"}}
    _, by_text, note = asyncio.run(count(unchecked))
    assert by_text.completion_tokens == 1 and note == "tokens counted by /tokenize"

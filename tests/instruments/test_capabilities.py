"""The capability probe and the token counting it vouches for, against the real bundled engine,
whose own `usage` is the reference."""

from __future__ import annotations

import asyncio
import dataclasses

from lab.instruments.capabilities import Endpoint, probe, refusal
from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
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

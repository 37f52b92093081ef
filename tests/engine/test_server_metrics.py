"""/metrics counts as vLLM does, on a server of its own (the counts are totals since its start):
every engine request that ends, finished or aborted, is observed exactly once in every
per-request histogram, when the engine has freed its blocks; per-prompt histograms once per
prompt; each engine step's tokens once."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.server_process import engine_server

pytestmark = pytest.mark.slow

# Observed once per engine request that ended (a choice of a prompt; vLLM's finished requests).
PER_REQUEST = ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
               "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
               "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds",
               "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens")
# Observed once per prompt once all of its choices ended (vLLM's parent request).
PER_PROMPT = ("vllm:request_params_n", "vllm:request_max_num_generation_tokens")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with engine_server(tmp_path_factory.mktemp("metrics"), "--max-model-len", "512") as s:
        yield s


def scrape(server) -> dict[str, dict[tuple, float]]:
    """family name -> {(sample name, sorted labels without model_name/engine): value}."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            out.setdefault(family.name, {})[(s.name, labels)] = s.value
    return out


def value(families: dict, family: str, sample: str | None = None, **labels: str) -> float:
    return families[family][(sample or family, tuple(sorted(labels.items())))]


def count(families: dict, family: str) -> float:
    return value(families, family, family + "_count")


async def hang_up_after_first_token(url: str, body: dict) -> None:
    """A streaming chat client that goes away once text has started to arrive."""
    async with httpx.AsyncClient(timeout=120) as c:
        async with c.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    return


async def abort_once_started(server) -> None:
    """A non-streaming request whose client gives up once the server has seen its first token."""
    ttft_before = count(scrape(server), "vllm:time_to_first_token_seconds")
    async with httpx.AsyncClient(timeout=120) as c:
        task = asyncio.ensure_future(c.post(f"{server.url}/v1/completions", json={
            "prompt": "Write a long story about the sea.", "max_tokens": 400, "ignore_eos": True}))
        deadline = time.monotonic() + 120
        while count(scrape(server), "vllm:time_to_first_token_seconds") == ttft_before:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_a_mixed_session_observes_every_ended_request_exactly_once(server) -> None:
    url = server.url
    chat = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12, "temperature": 0}
    # Finished requests: a completion, a streamed chat, n=2 (two engine requests, one prompt),
    # two prompts in one completion (two prompts).
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "The sea is", "max_tokens": 6}, timeout=120)
    assert r.status_code == 200
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                      json={**chat, "stream": True, "stream_options": {"include_usage": True}}) as s:
        assert [line for line in s.iter_lines() if line][-1] == "data: [DONE]"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Colours:", "max_tokens": 5, "n": 2, "temperature": 1,
                                                  "seed": 3}, timeout=120)
    assert len(r.json()["choices"]) == 2
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ["One", "Two"], "max_tokens": 4}, timeout=120)
    assert len(r.json()["choices"]) == 2
    # Refused before the engine (a 400): counts nowhere.
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "temperature": -1}).status_code == 400
    # Two aborts, the last things to end: a streaming client that hangs up, a request cancelled.
    asyncio.run(hang_up_after_first_token(url, {**chat, "max_tokens": 400, "ignore_eos": True}))
    asyncio.run(abort_once_started(server))

    deadline = time.monotonic() + 60
    while True:
        m = scrape(server)
        if value(m, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 2:
            break
        assert time.monotonic() < deadline, m["vllm:request_success"]
        time.sleep(0.02)
    # The scrape that counts the last abort already shows its blocks freed.
    assert value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:num_requests_waiting") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == 0

    ended = sum(value(m, "vllm:request_success", "vllm:request_success_total", finished_reason=r)
                for r in ("stop", "length", "abort"))
    assert ended == 8  # 1 + 1 + 2 + 2 + 2 aborts
    for family in PER_REQUEST:
        assert count(m, family) == ended, family
    for family in PER_PROMPT:
        assert count(m, family) == 7, family  # the n=2 request is one prompt
    assert value(m, "vllm:request_params_n", "vllm:request_params_n_sum") == 8
    # Every ended request produced a token before it ended, so each had a first token.
    assert count(m, "vllm:time_to_first_token_seconds") == ended
    assert count(m, "vllm:time_per_output_token_seconds") == count(m, "vllm:inter_token_latency_seconds") > 0
    # Per-request token counts add up to the engine's counters.
    assert value(m, "vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") \
        == value(m, "vllm:generation_tokens", "vllm:generation_tokens_total")
    stats = server.stats()
    assert value(m, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum") \
        == stats["prompt_tokens"] + stats["generation_tokens"]
    assert 0 < count(m, "vllm:iteration_tokens_total") <= stats["steps"]
    # Phases: prefill + decode = inference, summed over the same requests.
    sums = {p: value(m, f"vllm:request_{p}_time_seconds", f"vllm:request_{p}_time_seconds_sum")
            for p in ("prefill", "decode", "inference")}
    assert sums["inference"] == pytest.approx(sums["prefill"] + sums["decode"], abs=1e-6)


def test_cache_config_info_carries_the_kv_cache_config(server) -> None:
    m = scrape(server)
    (labels, v), = [(dict(k[1]), v) for k, v in m["vllm:cache_config_info"].items()]
    stats = server.stats()
    assert v == 1
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == str(stats["kv_pool"]["blocks"])
    assert labels["cache_dtype"] == "auto" and labels["enable_prefix_caching"] == "True"
    assert labels["num_cpu_blocks"] == "0"

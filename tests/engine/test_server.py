"""The engine's HTTP server, live, through the official openai SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import httpx
import openai
import pytest
import torch

from lab.engine.serve.gc_pauses import GcPauses
from tests.engine.server_process import engine_server

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with engine_server(tmp_path_factory.mktemp("server"), "--max-model-len", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def wait_idle(server, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["blocks_in_use"] == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


# -- the SDK -----------------------------------------------------------------------------------

def test_completions_stream_and_not(client) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 8)
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices


def test_chat_stream_and_not(client) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_logprobs(client) -> None:
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens == len(lp.tokens)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0
        assert max(top.values()) == pytest.approx(value)  # greedy picks the best
        assert top[token] == pytest.approx(value)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_echo_prompt_logprobs_match_transformers(client, hf_model, hf_tokenizer) -> None:
    """What lm-evaluation-harness `local-completions` sends for loglikelihood tasks."""
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                  seed=1234)
    lp = r.choices[0].logprobs
    ids = hf_tokenizer(prompt)["input_ids"]
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


def test_cached_tokens_on_a_repeated_prompt(client) -> None:
    prompt = "Repeat after me: " + " ".join(f"word{i}" for i in range(60))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0


def test_stop_and_seed(client) -> None:
    r = client.completions.create(model=MODEL, prompt="One. Two. Three. Four.", max_tokens=30, temperature=0,
                                  stop=["."])
    assert "." not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=7)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_tokenize_detokenize_models(server) -> None:
    t = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert t["count"] == len(t["tokens"]) == 2 and t["max_model_len"] == 1024
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "hello world"
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == MODEL


def test_stats_and_metrics(server) -> None:
    stats = server.stats()
    assert len(stats["config_hash"]) == 16 and stats["config"]["max_model_len"] == 1024
    assert stats["kv_pool"]["tokens"] == stats["kv_pool"]["blocks"] * 16
    assert stats["device"] == "cpu" and stats["peak_memory_bytes"] > 0
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:num_preemptions_total"):
        assert name in metrics, name
    httpx.post(f"{server.url}/reset_prefix_cache").raise_for_status()
    assert server.stats()["prefix_cache"]["cached_blocks"] == 0


def test_cpu_threads_are_reported_with_where_they_came_from(server) -> None:
    # The test server sets no --cpu-threads and no OMP_NUM_THREADS: the engine's own default.
    threads = server.stats()["cpu_threads"]
    assert threads["source"] == "usable cores - 1"
    assert threads["intra_op"] == max(1, threads["usable_cores"] - 1) == threads["inter_op"]
    assert threads["usable_cores"] <= threads["affinity_cores"] == len(os.sched_getaffinity(0))


def test_version_ping_and_a_default_preflight(server) -> None:
    from importlib.metadata import version

    assert httpx.get(f"{server.url}/version").json() == {"version": version("lab")}
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{server.url}/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    # The default CORS policy, vLLM's: any origin, method and header.
    r = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": "http://page.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, x-custom"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "x-custom" in r.headers["access-control-allow-headers"]


def test_the_start_up_heap_is_frozen_and_collector_pauses_are_counted(client, server) -> None:
    # A full collection walks every tracked object; the engine's start-up heap (a Block per KV
    # block, the modules, the web framework) is frozen out of it, and each pass is counted.
    gc_stats = server.stats()["gc"]
    assert gc_stats["frozen_objects"] > 10_000
    assert [sorted(g) for g in gc_stats["generations"]] == [["collections", "longest_ms", "pause_ms"]] * 3
    client.completions.create(model=MODEL, prompt="Count to three.", max_tokens=4)
    after = server.stats()["gc"]["generations"]
    assert all(a["collections"] >= b["collections"] for a, b in zip(after, gc_stats["generations"]))
    assert all(g["longest_ms"] <= g["pause_ms"] for g in after)


def test_gc_freeze_false_leaves_the_heap_to_the_collector(tmp_path) -> None:
    with engine_server(tmp_path, "--max-model-len", "512", "--gc-freeze", "false") as s:
        stats = s.stats()
    assert stats["config"]["gc_freeze"] is False and stats["gc"]["frozen_objects"] == 0


def test_collector_passes_are_counted_by_generation_and_timed() -> None:
    pauses = GcPauses()
    pauses.install()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        pauses.uninstall()
    gc.collect()  # not counted: uninstalled
    assert pauses.collections[2] == 1 and pauses.collections[0] >= 1
    assert pauses.pause_s[2] > 0 and pauses.longest_s[2] == pauses.pause_s[2]


# -- errors ------------------------------------------------------------------------------------

def error_of(response: httpx.Response) -> str:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "code"}
    assert "\n" not in body["error"]["message"]
    return body["error"]["message"]


def test_error_statuses(server) -> None:
    url = f"{server.url}/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in error_of(r)
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": "many"})
    assert r.status_code == 400 and "max_tokens" in error_of(r)
    r = httpx.post(url, json={"prompt": "hi", "temperature": -3})
    assert r.status_code == 400 and "temperature" in error_of(r)
    r = httpx.post(url, json={"prompt": "word " * 1100, "max_tokens": 1})
    n = httpx.post(f"{server.url}/tokenize", json={"prompt": "word " * 1100}).json()["count"]
    assert r.status_code == 400 and f"{n} tokens" in error_of(r) and "context is 1024" in error_of(r)
    r = httpx.post(url, json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400


def test_api_key_and_queue_full(tmp_path) -> None:
    with engine_server(tmp_path, "--max-model-len", "512", "--api-key", "sesame", "--max-num-seqs", "1",
                       "--max-waiting", "1") as s:
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi"}).status_code == 401
        for route in ("/health", "/ping", "/version", "/metrics"):  # for load balancers and scrapers
            assert httpx.get(f"{s.url}{route}").status_code == 200, route
        # A browser's preflight carries no key; it is answered, and the 401 itself is readable cross-origin.
        origin = {"Origin": "http://page.example"}
        r = httpx.options(f"{s.url}/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST",
                                                               "Access-Control-Request-Headers": "authorization"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi"}, headers=origin)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        headers = {"Authorization": "Bearer sesame"}

        async def burst() -> list[int]:
            async with httpx.AsyncClient(headers=headers, timeout=120) as c:
                # Six sent at once: one runs, one waits, the rest are refused long before 12 tokens.
                body = {"prompt": "Count to ten:", "max_tokens": 12, "ignore_eos": True}
                rs = await asyncio.gather(*[c.post(f"{s.url}/v1/completions", json=body) for _ in range(6)])
                return [r.status_code for r in rs]

        codes = asyncio.run(burst())
        assert 503 in codes and 200 in codes and set(codes) <= {200, 503}


def test_sigterm_stops_within_five_seconds(tmp_path) -> None:
    with engine_server(tmp_path, "--max-model-len", "512") as s:
        text = s.log_text()
        assert "effective config" in text and "KV pool" in text and s.stats()["config_hash"] in text
        # A request in flight must not hold the shutdown up.
        pending = httpx.AsyncClient(timeout=30)

        async def start_then_stop() -> float:
            task = asyncio.ensure_future(pending.post(f"{s.url}/v1/completions",
                                                      json={"prompt": "Tell a story", "max_tokens": 400,
                                                            "ignore_eos": True}))
            await asyncio.sleep(1.0)
            t0 = time.monotonic()
            os.killpg(s.proc.pid, signal.SIGTERM)
            while s.proc.poll() is None:
                await asyncio.sleep(0.05)
            task.cancel()
            await pending.aclose()
            return time.monotonic() - t0

        assert asyncio.run(start_then_stop()) < 5.0


# -- load and abuse ----------------------------------------------------------------------------

def test_fifty_disconnecting_clients_leave_no_blocks(server) -> None:
    async def one(c: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"Story number {i}: once upon a time", "max_tokens": 300, "ignore_eos": True,
                "stream": True}
        got = 0
        async with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    got += 1
                    if got == 2:
                        break  # hang up mid-stream
        return got

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=60)) as c:
            return await asyncio.gather(*[one(c, i) for i in range(50)])

    assert asyncio.run(main()) == [2] * 50
    stats = wait_idle(server)
    assert (stats["running"], stats["waiting"], stats["blocks_in_use"]) == (0, 0, 0)
    assert stats["requests_aborted"] >= 50


def test_burst_beyond_the_kv_pool_completes_through_preemption(tmp_path) -> None:
    # 32 blocks x 16 = 512 tokens: room for about six of these requests (5 blocks each) at once.
    with engine_server(tmp_path, "--max-model-len", "512", "--num-kv-blocks", "32") as s:
        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=300) as c:
                bodies = [{"prompt": f"Request {i}: " + "tell me about the sea. " * 8, "max_tokens": 24,
                           "ignore_eos": True, "temperature": 0} for i in range(16)]
                return await asyncio.gather(*[c.post(f"{s.url}/v1/completions", json=b) for b in bodies])

        responses = asyncio.run(main())
        assert [r.status_code for r in responses] == [200] * 16
        assert all(r.json()["usage"]["completion_tokens"] == 24 for r in responses)
        stats = s.stats()
        assert stats["preemptions"] > 0 and stats["blocks_in_use"] == 0


def test_overlapped_decode_server_burst_and_hangups(tmp_path) -> None:
    """The GPU default (`--overlap-decode on`) on the CPU: a burst that preempts, clients that hang
    up mid-stream, and the same greedy text as the engine without overlap."""
    from lab.engine.core.sampling_params import SamplingParams
    from lab.engine.serve.llm import LLM

    prompts = [f"Request {i}: " + "tell me about the sea. " * 8 for i in range(12)]
    with engine_server(tmp_path, "--max-model-len", "512", "--num-kv-blocks", "32", "--overlap-decode", "on") as s:
        async def main() -> tuple[list[httpx.Response], list[int]]:
            async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=40)) as c:
                async def hang_up(i: int) -> int:
                    body = {"prompt": f"Story {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
                    got = 0
                    async with c.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            got += line.startswith("data:")
                            if got == 3:
                                break
                    return got
                # 5 blocks each (54 prompt tokens + 24): twelve need 60 of the 32 blocks, so it preempts.
                bodies = [{"prompt": p, "max_tokens": 24, "ignore_eos": True, "temperature": 0} for p in prompts]
                done = asyncio.gather(*[c.post(f"{s.url}/v1/completions", json=b) for b in bodies])
                gone = asyncio.gather(*[hang_up(i) for i in range(10)])
                return await done, await gone

        responses, hung = asyncio.run(main())
        assert [r.status_code for r in responses] == [200] * 12 and hung == [3] * 10
        stats = wait_idle(s)
        assert (stats["running"], stats["waiting"], stats["blocks_in_use"]) == (0, 0, 0)
        assert stats["preemptions"] > 0 and stats["overlapped_steps"] > 0
    offline = LLM(MODEL, max_model_len=512).generate(
        prompts, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0))
    assert [r.json()["choices"][0]["text"] for r in responses] == [c.text for c in offline]

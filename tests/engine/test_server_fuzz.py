"""Property test: no request, however malformed, gets a 5xx or takes the server down, and no
request outlives its client.

Bodies are drawn from the routes' own OpenAPI schemas (each field replaced, at random, by a value
of a wrong type, an edge value or a valid one), plus raw byte soup, wrong methods and content
types. Valid draws keep generation tiny so the run stays fast. The property is checked on the
real SmolLM2, on dummy weights of its shape, for chat on a model without a chat template, and on
a tiny dummy model with the most draws, where clients also hang up at random moments (streaming or
not, `max_tokens: null` among them) and nothing may still run once every client is gone."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.hf_dir import write_template_less_model
from tests.engine.server_process import ServerProcess, engine_server

pytestmark = pytest.mark.slow

EXAMPLES = 520
DUMMY_EXAMPLES = 150
NO_TEMPLATE_EXAMPLES = 150
TINY_EXAMPLES = 1100
HANGUPS = 200  # 520 + 150 + 150 + 1100 + 200 + 2 = 2,122 generated requests in this file
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 5, 20, 21, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, 1e-9, 0.5, 1.0, 2.0, 100.0, 1e308]),
    st.text(max_size=40),
    st.sampled_from(["", "smollm2-135m", "\x00", "🚀" * 30, "<|im_start|>", "stop", "cut\ud83d", "\udc00"]),
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)

messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "robot", ""]),
    "content": st.one_of(st.text(max_size=60), st.none(), st.integers(),
                         st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                         "text": st.text(max_size=20)}), max_size=2)),
}), max_size=3)

FIELD_VALUES = {
    "model": st.sampled_from(["smollm2-135m", "other-model", ""]) | json_values,
    "prompt": st.one_of(st.text(max_size=80), st.lists(st.integers(-5, 60000), max_size=20),
                        st.lists(st.text(max_size=20), max_size=3),
                        st.lists(st.lists(st.integers(0, 49151), max_size=5), max_size=2), json_values),
    "messages": messages | json_values,
    "max_tokens": st.integers(-3, 4) | st.sampled_from([10**6, 2**40]) | json_values,
    "max_completion_tokens": st.integers(-1, 3) | json_values,
    "temperature": st.floats(-1, 3, allow_nan=False) | json_values,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False) | json_values,
    "top_k": st.integers(-3, 100) | json_values,
    "n": st.integers(-1, 4) | st.sampled_from([16, 17]) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20), json_values),
    "stop_token_ids": st.lists(st.integers(-2, 60000), max_size=3) | json_values,
    "seed": st.integers(-(2**65), 2**65) | json_values,
    "logprobs": st.integers(-1, 25) | st.booleans() | json_values,
    "top_logprobs": st.integers(-1, 25) | json_values,
    "echo": st.booleans() | json_values,
    "ignore_eos": st.booleans() | json_values,
    "presence_penalty": st.floats(-2, 2, allow_nan=False) | json_values,
    "logit_bias": st.dictionaries(st.text(max_size=3), st.integers(-100, 100), max_size=2) | json_values,
    "tokens": st.lists(st.integers(-10, 60000), max_size=10) | json_values,
    "best_of": st.integers(0, 3) | json_values,
    "suffix": st.text(max_size=5) | json_values,
    "min_tokens": st.integers(-1, 5) | json_values,
    "repetition_penalty": st.floats(-1, 3, allow_nan=False) | json_values,
    "frequency_penalty": st.floats(-3, 3, allow_nan=False) | json_values,
    "min_p": st.floats(-0.5, 1.5, allow_nan=False) | json_values,
    "allowed_token_ids": st.lists(st.integers(-2, 60000), max_size=3) | json_values,
    "response_format": st.sampled_from([
        {"type": "json_object"}, {"type": "text"}, {"type": "nonsense"}, {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}]) | json_values,
    "tools": st.just([{"type": "function", "function": {"name": "f"}}]) | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | json_values,
    "use_beam_search": st.booleans() | json_values,
    "an_unknown_field": json_values,
}


@st.composite
def bodies(draw, routes: list[str]) -> tuple[str, str, bytes, dict[str, str]]:
    route = draw(st.sampled_from(routes))
    kind = draw(st.sampled_from(["fields", "fields", "fields", "json", "bytes", "method"]))
    headers = {"content-type": draw(st.sampled_from(["application/json"] * 5 + ["text/plain", ""]))}
    if kind == "bytes":
        return "POST", route, draw(st.binary(max_size=200)), headers
    if kind == "method":
        return draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"])), route, b"", headers
    if kind == "json":
        return "POST", route, json.dumps(draw(json_values)).encode(), headers
    names = draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=7, unique=True))
    body = {name: draw(FIELD_VALUES[name]) for name in names}
    # Keep most draws anchored to a valid core so deep validation paths get exercised too.
    if draw(st.booleans()):
        body.setdefault("prompt" if route != "/v1/chat/completions" else "messages",
                        "Hi" if route != "/v1/chat/completions" else [{"role": "user", "content": "Hi"}])
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
            body["max_tokens"] = 4
        body.setdefault("max_tokens", 2)
        if draw(st.booleans()):  # a field in neither schema, named anything: accepted and named back
            body.setdefault(draw(st.text(max_size=12)), draw(json_values))
    return "POST", route, json.dumps(body).encode(), headers


def fuzz(server: ServerProcess, examples: int, routes: list[str]) -> list[tuple[str, int]]:
    """Send `examples` drawn requests; every answer must be below 500 and, when an error, carry a
    message. Returns (route, status) of each."""
    http = httpx.Client(base_url=server.url, timeout=60)
    seen: list[tuple[str, int]] = []

    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies(routes))
    def one(request: tuple[str, str, bytes, dict[str, str]]) -> None:
        method, route, content, headers = request
        r = http.request(method, route, content=content, headers=headers)
        seen.append((route, r.status_code))
        assert r.status_code < 500, (method, route, content[:300], r.status_code, r.text[:300])
        if r.status_code >= 400 and r.status_code != 405:
            assert "message" in r.json()["error"]

    one()
    http.close()
    stats = wait_idle(server)
    assert (stats["running"], stats["waiting"], stats["blocks_in_use"]) == (0, 0, 0), stats
    assert stats["engine_alive"] is True
    return seen


def wait_idle(server: ServerProcess, timeout: float = 60) -> dict:
    """The server's stats once nothing runs, waits or holds a block (or at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if (stats["running"], stats["waiting"], stats["blocks_in_use"]) == (0, 0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_no_5xx_under_fuzzing(tmp_path) -> None:
    with engine_server(tmp_path, "--max-model-len", "512") as server:
        seen = fuzz(server, EXAMPLES, ROUTES)
        assert len(seen) >= 500
        statuses = {status for _, status in seen}
        assert {200, 400} <= statuses, statuses  # both accepted and refused requests were drawn
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3,
                                                             "temperature": 0}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_no_5xx_under_fuzzing_on_dummy_weights(tmp_path) -> None:
    with engine_server(tmp_path, "--model", "dummy:smollm2-135m", "--max-model-len", "512") as server:
        statuses = {status for _, status in fuzz(server, DUMMY_EXAMPLES, ROUTES)}
        assert {200, 400} <= statuses, statuses
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
                        timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_chat_on_a_model_without_a_chat_template_is_never_a_5xx(tmp_path) -> None:
    model = write_template_less_model(tmp_path / "model")
    with engine_server(tmp_path, "--model", str(model), "--max-model-len", "256") as server:
        seen = fuzz(server, NO_TEMPLATE_EXAMPLES, ["/v1/chat/completions", "/tokenize"])
        # Without a template no chat can succeed; well-formed ones were drawn and refused.
        assert ("/v1/chat/completions", 200) not in seen
        assert ("/v1/chat/completions", 400) in seen


# -- clients that go away ------------------------------------------------------------------------

def hangup_bodies(rng: random.Random) -> list[tuple[str, dict]]:
    """Requests that would run for a while: long or unbounded (`max_tokens: null`), streaming or
    not, one choice or several, some with logits processing or a grammar."""
    out = []
    for i in range(HANGUPS):
        chat = rng.random() < 0.5
        body: dict = {"messages": [{"role": "user", "content": f"Story {i}"}]} if chat else {"prompt": f"Story {i}"}
        body["max_tokens"] = rng.choice([None, None, 400])
        body["stream"] = rng.random() < 0.5
        body["n"] = rng.choice([1, 1, 1, 2, 3])
        body["ignore_eos"] = True
        if rng.random() < 0.2:
            body["repetition_penalty"] = 1.2
        if rng.random() < 0.1:
            body.update(ignore_eos=False, response_format={"type": "json_object"})
        out.append(("/v1/chat/completions" if chat else "/v1/completions", body))
    return out


async def hang_up(port: int, route: str, body: dict, after: float) -> int | None:
    """Send `body` on a raw socket, read for `after` seconds, then close it. Returns the status
    if it arrived by then."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    status = None
    try:
        line = await asyncio.wait_for(reader.readline(), after)
        status = int(line.split()[1]) if line else None
        await asyncio.sleep(after)
    except asyncio.TimeoutError:
        pass
    writer.close()
    return status


def test_tiny_model_fuzz_hangups_and_unbounded_requests(tmp_path) -> None:
    with engine_server(tmp_path, "--model", "dummy:tiny", "--max-model-len", "512") as server:
        statuses = {status for _, status in fuzz(server, TINY_EXAMPLES, ROUTES)}
        assert {200, 400} <= statuses, statuses
        rng = random.Random(19)
        before = server.stats()

        async def storm() -> list[int | None]:
            sem = asyncio.Semaphore(40)

            async def one(route: str, body: dict) -> int | None:
                async with sem:
                    return await hang_up(server.port, route, body, rng.uniform(0.0, 0.4))

            return await asyncio.gather(*[one(route, body) for route, body in hangup_bodies(rng)])

        seen = asyncio.run(storm())
        assert all(s is None or s < 500 for s in seen), seen
        stats = wait_idle(server)  # every client is gone: nothing may still run or hold a block
        assert (stats["running"], stats["waiting"], stats["blocks_in_use"]) == (0, 0, 0), stats
        assert stats["engine_alive"] is True
        assert stats["requests_aborted"] - before["requests_aborted"] >= HANGUPS // 2
        # `max_tokens: null`, left alone, is bounded by the context: it ends there with "length".
        for route, body in [("/v1/completions", {"prompt": "Hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})]:
            r = httpx.post(f"{server.url}{route}", json={**body, "max_tokens": None, "ignore_eos": True}, timeout=120)
            usage = r.json()["usage"]
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert usage["prompt_tokens"] + usage["completion_tokens"] == 512

"""A client that goes away takes its work with it: every request, streaming or not, completions
or chat, one choice or several, `max_tokens: null` included, is aborted and its KV blocks freed as
soon as its socket closes. Real sockets, closed mid-generation, against the real engine."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.server_process import engine_server

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Write a long story about the sea."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with engine_server(tmp_path_factory.mktemp("disconnect"), "--max-model-len", "1024") as s:
        yield s


def aborted_in_metrics(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:request_success")
    return next(s.value for s in family.samples if s.labels["finished_reason"] == "abort")


def wait_until(server, predicate, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if predicate(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def idle(stats: dict) -> bool:
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["blocks_in_use"] == 0


def open_request(server, route: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("route,body,sequences", [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": None, "ignore_eos": True}, 1),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": None, "ignore_eos": True}, 1),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}, 1),
    ("/v1/chat/completions", {"messages": CHAT, "ignore_eos": True, "stream": True}, 1),
    ("/v1/completions", {"prompt": ["Once upon a time", "In a land far away"], "n": 2, "seed": 3,
                         "max_tokens": None, "ignore_eos": True}, 4),
    ("/v1/chat/completions", {"messages": CHAT, "n": 3, "max_tokens": 900, "ignore_eos": True,
                              "response_format": {"type": "text"}, "repetition_penalty": 1.1}, 3),
], ids=["completion", "chat", "completion-stream", "chat-stream", "completion-n2x2", "chat-n3-penalty"])
def test_closed_socket_aborts_and_frees_blocks(server, route, body, sequences) -> None:
    before = server.stats()
    metric_before = aborted_in_metrics(server)
    sock = open_request(server, route, body)
    try:
        running = wait_until(server, lambda s: s["running"] == sequences and s["generation_tokens"]
                             > before["generation_tokens"] + 2 * sequences)
        assert running["running"] == sequences and running["blocks_in_use"] > 0
    finally:
        sock.close()
    after = wait_until(server, idle)
    assert idle(after), after
    assert after["requests_aborted"] - before["requests_aborted"] == sequences
    assert after["requests_finished"] == before["requests_finished"]  # none counted as a success
    assert aborted_in_metrics(server) - metric_before == sequences


def test_sdk_timeout_on_an_unbounded_request_aborts_it(server) -> None:
    """A client that gives up on `max_tokens: null` must not leave it running to the end of the
    context (the fuzz test checks that such a request, left alone, ends there)."""
    before = server.stats()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=3)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=None, extra_body={"ignore_eos": True})
    after = wait_until(server, idle)
    assert idle(after) and after["requests_aborted"] - before["requests_aborted"] == 1

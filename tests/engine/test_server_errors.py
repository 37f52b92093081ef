"""What the server answers when a request cannot be served: a request it cannot plan (chat on a
model without a chat template, text that is not Unicode) is a one-line 400, streamed or not; an
error nothing anticipated is a JSON 500 naming it (or, once a stream has started, an error event),
and the server keeps serving."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from fastapi.responses import StreamingResponse
from starlette.testclient import TestClient

from lab.engine.core.config import from_sources
from lab.engine.core.llm_engine import LLMEngine
from lab.engine.serve.server import Server, build_app, sse_stream
from tests.engine.hf_dir import write_template_less_model
from tests.engine.server_process import engine_server

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def base_model_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("base-model")
    model = write_template_less_model(tmp / "model")
    with engine_server(tmp, "--model", str(model), "--served-model-name", "base", "--max-model-len", "256") as s:
        yield s


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}
    assert "\n" not in error["message"]
    return error["message"]


def test_chat_on_a_model_without_a_chat_template_is_a_400_naming_the_fix(base_model_server) -> None:
    url = base_model_server.url
    for stream in (False, True):
        message = error_of(httpx.post(f"{url}/v1/chat/completions",
                                      json={"messages": CHAT, "max_tokens": 4, "stream": stream}), 400)
        assert "no chat template" in message and "/v1/completions" in message
    message = error_of(httpx.post(f"{url}/tokenize", json={"messages": CHAT}), 400)
    assert "no chat template" in message

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="base", messages=CHAT, max_tokens=4, stream=stream)
    # The fix the message names works, and the refusals left the server healthy.
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.post(f"{url}/tokenize", json={"prompt": "Hello"}).json()["count"] == 5
    assert base_model_server.stats()["engine_alive"] is True


def test_text_that_is_not_unicode_is_a_400(base_model_server) -> None:
    # JSON can carry a lone UTF-16 surrogate; the tokenizer cannot take one.
    url = base_model_server.url
    for route, body in [("/v1/completions", b'{"prompt": "ab\\ud800", "max_tokens": 2}'),
                        ("/v1/completions", b'{"prompt": "ab\\ud800", "max_tokens": 2, "stream": true}'),
                        ("/tokenize", b'{"prompt": "\\udfffab"}'),
                        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}')]:
        r = httpx.post(url + route, content=body, headers={"content-type": "application/json"})
        assert "lone UTF-16 surrogate" in error_of(r, 400), route


@pytest.fixture(scope="module")
def app():
    engine = LLMEngine(from_sources({"model": "dummy:tiny", "max-model-len": 256}))
    app = build_app(Server(engine, "tiny"))

    @app.get("/raises")
    async def raises() -> None:
        raise KeyError("x")

    @app.get("/raises-mid-stream")
    async def raises_mid_stream() -> StreamingResponse:
        async def chunks():
            yield b'data: {"n": 1}\n\n'
            raise KeyError("x")
        return StreamingResponse(sse_stream("cmpl-test", chunks()), media_type="text/event-stream")

    return app


def test_an_unexpected_error_is_a_json_500_and_the_server_keeps_serving(app, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="lab.engine.serve.server")
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/raises", headers={"X-Request-Id": "client-7"})
        assert r.status_code == 500
        assert r.json() == {"error": {"message": "internal error: KeyError: 'x'", "type": "internal_error",
                                      "param": None, "code": None}}
        rid = r.headers["x-request-id"]
        [record] = [rec for rec in caplog.records if rid in rec.getMessage()]
        assert "client-7" in record.getMessage() and record.exc_info[0] is KeyError

        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_an_unexpected_error_mid_stream_is_an_error_event_then_done(app, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="lab.engine.serve.server")
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/raises-mid-stream")
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
        assert events[0] == '{"n": 1}' and events[-1] == "[DONE]"
        assert json.loads(events[1]) == {"error": {"message": "internal error: KeyError: 'x'",
                                                   "type": "internal_error"}}
        [record] = [rec for rec in caplog.records if "cmpl-test" in rec.getMessage()]
        assert record.exc_info[0] is KeyError

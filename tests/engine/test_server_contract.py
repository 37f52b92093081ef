"""What OpenAI and vLLM clients rely on, live through the openai SDK and raw HTTP: the strict
request contract (honoured or a 400 naming the field), n choices, JSON response formats, min_tokens
and penalties, model retrieval, echo logprobs, and /metrics under vLLM's names and rules."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.server_process import engine_server

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"

# vLLM's Prometheus metrics as its documentation lists them (docs.vllm.ai, "Production Metrics",
# and docs/design/metrics.md: the V1 engine), written as family names (no `_total`, `_bucket`).
VLLM_DOCUMENTED = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:iteration_tokens_total",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:cache_config_info", "vllm:lora_requests_info",
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits",  # a KV connector's cache (V1)
}
# The ones dashboards and autoscalers read first: this engine must export them.
VLLM_CORE = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
    "vllm:generation_tokens", "vllm:request_success", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with engine_server(tmp_path_factory.mktemp("contract"), "--max-model-len", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def salted(text: str) -> str:
    return f"[{uuid.uuid4().hex[:8]}] {text}"


def refused(server, route: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{route}", json=body, timeout=60)
    assert r.status_code == 400, (body, r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
    return error


# -- routes and choices --------------------------------------------------------------------------

def test_models_retrieve(client) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_n_choices_share_one_prefill_and_seed_per_choice(client, server) -> None:
    prompt = salted("List three colours of the rainbow, then three fruits, then three animals:")
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    before = server.stats()
    r = client.completions.create(n=2, seed=42, **kwargs)
    after = server.stats()
    assert [c.index for c in r.choices] == [0, 1]
    p = r.usage.prompt_tokens  # counted once, as OpenAI and vLLM do
    assert r.usage.completion_tokens == 24
    # The second choice's full blocks came from the first's prefill: one prefill, plus the tail.
    full = (p - 1) // 16 * 16
    assert full > 0 and after["prompt_tokens"] - before["prompt_tokens"] == p + (p - full)
    # Choice j samples with seed + j: each equals a single request with that seed.
    assert r.choices[0].text == client.completions.create(seed=42, **kwargs).choices[0].text
    assert r.choices[1].text == client.completions.create(seed=43, **kwargs).choices[0].text
    assert r.choices[0].text != r.choices[1].text


def test_chat_n_streams_every_choice(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                            n=3, max_tokens=6, seed=1, stream=True,
                                            stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finished = set()
    chunks = list(stream)
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2} and all(texts.values())
    assert chunks[-1].usage.completion_tokens <= 18


def test_continuous_usage_stats_as_guidellm_asks(client) -> None:
    """GuideLLM streams with vLLM's `continuous_usage_stats`: usage so far on every chunk."""
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    counts = [c.usage.completion_tokens for c in stream if c.choices and c.choices[0].delta.content is not None
              and c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 5


def test_n_over_the_limit_is_refused(server) -> None:
    assert refused(server, "/v1/completions", {"prompt": "Hi", "n": 17})["param"] == "n"


# -- response_format -------------------------------------------------------------------------------

def test_json_object_response_is_valid_json(client) -> None:
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=100, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Reply with a JSON object with keys name and age for a "
                                              "person named Bob who is 30."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_schema_response_follows_the_schema(client) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60, messages=[{"role": "user", "content": "Describe Paris."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"city", "population"} and isinstance(out["population"], int) and len(out["city"]) <= 20


def test_unsupported_response_formats_are_refused(server) -> None:
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert refused(server, "/v1/chat/completions", {**chat, "response_format": {"type": "nonsense"}})["param"] \
        == "response_format"
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    assert "nonsense" in refused(server, "/v1/chat/completions", {**chat, "response_format": bad_schema})["message"]
    assert refused(server, "/v1/chat/completions", {**chat, "response_format": {"type": "json_object"},
                                                    "ignore_eos": True})["param"] == "ignore_eos"


# -- the contract ----------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"), ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
    ("echo", True), ("use_beam_search", True), ("guided_json", {"type": "object"}), ("logits_processors", ["x"]),
    ("skip_special_tokens", False), ("priority", 3), ("store", True), ("continue_final_message", True),
])
def test_chat_fields_not_honoured_are_refused_by_name(server, field, value) -> None:
    error = refused(server, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value})
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("field,value", [("suffix", "end"), ("best_of", 3), ("truncate_prompt_tokens", 5),
                                         ("return_tokens_as_token_ids", True), ("prompt_logprobs", 2)])
def test_completion_fields_not_honoured_are_refused_by_name(server, field, value) -> None:
    error = refused(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, field: value})
    assert error["param"] == field and field in error["message"]


def test_defaults_of_refused_fields_and_unknown_fields_are_accepted(server) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "tools": [], "use_beam_search": False,
            "skip_special_tokens": True, "echo": False, "user": "u1", "my_field": 1, "another": "x"}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert r.headers["x-ignored-fields"] == "another, my_field"
    assert "ignored fields not in the OpenAI or vLLM schema: another, my_field" in server.log_text()
    # A name that is not Latin-1 still fits in a header (escaped) and a log line.
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "🚀": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"] == "\\ud83d\\ude80"


def test_null_content_and_tool_messages_are_refused(server) -> None:
    error = refused(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": None}]})
    assert error["param"] == "messages[0].content"
    tool_call = {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]}
    error = refused(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}, tool_call]})
    assert error["param"] == "messages[1].tool_calls"


# -- every validation error names its field -------------------------------------------------------

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
LONG = "word " * 1100  # over the 1024-token context
JSON_FORMAT = {"type": "json_object"}

# Every 400 the server can raise before a request enters the engine, found by reading serve/ and
# the engine's request checks: (route, body, param, fragment of the message). The body is JSON, or
# raw bytes where JSON from Python cannot say it. `param` follows OpenAI: the request field at
# fault, with a path into messages; None only where no field is at fault (the body itself).
VALIDATION_ERRORS = [
    # the body's shape (pydantic)
    (CMPL, b"{not json", None, "malformed JSON body"),
    (CMPL, [1, 2], None, "valid dictionary"),
    (CMPL, {}, "prompt", "prompt: Field required"),
    (CMPL, {"prompt": "hi", "max_tokens": "many"}, "max_tokens", "valid integer"),
    (CMPL, {"prompt": "hi", "temperature": "warm"}, "temperature", "expected a number"),
    (CMPL, {"prompt": [1, "a"]}, "prompt", "expected a string or a list of token ids"),
    (CMPL, {"prompt": "hi", "stop": 5}, "stop", "expected a string or a list of strings"),
    (CMPL, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "valid boolean"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": "x"}}, "logit_bias.5", "expected a number"),
    (CHAT, {"messages": []}, "messages", "at least 1 item"),
    (CHAT, {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'system', 'user'"),
    (CMPL, b'{"prompt": "ab\\ud800"}', "prompt", "lone UTF-16 surrogate"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages", "lone UTF-16 surrogate"),
    # messages
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1].type", "image_url content is not supported"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text",
     "text is required"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages[0].content", "not null"),
    (CHAT, {"messages": [{"role": "assistant", "content": "", "tool_call_id": "1"}]}, "messages[0].tool_call_id",
     "no tool calling"),
    # fields this engine does not honour, and combinations it refuses
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    (CMPL, {"prompt": "hi", "n": 17}, "n", "n must be in [1, 16]"),
    (CMPL, {"prompt": "hi", "n": 2, "best_of": 3}, "best_of", "best_of must equal n"),
    (CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    (CHAT, {"messages": HI, "response_format": JSON_FORMAT, "ignore_eos": True}, "ignore_eos", "JSON"),
    (CHAT, {"messages": HI, "response_format": JSON_FORMAT, "min_tokens": 2}, "min_tokens", "JSON"),
    (CMPL, {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "must be token ids"),
    (CMPL, {"prompt": []}, "prompt", "must not be empty"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    # response_format
    (CHAT, {"messages": HI, "response_format": {"type": "yaml"}}, "response_format", "is not supported"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format", "with a name and a schema"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "response_format", "JSON Schema object"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "not usable"),
    # the context
    (CMPL, {"prompt": LONG, "max_tokens": 1}, "prompt", "context is 1024"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, "messages", "context is 1024"),
    (CMPL, {"prompt": "hi", "max_tokens": 1024}, "max_tokens", "exceeds this model's context"),
    (CHAT, {"messages": HI, "max_tokens": 1024}, "max_tokens", "exceeds this model's context"),
    (CHAT, {"messages": HI, "max_completion_tokens": 1024}, "max_completion_tokens",
     "max_completion_tokens (1024)"),
    (CMPL, {"prompt": "", "add_special_tokens": False}, "prompt", "the prompt is empty"),
    (CMPL, {"prompt": [1, 999999]}, "prompt", "outside the vocabulary"),
    # sampling parameters
    (CMPL, {"prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1"),
    (CMPL, {"prompt": "hi", "temperature": -1}, "temperature", "temperature must be in [0, 100]"),
    (CMPL, {"prompt": "hi", "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    (CMPL, {"prompt": "hi", "top_k": -2}, "top_k", "top_k must be"),
    (CMPL, {"prompt": "hi", "min_p": 2}, "min_p", "min_p must be in [0, 1]"),
    (CMPL, {"prompt": "hi", "logprobs": 50}, "logprobs", "logprobs must be in [0, 20]"),
    (CMPL, {"prompt": "hi", "echo": True, "logprobs": 50, "max_tokens": 1}, "logprobs", "logprobs must be in"),
    (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "top_logprobs must be in [0, 20]"),
    (CMPL, {"prompt": "hi", "seed": 2**64}, "seed", "64 bits"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [999999]}, "stop_token_ids", "stop_token_ids must be in"),
    (CMPL, {"prompt": "hi", "stop": [""]}, "stop", "must not be empty"),
    (CMPL, {"prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    (CMPL, {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens", "min_tokens must be in"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in"),
    (CMPL, {"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    (CMPL, {"prompt": "hi", "presence_penalty": -3}, "presence_penalty", "[-2, 2]"),
    (CMPL, {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": 200}}, "logit_bias", "[-100, 100]"),
    (CMPL, {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
    (CMPL, {"prompt": "hi", "allowed_token_ids": [999999]}, "allowed_token_ids", "allowed_token_ids must be in"),
    # vLLM's small routes
    ("/tokenize", {}, "prompt", "exactly one of prompt or messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", "image_url content is not supported"),
    ("/detokenize", {"tokens": [999999]}, "tokens", "outside the vocabulary"),
]


@pytest.mark.parametrize("route,body,param,fragment", VALIDATION_ERRORS,
                         ids=[f"{i}-{row[2]}" for i, row in enumerate(VALIDATION_ERRORS)])
def test_every_validation_error_names_its_field(server, route, body, param, fragment) -> None:
    if isinstance(body, bytes):
        r = httpx.post(f"{server.url}{route}", content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = httpx.post(f"{server.url}{route}", json=body, timeout=60)
    assert r.status_code == 400, (body, r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
    assert error["param"] == param, error
    assert fragment in error["message"], error


def test_an_unknown_model_is_a_404_naming_the_model(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "model_not_found"


# -- sampling controls -----------------------------------------------------------------------------

def test_min_tokens_holds_off_eos(client) -> None:
    messages = [{"role": "user", "content": "Say hi."}]
    short = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=80)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 40
    held = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=80,
                                          extra_body={"min_tokens": n + 10})
    assert held.usage.completion_tokens >= n + 10
    # Greedy: the same tokens up to where EOS came, which was masked.
    assert held.choices[0].message.content.startswith(short.choices[0].message.content)


def test_penalties_reduce_repetition(client) -> None:
    kwargs = dict(model=MODEL, prompt="Repeat: go go go go go go go go go go", max_tokens=24, temperature=0)

    def repeats(text: str) -> int:
        return text.split().count("go")

    plain = client.completions.create(**kwargs).choices[0].text
    assert repeats(plain) >= 20  # greedy SmolLM2 keeps repeating
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        text = client.completions.create(**kwargs, **extra).choices[0].text
        assert repeats(text) < repeats(plain) // 2, (extra, text)


def test_echo_logprobs_include_the_actual_token(client) -> None:
    r = client.completions.create(model=MODEL, prompt="Zebras quietly compute eigenvalues", max_tokens=3,
                                  temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs[0] is None
    surprising = 0
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == pytest.approx(value)
        surprising += len(top) == 2  # the actual token was not the best: it is added beside it
    assert surprising >= 2


# -- metrics -----------------------------------------------------------------------------------------

def scrape(server) -> dict:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict, name: str, **labels: str) -> float:
    return next(s.value for s in families[name].samples
                if s.name == name + "_total" and all(s.labels.get(k) == v for k, v in labels.items()))


def observed(families: dict, name: str, suffix: str) -> float:
    return next((s.value for s in families[name].samples if s.name == name + suffix), 0.0)


def test_metrics_use_vllm_names_labels_and_counting(client, server) -> None:
    prompt = salted("Tell me about the history of the printing press in Europe. " * 3)
    before = scrape(server)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    after = scrape(server)
    ours = {name for name in after if name.startswith("vllm:")}
    assert not {name for name in after if name.startswith("lab:")}
    assert ours <= VLLM_DOCUMENTED, ours - VLLM_DOCUMENTED
    assert VLLM_CORE <= ours, VLLM_CORE - ours
    for family in ours:
        for s in after[family].samples:
            assert s.labels.get("model_name") == MODEL and s.labels.get("engine") == "0", s
    reasons = {s.labels["finished_reason"] for s in after["vllm:request_success"].samples
               if s.name.endswith("_total")}
    assert reasons == {"stop", "length", "abort"}
    assert sample(after, "vllm:request_success", finished_reason="length") \
        - sample(before, "vllm:request_success", finished_reason="length") == 2
    # Prompt tokens count every request's whole prompt, prefix-cache hits included.
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert sample(after, "vllm:prompt_tokens") - sample(before, "vllm:prompt_tokens") \
        == first.usage.prompt_tokens + second.usage.prompt_tokens
    # Each finished request splits its running time into prefill and decode, as vLLM's phases do.
    phase = {name: (observed(after, name, "_count") - observed(before, name, "_count"),
                    observed(after, name, "_sum") - observed(before, name, "_sum"))
             for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                          "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds")}
    assert {count for count, _ in phase.values()} == {2}
    prefill, decode, inference = (phase[f"vllm:request_{p}_time_seconds"][1] for p in ("prefill", "decode", "inference"))
    assert prefill > 0 and decode > 0 and inference == pytest.approx(prefill + decode, abs=1e-6)

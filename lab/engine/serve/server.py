"""The OpenAI-compatible HTTP server around the async engine (FastAPI + uvicorn)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib.metadata
import json
import logging
import math
import re
import time
import uuid
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from lab.engine.core.llm_engine import EngineBusyError, LLMEngine
from lab.engine.core.output_processor import RequestOutput
from lab.engine.core.sampling_params import BadRequestError, SamplingParams
from lab.engine.core.sequence import TokenLogprob
from lab.engine.serve.async_engine import AsyncEngine, EngineDeadError
from lab.engine.serve.cors import CorsPolicy
from lab.engine.serve.engine_stats import engine_stats
from lab.engine.serve.gc_pauses import GcPauses, freeze_startup_heap
from lab.engine.serve.metrics import EngineMetrics, Parent
from lab.engine.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                       GenerationRequest)
from lab.engine.serve.structured_output import StructuredOutput

log = logging.getLogger(__name__)

# Liveness, version and metrics need no API key (load balancers and scrapers send none), as on vLLM.
OPEN_PATHS = {"/health", "/ping", "/version", "/metrics"}


class ModelNotFound(LookupError):
    pass


def one_line(message: str) -> str:
    """`message` on one line, encodable as UTF-8 even when it quotes a lone surrogate from the request."""
    return " ".join(message.split()).encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, kind: str, code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": one_line(message), "type": kind, "param": param, "code": code}})


def internal_error_message(exc: BaseException) -> str:
    return one_line(f"internal error: {type(exc).__name__}: {exc}")


@contextmanager
def planning(inputs: str) -> Iterator[None]:
    """Whatever fails before a request enters the engine (tokenizer, chat template, parameters)
    is answered as the request's error, a 400, never as a 500, and names a field: its own, or
    `inputs` (the prompt or the messages, which the tokenizer and the chat template read)."""
    try:
        yield
    except ModelNotFound:
        raise
    except BadRequestError as exc:
        exc.param = exc.param or inputs
        raise
    except ValueError as exc:  # ChatTemplateError among them: their messages are written for the user
        raise BadRequestError(str(exc) or type(exc).__name__, param=inputs) from exc
    except Exception as exc:
        # The client is told what failed; the traceback is kept because this may be a bug here.
        log.warning("request refused while planning it: %s: %s", type(exc).__name__, exc, exc_info=exc)
        raise BadRequestError(f"cannot prepare this request: {type(exc).__name__}: {exc}", param=inputs) from exc


def check_request(engine: LLMEngine, ids: list[int], params: SamplingParams, names: dict[str, str]) -> None:
    """`engine.check_request`, its errors naming the route's fields: the engine names its own
    (SamplingParams' fields, `prompt`), which a route may call otherwise (`names`)."""
    try:
        engine.check_request(ids, params)
    except BadRequestError as exc:
        name = names.get(exc.param or "")
        if name is None:
            raise
        # The prompt stays "the prompt" (of a chat, the templated messages); a parameter takes
        # the name the client gave it.
        message = str(exc) if exc.param == "prompt" else re.sub(rf"\b{exc.param}\b", name, str(exc), count=1)
        raise BadRequestError(message, param=name) from exc


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def sse_stream(request_id: str, chunks: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """`chunks`, then `data: [DONE]`. The status line is sent before the first chunk, so an error
    while streaming can only be told in the stream: it becomes an error event, never a torn
    connection."""
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield chunk
        except (BadRequestError, EngineBusyError, EngineDeadError) as exc:
            yield _sse({"error": {"message": one_line(str(exc)), "type": type(exc).__name__,
                                  "param": getattr(exc, "param", None)}})
        except Exception as exc:
            log.error("request %s failed while streaming", request_id, exc_info=exc)
            yield _sse({"error": {"message": internal_error_message(exc), "type": "internal_error"}})
    yield b"data: [DONE]\n\n"


# How pydantic tags the member of a union each error is about, and what to call it in a message.
UNION_MEMBERS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
                 "list[int]": "a list of token ids", "list[str]": "a list of strings",
                 "list[list[int]]": "a list of token-id lists", "list[ChatContentPart]": "a list of content parts"}


def _field_path(loc: tuple) -> tuple[str, int]:
    """OpenAI's spelling of an error's location (`messages[0].content`), and how many of `loc`'s
    parts it took: it stops at a union member's tag, which names no field."""
    path = ""
    used = 0
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in UNION_MEMBERS or "[" in part or "-" in part:
            break
        else:
            path += f".{part}" if path else part
        used += 1
    return path, used


def validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """A body that does not parse: (one-line message, the field it is about). The first error
    decides; a value that matched no member of a union says what each member wanted."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}", None
    own = first.get("ctx", {}).get("error")
    if isinstance(own, BadRequestError):  # raised by a validator of ours, with its field
        return str(own), own.param
    loc = tuple(first.get("loc", ()))
    loc = loc[1:] if loc[:1] == ("body",) else loc
    path, used = _field_path(loc)
    if used < len(loc):  # every member of a union failed
        members = []
        for err in errors:
            err_loc = tuple(err.get("loc", ()))
            err_loc = err_loc[1:] if err_loc[:1] == ("body",) else err_loc
            if err_loc[:used] == loc[:used] and len(err_loc) > used:
                member = UNION_MEMBERS.get(str(err_loc[used]), str(err_loc[used]))
                if member not in members:
                    members.append(member)
        if "a number" in members and "an integer" in members:
            members.remove("an integer")
        message = f"{path}: expected {' or '.join(members)}"
    else:
        message = f"{path}: {first.get('msg', 'invalid')}" if path else first.get("msg", "invalid request")
    return message, path or None


@dataclass
class Collected:
    """One prompt's generation gathered for a non-streaming answer."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        self.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def usage_so_far(out: RequestOutput) -> dict[str, Any]:
    """vLLM's `continuous_usage_stats`: the chunk's choice's usage up to this chunk."""
    return usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)


@dataclass
class Choice:
    """One sequence the engine runs for a request: prompt `prompt_index`'s choice `index` (OpenAI
    numbers choices prompt-major: prompt i's j-th is i * n + j). A follower (`leader` set) is
    submitted once its leader's first token is out, so its prompt's full KV blocks come from the
    prefix cache: n choices cost one prefill."""
    index: int
    ids: list[int]
    params: SamplingParams
    parent: Parent
    leader: int | None = None


class Server:
    """Request handling; the FastAPI routes in `build_app` are thin wrappers around it."""

    def __init__(self, engine: LLMEngine, served_model_name: str, api_key: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.metrics = EngineMetrics(engine, served_model_name)
        self.async_engine = AsyncEngine(engine, on_end=self.ended, on_step=self.metrics.step)
        self.queue_wait_s: float | None = None  # moving average of the time requests waited for a step
        self.structured = StructuredOutput(engine.tokenizer, engine.model_config.vocab_size)
        self.gc = GcPauses()
        self.started_at = time.time()

    # -- helpers -----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.served_model_name, self.engine.config.model):
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {self.served_model_name!r}")

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(1, self.engine.max_model_len - prompt_len)

    def ended(self, request_id: str, out: RequestOutput | None) -> None:
        """A request's end (on the event loop): its metrics, and the queue wait that `Retry-After` tells."""
        self.metrics.ended(request_id, out)
        if out is not None and out.phases is not None and out.phases.scheduled is not None:
            wait = out.phases.scheduled - out.phases.arrival
            self.queue_wait_s = wait if self.queue_wait_s is None else 0.8 * self.queue_wait_s + 0.2 * wait

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait before it asks again: about as long as requests
        have lately waited in the queue for a step (1 to 60)."""
        return min(60, max(1, math.ceil(self.queue_wait_s or 0)))

    def model_card(self) -> dict[str, Any]:
        return {"id": self.served_model_name, "object": "model", "created": int(self.started_at),
                "owned_by": "lab", "root": self.engine.config.model, "parent": None,
                "max_model_len": self.engine.max_model_len}

    async def admit(self, rid: str, choices: list[Choice], arrival: float) -> dict[int, asyncio.Queue]:
        """Queue each prompt's first choice in the engine before any response starts, so a full
        queue is answered with a 503 and Retry-After, a stream's included; the queues their outputs
        arrive on, by choice index. Further choices follow their first one's prefill, admitted with
        it. A client gone between this and the start of its response leaves its request to run
        to max_tokens, as nothing reads it to notice."""
        sinks: dict[int, asyncio.Queue] = {}
        try:
            for c in choices:
                if c.leader is None:
                    request_id = f"{rid}-{c.index}"
                    self.metrics.submitted(request_id, arrival, c.params.max_tokens, c.parent)
                    sinks[c.index] = await self.async_engine.submit(request_id, c.ids, c.params)
        except BaseException:
            for index in sinks:  # all of a request or none of it
                self.async_engine.abort(f"{rid}-{index}")
            raise
        return sinks

    async def stream_outputs(self, request_id: str, choice: Choice, arrival: float,
                             sink: asyncio.Queue | None = None) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one sequence (already queued on `sink` by `admit`, or submitted
        now), observing its token latencies on the way; the metrics of how it ended are observed
        when the engine reports its end (EngineMetrics)."""
        last: float | None = None
        if sink is None:
            self.metrics.submitted(request_id, arrival, choice.params.max_tokens, choice.parent)
            sink = await self.async_engine.submit(request_id, choice.ids, choice.params,
                                                  admitted=choice.leader is not None)
        async for out in self.async_engine.outputs(request_id, sink):
            if out.new_token_ids:
                now = time.monotonic()
                if last is None:
                    self.metrics.first_token(now - arrival, out.num_prompt_tokens)
                else:
                    self.metrics.inter_token((now - last) / len(out.new_token_ids))
                last = now
            yield out

    async def merged(self, rid: str, choices: list[Choice], arrival: float,
                     sinks: dict[int, asyncio.Queue]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several sequences interleaved as they arrive (those `admit` queued read from
        `sinks`); cancelling aborts them all."""
        if len(choices) == 1:
            # aclosing: a consumer that stops early aborts the sequence now, not when the
            # generator is collected.
            async with aclosing(self.stream_outputs(f"{rid}-0", choices[0], arrival, sinks.get(0))) as outs:
                async for out in outs:
                    yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        prefilled = {c.index: asyncio.Event() for c in choices if c.leader is None}
        submitted: set[int] = set(sinks)
        read: set[int] = set()

        async def pump(c: Choice) -> None:
            try:
                if c.leader is not None:
                    await prefilled[c.leader].wait()
                submitted.add(c.index)  # no await until stream_outputs has registered it
                read.add(c.index)
                async for out in self.stream_outputs(f"{rid}-{c.index}", c, arrival, sinks.get(c.index)):
                    if c.index in prefilled:
                        prefilled[c.index].set()
                    await queue.put((c.index, out))
            except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((c.index, exc))
            finally:
                if c.index in prefilled:
                    prefilled[c.index].set()  # a leader that failed must not hold its followers

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            remaining = len(choices)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield i, item
                remaining -= item.finished
        finally:
            for t in tasks:
                t.cancel()
            for c in choices:
                if c.index not in submitted:
                    self.metrics.skipped(c.parent)  # its request ended before this choice's turn
            for index in set(sinks) - read:
                self.async_engine.abort(f"{rid}-{index}")  # queued by admit, never read: cancelled first

    async def collect(self, rid: str, choices: list[Choice], arrival: float,
                      sinks: dict[int, asyncio.Queue]) -> list[Collected]:
        results = [Collected() for _ in choices]
        async for i, out in self.merged(rid, choices, arrival, sinks):
            results[i].add(out)
        return results

    async def until_done_or_disconnected(self, request: Request, work: asyncio.Future) -> Any:
        """Await `work`, cancelling it (and so aborting its sequences, which the engine drops at
        its next step) as soon as the client goes away. The request body has been read, so the
        next ASGI message is the server's `http.disconnect`: waiting for it costs nothing, and
        reacts at once where polling would lag."""
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                work.cancel()
                log.info("request %s: client went away, aborted", request.state.request_id)
                return None
            return work.result()
        finally:
            watcher.cancel()

    def choices(self, body: GenerationRequest, prompts: list[tuple[list[int], SamplingParams]]) -> list[Choice]:
        """n choices per prompt: per-choice seeds (seed + j), and a grammar matcher each."""
        grammar = self.structured.grammar(body.response_format) if body.grammar_requested else None
        n = body.choices_per_prompt
        out = []
        for ids, params in prompts:
            first = len(out)
            parent = Parent(n)
            for j in range(n):
                p = dataclasses.replace(params, seed=None if params.seed is None else params.seed + j,
                                        logits_processors=[self.structured.processor(grammar)] if grammar else [])
                self.engine.check_request(ids, p)
                out.append(Choice(len(out), ids, p, parent, leader=first if j else None))
        return out

    # -- logprob formatting ------------------------------------------------------------------

    def completion_logprobs(self, token_ids: list[int], lps: list[TokenLogprob | None],
                            offset: int) -> dict[str, Any]:
        strings = self.tokenizer.token_strings(token_ids)
        top_ids = sorted({t for lp in lps if lp for t, _ in lp.top})
        names = dict(zip(top_ids, self.tokenizer.token_strings(top_ids)))
        offsets = []
        for s in strings:
            offsets.append(offset)
            offset += len(s)
        # As vLLM: each position's alternatives include the token actually there (sampled, or
        # the prompt's own under echo) even when it is not among the top k.
        tops: list[dict[str, float] | None] = []
        for lp, s in zip(lps, strings):
            if lp is None:
                tops.append(None)
                continue
            top = {names[t]: v for t, v in lp.top}
            if all(t != lp.token_id for t, _ in lp.top):
                top[s] = lp.logprob
            tops.append(top)
        return {
            "tokens": strings,
            "token_logprobs": [lp.logprob if lp else None for lp in lps],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        ids = [lp.token_id for lp in lps]
        top_ids = sorted({t for lp in lps for t, _ in lp.top})
        names = dict(zip(top_ids, self.tokenizer.token_strings(top_ids)))

        def entry(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}

        content = []
        for lp, s in zip(lps, self.tokenizer.token_strings(ids)):
            item = entry(s, lp.logprob)
            item["top_logprobs"] = [entry(names[t], v) for t, v in lp.top]
            content.append(item)
        return {"content": content}

    # -- completions -------------------------------------------------------------------------

    def ignored_fields(self, body: GenerationRequest, request: Request) -> dict[str, str]:
        """Fields in neither OpenAI's nor vLLM's schema: logged, and named in a response header."""
        unknown = body.unknown_fields()
        if not unknown:
            return {}
        # Names are the client's: escaped to ASCII (a header is Latin-1, a log line UTF-8, and a
        # name may hold anything JSON allows), each cut short and at most 20 listed.
        names = [json.dumps(n)[1:-1][:40] for n in unknown[:20]] + (["..."] if len(unknown) > 20 else [])
        log.warning("request %s: ignored fields not in the OpenAI or vLLM schema: %s",
                    request.state.request_id, ", ".join(names))
        return {"x-ignored-fields": ", ".join(names)}

    def plan_completion(self, body: CompletionRequest) -> list[Choice]:
        body.check_unsupported()
        prompts = []
        for prompt in body.prompts():
            ids = (self.tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens is not False)
                   if isinstance(prompt, str) else list(prompt))
            max_tokens = body.max_tokens if body.max_tokens is not None else self.default_max_tokens(len(ids))
            prompt_lp = body.logprobs if (body.echo and body.logprobs is not None) else None
            params = body.sampling(max_tokens, body.logprobs, prompt_lp)
            check_request(self.engine, ids, params, {"prompt_logprobs": "logprobs"})
            prompts.append((ids, params))
        return self.choices(body, prompts)

    def echo_part(self, body: CompletionRequest, ids: list[int],
                  prompt_lps: list[TokenLogprob | None] | None) -> tuple[str, dict | None]:
        text = self.tokenizer.decode(ids)
        if body.logprobs is None:
            return text, None
        lps = list(prompt_lps or [None] * len(ids))
        return text, self.completion_logprobs(ids, lps, 0)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        rid = request.state.request_id = f"cmpl-{uuid.uuid4().hex}"
        with planning("prompt"):
            self.check_model(body.model)
            choices = self.plan_completion(body)
        headers = self.ignored_fields(body, request)
        created = int(time.time())
        sinks = await self.admit(rid, choices, arrival)
        if body.stream:
            return StreamingResponse(sse_stream(rid, self._stream_completion(body, choices, rid, created, arrival,
                                                                             sinks)),
                                     media_type="text/event-stream", headers=headers)
        results = await self.until_done_or_disconnected(request, asyncio.ensure_future(
            self.collect(rid, choices, arrival, sinks)))
        if results is None:
            return Response(status_code=499)
        out = []
        for choice, c in zip(choices, results):
            text, lps = c.text, None
            if body.logprobs is not None:
                lps = self.completion_logprobs(c.token_ids, list(c.logprobs), 0)
            if body.echo:
                echo_text, echo_lps = self.echo_part(body, choice.ids, c.prompt_logprobs)
                if lps is not None and echo_lps is not None:
                    shift = len(echo_text)
                    lps = {k: echo_lps[k] + (lps[k] if k != "text_offset" else [o + shift for o in lps[k]])
                           for k in lps}
                text = echo_text + text
            out.append({"index": choice.index, "text": text, "logprobs": lps, "finish_reason": c.finish_reason})
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": self.served_model_name,
            "choices": out, "usage": self.total_usage(choices, results)}, headers=headers)

    @staticmethod
    def total_usage(choices: list[Choice], results: list[Collected]) -> dict[str, Any]:
        """Each prompt counted once (on its first choice, as vLLM does), every choice's output."""
        leaders = [c for ch, c in zip(choices, results) if ch.leader is None]
        return usage(sum(c.num_prompt_tokens for c in leaders), sum(c.num_output_tokens for c in results),
                     sum(c.num_cached_tokens for c in leaders))

    async def _stream_completion(self, body: CompletionRequest, choices: list[Choice], rid: str, created: int,
                                 arrival: float, sinks: dict[int, asyncio.Queue]) -> AsyncIterator[bytes]:
        def chunk(items: list[dict], extra: dict | None = None) -> bytes:
            payload = {"id": rid, "object": "text_completion", "created": created,
                       "model": self.served_model_name, "choices": items, **(extra or {})}
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

        results = [Collected() for _ in choices]
        offsets = [0] * len(choices)
        if body.echo and body.logprobs is None:
            for c in choices:
                text, _ = self.echo_part(body, c.ids, None)
                offsets[c.index] = len(text)
                yield chunk([{"index": c.index, "text": text, "logprobs": None, "finish_reason": None}])
        async for i, out in self.merged(rid, choices, arrival, sinks):
            lps = None
            text = out.new_text
            if out.prompt_logprobs is not None and body.echo:
                echo_text, lps_echo = self.echo_part(body, choices[i].ids, out.prompt_logprobs)
                yield chunk([{"index": i, "text": echo_text, "logprobs": lps_echo, "finish_reason": None}])
                offsets[i] = len(echo_text)
            if body.logprobs is not None and out.new_logprobs:
                lps = self.completion_logprobs(out.new_token_ids, list(out.new_logprobs), offsets[i])
            if text or lps or out.finished:
                yield chunk([{"index": i, "text": text, "logprobs": lps,
                              "finish_reason": out.finish_reason if out.finished else None}],
                            {"usage": usage_so_far(out)} if body.continuous_usage else None)
            offsets[i] += len(text)
            if out.finished:
                results[i].add(out)
        if body.include_usage:
            yield chunk([], {"usage": self.total_usage(choices, results)})

    # -- chat --------------------------------------------------------------------------------

    def plan_chat(self, body: ChatCompletionRequest) -> list[Choice]:
        body.check_unsupported()
        prompt = self.tokenizer.apply_chat_template(body.plain_messages(),
                                                    add_generation_prompt=body.add_generation_prompt is not False)
        # The template writes its own BOS unless the client asks for the tokenizer's too.
        ids = self.tokenizer.encode(prompt, add_special_tokens=bool(body.add_special_tokens))
        requested = body.requested_max_tokens()
        max_tokens = requested if requested is not None else self.default_max_tokens(len(ids))
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise BadRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        params = body.sampling(max_tokens, (top or 0) if body.logprobs else None)
        check_request(self.engine, ids, params, {
            "prompt": "messages", "logprobs": "top_logprobs",
            "max_tokens": "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"})
        return self.choices(body, [(ids, params)])

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        rid = request.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        with planning("messages"):
            self.check_model(body.model)
            choices = self.plan_chat(body)
        headers = self.ignored_fields(body, request)
        created = int(time.time())
        sinks = await self.admit(rid, choices, arrival)
        if body.stream:
            return StreamingResponse(sse_stream(rid, self._stream_chat(body, choices, rid, created, arrival, sinks)),
                                     media_type="text/event-stream", headers=headers)
        results = await self.until_done_or_disconnected(request, asyncio.ensure_future(
            self.collect(rid, choices, arrival, sinks)))
        if results is None:
            return Response(status_code=499)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": self.served_model_name,
            "choices": [{"index": ch.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": self.chat_logprobs(c.logprobs) if body.logprobs else None,
                         "finish_reason": c.finish_reason} for ch, c in zip(choices, results)],
            "usage": self.total_usage(choices, results)}, headers=headers)

    async def _stream_chat(self, body: ChatCompletionRequest, choices: list[Choice], rid: str,
                           created: int, arrival: float, sinks: dict[int, asyncio.Queue]) -> AsyncIterator[bytes]:
        def chunk(items: list[dict], extra: dict | None = None) -> bytes:
            payload = {"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": self.served_model_name, "choices": items, **(extra or {})}
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

        for c in choices:
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        results = [Collected() for _ in choices]
        async for i, out in self.merged(rid, choices, arrival, sinks):
            lps = self.chat_logprobs(out.new_logprobs) if body.logprobs and out.new_logprobs else None
            if out.new_text or lps or out.finished:
                delta = {"content": out.new_text} if out.new_text else {}
                yield chunk([{"index": i, "delta": delta, "logprobs": lps,
                              "finish_reason": out.finish_reason if out.finished else None}],
                            {"usage": usage_so_far(out)} if body.continuous_usage else None)
            if out.finished:
                results[i].add(out)
        if body.include_usage:
            yield chunk([], {"usage": self.total_usage(choices, results)})

    # -- small endpoints ---------------------------------------------------------------------

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        with planning("messages" if body.messages is not None else "prompt"):
            self.check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise BadRequestError("give exactly one of prompt or messages", param="prompt")
            if body.messages is not None:
                for i, m in enumerate(body.messages):
                    m.check(i)
                text = self.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": m.text()} for m in body.messages],
                    add_generation_prompt=body.add_generation_prompt)
                tokens = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                tokens = self.tokenizer.encode(body.prompt or "")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        with planning("tokens"):
            self.check_model(body.model)
            vocab = self.engine.model_config.vocab_size
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
            return {"prompt": self.tokenizer.decode(body.tokens)}

    def stats(self) -> dict[str, Any]:
        stats = engine_stats(self.engine, self.served_model_name, self.started_at)
        stats["queue"]["retry_after_s"] = self.retry_after_s()
        stats["engine_alive"] = self.async_engine.alive
        stats["gc"] = self.gc.stats()
        return stats


def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
    """An error nothing else maps: the client gets its type and message as JSON, the log the
    traceback under the request id (and the client's X-Request-Id, when it sent one)."""
    rid = getattr(request.state, "request_id", None) or f"req-{uuid.uuid4().hex}"
    log.error("request %s (%s %s, X-Request-Id %s) failed", rid, request.method, request.url.path,
              request.headers.get("x-request-id", "-"), exc_info=exc)
    response = error_response(500, internal_error_message(exc), "internal_error")
    response.headers["x-request-id"] = rid
    return response


class Guard:
    """The API key check, and the catch-all for errors no handler maps, as a plain ASGI
    middleware. Not `app.middleware("http")`: Starlette's BaseHTTPMiddleware relays every chunk
    of a streamed response through an anyio memory stream and a task switch, which cost the event
    loop as much CPU as the SSE encoding itself, and that loop shares the GIL with the engine's
    step loop. Not an `app.exception_handler(Exception)` either: Starlette re-raises after such a
    handler, and uvicorn would log the traceback a second time, without the request id."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key and scope["path"] not in OPEN_PATHS:
            if Request(scope).headers.get("authorization", "") != f"Bearer {self.api_key}":
                response = error_response(401, "a valid API key is required (Authorization: Bearer <key>)",
                                          "authentication_error", "invalid_api_key")
                await response(scope, receive, send)
                return
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if started:
                raise  # the status line is out: nothing but the connection can carry the error now
            await on_internal_error(Request(scope), exc)(scope, receive, send)


def lab_version() -> str:
    try:
        return importlib.metadata.version("lab")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_app(server: Server, cors: CorsPolicy | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.async_engine.start(asyncio.get_running_loop())
        if server.engine.config.gc_freeze:
            log.info("froze %d objects of the start-up heap out of the garbage collector's passes",
                     freeze_startup_heap())
        server.gc.install()
        yield
        server.gc.uninstall()
        if server.engine.config.gc_freeze:
            gc.unfreeze()  # an engine served in a longer-lived process (tests) hands its heap back
        server.async_engine.shutdown()
        server.engine.close()  # the file tier's queued blocks land before the process exits

    version = lab_version()
    app = FastAPI(title="lab engine", version=version, lifespan=lifespan)

    app.add_middleware(Guard, api_key=server.api_key)
    # Added last, so outermost: a preflight is answered before the API key check (a browser sends
    # none with it), and every response to an allowed origin carries Access-Control-* (401s and
    # 500s included, which a page could not read otherwise).
    cors = cors or CorsPolicy()
    app.add_middleware(CORSMiddleware, allow_origins=cors.origins, allow_methods=cors.methods,
                       allow_headers=cors.headers, allow_credentials=cors.credentials)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error(exc)
        return error_response(400, message, "invalid_request_error", param=param)

    # The engine's own errors, each to its OpenAI status, type, code and param.
    errors = {BadRequestError: (400, "invalid_request_error", None, None),
              ModelNotFound: (404, "invalid_request_error", "model_not_found", "model"),
              EngineBusyError: (503, "service_unavailable", None, None),
              EngineDeadError: (503, "service_unavailable", None, None)}
    for kind, (status, error_type, code, param) in errors.items():
        async def on_error(request: Request, exc: Exception, status=status, error_type=error_type, code=code,
                           param=param) -> JSONResponse:
            # A full queue is a capacity refusal: the client is told when to ask again.
            headers = {"Retry-After": str(server.retry_after_s())} if isinstance(exc, EngineBusyError) else None
            return error_response(status, str(exc), error_type, code, getattr(exc, "param", None) or param, headers)
        app.add_exception_handler(kind, on_error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.get("/health")
    async def health() -> Response:
        if not server.async_engine.alive:
            return error_response(503, "the engine loop is not running", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness route for load balancers: /health's answer."""
        return await health()

    @app.get("/version")
    async def version_route() -> dict[str, str]:
        return {"version": version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        server.check_model(model_id)
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return server.detokenize(body)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        dropped = await server.async_engine.call(lambda e: e.reset_prefix_cache())
        return {"status": "ok", "blocks_dropped": dropped}

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return server.stats()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    return app

"""An OpenAI-compatible engine with scripted timing, for measuring the lab itself.

It behaves like a continuously batching engine with a fixed step: one loop ticks every
`--step-ms`, and each tick gives one token to every running stream, so the decode figures of a
boot follow from the step alone and everything else a ladder sees is the host's own noise. Its
known-effect knob, `--inject-step-delay-ms`, lengthens every tick that has work by exactly that
much (as the bundled engine's knob of the same name does), so an arm with a true slowdown of
delay / step is possible. `--noop` changes nothing: arms that set it are A/A arms.
`--interrupt-requests` makes it serve one request at a time as llama-cpp-python's server does by
default: a request that arrives ends every stream in progress (finish_reason "stop").
`--eos-after N` ends every completion at N tokens with finish_reason "stop", ignore_eos or not, as
llama.cpp's server ends one at the model's EOS.

Booted by `lab run` as a `command` engine (benchmarks/ladders/scripted-*.yaml):
    python benchmarks/scripted_engine.py --port PORT [--step-ms 10] [--inject-step-delay-ms 0.5]
Endpoints: POST /v1/completions and /v1/chat/completions (streamed or not, `usage` with
`stream_options.include_usage`), GET /v1/models. The completion has `max_tokens` tokens.
With `--tokenizer SPEC` (one `engine.tokenizer:` names: smollm2-135m, a .gguf, a tokenizer.json) it
counts prompts with that tokenizer and serves POST /tokenize as vLLM does, so it can stand beside a
real engine of that model in one window (an engine arm); without it a prompt token is a word.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger("scripted_engine")


class Stepper:
    """The engine loop: every tick hands one token to each running stream."""

    def __init__(self, step_s: float, delay_s: float, interrupt: bool = False) -> None:
        self.step_s = step_s
        self.delay_s = delay_s
        self.interrupt = interrupt
        self.running: set[asyncio.Queue[int]] = set()
        self._work = asyncio.Event()

    def join(self) -> asyncio.Queue[int]:
        """A new stream's queue of tokens (1 each); 0 tells a stream it was interrupted."""
        queue: asyncio.Queue[int] = asyncio.Queue()
        if self.interrupt:
            for other in self.running:
                other.put_nowait(0)
            self.running.clear()
        self.running.add(queue)
        self._work.set()
        return queue

    def leave(self, queue: asyncio.Queue[int]) -> None:
        self.running.discard(queue)

    async def loop(self) -> None:
        deadline = time.perf_counter()
        while True:
            if not self.running:
                self._work.clear()
                await self._work.wait()
                deadline = time.perf_counter()
            # Absolute deadlines: a late wake-up shortens the next sleep instead of adding up.
            deadline += self.step_s + self.delay_s
            await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
            for queue in list(self.running):
                queue.put_nowait(1)


def build(step_ms: float, delay_ms: float, model: str, interrupt: bool = False, eos_after: int = 0,
          tokenizer: str | None = None) -> Starlette:
    stepper = Stepper(step_ms / 1e3, delay_ms / 1e3, interrupt)
    if tokenizer is not None:
        from lab.instruments import local_tokenizer  # only this mode needs the lab

        local = local_tokenizer.load(tokenizer)

    def prompt_ids(body: dict[str, Any]) -> list[int] | None:
        if "messages" in body:
            return local.encode_messages(body["messages"])
        return local.encode(str(body.get("prompt", "")))

    async def tokenize(request: Request) -> Response:
        ids = prompt_ids(await request.json())
        if ids is None:
            return JSONResponse({"error": {"message": "no chat template"}}, status_code=400)
        return JSONResponse({"tokens": ids, "count": len(ids)})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def complete(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        asked = int(body.get("max_tokens") or 16)
        n = min(asked, eos_after) if eos_after else asked
        prompt = (" ".join(str(m.get("content", "")) for m in body.get("messages", [])) if chat
                  else str(body.get("prompt", "")))
        counted = len(prompt_ids(body) or []) if tokenizer is not None else len(prompt.split())
        usage = {"prompt_tokens": counted, "completion_tokens": n, "total_tokens": counted + n}
        kind = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            queue = stepper.join()
            got = 0
            try:
                while got < n and await queue.get():
                    got += 1
            finally:
                stepper.leave(queue)
            text = "".join(f"t{i} " for i in range(got))
            finish = "length" if got == asked else "stop"
            usage = {**usage, "completion_tokens": got, "total_tokens": usage["prompt_tokens"] + got}
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                      if chat else {"index": 0, "text": text, "finish_reason": finish})
            return JSONResponse({"id": "x", "object": kind, "model": model, "choices": [choice], "usage": usage})

        def event(text: str | None, finish: str | None, with_usage: bool = False) -> str:
            choices = [] if text is None else [
                {"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                else {"index": 0, "text": text, "finish_reason": finish}]
            obj: dict[str, Any] = {"id": "x", "object": kind + ".chunk" if chat else kind, "model": model,
                                   "choices": choices}
            if with_usage:
                obj["usage"] = usage
            return f"data: {json.dumps(obj)}\n\n"

        async def stream() -> Any:
            queue = stepper.join()
            try:
                for i in range(n):
                    if not await queue.get():
                        usage.update(completion_tokens=i, total_tokens=usage["prompt_tokens"] + i)
                        yield event("", "stop")  # interrupted by a newer request
                        break
                    yield event(f"t{i} ", None if i < n - 1 else "length" if n == asked else "stop")
            finally:
                stepper.leave(queue)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield event(None, None, with_usage=True)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(stepper.loop())
        yield
        task.cancel()

    routes = [Route("/v1/models", models), Route("/v1/completions", complete, methods=["POST"]),
              Route("/v1/chat/completions", complete, methods=["POST"])]
    if tokenizer is not None:
        routes.append(Route("/tokenize", tokenize, methods=["POST"]))
    return Starlette(routes=routes, lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--step-ms", type=float, default=10.0, help="engine step: one token per running stream")
    parser.add_argument("--inject-step-delay-ms", type=float, default=0.0, help="added to every step with work")
    parser.add_argument("--noop", default="", help="changes nothing (A/A arms)")
    parser.add_argument("--interrupt-requests", action="store_true",
                        help="serve one request at a time: a new request ends the streams in progress")
    parser.add_argument("--eos-after", type=int, default=0,
                        help="end every completion at this many tokens (finish_reason stop), ignore_eos or not")
    parser.add_argument("--tokenizer", help="count prompts with this tokenizer and serve /tokenize")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    log.info("scripted engine: step %.3f ms + injected %.3f ms, noop=%r", args.step_ms, args.inject_step_delay_ms,
             args.noop)
    uvicorn.run(build(args.step_ms, args.inject_step_delay_ms, args.model, args.interrupt_requests, args.eos_after,
                      args.tokenizer),
                host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()

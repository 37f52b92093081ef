"""A proxy in front of the real engine server that makes it an engine which ignores `ignore_eos`,
as llama-cpp-python's server does, and optionally `logit_bias` too.

Every request is forwarded as it came, streams byte for byte, except the bodies of completions and
chats:

  --drop FIELD      removes FIELD from the body before the engine sees it (`ignore_eos`, and
                    `logit_bias` for an engine that honours neither); repeatable
  --end-after N     with --eos-id ID: a model that ends every reply after N tokens. The proxy asks
                    the engine for `min_tokens: N` and a `logit_bias` of +100 on ID, under the
                    client's own `logit_bias` (the client's entry for ID wins, as the ban's -100
                    must), so the real model stops there by itself and only a working ban (or a
                    working `ignore_eos`) carries it further

Run as `python -m tests.instruments.eos_proxy --upstream URL --port P ...`; `eos_proxy()` starts it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

GENERATING = ("/v1/completions", "/v1/chat/completions")
ROOT = Path(__file__).resolve().parents[2]


def _rewrite(body: dict, drop: list[str], end_after: int | None, eos_id: int | None) -> dict:
    for name in drop:
        body.pop(name, None)
    if end_after is not None and eos_id is not None:
        body["min_tokens"] = min(end_after, int(body.get("max_tokens") or end_after))
        body["logit_bias"] = {str(eos_id): 100, **(body.get("logit_bias") or {})}
    return body


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--drop", action="append", default=[])
    parser.add_argument("--end-after", type=int, default=None)
    parser.add_argument("--eos-id", type=int, default=None)
    args = parser.parse_args()

    import uvicorn
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    upstream = httpx.AsyncClient(base_url=args.upstream, timeout=600, trust_env=False)

    async def forward(request: Request) -> StreamingResponse:
        content = await request.body()
        if request.method == "POST" and request.url.path in GENERATING and content:
            content = json.dumps(_rewrite(json.loads(content), args.drop, args.end_after, args.eos_id)).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        sent = upstream.build_request(request.method, request.url.path, content=content or None, headers=headers)
        answer = await upstream.send(sent, stream=True)
        kept = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "x-ignored-fields")}
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code, headers=kept,
                                 background=BackgroundTask(answer.aclose))

    app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


@contextmanager
def eos_proxy(upstream: str, log: Path, *flags: str, timeout: float = 60) -> Iterator[str]:
    """The proxy's base URL while it runs in front of `upstream`, started with `flags`."""
    from tests.engine.server_process import free_port, stop_group, wait_healthy

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.instruments.eos_proxy", "--upstream", upstream,
                                 "--port", str(port), *flags], stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, timeout, "proxy")
        yield url
    finally:
        stop_group(proc)


if __name__ == "__main__":
    main()

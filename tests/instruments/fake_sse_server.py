"""A scripted OpenAI-compatible streaming server that records when it wrote every chunk: the
truth against which the streaming client's timing is judged.

It runs in its own process (`FakeServer` starts it) so it shares neither the client's event loop
nor its GIL. Every write is bracketed by `perf_counter_ns()` just before and just after the
`send()` call, so the instant the bytes entered the kernel lies inside `[t0, t1]` however late the
server's own scheduling made that write. CLOCK_MONOTONIC is shared by every process on the host,
so these times compare directly with the client's.

Each request is scripted by an extension field in its body, `x_fake` (all keys optional):
  ttft_ms           delay from receiving the request to the first token chunk (default 10)
  itl_ms            delay between token chunks: a number, or a list used cyclically (default 10)
  tokens_per_chunk  tokens carried by each chunk (default 1)
  split_ms          write each token event in two halves, this far apart, cutting its line
  burst             hold token events and write this many in one send (a server or proxy that
                    coalesces): the client reads them together and cannot tell when each was made
  burst_every       burst only every n-th completion the server serves (counting from 1)
  cached_tokens     report `prompt_tokens_details.cached_tokens`; left out of `usage` when absent
  fail              one of: status_500, malformed, error_event, drop, stall
  fail_after        token chunks written before a mid-stream failure (default 2)
  crlf              end SSE lines with CRLF and open the stream with an SSE comment, as some
                    servers do
The completion has `max_tokens` tokens (default 16) whose text is "t0 t1 t2 ...". The prompt's
token count is its number of whitespace-separated words. `stream_options.include_usage` and
vLLM's `stream_options.continuous_usage_stats` are honoured, and so are `logprobs` and
`top_logprobs` on both endpoints.

`GET /truth` returns {"requests": {request_id: record}, "max_active": n}: a record holds
`received_ns` (request fully read) and `writes`, one per write: {kind, t0, t1, tokens}, kind being
head (status line and headers), comment, role, part (the first half of a split event), token,
usage, done, end (the chunked body's terminator), body (a whole non-streamed response) or fail.
The request id is the `X-Request-Id` header. `POST /reset` forgets all of it.

`FakeServer(script=...)` gives every request a default script (keys of its own `x_fake` win), for
instruments whose requests carry no `x_fake`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

_FAILURES = {"status_500", "malformed", "error_event", "drop", "stall"}
_STALL_S = 60.0


@dataclass
class _Record:
    received_ns: int
    writes: list[dict[str, int | str]] = field(default_factory=list)


class _Connection:
    """One client socket: reads requests and writes timestamped responses."""

    def __init__(self, server: _Server, sock: socket.socket) -> None:
        self._server = server
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._buf = b""

    async def serve(self) -> None:
        try:
            while await self._handle_one():
                pass
        except (ConnectionError, OSError):
            pass  # the client went away; its requests' truth is already recorded
        finally:
            self._sock.close()

    async def _read_request(self) -> tuple[str, str, dict[str, str], bytes] | None:
        while b"\r\n\r\n" not in self._buf:
            data = await self._loop.sock_recv(self._sock, 65536)
            if not data:
                return None
            self._buf += data
        head, self._buf = self._buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(self._buf) < length:
            data = await self._loop.sock_recv(self._sock, 65536)
            if not data:
                return None
            self._buf += data
        body, self._buf = self._buf[:length], self._buf[length:]
        return method, path, headers, body

    async def _write(self, data: bytes) -> tuple[int, int]:
        """Send `data` now; the bytes entered the kernel between the two returned times."""
        t0 = time.perf_counter_ns()
        try:
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        t1 = time.perf_counter_ns()
        if sent < len(data):
            # Only when the client stops reading and the socket buffer fills.
            await self._loop.sock_sendall(self._sock, data[sent:])
            t1 = time.perf_counter_ns()
        return t0, t1

    async def _write_chunks(self, record: _Record, kind: str, events: list[tuple[bytes, int]]) -> None:
        """Several events in one send: one (t0, t1) for all of them."""
        t0, t1 = await self._write(b"".join(b"%x\r\n%s\r\n" % (len(data), data) for data, _ in events))
        record.writes += [{"kind": kind, "t0": t0, "t1": t1, "tokens": tokens} for _, tokens in events]

    async def _write_chunk(self, record: _Record, kind: str, data: bytes, tokens: int = 0) -> None:
        t0, t1 = await self._write(b"%x\r\n%s\r\n" % (len(data), data))
        record.writes.append({"kind": kind, "t0": t0, "t1": t1, "tokens": tokens})

    async def _respond_json(self, status: int, obj: Any, record: _Record | None = None) -> None:
        body = json.dumps(obj).encode()
        reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        t0, t1 = await self._write(head + body)
        if record is not None:
            record.writes.append({"kind": "body", "t0": t0, "t1": t1, "tokens": 0})

    async def _handle_one(self) -> bool:
        request = await self._read_request()
        if request is None:
            return False
        received_ns = time.perf_counter_ns()
        method, path, headers, body = request
        if method == "GET" and path == "/truth":
            await self._respond_json(200, self._server.truth())
        elif method == "POST" and path == "/reset":
            self._server.reset()
            await self._respond_json(200, {})
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            request_id = headers.get("x-request-id") or self._server.new_id()
            record = _Record(received_ns)
            self._server.records[request_id] = record
            self._server.enter()
            try:
                return await _Completion(self, record, request_id, path, json.loads(body)).run()
            finally:
                self._server.leave()
        else:
            await self._respond_json(404, {"error": {"message": f"no route {method} {path}"}})
        return True


class _Completion:
    """One scripted completion, streamed or not."""

    def __init__(self, conn: _Connection, record: _Record, request_id: str, path: str,
                 payload: dict[str, Any]) -> None:
        self.conn = conn
        self.record = record
        self.chat = path == "/v1/chat/completions"
        self.payload = payload
        script = {**conn._server.script, **payload.get("x_fake", {})}
        every = script.get("burst_every", 1)
        self.burst = script.get("burst", 1) if conn._server.completions % every == 0 else 1
        self.ttft_s = script.get("ttft_ms", 10) / 1e3
        itl = script.get("itl_ms", 10)
        self.itl_s = [x / 1e3 for x in (itl if isinstance(itl, list) else [itl])]
        self.per_chunk = script.get("tokens_per_chunk", 1)
        self.split_s = script["split_ms"] / 1e3 if "split_ms" in script else None
        self.cached = script.get("cached_tokens")
        self.fail = script.get("fail")
        if self.fail is not None and self.fail not in _FAILURES:
            raise ValueError(f"unknown scripted failure {self.fail!r}")
        self.fail_after = script.get("fail_after", 2)
        self.eol = b"\r\n" if script.get("crlf") else b"\n"
        self.n_tokens = payload.get("max_tokens", 16)
        options = payload.get("stream_options") or {}
        self.include_usage = options.get("include_usage", False)
        self.continuous_usage = options.get("continuous_usage_stats", False)
        self.logprobs = payload.get("logprobs")
        self.top = payload.get("top_logprobs", 0) if self.chat else (self.logprobs or 0)
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.prompt_tokens = len(self._prompt_text().split())

    def _prompt_text(self) -> str:
        if self.chat:
            return " ".join(str(m.get("content", "")) for m in self.payload.get("messages", []))
        return str(self.payload.get("prompt", ""))

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": self.prompt_tokens,
                                 "completion_tokens": completion_tokens,
                                 "total_tokens": self.prompt_tokens + completion_tokens}
        if self.cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return usage

    def _logprobs(self, tokens: list[str]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        # Token "t<i> " has logprob -(i + 1) / 4, whichever chunk carries it.
        lps = [-0.25 * (int(t[1:]) + 1) for t in tokens]
        if self.chat:
            return {"content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()),
                 "top_logprobs": [{"token": f"{t}#{k}", "logprob": lp - k, "bytes": None}
                                  for k in range(self.top)]}
                for t, lp in zip(tokens, lps)]}
        return {"tokens": tokens, "token_logprobs": lps, "text_offset": [0] * len(tokens),
                "top_logprobs": [{f"{t}#{k}": lp - k for k in range(self.top)}
                                 for t, lp in zip(tokens, lps)]}

    def _choice(self, text: str | None, tokens: list[str], finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish,
                                  "logprobs": self._logprobs(tokens)}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if text is None \
                else {"content": text}
        else:
            choice["text"] = text or ""
        return choice

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id, "created": 0, "model": "fake", "choices": choices,
            "object": "chat.completion.chunk" if self.chat else "text_completion"}
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + json.dumps(obj).encode() + self.eol * 2

    def _gap(self, chunk: int) -> float:
        """Seconds between token chunk `chunk` and the next."""
        return self.itl_s[chunk % len(self.itl_s)]

    def _sleep_until(self, start_ns: int, offset_s: float) -> Any:
        # Deadlines are absolute from the request's arrival so late wake-ups do not accumulate.
        return asyncio.sleep(max(0.0, (start_ns - time.perf_counter_ns()) / 1e9 + offset_s))

    async def run(self) -> bool:
        """Serve the completion; False when the connection must not be reused."""
        if self.fail == "status_500":
            await self.conn._respond_json(500, {"error": {
                "message": "scripted failure", "type": "InternalServerError", "code": 500}},
                self.record)
            return True
        if not self.payload.get("stream", False):
            await self._run_whole()
            return True
        return await self._run_stream()

    async def _run_whole(self) -> None:
        n_chunks = -(-self.n_tokens // self.per_chunk)
        await self._sleep_until(self.record.received_ns,
                                self.ttft_s + sum(self._gap(i) for i in range(n_chunks - 1)))
        tokens = [f"t{i} " for i in range(self.n_tokens)]
        choice = {"index": 0, "finish_reason": "length", "logprobs": self._logprobs(tokens)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": "".join(tokens)}
        else:
            choice["text"] = "".join(tokens)
        await self.conn._respond_json(200, {
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": 0, "model": "fake", "choices": [choice],
            "usage": self._usage(self.n_tokens)}, self.record)

    async def _run_stream(self) -> bool:
        conn, record, start = self.conn, self.record, self.record.received_ns
        t0, t1 = await conn._write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                   b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
        record.writes.append({"kind": "head", "t0": t0, "t1": t1, "tokens": 0})
        if self.eol == b"\r\n":
            await conn._write_chunk(record, "comment", b": ping\r\n\r\n")
        if self.chat:
            await conn._write_chunk(record, "role", self._event(
                [self._choice(None, [], None)], self._usage(0) if self.continuous_usage else None))
        sent = 0
        chunk = 0
        held: list[tuple[bytes, int]] = []  # token events made but not yet written (burst)
        due_s = self.ttft_s
        while sent < self.n_tokens:
            if self.fail is not None and chunk == self.fail_after:
                return await self._fail()
            await self._sleep_until(start, due_s)
            due_s += self._gap(chunk)
            tokens = [f"t{i} " for i in range(sent, min(sent + self.per_chunk, self.n_tokens))]
            sent += len(tokens)
            finish = "length" if sent == self.n_tokens else None
            event = self._event([self._choice("".join(tokens), tokens, finish)],
                                self._usage(sent) if self.continuous_usage else None)
            if self.burst > 1:
                held.append((event, len(tokens)))
                if len(held) == self.burst or sent == self.n_tokens:
                    await conn._write_chunks(record, "token", held)
                    held = []
                chunk += 1
                continue
            if self.split_s is not None:
                cut = len(event) // 2
                await conn._write_chunk(record, "part", event[:cut])
                await asyncio.sleep(self.split_s)
                event = event[cut:]
            await conn._write_chunk(record, "token", event, len(tokens))
            chunk += 1
        if self.include_usage:
            await conn._write_chunk(record, "usage", self._event([], self._usage(sent)))
        await conn._write_chunk(record, "done", b"data: [DONE]" + self.eol * 2)
        t0, t1 = await conn._write(b"0\r\n\r\n")
        record.writes.append({"kind": "end", "t0": t0, "t1": t1, "tokens": 0})
        return True

    async def _fail(self) -> bool:
        conn, record = self.conn, self.record
        if self.fail == "malformed":
            await conn._write_chunk(record, "fail", b'data: {"choices": [{"delta": {"cont\n\n')
            await conn._write_chunk(record, "done", b"data: [DONE]\n\n")
            await conn._write(b"0\r\n\r\n")
            return True
        if self.fail == "error_event":
            await conn._write_chunk(record, "fail", b"data: " + json.dumps({"error": {
                "message": "scripted mid-stream failure", "type": "InternalServerError",
                "code": 500}}).encode() + b"\n\n")
            await conn._write_chunk(record, "done", b"data: [DONE]\n\n")
            await conn._write(b"0\r\n\r\n")
            return True
        if self.fail == "stall":
            await asyncio.sleep(_STALL_S)
        record.writes.append({"kind": "fail", "t0": time.perf_counter_ns(),
                              "t1": time.perf_counter_ns(), "tokens": 0})
        # An abrupt close mid-body: the client sees the chunked body end without its terminator.
        conn._sock.shutdown(socket.SHUT_RDWR)
        return False


class _Server:
    def __init__(self, script: dict[str, Any]) -> None:
        self.records: dict[str, _Record] = {}
        self.active = 0
        self.max_active = 0
        self.completions = 0  # completions served since start or reset, this one included
        self.script = script
        self._next_id = 0

    def new_id(self) -> str:
        self._next_id += 1
        return f"fake-{self._next_id}"

    def enter(self) -> None:
        self.completions += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)

    def leave(self) -> None:
        self.active -= 1

    def reset(self) -> None:
        self.records.clear()
        self.max_active = self.active
        self.completions = 0

    def truth(self) -> dict[str, Any]:
        return {"requests": {rid: {"received_ns": r.received_ns, "writes": r.writes}
                             for rid, r in self.records.items()},
                "max_active": self.max_active}

    async def serve(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(1024)
        listener.setblocking(False)
        # The parent waits for this line: the port, once the socket accepts connections.
        sys.stdout.write(f"{listener.getsockname()[1]}\n")
        sys.stdout.flush()
        tasks: set[asyncio.Task[None]] = set()
        while True:
            sock, _ = await loop.sock_accept(listener)
            sock.setblocking(False)
            # Small writes must leave at once, as a real server's token chunks do.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.create_task(_Connection(self, sock).serve())
            tasks.add(task)
            task.add_done_callback(tasks.discard)


def arrival_offsets_ns(times_ns: list[int], record: dict[str, Any]) -> list[int]:
    """How far each client arrival time for a token chunk lies outside the interval in which the
    server wrote that chunk: 0 inside `[t0, t1]`, positive when later, negative when earlier (which
    no correct client can be). Chunks pair up in order; the lengths must already agree."""
    writes = [w for w in record["writes"] if w["kind"] == "token"]
    return [t - w["t1"] if t > w["t1"] else min(0, t - w["t0"]) for t, w in zip(times_ns, writes)]


class FakeServer:
    """The fake server in a child process, for the length of a `with` block."""

    def __init__(self, host: str = "127.0.0.1", script: dict[str, Any] | None = None) -> None:
        self.host = host
        self.script = script or {}
        self.url = ""
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> FakeServer:
        self._proc = subprocess.Popen([sys.executable, __file__, self.host, json.dumps(self.script)],
                                      stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        port = self._proc.stdout.readline().strip()
        if not port:
            self._proc.wait(5)
            raise RuntimeError(f"fake SSE server exited with {self._proc.returncode}")
        self.url = f"http://{self.host}:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.terminate()
        self._proc.wait(10)

    def truth(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/truth", timeout=30, trust_env=False).json()

    def reset(self) -> None:
        httpx.post(f"{self.url}/reset", timeout=30, trust_env=False).raise_for_status()


if __name__ == "__main__":
    asyncio.run(_Server(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}).serve(
        sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1", 0))

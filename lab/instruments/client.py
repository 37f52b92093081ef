"""The streaming client every instrument talks to an engine through: OpenAI chat and text
completions over HTTP/1.1 keep-alive, one `Receipt` per request, errors as receipts.

Arrival times. A chunk's arrival time is taken where it enters this host, not where Python code
gets round to it. On Linux each socket asks the kernel to timestamp incoming data
(SO_TIMESTAMPNS): the stamp is taken as the bytes reach the socket, so the client's own event-loop
backlog cannot leak into TTFT or inter-token latencies. The stamp is converted from the kernel's
realtime clock to `perf_counter_ns()`'s monotonic clock at each read. Where the kernel gives no
stamp, the read itself happens in the event loop's I/O callback and is stamped there, before any
queued task runs. Either way `Receipt.read_lag_max_ns` records how far behind the client's code
fell, which is the test that the client was not the bottleneck. A read returns everything queued
on the socket, so chunks of one stream that pile up while the client is late share the stamp of
the latest (`Receipt.coalesced_chunks` counts them). Only plain http:// is spoken: the lab
measures engines it boots.
"""

from __future__ import annotations

import asyncio
import json
import platform
import socket
import struct
import sys
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, cast

import httpcore
import httpx

from lab.instruments.receipt import DEFAULT_LATE_READ_MS, Receipt, TokenLogprob

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Linux's SO_TIMESTAMPNS (SO_TIMESTAMPNS_OLD: a timespec of two C longs), which the socket module
# does not export. Its number is the generic one, used by these architectures.
_SO_TIMESTAMPNS = 35
_GENERIC_SOCKET_ABI = {"x86_64", "aarch64", "arm64"}
_TIMESPEC = struct.Struct("@ll")
_ANCILLARY_SPACE = socket.CMSG_SPACE(_TIMESPEC.size)
_READ_BYTES = 64 * 1024
# Past this many unread bytes a connection stops reading until its task catches up.
_MAX_BUFFERED = 4 * 1024 * 1024


class _ClockOffset:
    """CLOCK_REALTIME minus `perf_counter_ns()`, re-measured at most once a second so a step of
    the realtime clock is picked up (both clocks share NTP's rate corrections)."""

    def __init__(self) -> None:
        self._offset_ns = 0
        self._measured_ns = -(10**18)

    def at(self, mono_ns: int) -> int:
        if mono_ns - self._measured_ns > 1_000_000_000:
            # The pair read closest together wins: a preemption between the two reads would
            # shift every stamp by its length.
            best_width = None
            for _ in range(5):
                before = time.perf_counter_ns()
                real = time.time_ns()
                after = time.perf_counter_ns()
                if best_width is None or after - before < best_width:
                    best_width = after - before
                    self._offset_ns = real - (before + after) // 2
            self._measured_ns = mono_ns
        return self._offset_ns


_CLOCK_OFFSET = _ClockOffset()


class _StampedStream(httpcore.AsyncNetworkStream):
    """A TCP connection that reads whenever the socket is readable, in the event loop's I/O
    callback, and remembers when each piece arrived; `last_rx_ns` is the arrival of the piece the
    last `read()` returned. Reading eagerly, rather than when the HTTP parser asks, keeps two
    chunks from sharing one read (and one stamp) while the task is busy elsewhere."""

    def __init__(self, sock: socket.socket, kernel_stamps: bool) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._kernel_stamps = kernel_stamps
        self._pieces: deque[tuple[int, bytes]] = deque()  # (arrival, bytes); b"" is end of stream
        self._buffered = 0
        self._error: OSError | None = None
        self._reading = False
        self._waiter: asyncio.Future[None] | None = None
        # One timer per connection, re-armed only when it fires: a timer per read would cost a
        # heap push and a cancellation for every chunk.
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.last_rx_ns = 0
        self._start_reading()

    def _start_reading(self) -> None:
        self._reading = True
        self._loop.add_reader(self._fd, self._on_readable)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def _on_readable(self) -> None:
        try:
            if self._kernel_stamps:
                data, ancillary, _, _ = self._sock.recvmsg(_READ_BYTES, _ANCILLARY_SPACE)
                now = time.perf_counter_ns()
                t_ns = now
                if ancillary and ancillary[0][1] == _SO_TIMESTAMPNS:
                    sec, nsec = _TIMESPEC.unpack_from(ancillary[0][2])
                    # min(): a realtime step must not stamp bytes after they were read.
                    t_ns = min(now, sec * 1_000_000_000 + nsec - _CLOCK_OFFSET.at(now))
            else:
                data = self._sock.recv(_READ_BYTES)
                t_ns = time.perf_counter_ns()
        except BlockingIOError:
            return
        except OSError as exc:
            self._error = exc
            data, t_ns = b"", time.perf_counter_ns()
        self._pieces.append((t_ns, data))
        self._buffered += len(data)
        if not data or self._buffered > _MAX_BUFFERED:
            self._stop_reading()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _on_timer(self, timeout: float) -> None:
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return
        if self._loop.time() >= self._deadline:
            self._waiter.set_exception(httpcore.ReadTimeout(f"no data for {timeout} s"))
        else:
            self._timer = self._loop.call_at(self._deadline, self._on_timer, timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if not self._pieces:
            if not self._reading:
                raise httpcore.ReadError("read on a closed connection")
            self._waiter = self._loop.create_future()
            if timeout is not None:
                self._deadline = self._loop.time() + timeout
                if self._timer is None:
                    self._timer = self._loop.call_at(self._deadline, self._on_timer, timeout)
            try:
                await self._waiter
            finally:
                self._waiter = None
        t_ns, data = self._pieces[0]
        self.last_rx_ns = t_ns
        if not data:
            if self._error is not None:
                raise httpcore.ReadError(str(self._error))
            return data  # end of stream stays queued: every later read sees it too
        if len(data) > max_bytes:
            self._pieces[0] = (t_ns, data[max_bytes:])
            data = data[:max_bytes]
        else:
            self._pieces.popleft()
        self._buffered -= len(data)
        if not self._reading and self._buffered <= _MAX_BUFFERED // 2 and not (
                self._pieces and not self._pieces[-1][1]):
            self._start_reading()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return  # h11's end of a sized body; a send() of nothing still costs a syscall
        try:
            async with asyncio.timeout(timeout):
                await self._loop.sock_sendall(self._sock, buffer)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(f"write blocked for {timeout} s") from exc
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        self._stop_reading()
        if self._timer is not None:
            self._timer.cancel()
        self._sock.close()

    def get_extra_info(self, info: str) -> Any:
        if info == "socket":
            return self._sock
        if info == "is_readable":
            # The pool asks before reusing an idle connection: anything read since means the
            # server closed it (or broke the protocol).
            return bool(self._pieces)
        return None


async def _connect(addresses: list[tuple[Any, ...]], timeout: float | None,
                   kernel_stamps: bool) -> _StampedStream:
    """A connection to the first of `getaddrinfo`'s answers that accepts one."""
    loop = asyncio.get_running_loop()
    failure = OSError("no address to connect to")
    try:
        async with asyncio.timeout(timeout):
            for family, kind, proto, _, address in addresses:
                sock = socket.socket(family, kind, proto)
                try:
                    sock.setblocking(False)
                    # Request bytes must leave at once, not wait for Nagle's timer.
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await loop.sock_connect(sock, address)
                except OSError as exc:
                    sock.close()
                    failure = exc
                    continue
                return _StampedStream(sock, kernel_stamps and _ask_kernel_stamps(sock))
    except TimeoutError as exc:
        raise httpcore.ConnectTimeout(f"connect took over {timeout} s") from exc
    raise httpcore.ConnectError(str(failure)) from failure


def _ask_kernel_stamps(sock: socket.socket) -> bool:
    if sys.platform != "linux" or platform.machine() not in _GENERIC_SOCKET_ABI:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


class _StampingTransport(httpx.AsyncBaseTransport):
    """httpx over HTTP/1.1 connections on `_StampedStream`s, pooled as a stack of idle ones.

    httpcore's own pool rescans every connection for each idle one whenever a request starts or
    ends; at 256 connections that was seconds of CPU per batch, stalling every stream's reads.
    """

    def __init__(self, max_connections: int, kernel_stamps: bool) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[httpcore.AsyncHTTP11Connection] = []
        self._kernel_stamps = kernel_stamps
        # Resolved once: the engine's address does not move during a run, and each lookup would
        # go through a thread.
        self._addresses: list[tuple[Any, ...]] | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port,
                             target=url.raw_path),
            headers=request.headers.raw, content=request.stream, extensions=request.extensions)
        await self._slots.acquire()
        try:
            connection, opened = await self._checkout(core_request)
            response = await connection.handle_async_request(core_request)
        except BaseException:
            self._slots.release()
            raise
        return httpx.Response(status_code=response.status, headers=response.headers,
                              stream=_Body(response.stream, self, connection),
                              extensions={**response.extensions, "opened_connection": opened})

    async def _checkout(self, request: httpcore.Request) -> tuple[httpcore.AsyncHTTP11Connection,
                                                                   bool]:
        while self._idle:
            connection = self._idle.pop()
            if connection.is_idle() and not connection.has_expired():
                return connection, False
            await connection.aclose()
        origin = request.url.origin
        if self._addresses is None:
            try:
                self._addresses = await asyncio.get_running_loop().getaddrinfo(
                    origin.host.decode("ascii"), origin.port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise httpcore.ConnectError(str(exc)) from exc
        timeout = request.extensions.get("timeout", {}).get("connect")
        stream = await _connect(self._addresses, timeout, self._kernel_stamps)
        return httpcore.AsyncHTTP11Connection(origin, stream), True

    def checkin(self, connection: httpcore.AsyncHTTP11Connection) -> None:
        # A connection the server or a failure closed is simply dropped.
        if connection.is_idle():
            self._idle.append(connection)
        self._slots.release()

    async def aclose(self) -> None:
        while self._idle:
            await self._idle.pop().aclose()


class _Body(httpx.AsyncByteStream):
    """A response body that hands its connection back to the pool once closed."""

    def __init__(self, stream: Any, pool: _StampingTransport,
                 connection: httpcore.AsyncHTTP11Connection) -> None:
        self._stream = stream
        self._pool = pool
        self._connection: httpcore.AsyncHTTP11Connection | None = connection

    def __aiter__(self) -> Any:
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            if self._connection is not None:
                self._pool.checkin(self._connection)
                self._connection = None


class _StreamParser:
    """Turns one response's SSE `data:` payloads into the receipt's fields."""

    def __init__(self, receipt: Receipt, chat: bool) -> None:
        self.receipt = receipt
        self.chat = chat
        self.done = False
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[Any] = []
        self.chunk_tokens: list[int] = []
        self.every_chunk_has_usage = True
        self.tokens_so_far = 0

    def feed(self, data: bytes, t_ns: int) -> None:
        """One `data:` payload that arrived at `t_ns`; sets `receipt.error` on an error event."""
        if data == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self.receipt.error = f"malformed stream chunk: {data[:200]!r}"
            return
        if "error" in obj or obj.get("object") == "error":
            self.receipt.error = f"error event in stream: {_error_message(obj)}"
            return
        receipt = self.receipt
        if receipt.response_id is None:
            receipt.response_id = obj.get("id")
        usage = obj.get("usage")
        if usage:
            _take_usage(receipt, usage)
            receipt.response = obj
        choices = obj.get("choices")
        if not choices:
            return
        choice = choices[0]
        if self.chat:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            carries = bool(text or reasoning or delta.get("tool_calls"))
            if reasoning:
                self.reasoning.append(reasoning)
        else:
            text = choice.get("text")
            carries = bool(text)
        logprobs = choice.get("logprobs")
        if logprobs:
            self.logprobs.append(logprobs)
            carries = carries or bool(logprobs.get("content") or logprobs.get("tokens"))
        if text:
            self.text.append(text)
        if choice.get("finish_reason"):
            receipt.finish_reason = choice["finish_reason"]
        if carries:
            if receipt.t_first_token_ns is None:
                receipt.t_first_token_ns = t_ns
            receipt.t_last_token_ns = t_ns
            receipt.token_times_ns.append(t_ns)
            if usage:
                self.chunk_tokens.append(usage["completion_tokens"] - self.tokens_so_far)
            else:
                self.every_chunk_has_usage = False
        if usage:
            self.tokens_so_far = usage.get("completion_tokens", 0)

    def finish(self) -> None:
        receipt = self.receipt
        receipt.text = "".join(self.text)
        receipt.reasoning_text = "".join(self.reasoning)
        if self.logprobs:
            receipt.logprobs = [t for lp in self.logprobs for t in _token_logprobs(lp, self.chat)]
        if self.every_chunk_has_usage and self.chunk_tokens:
            receipt.chunk_tokens = self.chunk_tokens


def _take_usage(receipt: Receipt, usage: Mapping[str, Any]) -> None:
    receipt.usage_present = True
    receipt.prompt_tokens = usage.get("prompt_tokens") or 0
    receipt.completion_tokens = usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    receipt.cached_tokens_present = cached is not None
    receipt.cached_tokens = cached or 0


def _token_logprobs(logprobs: Mapping[str, Any], chat: bool) -> list[TokenLogprob]:
    if chat:
        return [TokenLogprob(t["token"], t["logprob"],
                             {alt["token"]: alt["logprob"] for alt in t.get("top_logprobs") or []})
                for t in logprobs.get("content") or []]
    tops = logprobs.get("top_logprobs") or []
    return [TokenLogprob(token, logprob, dict(tops[i] or {}) if i < len(tops) else {})
            for i, (token, logprob) in enumerate(zip(logprobs.get("tokens") or [],
                                                     logprobs.get("token_logprobs") or []))]


def _error_message(obj: Any) -> str:
    """The message of an OpenAI-style error body, whichever of the common shapes it takes."""
    if isinstance(obj, Mapping):
        inner = obj.get("error", obj)
        if isinstance(inner, Mapping):
            return str(inner.get("message") or inner.get("detail") or inner)
        return str(inner)
    return str(obj)


def _endpoint(payload: Mapping[str, Any]) -> str:
    if "messages" in payload:
        return CHAT
    if "prompt" in payload:
        return COMPLETIONS
    raise ValueError("a payload needs `messages` (chat) or `prompt` (completions)")


class StreamingClient:
    """One engine's OpenAI API. Use as `async with StreamingClient(url) as client:`.

    `base_url` is the server root (a trailing `/v1` is accepted). `timeout` bounds every wait on
    the network: connecting, writing, and the gap before the next bytes of a response.
    `max_connections` sizes the keep-alive pool and caps `run_all`'s concurrency.
    `late_read_ms` is how far behind arrival a stream may be read before its receipt is marked
    `unvouched` (so are streams with coalesced chunks).
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 max_connections: int = 256, kernel_timestamps: bool = True,
                 late_read_ms: float = DEFAULT_LATE_READ_MS) -> None:
        base_url = base_url.rstrip("/")
        self._late_read_ns = int(late_read_ms * 1e6)
        self.base_url = base_url.removesuffix("/v1")
        self.max_connections = max_connections
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        if httpx.URL(self.base_url).scheme != "http":
            raise ValueError(f"{base_url}: only http:// engines on reachable hosts are measured")
        transport = _StampingTransport(max_connections, kernel_timestamps)
        # Absolute URLs built once: httpx would otherwise parse and join one per request.
        self._urls = {path: httpx.URL(self.base_url + path) for path in (CHAT, COMPLETIONS)}
        self._http = httpx.AsyncClient(headers=headers,
                                       timeout=httpx.Timeout(timeout), transport=transport,
                                       trust_env=False)

    async def __aenter__(self) -> StreamingClient:
        await self._http.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self._http.__aexit__(exc_type, exc, tb)

    async def request(self, payload: Mapping[str, Any], *,
                      t_queued_ns: int | None = None) -> Receipt:
        """Send one request (one choice, n=1) and wait for all of it. The endpoint follows from
        the payload; it streams unless `"stream": False`, and a stream always asks for `usage`.
        Never raises for a failed request: the receipt's `error` says what went wrong."""
        if t_queued_ns is None:
            t_queued_ns = time.perf_counter_ns()
        body = dict(payload)
        body["stream"] = body.get("stream", True)
        if body["stream"]:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        receipt = Receipt(request_id=uuid.uuid4().hex, endpoint=_endpoint(body), payload=body,
                          t_queued_ns=t_queued_ns)

        async def trace(event: str, info: Mapping[str, Any]) -> None:
            if event == "http11.send_request_headers.started":
                receipt.t_sent_ns = time.perf_counter_ns()

        try:
            async with self._http.stream(
                    "POST", self._urls[receipt.endpoint], content=json.dumps(body).encode(),
                    headers={"X-Request-Id": receipt.request_id},
                    extensions={"trace": trace}) as response:
                receipt.status = response.status_code
                receipt.opened_connection = response.extensions["opened_connection"]
                if response.status_code != 200:
                    await self._read_error(response, receipt)
                elif body["stream"]:
                    await self._read_stream(response, receipt)
                else:
                    await self._read_whole(response, receipt)
        except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
            if receipt.error is None:
                receipt.error = f"{type(exc).__name__}: {exc}"
        if receipt.t_done_ns is None:
            receipt.t_done_ns = time.perf_counter_ns()
        receipt.unvouched = receipt.unvouched_reason(self._late_read_ns)
        return receipt

    async def run_all(self, payloads: Sequence[Mapping[str, Any]], concurrency: int, *,
                      offsets_s: Sequence[float] | None = None) -> list[Receipt]:
        """Send every payload keeping `concurrency` requests in flight while any are waiting, and
        return the receipts in input order. With `offsets_s` (non-decreasing, one per payload),
        payload i is handed over `offsets_s[i]` seconds after the call, and still waits for a
        free slot; its queue time counts from that moment."""
        if not 1 <= concurrency <= self.max_connections:
            raise ValueError(f"concurrency {concurrency} outside 1..{self.max_connections} "
                             "(max_connections)")
        for payload in payloads:
            _endpoint(payload)  # a malformed batch is refused before anything is sent
        if offsets_s is not None:
            if len(offsets_s) != len(payloads):
                raise ValueError("offsets_s needs one offset per payload")
            if any(b < a for a, b in zip(offsets_s, offsets_s[1:])):
                raise ValueError("offsets_s must not decrease")
        receipts: list[Receipt | None] = [None] * len(payloads)
        start_ns = time.perf_counter_ns()
        pending = iter(range(len(payloads)))

        async def worker() -> None:
            # Workers share one iterator, so requests leave in input order and a worker that
            # finishes takes the next request at once: no slot stays empty while any wait.
            for i in pending:
                t_queued_ns = start_ns
                if offsets_s is not None:
                    t_queued_ns = start_ns + int(offsets_s[i] * 1e9)
                    wait_ns = t_queued_ns - time.perf_counter_ns()
                    if wait_ns > 0:
                        await asyncio.sleep(wait_ns / 1e9)
                receipts[i] = await self.request(payloads[i], t_queued_ns=t_queued_ns)

        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, len(payloads))):
                group.create_task(worker())
        return cast(list[Receipt], receipts)

    @staticmethod
    async def _read_error(response: httpx.Response, receipt: Receipt) -> None:
        body = await response.aread()
        _mark_done(response, receipt)
        try:
            receipt.response = json.loads(body)
            message = _error_message(receipt.response)
        except ValueError:
            message = body[:200].decode(errors="replace")
        receipt.error = f"HTTP {response.status_code}: {message}"

    @staticmethod
    async def _read_whole(response: httpx.Response, receipt: Receipt) -> None:
        obj = receipt.response = json.loads(await response.aread())
        _mark_done(response, receipt)
        receipt.response_id = obj.get("id")
        if obj.get("usage"):
            _take_usage(receipt, obj["usage"])
        choice = (obj.get("choices") or [{}])[0]
        chat = receipt.endpoint == CHAT
        message = choice.get("message") or {}
        receipt.text = (message.get("content") if chat else choice.get("text")) or ""
        receipt.reasoning_text = (message.get("reasoning_content") or message.get("reasoning")
                                  or "") if chat else ""
        receipt.finish_reason = choice.get("finish_reason")
        if choice.get("logprobs"):
            receipt.logprobs = _token_logprobs(choice["logprobs"], chat)

    @staticmethod
    async def _read_stream(response: httpx.Response, receipt: Receipt) -> None:
        stream: _StampedStream = response.extensions["network_stream"]
        parser = _StreamParser(receipt, receipt.endpoint == CHAT)
        lag_max = 0
        pending = b""
        try:
            async for data in response.aiter_raw():
                # Hot path: one stamp per read, and JSON only for complete `data:` lines.
                t_ns = stream.last_rx_ns
                lag_max = max(lag_max, time.perf_counter_ns() - t_ns)
                if b"\n" not in data:
                    pending += data
                    continue
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if line.startswith(b"data:"):
                        parser.feed(line[5:].strip(), t_ns)
                if receipt.error is not None:
                    return
            _mark_done(response, receipt)
            if not parser.done:
                receipt.error = "stream ended without [DONE]"
        finally:
            # What arrived before a failure is kept.
            parser.finish()
            receipt.read_lag_max_ns = max(lag_max, receipt.read_lag_max_ns)


def _mark_done(response: httpx.Response, receipt: Receipt) -> None:
    """The response ended when the read that delivered its last bytes arrived."""
    stream: _StampedStream = response.extensions["network_stream"]
    receipt.t_done_ns = stream.last_rx_ns
    receipt.read_lag_max_ns = time.perf_counter_ns() - stream.last_rx_ns

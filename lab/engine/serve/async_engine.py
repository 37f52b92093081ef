"""Runs the synchronous engine on its own thread beside an asyncio event loop, so HTTP parsing and
streaming never block scheduling and a step never waits on a slow client.

The engine thread owns the LLMEngine: requests and aborts reach it through a queue, and each
step's outputs go back to the event loop in one call, fanned out to per-request queues.

Build the engine with `build_engine`, not on the thread that will serve HTTP: on the CPU, torch's
OpenMP runtime (libgomp) keeps a pool of worker threads for every thread that ever ran a parallel
region, and once its pools hold more threads than the host has cores it stops spinning between
regions. Each of the few hundred parallel regions of a decode step then waits for its workers to
be woken from a futex, which made served decode a quarter slower than offline decode (the
offline engine runs on the one thread that loaded it). A thread that exits frees its pool."""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from lab.engine.core.config import EngineConfig
from lab.engine.core.llm_engine import EngineBusyError, LLMEngine
from lab.engine.core.output_processor import RequestOutput
from lab.engine.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: asyncio.Queue
    accepted: asyncio.Future
    admitted: bool  # part of a request already admitted: never refused for a full queue


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: object
    done: asyncio.Future


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error; the server answers 503."""


def build_engine(config: EngineConfig) -> LLMEngine:
    """LLMEngine(config), built on a short-lived thread so that no OpenMP pool outlives the load
    but the engine thread's (see the module docstring); the load's errors are raised here."""
    result: dict[str, object] = {}

    def build() -> None:
        try:
            result["engine"] = LLMEngine(config)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=build, name="engine-build")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["engine"]  # type: ignore[return-value]


# A request's end, on the event loop: its last output when the engine finished or aborted it
# (its KV blocks already freed), None when the engine refused it.
EndHook = Callable[[str, RequestOutput | None], None]
# The tokens one engine step computed (prompt and generated), on the engine thread.
StepHook = Callable[[int], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_end: EndHook | None = None, on_step: StepHook | None = None) -> None:
        self.engine = engine
        self.on_end = on_end
        self.on_step = on_step
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, asyncio.Queue] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.started_at = time.time()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        # The event loop and the step loop share one GIL. A thread that waits for it gets it only
        # when the holder blocks or after the switch interval, so a step that ends while the loop
        # writes the last step's chunks can wait that long before it may launch the next one.
        sys.setswitchinterval(self.engine.config.gil_switch_interval_ms / 1000)
        self.loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- API for the server ------------------------------------------------------------------

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     admitted: bool = False) -> asyncio.Queue:
        """Hand the request to the engine and wait until it is queued there; the queue its outputs
        will arrive on (read them with `outputs`). Raises what the engine refuses it with
        (BadRequestError, EngineBusyError when the waiting queue is full unless `admitted`), so a
        server can answer a refusal with an error status before it starts a response."""
        if not self.alive:
            raise EngineDeadError(f"the engine loop is not running: {self.error!r}")
        assert self.loop is not None
        sink: asyncio.Queue = asyncio.Queue()
        accepted = self.loop.create_future()
        self._send(_Add(request_id, prompt_token_ids, params, sink, accepted, admitted))
        try:
            await accepted
        except asyncio.CancelledError:
            self._send(_Abort(request_id))  # it may be in the engine by now: take it out
            raise
        return sink

    async def outputs(self, request_id: str, sink: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """A submitted request's outputs as steps produce them; aborts it if the consumer stops
        early (a client that disconnects frees its KV blocks)."""
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       admitted: bool = False) -> AsyncIterator[RequestOutput]:
        """`submit`, then its `outputs`."""
        sink = await self.submit(request_id, prompt_token_ids, params, admitted)
        async for out in self.outputs(request_id, sink):
            yield out

    def abort(self, request_id: str) -> None:
        """Take a submitted request out of the engine at its next step, wherever it is."""
        self._send(_Abort(request_id))

    async def call(self, fn):
        """Run `fn(engine)` on the engine thread between steps (stats, cache reset)."""
        if not self.alive:
            raise EngineDeadError(f"the engine loop is not running: {self.error!r}")
        assert self.loop is not None
        done = self.loop.create_future()
        self._send(_Call(fn, done))
        return await done

    def _send(self, item: object) -> None:
        self._inbox.put(item)
        self._wake.set()

    # -- the engine thread -------------------------------------------------------------------

    def _resolve(self, fut: asyncio.Future, value=None, error: BaseException | None = None) -> None:
        def set_it() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)
        self.loop.call_soon_threadsafe(set_it)  # type: ignore[union-attr]

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Add):
                try:
                    self.engine.add_request(item.request_id, item.prompt_token_ids, item.params,
                                            admitted=item.admitted)
                except (ValueError, EngineBusyError) as exc:
                    self._resolve(item.accepted, error=exc)
                    self._ended(item.request_id, None)
                    continue
                except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
                    log.exception("request %s refused by an unexpected error", item.request_id)
                    self.engine.abort(item.request_id)  # in case it got as far as the queue
                    self._resolve(item.accepted, error=exc)
                    self._ended(item.request_id, None)
                    continue
                self._sinks[item.request_id] = item.sink
                self._resolve(item.accepted, True)
            elif isinstance(item, _Abort):
                out = self.engine.abort(item.request_id)
                if out is not None:
                    log.debug("aborted %s", item.request_id)
                    self._ended(item.request_id, out)
                self._sinks.pop(item.request_id, None)
            elif isinstance(item, _Call):
                try:
                    self._resolve(item.done, item.fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - reported to the caller
                    self._resolve(item.done, error=exc)

    def _ended(self, request_id: str, out: RequestOutput | None) -> None:
        if self.on_end is not None:
            self.loop.call_soon_threadsafe(self.on_end, request_id, out)  # type: ignore[union-attr]

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        routed = []
        ended = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                routed.append((sink, out))
            if out.finished:
                self._sinks.pop(out.request_id, None)
                ended.append(out)
        if routed or ended:
            self.loop.call_soon_threadsafe(_fan_out, routed, ended, self.on_end)  # type: ignore[union-attr]

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                c = self.engine.counters
                before = c.prompt_tokens + c.generation_tokens
                outputs = self.engine.step()
                if self.on_step is not None:
                    self.on_step(c.prompt_tokens + c.generation_tokens - before)
                self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            log.exception("engine loop died")
            self.error = exc
            dead = EngineDeadError(f"engine loop died: {exc!r}")
            sinks = list(self._sinks.values())
            self._sinks.clear()
            if self.loop is not None and sinks:
                self.loop.call_soon_threadsafe(_fan_out, [(s, dead) for s in sinks], [], None)


def _fan_out(routed: list, ended: list[RequestOutput], on_end: EndHook | None) -> None:
    for sink, item in routed:
        sink.put_nowait(item)
    if on_end is not None:
        for out in ended:
            on_end(out.request_id, out)

"""Long sessions held resident while a probe runs: the needle asked beside work that fills the KV pool.

Each session is one long chat prompt of `tokens` tokens (salted, sized through `/tokenize`). All
are first sent together and answered (warm: their prefixes are in the prefix cache), then each
is re-sent turn after turn until the probe is over, so at any moment a session is running or its
prefix is cached, and a pool too small for them and the probe has to evict or preempt. The last
turns finish on their own (a turn is `answer_tokens` long), so every request ends with a receipt.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.prompts import Messages, chat_messages, filler_words, fit_messages, request_salt
from lab.instruments.receipt import Receipt

TASK = "Keep these project notes in mind for the rest of the conversation:"
QUESTION = "Which of the people in the notes worked hardest?"


class ResidentSessions:
    """`async with ResidentSessions(...) as resident:` warms the sessions on entry and keeps them
    running until the block ends; `receipts` then holds every request they sent, warm-up first."""

    def __init__(self, client: StreamingClient, model: str, salt: str, sessions: int, tokens: int,
                 answer_tokens: int) -> None:
        self._client = client
        self._model = model
        self._salt = salt
        self._sessions = sessions
        self._tokens = tokens
        self._answer_tokens = answer_tokens
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._bodies: list[dict[str, Any]] = []
        self.receipts: list[Receipt] = []
        self.warm = 0  # how many of `receipts` are the warm-up

    async def build(self, extras: EngineExtras) -> None:
        """Size each session's prompt; call before entering."""
        for i in range(self._sessions):
            salt = request_salt(self._salt, "resident", i)
            words = filler_words(salt, self._tokens)

            def render(k: int, tail: str, salt: str = salt, words: list[str] = words) -> Messages:
                return chat_messages(salt, f"{TASK}\n\n{' '.join(words[:k])}{tail}\n\n{QUESTION}")

            fitted = await fit_messages(extras, self._tokens, render, len(words))
            self._bodies.append({"model": self._model, "messages": fitted.form, "max_tokens": self._answer_tokens,
                                 "temperature": 0})

    async def __aenter__(self) -> ResidentSessions:
        self.receipts += await asyncio.gather(*(self._client.request(body) for body in self._bodies))
        self.warm = len(self.receipts)
        self._tasks = [asyncio.create_task(self._hold(body)) for body in self._bodies]
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _hold(self, body: dict[str, Any]) -> None:
        while not self._stop.is_set():
            receipt = await self._client.request(body)
            self.receipts.append(receipt)
            if not receipt.ok:
                return  # a session the engine refuses is not held; the caller sees its receipt

    def failed(self) -> list[Receipt]:
        return [r for r in self.receipts if not r.ok]

    def overlapping(self, probe: Receipt) -> int:
        """How many session turns were in flight at some moment while the probe was."""
        if probe.t_sent_ns is None or probe.t_done_ns is None:
            return 0
        return sum(1 for r in self.receipts[self.warm:] if r.t_sent_ns is not None and r.t_done_ns is not None
                   and r.t_sent_ns < probe.t_done_ns and r.t_done_ns > probe.t_sent_ns)

"""The agent sessions a soak simulates, driven over the OpenAI chat API.

Each session is one growing conversation: a system message that starts with the session's salt, a
task of `start_tokens`, then turn after turn the previous answer (as the assistant), a tool output
of a sampled size and a system reminder (as the user, the way coding agents put both in the user
turn). Every `subagent_every` turns a session starts `subagents` fresh short conversations beside
its own turn and waits for them before its next turn, as an agent waits for the results it asked
for; they are cold starts queued behind every session's work. When a turn's prompt reaches
`compact_at_tokens`, the session sends a summary request over the whole conversation and restarts
from the summary. All text is synthetic filler drawn from the seed and the boot's salt, sized in
words from the tokens per word the engine's `/tokenize` counts on a sample (estimated from
characters when it has none): sizes are targets, and every figure uses `usage` instead.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.prompts import Messages, chat_messages, estimated_tokens, filler_words, request_salt
from lab.instruments.receipt import Receipt

Kind = Literal["turn", "compaction", "subagent", "subagent_alone"]
TASK = "You are working through a long refactoring task. Here is the repository overview:"
REMINDER = ("<system-reminder>Keep working on the task. Use the tool output above; do not repeat it. "
            "Answer briefly.</system-reminder>")
COMPACT = "Summarise the conversation so far in a few sentences, so that the work can continue from the summary."
RESUME = "Summary of the work so far:"
SUBAGENT_TASK = "You are a subagent. Read these notes and report the one fact that matters in one sentence:"
# Words of filler measured through /tokenize to learn the tokens per word.
SAMPLE_WORDS = 400


class SessionSizes(Protocol):
    """The soak parameters the sessions read (lab.instruments.soak.SoakParams)."""

    sessions: int
    turns: int
    start_tokens: int
    tool_tokens: tuple[int, int]
    answer_tokens: int
    subagent_every: int
    subagents: int
    subagent_tokens: int
    subagent_answer_tokens: int
    compact_at_tokens: int
    summary_tokens: int
    seed: int
    time_budget_s: float


@dataclass
class Exchange:
    """One request of the soak and what it belongs to."""

    kind: Kind
    session: int  # -1 for the subagent sent alone before the sessions start
    turn: int  # the session's turn (a subagent's: its parent's turn)
    receipt: Receipt
    # The prompt tokens of the same conversation's previous request: the part of this prompt a
    # prefix cache can serve. None for the first turn of a conversation (or after a compaction).
    previous_prompt_tokens: int | None = None


@dataclass
class SoakLog:
    exchanges: list[Exchange] = field(default_factory=list)
    stopped_by_budget: list[int] = field(default_factory=list)  # sessions the time budget ended early
    ended_by_error: list[int] = field(default_factory=list)  # sessions a failed turn ended


class Sessions:
    """Runs every session of one soak against one engine."""

    def __init__(self, sizes: SessionSizes, client: StreamingClient, model: str, salt: str,
                 log: logging.Logger) -> None:
        self.sizes = sizes
        self.client = client
        self.model = model
        self.salt = salt
        self.log = log
        self.tokens_per_word = 1.3
        self.result = SoakLog()
        self._deadline_ns = 0

    async def size_words(self, extras: EngineExtras) -> None:
        """Learn the engine's tokens per filler word, so sizes in tokens become word counts."""
        sample = " ".join(filler_words(f"{self.salt}/sample", SAMPLE_WORDS))
        ids = await extras.tokenize(prompt=sample)
        self.tokens_per_word = (len(ids) if ids is not None else estimated_tokens(sample)) / SAMPLE_WORDS

    async def run(self) -> SoakLog:
        self._deadline_ns = time.perf_counter_ns() + int(self.sizes.time_budget_s * 1e9)
        if self.sizes.subagents:
            # The same cold start with nothing else running: what a subagent costs when it does not queue.
            await self._subagent(-1, 0, 0, "subagent_alone")
        async with asyncio.TaskGroup() as group:
            for i in range(self.sizes.sessions):
                group.create_task(self._session(i))
        return self.result

    async def _session(self, i: int) -> None:
        sizes = self.sizes
        rng = random.Random(f"{sizes.seed}/session/{i}")
        salt = request_salt(self.salt, "soak", i)
        messages = chat_messages(salt, f"{TASK}\n\n{self._text(salt, 'task', sizes.start_tokens)}")
        previous: int | None = None
        for turn in range(sizes.turns):
            if time.perf_counter_ns() > self._deadline_ns:
                self.log.info("soak: session %d stopped by the time budget after %d turns", i, turn)
                self.result.stopped_by_budget.append(i)
                return
            subagents = []
            if sizes.subagents and turn > 0 and turn % sizes.subagent_every == 0:
                subagents = [asyncio.create_task(self._subagent(i, turn, j, "subagent"))
                             for j in range(sizes.subagents)]
            receipt = await self.client.request(self._body(messages, sizes.answer_tokens))
            self.result.exchanges.append(Exchange("turn", i, turn, receipt, previous))
            if subagents:
                await asyncio.gather(*subagents)
            if not receipt.ok:
                self.log.warning("soak: session %d turn %d failed, the session ends: %s", i, turn, receipt.error)
                self.result.ended_by_error.append(i)
                return
            tool = self._text(salt, f"tool/{turn}", rng.randint(*sizes.tool_tokens))
            followup = f"Tool output:\n{tool}\n\n{REMINDER}"
            messages = [*messages, {"role": "assistant", "content": receipt.text}]
            previous = receipt.prompt_tokens
            if receipt.prompt_tokens >= sizes.compact_at_tokens and turn + 1 < sizes.turns:
                summary = await self.client.request(
                    self._body([*messages, {"role": "user", "content": COMPACT}], sizes.summary_tokens))
                self.result.exchanges.append(Exchange("compaction", i, turn, summary, previous))
                if not summary.ok:
                    self.log.warning("soak: session %d compaction failed, the session ends: %s", i, summary.error)
                    self.result.ended_by_error.append(i)
                    return
                # The conversation restarts from the summary: nothing before it is a prefix any more.
                messages = chat_messages(salt, f"{TASK}\n\n{RESUME} {summary.text.strip()}")
                previous = None
            messages = [*messages, {"role": "user", "content": followup}]

    async def _subagent(self, session: int, turn: int, j: int, kind: Kind) -> None:
        salt = request_salt(self.salt, "soak", session, turn, j, "subagent")
        messages = chat_messages(salt, f"{SUBAGENT_TASK}\n\n{self._text(salt, 'notes', self.sizes.subagent_tokens)}")
        receipt = await self.client.request(self._body(messages, self.sizes.subagent_answer_tokens))
        self.result.exchanges.append(Exchange(kind, session, turn, receipt))

    def _body(self, messages: Messages, max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}

    def _text(self, salt: str, part: str, tokens: int) -> str:
        return " ".join(filler_words(f"{salt}/{part}", max(1, round(tokens / self.tokens_per_word))))

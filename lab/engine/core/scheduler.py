"""Continuous batching: decide, every step, which sequences run and how many tokens each computes.

Per step the scheduler fills a token budget (`max_num_batched_tokens`) with one token per decoding
sequence and chunks of prompts. A prompt chunk is capped per request
(`long_prefill_token_threshold`), the number of prompts advancing in one step is capped
(`max_parallel_prefills`), a step whose only work is one prompt may take a larger budget
(`lone_prefill_tokens`: nobody else is waiting on that step, and a long prompt in fewer chunks
re-reads its cached prefix fewer times), and at most `max_num_seqs` sequences hold KV blocks. When blocks run
out, the most recently admitted sequence is preempted: its blocks are freed and it is recomputed
later (prompt plus the tokens it had generated).

With prompt lookup on, a decoding sequence may carry a draft: its step computes the last known
token plus the draft tokens (all counted against the budget, all given KV slots), and the model
runner verifies them. Drafts are added to a plan once its sequences' tokens are all on the host
(`add_drafts`), from the budget the plan left; a draft is cut to it and dropped before anything is
preempted for its blocks."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from lab.engine.core.config import EngineConfig
from lab.engine.core.sequence import Sequence, Status
from lab.engine.kv.block_manager import BlockManager
from lab.engine.spec.prompt_lookup import PromptLookup


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens computed this step, draft tokens included
    draft: list[int] = field(default_factory=list)  # proposed tokens verified after the last known one

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens - len(self.draft) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # query-length-1 sequences first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)

    # -- the step plan -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self._lone_prompt():
            budget = max(budget, self.config.lone_prefill_tokens)
        prefills = 0
        scheduled_ids: set[int] = set()

        def take_running(want_prefill: bool) -> None:
            nonlocal budget, prefills
            i = 0
            while i < len(self.running) and budget > 0:
                seq = self.running[i]
                if seq.seq_id in scheduled_ids or seq.is_prefill != want_prefill:
                    i += 1
                    continue
                if want_prefill and not self._prefill_slot_free(prefills):
                    return
                n = self._chunk(seq, budget)
                while not self.blocks.allocate(seq, n):
                    victim = self.running[-1]
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is not Status.RUNNING:
                    continue  # seq preempted itself; the list shifted, keep the same index
                out.scheduled.append(ScheduledSeq(seq, n))
                scheduled_ids.add(seq.seq_id)
                budget -= n
                prefills += want_prefill
                i += 1

        def admit_waiting() -> None:
            nonlocal budget, prefills
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                if not self._prefill_slot_free(prefills):
                    return
                seq = self.waiting[0]
                cached = self.blocks.match_prefix(seq) if seq.num_computed_tokens == 0 else []
                remaining = seq.num_tokens - len(cached) * self.blocks.block_size
                n = self._chunk_len(remaining, budget)
                if not self.blocks.allocate(seq, n, cached):
                    return  # never preempt running work to admit new work
                if not seq.admitted:
                    # Only a first admission counts toward hit statistics and usage.cached_tokens.
                    self.blocks.record_lookup(seq, len(cached))
                    seq.num_cached_tokens = len(cached) * self.blocks.block_size
                    seq.admitted = True
                    seq.scheduled_time = time.monotonic()
                self.waiting.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                scheduled_ids.add(seq.seq_id)
                budget -= n
                prefills += 1

        if self.config.schedule_policy == "prefill-first":
            take_running(want_prefill=True)
            admit_waiting()
            take_running(want_prefill=False)
        else:
            take_running(want_prefill=False)
            take_running(want_prefill=True)
            admit_waiting()
        # The attention metadata wants single-token queries first.
        out.scheduled.sort(key=lambda s: s.num_tokens != 1)
        return out

    def add_drafts(self, plan: SchedulerOutput, drafter: PromptLookup) -> None:
        """Give the decoding sequences of `plan`, whose tokens must all be on the host, the drafts
        that pay in a step that does not overlap, within the token budget the plan left."""
        budget = self.config.max_num_batched_tokens - plan.num_tokens
        batch = len(plan.scheduled)
        for s in plan.scheduled:
            if budget <= 0:
                break
            if s.num_tokens != 1 or not s.samples:
                continue  # a prompt chunk
            draft = drafter.propose(s.seq, batch, budget)
            if draft and self.blocks.allocate(s.seq, 1 + len(draft)):
                s.draft = draft
                s.num_tokens += len(draft)
                budget -= len(draft)
        plan.scheduled.sort(key=lambda s: s.num_tokens != 1)

    def _lone_prompt(self) -> bool:
        """Whether this step's only possible work is one prompt's prefill (no decode, no other request)."""
        if len(self.running) + len(self.waiting) != 1:
            return False
        return bool(self.waiting) or self.running[0].is_prefill

    def _prefill_slot_free(self, prefills: int) -> bool:
        cap = self.config.max_parallel_prefills
        return cap == 0 or prefills < cap

    def _chunk_len(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return self._chunk_len(seq.num_remaining, budget)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]

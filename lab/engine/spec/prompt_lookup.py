"""Prompt-lookup drafting (n-gram speculation, no draft model): guess a sequence's next tokens by
finding its last n tokens earlier in the same sequence (prompt and output) and proposing what
followed them there. Summaries, code edits and extraction repeat their input, so such guesses
are often right; the target model then checks k of them in one step (`rejection_sampler`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from lab.engine.core.config import EngineConfig
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.core.sequence import Sequence


def find_draft(tokens: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the sequence's last n tokens,
    trying n from `n_max` down to `n_min`; empty when no n-gram recurs. The occurrence is the
    latest one followed by k tokens (the freshest context), else the earliest (the longest
    continuation: in text that repeats with a short period the latest is followed by few)."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows that start before the suffix itself and leave at least one token after them.
        windows = sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= length]
            start = int(full[-1] if len(full) else hits[0]) + n
            return arr[start:start + k].tolist()
    return []


def drafts_allowed(params: SamplingParams) -> bool:
    """Whether a request's tokens may be drafted. Penalties, biases, allowed ids and logits
    processors (grammars keep state per token) change the target distribution token by token,
    so such requests decode one token per step; min_tokens is applied per drafted position."""
    return not (params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
                or params.logit_bias or params.allowed_token_ids is not None or params.logits_processors)


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters: a draft is one sequence's proposal in one step."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


# A sequence whose last PATIENCE lookups gained nothing (no n-gram recurred, or every drafted
# token was rejected) stops looking for FIRST_PAUSE engine steps; after a pause one more fruitless
# look pauses it again, twice as long, up to MAX_PAUSE (each look costs a step that cannot overlap,
# and the sequence has already shown it rarely repeats); an accepted token ends the schedule. While every
# running sequence pauses, decode steps overlap again (drafting needs each token on the host).
# A pause ends on a step that is a multiple of FIRST_PAUSE, so the sequences of a batch, which
# start decoding on different steps, look on the same steps: one step that cannot overlap serves
# all of them, where unaligned pauses would each break a step of their own.
PATIENCE = 4
FIRST_PAUSE = 16
MAX_PAUSE = 1024


@dataclass
class Backoff:
    """One sequence's lookups that gained nothing in a row, and its pause."""
    misses: int = 0
    pause: int = FIRST_PAUSE
    resume_at: int = 0  # the engine step from which the sequence looks again

    def gained(self, accepted: int, step: int) -> None:
        if accepted:
            self.misses, self.pause = 0, FIRST_PAUSE
            return
        self.misses += 1
        if self.misses >= (PATIENCE if self.pause == FIRST_PAUSE else 1):
            self.misses, self.resume_at = 0, -(-(step + self.pause) // FIRST_PAUSE) * FIRST_PAUSE
            self.pause = min(2 * self.pause, MAX_PAUSE)


class PromptLookup:
    """Proposes the drafts of decoding sequences, capped so that a fully accepted draft plus the
    token sampled after it never passes max_tokens or the context."""

    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.n_min = config.prompt_lookup_min
        self.n_max = config.prompt_lookup_max
        self.max_model_len = max_model_len
        self.counters = SpecCounters()
        self._backoff: dict[int, Backoff] = {}
        self.step = 0  # the engine's steps so far: the clock pauses are aligned to

    def tick(self) -> None:
        """The engine starts a step."""
        self.step += 1

    def _room(self, seq: Sequence, budget: int) -> int:
        p = seq.params
        return min(self.k, budget, p.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)

    def _may_look(self, seq: Sequence, room: int) -> bool:
        backoff = self._backoff.get(seq.seq_id)
        return (room > 0 and drafts_allowed(seq.params)
                and (backoff is None or self.step >= backoff.resume_at))

    def will_look(self, seq: Sequence) -> bool:
        """Whether `seq`'s next step looks for a draft: then its tokens must all be on the host."""
        return self._may_look(seq, self._room(seq, self.k))

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for `seq`, at most `budget` of them; `seq` must have no pending tokens."""
        room = self._room(seq, budget)
        if not self._may_look(seq, room):
            return []
        draft = find_draft(seq.token_ids, room, self.n_min, self.n_max)
        if not draft:
            self._backoff.setdefault(seq.seq_id, Backoff()).gained(0, self.step)
        return draft

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a verified draft and feed its outcome to the sequence's backoff."""
        self.counters.record(drafted, accepted)
        self._backoff.setdefault(seq.seq_id, Backoff()).gained(accepted, self.step)

    def forget(self, seq: Sequence) -> None:
        self._backoff.pop(seq.seq_id, None)

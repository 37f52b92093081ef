"""Prompt-lookup drafting (n-gram speculation, no draft model): guess a sequence's next tokens by
finding its last n tokens earlier in the same sequence (prompt and output) and proposing what
followed them there. Summaries, code edits and extraction repeat their input, so such guesses
are often right; the target model then checks them in one step (`rejection_sampler`).

A draft is proposed only where it pays: each sequence's n-gram index (`ngram_index.py`) says
whether a lookup would find anything, and how often its predictions came true lately
(`acceptance.py`), and the cost model measured at load (`draft_costs.py`) says what verifying a
draft and giving up overlapped decode cost at the step's batch size. Text that does not repeat
itself never drafts, so its decode overlaps on every step; a sequence drafts again as soon as its
text starts copying, since the index scores every token whether or not the sequence drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

from lab.engine.core.config import EngineConfig
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.core.sequence import Sequence
from lab.engine.spec.acceptance import HitRates
from lab.engine.spec.draft_costs import DraftCosts, Price
from lab.engine.spec.ngram_index import NgramIndex


def drafts_allowed(params: SamplingParams) -> bool:
    """Whether a request's tokens may be drafted. Penalties, biases, allowed ids and logits
    processors (grammars keep state per token) change the target distribution token by token,
    so such requests decode one token per step; min_tokens is applied per drafted position."""
    return not (params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
                or params.logit_bias or params.allowed_token_ids is not None or params.logits_processors)


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (a draft is one sequence's proposal in one step), and
    the decode steps that gave up overlapping to draft."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    sync_steps: int = 0
    graph_verify_steps: int = 0  # verify steps that replayed a CUDA graph rather than running eagerly

    def record(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


@dataclass
class Tracked:
    """One sequence's index and hit rates."""
    index: NgramIndex
    rates: HitRates = field(default_factory=HitRates)


class PromptLookup:
    """Proposes the drafts of decoding sequences, capped so that a fully accepted draft plus the
    token sampled after it never passes max_tokens or the context."""

    def __init__(self, config: EngineConfig, max_model_len: int, costs: DraftCosts) -> None:
        self.k = config.num_speculative_tokens
        self.n_min = config.prompt_lookup_min
        self.n_max = config.prompt_lookup_max
        self.max_model_len = max_model_len
        self.costs = costs
        self.counters = SpecCounters()
        self._tracked: dict[int, Tracked] = {}

    def admit(self, seq: Sequence) -> None:
        """Index a new request's prompt, when its tokens may be drafted: at arrival, before its
        prefill, rather than on a decode step."""
        if drafts_allowed(seq.params):
            tracked = self._tracked[seq.seq_id] = Tracked(NgramIndex(self.n_min, self.n_max))
            tracked.index.start(seq.token_ids, seq.num_prompt_tokens)

    def _room(self, seq: Sequence, budget: int) -> int:
        p = seq.params
        return min(self.k, budget, p.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)

    def _plan(self, seq: Sequence, price: Price, budget: int) -> tuple[int, float]:
        """How many tokens `seq` should draft and what that gains net of its verification."""
        tracked = self._tracked.get(seq.seq_id)  # none: its tokens may not be drafted
        room = self._room(seq, budget)
        if tracked is None or room <= 0:
            return 0, 0.0
        for hit in tracked.index.advance(seq.token_ids, seq.num_known_tokens):
            tracked.rates.update(hit)
        if tracked.index.source < 0:
            return 0, 0.0
        return price.best(tracked.rates, room)

    def pays_to_sync(self, seqs: list[Sequence]) -> bool:
        """Whether drafting in this decode step gains more than the overlap it gives up. With
        overlap the newest token of each sequence is still on the device: the estimate stops at the
        token before it, and the draft (`propose`, once the step has been collected) starts after it."""
        price = self.costs.price(len(seqs))
        gain = 0.0
        for seq in seqs:
            gain += self._plan(seq, price, self.k)[1]
            if gain > price.sync:
                self.counters.sync_steps += 1
                return True
        return False

    def propose(self, seq: Sequence, batch: int, budget: int) -> list[int]:
        """Draft tokens for `seq` in a step of `batch` sequences that does not overlap, at most
        `budget` of them, where they gain more than verifying them costs; `seq`'s tokens must all be
        on the host."""
        d, _ = self._plan(seq, self.costs.price(batch), budget)
        return self._tracked[seq.seq_id].index.draft(seq.token_ids, d) if d else []

    def forget(self, seq: Sequence) -> None:
        self._tracked.pop(seq.seq_id, None)

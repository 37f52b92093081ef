"""From sampled tokens to what a client sees: incremental text, stop conditions, and the deltas
streamed out of each step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lab.engine.core.sequence import Sequence, TokenLogprob
from lab.engine.weights.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output only
    phases: RequestPhases | None = None  # on the last output only


@dataclass(frozen=True)
class RequestPhases:
    """Where a finished request's time went, on the engine's clock (time.monotonic): waiting for
    a step, computing its prompt up to the first token, then decoding to the end."""
    arrival: float
    scheduled: float | None  # None: never admitted (aborted while it waited)
    first_token: float | None
    finished: float


@dataclass
class TextState:
    """Incremental detokenisation (byte-level BPE may split a character across tokens, so text is
    only released once it decodes cleanly) plus stop-string hold-back."""
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    emitted: int = 0  # characters of `text` already sent
    emitted_tokens: int = 0
    emitted_logprobs: int = 0
    sent_prompt_logprobs: bool = False
    stop_text_found: bool = False
    stop_floor: int = 0  # text before min_tokens was reached: no stop string may start there
    ids: list[int] = field(default_factory=list)  # output ids that carry text (specials skipped)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.states: dict[int, TextState] = {}

    def _append_text(self, seq: Sequence, state: TextState) -> None:
        token = seq.last_known_token
        if token in self.tokenizer.special_ids:
            return
        ids = state.ids
        ids.append(token)
        full = self.tokenizer.decode(ids[state.prefix_offset:])
        if full.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        prev = self.tokenizer.decode(ids[state.prefix_offset:state.read_offset])
        state.text += full[len(prev):]
        state.prefix_offset = state.read_offset
        state.read_offset = len(ids)

    def _check_stop(self, seq: Sequence, state: TextState, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            # Before min_tokens nothing ends a request, as in vLLM: the sampler masks EOS and stop
            # ids, stop strings are not matched, and min_tokens <= max_tokens fits the context.
            state.stop_floor = len(state.text)
            return None
        if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if p.stop:
            window = max(len(s) for s in p.stop) + 16
            start = max(state.stop_floor, state.emitted - window)
            hits = [(state.text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                state.text = state.text[: i + len(s)] if p.include_stop_str_in_output else state.text[:i]
                state.stop_text_found = True
                return "stop"
        if seq.num_output_tokens >= p.max_tokens:
            return "length"
        if seq.num_known_tokens >= self.max_model_len:
            return "length"
        return None

    def on_token(self, seq: Sequence) -> RequestOutput:
        """Account for the newest known token of `seq`; sets `seq.finish_reason` when it stops."""
        self.advance(seq)
        return self.emit(seq)

    def advance(self, seq: Sequence) -> bool:
        """Take in the newest known token of `seq` without emitting it (a verify step appends
        several before one output); True when it ends the request."""
        state = self.states.setdefault(seq.seq_id, TextState())
        token = seq.last_known_token
        if seq.params.detokenize:
            self._append_text(seq, state)
        reason = self._check_stop(seq, state, token)
        if reason is not None:
            seq.finish_reason = reason
            if not state.stop_text_found:
                # Flush text held back for an incomplete character at the very end.
                ids = state.ids
                if len(ids) != state.read_offset:
                    tail = self.tokenizer.decode(ids[state.prefix_offset:])
                    prev = self.tokenizer.decode(ids[state.prefix_offset:state.read_offset])
                    state.text += tail[len(prev):]
        return reason is not None

    def emit(self, seq: Sequence) -> RequestOutput:
        """What `seq` produced since its last output."""
        return self._emit(seq, self.states.setdefault(seq.seq_id, TextState()))

    def finish_without_token(self, seq: Sequence, reason: str) -> RequestOutput:
        """A request that ends with no new token (aborted, or echo-only with max_tokens 0)."""
        seq.finish_reason = reason
        return self._emit(seq, self.states.setdefault(seq.seq_id, TextState()))

    def _emit(self, seq: Sequence, state: TextState) -> RequestOutput:
        finished = seq.finish_reason is not None
        limit = len(state.text)
        if not finished and seq.params.stop:
            # Hold back what could still turn out to be the start of a stop string.
            limit = max(state.emitted, limit - (max(len(s) for s in seq.params.stop) - 1))
        new_text = state.text[state.emitted:limit]
        state.emitted = limit
        new_tokens = seq.token_ids[seq.num_prompt_tokens + state.emitted_tokens:seq.num_known_tokens]
        state.emitted_tokens = seq.num_output_tokens
        new_lps = seq.logprobs[state.emitted_logprobs:]
        state.emitted_logprobs = len(seq.logprobs)
        prompt_lps = None
        if seq.wants_prompt_logprobs and not state.sent_prompt_logprobs:
            prompt_lps = list(seq.prompt_logprobs)
            state.sent_prompt_logprobs = True
        if finished:
            self.states.pop(seq.seq_id, None)
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_tokens, new_text=new_text, new_logprobs=new_lps,
            finished=finished, finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=prompt_lps,
            phases=RequestPhases(seq.arrival_time, seq.scheduled_time, seq.first_token_time, time.monotonic())
            if finished else None)

    def text_of(self, seq: Sequence) -> str:
        state = self.states.get(seq.seq_id)
        return state.text if state else ""

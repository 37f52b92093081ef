"""The receipt: everything one request did, as the client saw it and as the server counted it.

Times are integer nanoseconds on `time.perf_counter_ns()`'s clock (CLOCK_MONOTONIC on Linux), so
they compare across processes on one host. Token counts come from the server's `usage`, or, for an
engine that streams none, from its tokenizer endpoint once the capability probe checked it
(`usage_counted_by`); chunks are counted for timing, never as tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# How far behind the arrival of a stream's bytes the client's code may fall before it no longer
# vouches for the stream's timing (a stall that long can hide coalesced or late-stamped chunks).
DEFAULT_LATE_READ_MS = 50.0


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's logprob and its alternatives, the same shape for both endpoints."""

    token: str
    logprob: float
    top: dict[str, float]


@dataclass(slots=True)
class Receipt:
    """One request. Arrival times (token chunks, first and last token, done) are when the bytes
    reached this host, not when the client's code got to them (lab/instruments/client.py)."""

    request_id: str  # also sent as the X-Request-Id header, so server logs can be matched
    endpoint: str  # "/v1/chat/completions" or "/v1/completions"
    payload: dict[str, Any]  # exactly the body that was sent
    t_queued_ns: int  # handed to the client (before any wait for a concurrency slot)
    t_sent_ns: int | None = None  # just before the request's first byte was written
    t_first_token_ns: int | None = None  # first chunk carrying generated text or a token
    t_last_token_ns: int | None = None
    t_done_ns: int | None = None  # the response's last bytes arrived, or it failed
    # Arrival of every chunk that carried generated tokens; for a stream only.
    token_times_ns: list[int] = field(default_factory=list)
    # Tokens carried by each of those chunks, when the server put a running `usage` on every
    # chunk (vLLM's `continuous_usage_stats`); None otherwise.
    chunk_tokens: list[int] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_present: bool = False
    # The tokenizer route that counted prompt and completion tokens, where the stream carried no usage.
    usage_counted_by: str | None = None
    cached_tokens_present: bool = False
    text: str = ""
    reasoning_text: str = ""  # `reasoning_content` / `reasoning` deltas of reasoning models
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    status: int | None = None
    error: str | None = None
    # A non-streamed (or error) body as parsed, or a stream's last chunk that carried `usage`:
    # whatever else the server reported, kept for the store.
    response: Any = None
    response_id: str | None = None
    opened_connection: bool = False  # False when a kept-alive connection carried it
    # Worst delay between bytes of the response reaching this host and the client's code reading
    # them: how far the client itself fell behind.
    read_lag_max_ns: int = 0
    # Why the client cannot vouch for this stream's per-token timing (`unvouched_reason`), or None.
    unvouched: str | None = None

    # The store's writer (lab/store/writer.py) reads these names.
    @property
    def t_first_ns(self) -> int | None:
        return self.t_first_token_ns

    @property
    def t_last_ns(self) -> int | None:
        return self.t_last_token_ns

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def queue_ns(self) -> int | None:
        """Time spent waiting in the client before being sent."""
        return None if self.t_sent_ns is None else self.t_sent_ns - self.t_queued_ns

    @property
    def ttft_ns(self) -> int | None:
        if self.t_first_token_ns is None or self.t_sent_ns is None:
            return None
        return self.t_first_token_ns - self.t_sent_ns

    @property
    def e2e_ns(self) -> int | None:
        """From send to the end of the response (queue time is separate, in `queue_ns`)."""
        if self.t_done_ns is None or self.t_sent_ns is None:
            return None
        return self.t_done_ns - self.t_sent_ns

    @property
    def inter_token_latencies_ns(self) -> list[float]:
        """Latency of every token after the first chunk's. A chunk carrying k tokens (known only
        from a running `usage`) spreads its gap over k entries; otherwise each gap between chunk
        arrivals is one entry."""
        times = self.token_times_ns
        gaps = [b - a for a, b in zip(times, times[1:])]
        if self.chunk_tokens is None:
            return [float(g) for g in gaps]
        return [g / k for g, k in zip(gaps, self.chunk_tokens[1:]) for _ in range(k)]

    @property
    def coalesced_chunks(self) -> int:
        """Token chunks that reached the client in one read with the next token chunk, so they
        carry its arrival time: an upper bound on their own. Non-zero means the client stopped
        reading for longer than the gap between those tokens."""
        times = self.token_times_ns
        return sum(a == b for a, b in zip(times, times[1:]))

    def unvouched_reason(self, late_read_ns: int) -> str | None:
        """Why this stream's per-token times are not the client's to vouch for, or None: chunks
        that arrived coalesced (they carry a later chunk's time, so a first token stamped late
        inflates the stream's tok/s), or a read that fell behind arrival by more than the bound."""
        if not self.token_times_ns:
            return None
        why = []
        if (coalesced := self.coalesced_chunks):
            why.append(f"{coalesced} of {len(self.token_times_ns)} token chunks arrived coalesced with the next "
                       "(their times are upper bounds)")
        if self.read_lag_max_ns > late_read_ns:
            why.append(f"the client read its bytes up to {self.read_lag_max_ns / 1e6:.1f} ms after they arrived "
                       f"(bound {late_read_ns / 1e6:g} ms)")
        return "; ".join(why) or None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second after the first chunk, counted by the server's `usage`."""
        if self.t_first_token_ns is None or self.t_last_token_ns is None or not self.usage_present:
            return None
        span = self.t_last_token_ns - self.t_first_token_ns
        first = self.chunk_tokens[0] if self.chunk_tokens else 1
        if span <= 0 or self.completion_tokens <= first:
            return None
        return (self.completion_tokens - first) * 1e9 / span

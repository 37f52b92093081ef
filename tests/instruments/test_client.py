"""The streaming client against a scripted server in another process that records when it wrote
every chunk (tests/instruments/fake_sse_server.py).

Timing is judged against what the server actually did, timestamped by the server around each
send(), never against the script: a server that wakes late on a busy machine moves the truth with
it, so its scheduling noise is not counted as client error.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
from collections.abc import Iterator
from typing import Any

import pytest
from fake_sse_server import FakeServer, arrival_offsets_ns

from lab.instruments import client as client_module
from lab.instruments.client import StreamingClient
from lab.instruments.receipt import Receipt, TokenLogprob

MS = 1_000_000


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    with FakeServer() as fake:
        yield fake


def run_all(url: str, payloads: list[dict[str, Any]], concurrency: int,
            **kwargs: Any) -> list[Receipt]:
    client_kwargs = {k: kwargs.pop(k) for k in ("timeout", "max_connections") if k in kwargs}

    async def go() -> list[Receipt]:
        async with StreamingClient(url, **client_kwargs) as client:
            return await client.run_all(payloads, concurrency, **kwargs)

    return asyncio.run(go())


def chat(tokens: int = 8, **script: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": "three word prompt"}],
            "max_tokens": tokens, "x_fake": script}


def text_of(n: int) -> str:
    return "".join(f"t{i} " for i in range(n))


def test_timing_matches_the_servers_writes_at_64_streams(server: FakeServer) -> None:
    """Statistic asserted: for every token chunk of all 64 streams, the client's arrival time lies
    within 1 ms of the interval in which the server wrote it (so TTFT, which is the first chunk's
    arrival minus the client's own send time, is within 1 ms too), and every inter-token latency is
    within 1 ms of the server's. Chunks the client itself reports as coalesced (read together with
    the next token chunk, after it stopped reading for longer than their gap) are exempt from the
    1 ms bound, must never be early, and must stay rare: gaps here are 30-60 ms, so only an OS
    stall of the client that long produces one (a client that stamped per request rather than
    per read would coalesce nearly all)."""
    server.reset()
    payloads = []
    for i in range(64):
        gaps = [30, 45, 35, 60]
        payloads.append(chat(24, ttft_ms=150 + 7 * (i % 10), itl_ms=gaps[i % 4:] + gaps[:i % 4]))
    receipts = run_all(server.url, payloads, 64)
    truth = server.truth()
    assert truth["max_active"] == 64

    offsets, itl_errors, coalesced = [], [], 0
    for receipt in receipts:
        assert receipt.error is None
        record = truth["requests"][receipt.request_id]
        token_writes = [w for w in record["writes"] if w["kind"] == "token"]
        assert len(receipt.token_times_ns) == len(token_writes) == 24
        assert receipt.t_queued_ns <= receipt.t_sent_ns < record["received_ns"]
        own = arrival_offsets_ns(receipt.token_times_ns, record)
        assert min(own) >= 0, "a chunk stamped before the server wrote it"
        times = receipt.token_times_ns
        exact = [i == len(times) - 1 or times[i] != times[i + 1] for i in range(len(times))]
        coalesced += receipt.coalesced_chunks
        offsets += [o for o, e in zip(own, exact) if e]
        # The server's inter-token latency, read at the points of its write intervals nearest
        # the client's stamps, differs from the client's by the change in offset.
        itl_errors += [b - a for a, b, ea, eb in zip(own, own[1:], exact, exact[1:]) if ea and eb]
        if exact[0]:
            # TTFT against the server's: from this request's send to the first token's write.
            first = token_writes[0]
            assert first["t0"] - receipt.t_sent_ns <= receipt.ttft_ns \
                <= first["t1"] - receipt.t_sent_ns + MS
    summary = (f"offsets ms: median {statistics.median(offsets) / MS:.4f}, "
               f"max {max(offsets) / MS:.4f}; coalesced {coalesced} of {64 * 24}")
    assert max(offsets) <= MS, summary
    assert max(abs(e) for e in itl_errors) <= MS, summary
    # A client that stamped per request would coalesce 23 of every 24 chunks. On two cores shared
    # with the rest of the suite, stalls of the client over 30 ms coalesced 15 % in one full run
    # (236 of 1,536), while the test run alone passed the old bound; a quarter still tells the two apart.
    assert coalesced <= 0.25 * 64 * 24, summary


def test_token_counts_come_from_usage_not_from_chunks(server: FakeServer) -> None:
    plain, running = run_all(server.url, [
        chat(10, tokens_per_chunk=3, itl_ms=20, cached_tokens=2),
        {**chat(10, tokens_per_chunk=3, itl_ms=20),
         "stream_options": {"continuous_usage_stats": True}},
    ], 2)
    for receipt in (plain, running):
        assert receipt.error is None
        assert len(receipt.token_times_ns) == 4
        assert receipt.completion_tokens == 10
        assert receipt.prompt_tokens == 3
        assert receipt.text == text_of(10)
        assert receipt.payload["stream_options"]["include_usage"] is True
    assert (plain.cached_tokens, plain.cached_tokens_present) == (2, True)
    assert (running.cached_tokens, running.cached_tokens_present) == (0, False)

    span = plain.t_last_token_ns - plain.t_first_token_ns
    assert plain.chunk_tokens is None
    assert plain.decode_tokens_per_s == pytest.approx(9 * 1e9 / span)
    # With a running count the first chunk's 3 tokens are known, and each gap is spread over
    # the tokens of the chunk it led to.
    span = running.t_last_token_ns - running.t_first_token_ns
    assert running.chunk_tokens == [3, 3, 3, 1]
    assert running.decode_tokens_per_s == pytest.approx(7 * 1e9 / span)
    itl = running.inter_token_latencies_ns
    assert len(itl) == 7 and sum(itl) == pytest.approx(span)
    assert itl[0] == itl[1] == itl[2]


def test_queue_time_is_recorded_when_concurrency_is_limited(server: FakeServer) -> None:
    server.reset()
    payloads = [chat(3 + i, ttft_ms=60, itl_ms=20) for i in range(6)]
    receipts = run_all(server.url, payloads, 2)
    assert server.truth()["max_active"] == 2
    assert [r.completion_tokens for r in receipts] == [3, 4, 5, 6, 7, 8]  # input order
    done = []
    for i, receipt in enumerate(receipts):
        assert receipt.error is None
        assert receipt.t_queued_ns == receipts[0].t_queued_ns  # all handed over at the call
        if i >= 2:
            # It can only leave once i - 1 earlier requests have finished, and its wait shows.
            assert receipt.t_sent_ns > sorted(done)[i - 2]
            assert receipt.queue_ns >= sorted(done)[i - 2] - receipt.t_queued_ns
        done.append(receipt.t_done_ns)
        in_flight = sum(r.t_sent_ns <= receipt.t_sent_ns < r.t_done_ns for r in receipts)
        assert in_flight <= 2
    assert receipts[5].queue_ns > 2 * 100 * MS


def test_offsets_hand_requests_over_later_and_queue_time_counts_from_then(
        server: FakeServer) -> None:
    long, short = run_all(server.url, [chat(10, ttft_ms=300, itl_ms=20), chat(2, ttft_ms=5)], 1,
                          offsets_s=[0.0, 0.1])
    assert long.error is None and short.error is None
    assert short.t_queued_ns - long.t_queued_ns == 100 * MS
    # The only slot is busy until the long request ends, so the short one waits from its hand-over.
    assert short.t_sent_ns > long.t_done_ns
    assert short.queue_ns == short.t_sent_ns - short.t_queued_ns >= long.t_done_ns - \
        short.t_queued_ns

    long, short = run_all(server.url, [chat(10, ttft_ms=300, itl_ms=20), chat(2, ttft_ms=5)], 2,
                          offsets_s=[0.0, 0.1])
    truth = server.truth()["requests"]
    assert truth[short.request_id]["received_ns"] - long.t_queued_ns >= 100 * MS
    assert short.t_done_ns < long.t_first_token_ns  # it ran beside the long one, not after


def test_failures_become_receipts_and_the_batch_completes(server: FakeServer) -> None:
    payloads = [
        chat(4),
        chat(4, fail="status_500"),
        {**chat(4, fail="status_500"), "stream": False},
        chat(6, fail="malformed"),
        chat(6, fail="error_event"),
        chat(6, fail="drop"),
        chat(6, fail="stall"),
        chat(4),
    ]
    receipts = run_all(server.url, payloads, 4, timeout=1.0)
    ok, s500, s500_whole, malformed, event, drop, stall, ok_again = receipts
    for receipt in (ok, ok_again):
        assert receipt.error is None and receipt.text == text_of(4)
    for receipt in (s500, s500_whole):
        assert receipt.status == 500 and receipt.error == "HTTP 500: scripted failure"
    assert malformed.error.startswith("malformed stream chunk")
    assert event.error == "error event in stream: scripted mid-stream failure"
    assert "incomplete chunked read" in drop.error
    assert stall.error.startswith("ReadTimeout")
    for receipt in (malformed, event, drop, stall):
        assert receipt.status == 200
        assert receipt.text == text_of(2)  # what arrived before the failure is kept
        assert len(receipt.token_times_ns) == 2
        assert receipt.t_done_ns is not None


def test_an_unreachable_server_gives_error_receipts() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        receipts = run_all(f"http://127.0.0.1:{port}", [chat(2), chat(2)], 2)
    assert [r.error.split(":")[0] for r in receipts] == ["ConnectError", "ConnectError"]
    assert all(r.t_sent_ns is None and r.ttft_ns is None for r in receipts)


def test_events_split_mid_line_are_stamped_when_their_line_completes(server: FakeServer) -> None:
    receipt, crlf = run_all(server.url, [chat(5, split_ms=15, itl_ms=30),
                                         chat(5, crlf=True)], 2)
    record = server.truth()["requests"][receipt.request_id]
    assert receipt.error is None and receipt.text == text_of(5)
    # Each event's first half went out 15 ms before its second: a stamp from the first half
    # would be 15 ms early.
    assert all(0 <= o <= MS for o in arrival_offsets_ns(receipt.token_times_ns, record))
    assert crlf.error is None and crlf.text == text_of(5) and crlf.completion_tokens == 5


def test_completions_non_streaming_and_logprobs(server: FakeServer) -> None:
    completion, whole_chat, chat_lp = run_all(server.url, [
        {"model": "fake", "prompt": "a b c d", "max_tokens": 3, "logprobs": 2},
        {**chat(3), "stream": False},
        {**chat(2), "logprobs": True, "top_logprobs": 1},
    ], 3)
    assert completion.endpoint == "/v1/completions"
    assert completion.text == text_of(3) and completion.prompt_tokens == 4
    assert completion.finish_reason == "length"
    assert completion.logprobs == [
        TokenLogprob("t0 ", -0.25, {"t0 #0": -0.25, "t0 #1": -1.25}),
        TokenLogprob("t1 ", -0.5, {"t1 #0": -0.5, "t1 #1": -1.5}),
        TokenLogprob("t2 ", -0.75, {"t2 #0": -0.75, "t2 #1": -1.75}),
    ]
    assert whole_chat.error is None and whole_chat.text == text_of(3)
    assert whole_chat.completion_tokens == 3 and whole_chat.token_times_ns == []
    assert whole_chat.ttft_ns is None and whole_chat.e2e_ns > 0
    assert "stream_options" not in whole_chat.payload
    assert chat_lp.logprobs == [TokenLogprob("t0 ", -0.25, {"t0 #0": -0.25}),
                                TokenLogprob("t1 ", -0.5, {"t1 #0": -0.5})]


def test_a_response_larger_than_the_read_ahead_arrives_whole(
        server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # A connection stops reading past this many unread bytes and resumes as they are consumed.
    monkeypatch.setattr(client_module, "_MAX_BUFFERED", 4096)
    whole, streamed = run_all(server.url, [{**chat(20000, itl_ms=0), "stream": False},
                                           chat(3000, itl_ms=0)], 2)
    assert whole.error is None and whole.text == text_of(20000)
    assert streamed.error is None and streamed.text == text_of(3000)


def test_connections_are_kept_alive_across_requests(server: FakeServer) -> None:
    async def go() -> tuple[list[Receipt], list[Receipt]]:
        async with StreamingClient(server.url + "/v1/") as client:
            first = await client.run_all([chat(2) for _ in range(8)], 8)
            second = await client.run_all([chat(2) for _ in range(8)], 8)
            return first, second

    first, second = asyncio.run(go())
    assert all(r.opened_connection for r in first)
    assert not any(r.opened_connection for r in second)
    assert all(r.error is None for r in first + second)


def test_concurrency_beyond_the_pool_is_refused(server: FakeServer) -> None:
    with pytest.raises(ValueError, match="max_connections"):
        run_all(server.url, [chat(2)], 9, max_connections=8)

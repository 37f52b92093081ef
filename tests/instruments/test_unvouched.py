"""Streams the client cannot vouch for: chunks a server coalesced, or bytes the client read late, are
marked in the stored receipt; decode cells count them, and `unvouched: exclude` leaves them out of
the per-stream figures. Against the scripted-timing server, through the store `lab run` writes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.instruments.client import StreamingClient
from lab.instruments.decode import DecodeInstrument
from lab.store.db import open_store
from tests.instruments.fake_sse_server import FakeServer
from tests.instruments.speed_boot import SpeedBench, Stored


@pytest.fixture(scope="module")
def bursty() -> Iterator[FakeServer]:
    """Every second completion is written two token events per send, as a coalescing proxy would."""
    # Token gaps of 25 ms: only a client stall that long coalesces a clean stream by accident.
    with FakeServer(script={"burst": 2, "burst_every": 2, "itl_ms": 25, "ttft_ms": 5}) as server:
        yield server


def chat(tokens: int, **script: object) -> dict[str, object]:
    return {"model": "fake", "messages": [{"role": "user", "content": "a prompt"}], "max_tokens": tokens,
            "x_fake": script}


def test_coalesced_and_late_streams_are_marked_and_clean_ones_are_not(bursty: FakeServer) -> None:
    async def go() -> list:
        async with StreamingClient(bursty.url, late_read_ms=50) as client:
            clean = await client.request(chat(8, burst=1))
            coalesced = await client.request(chat(8, burst=4))
            # The client's own event loop stalls for 300 ms just after sending: the whole 4-token stream
            # arrives meanwhile and is read in one piece, long after it came.
            request = asyncio.create_task(client.request(chat(4, burst=1)))
            await asyncio.sleep(0.002)
            time.sleep(0.3)
            return [clean, coalesced, await request]

    clean, coalesced, late = asyncio.run(go())
    assert clean.error is None and clean.coalesced_chunks == 0 and clean.unvouched is None
    assert coalesced.coalesced_chunks == 6  # two sends of four events: three shared stamps each
    assert coalesced.unvouched == "6 of 8 token chunks arrived coalesced with the next (their times are upper bounds)"
    assert late.read_lag_max_ns > 50e6 and "the client read its bytes up to" in late.unvouched
    assert "(bound 50 ms)" in late.unvouched


def measure(server: FakeServer, tmp_path: Path, **params: object) -> Stored:
    server.reset()  # completions are counted from here: the probe is the first, the streams 2-9
    store = open_store(str(tmp_path / "lab.db"))
    try:
        return SpeedBench(store, server=None).measure(  # type: ignore[arg-type]
            DecodeInstrument(), {"levels": [2], "max_tokens": 8, **params}, salt="unvouched",
            base_url=server.url, model="fake")
    finally:
        store.close()


def test_decode_cells_count_unvouched_streams_and_the_receipts_say_why(bursty: FakeServer, tmp_path: Path) -> None:
    stored = measure(bursty, tmp_path)
    stream = stored.cell("stream_tok_s", level=2)
    requests = stored.requests_of(stream)
    marked = [r for r in requests if r.unvouched is not None]
    assert len(requests) == 8 and len(marked) == 4  # completions 2, 4, 6, 8 of the server
    assert all("4 of 8 token chunks arrived coalesced" in r.unvouched for r in marked)
    assert stream.valid and stream.unvouched_streams == 4 and "4 of 8 streams unvouched (first: " in stream.note
    assert stored.cell("agg_tok_s", level=2).unvouched_streams == 4
    per_category = stored.of("category_stream_tok_s")
    assert sorted(c.unvouched_streams for c in per_category) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(c.valid for c in per_category)


def test_exclude_leaves_unvouched_streams_out_of_the_per_stream_figures(bursty: FakeServer, tmp_path: Path) -> None:
    stored = measure(bursty, tmp_path, unvouched="exclude")
    stream = stored.cell("stream_tok_s", level=2)
    kept = stored.requests_of(stream)
    assert len(kept) == 4 and all(r.unvouched is None for r in kept) and stream.unvouched_streams == 0
    assert stream.value == pytest.approx(sum((r.completion_tokens - 1) * 1e9 / (r.t_last_ns - r.t_first_ns)
                                             for r in kept) / 4)
    assert "4 of 8 streams unvouched, excluded" in stream.note
    assert len(stored.requests_of(stored.cell("ttft_s", level=2))) == 4
    aggregate = stored.cell("agg_tok_s", level=2)  # wall clock: every token still counts
    assert aggregate.valid and len(stored.requests_of(aggregate)) == 8 and aggregate.unvouched_streams == 4
    per_category = stored.of("category_stream_tok_s")
    emptied = [c for c in per_category if not c.valid]
    assert len(emptied) == 4 and {c.note for c in emptied} == {"every stream was unvouched and excluded"}

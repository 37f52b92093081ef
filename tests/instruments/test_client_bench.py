"""Benchmark: the streaming client's timing error and CPU cost at 256 concurrent streams.

`pytest tests/instruments/test_client_bench.py --benchmark-enable` prints the figures and stores
them in the benchmark's `extra_info`; under the project's default `--benchmark-disable` the batch
still runs once and its sanity checks hold.

The workload is a steady decode: 256 streams of 48 tokens, 20 tokens/s each (gaps of 40-60 ms),
5,120 chunks/s in all, after a first token at 400-475 ms (by then all 256 requests are out, as
behind a real engine's prefill). It runs twice: with the kernel's receive timestamps (the
default) and with arrival stamped in the event loop's I/O callback, to show what the first buys.
Timing error is each token chunk's arrival time minus the end of the server's write of it
(`arrival_offsets_ns`), over all chunks.
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_sse_server import FakeServer, arrival_offsets_ns

from lab.instruments.client import StreamingClient
from lab.instruments.receipt import Receipt

STREAMS = 256
TOKENS = 48
GAPS_MS = [40, 60, 50, 50]
MS = 1e6


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    with FakeServer() as fake:
        yield fake


def _payload(i: int, tokens: int, ttft_ms: float) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": f"stream {i}"}],
            "max_tokens": tokens,
            "x_fake": {"ttft_ms": ttft_ms, "itl_ms": GAPS_MS[i % 4:] + GAPS_MS[:i % 4]}}


async def _batch(url: str, kernel_timestamps: bool) -> tuple[list[Receipt], dict[str, float]]:
    async with StreamingClient(url, max_connections=STREAMS,
                               kernel_timestamps=kernel_timestamps) as client:
        # Open the 256 keep-alive connections first: the figures are for streaming, not connects.
        await client.run_all([_payload(i, 1, 1) for i in range(STREAMS)], STREAMS)
        payloads = [_payload(i, TOKENS, 400 + 5 * (i % 16)) for i in range(STREAMS)]
        before, cpu_before = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        receipts = await client.run_all(payloads, STREAMS)
        cpu_s = time.process_time() - cpu_before
        after = resource.getrusage(resource.RUSAGE_SELF)
    return receipts, {"cpu_s": cpu_s, "user_s": after.ru_utime - before.ru_utime,
                      "sys_s": after.ru_stime - before.ru_stime}


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@pytest.mark.parametrize("kernel_timestamps", [True, False], ids=["kernel-stamps", "loop-stamps"])
def test_timing_error_and_cpu_at_256_streams(benchmark: Any, server: FakeServer,
                                             request: pytest.FixtureRequest,
                                             capsys: pytest.CaptureFixture[str],
                                             kernel_timestamps: bool) -> None:
    server.reset()
    receipts, cpu = benchmark.pedantic(
        lambda: asyncio.run(_batch(server.url, kernel_timestamps)), rounds=1, iterations=1)
    truth = server.truth()
    assert truth["max_active"] == STREAMS

    offsets: list[float] = []
    for receipt in receipts:
        assert receipt.error is None
        assert receipt.completion_tokens == len(receipt.token_times_ns) == TOKENS
        offsets += arrival_offsets_ns(receipt.token_times_ns, truth["requests"][receipt.request_id])
    offsets.sort()
    chunks = len(offsets)
    sent = [r.t_sent_ns for r in receipts]
    figures = {
        "chunks": chunks,
        "error_median_ms": statistics.median(offsets) / MS,
        "error_p99_ms": _quantile(offsets, 0.99) / MS,
        "error_max_ms": offsets[-1] / MS,
        "coalesced_chunks": sum(r.coalesced_chunks for r in receipts),
        "read_lag_max_ms": max(r.read_lag_max_ns for r in receipts) / MS,
        "send_burst_ms": (max(sent) - min(sent)) / MS,
        "cpu_ms_per_1k_chunks": cpu["cpu_s"] * 1e6 / chunks,
        "user_ms_per_1k_chunks": cpu["user_s"] * 1e6 / chunks,
        "sys_ms_per_1k_chunks": cpu["sys_s"] * 1e6 / chunks,
    }
    benchmark.extra_info.update(figures)
    if not benchmark.disabled:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        with capsys.disabled():
            reporter.ensure_newline()
            reporter.write_line(f"client at {STREAMS} streams, "
                                f"{'kernel' if kernel_timestamps else 'loop'} stamps: " +
                                ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in figures.items()))
    assert offsets[0] >= 0, "a chunk stamped before the server wrote it"
    if kernel_timestamps:
        assert figures["error_median_ms"] < 1.0, figures

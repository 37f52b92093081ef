"""The bundled server under overload (the fault suite's overload case, docs/faults.md), on the CPU
with SmolLM2 and a KV pool of 256 tokens, driven by benchmarks/overload.py as a user runs it: the
requests it queues need at least twice the pool, and more arrive than its queue takes. Every
request is served in full or refused with an OpenAI error, 503 with Retry-After (a stream too,
before its response starts); none hangs; the KV pool is never overrun and the process holds no
more memory than after one request; /v1/stats counts the queue, the preemptions and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.benchmarks.scripts import BENCHMARKS, ROOT
from tests.engine.server_process import engine_server

KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, float32
POOL_TOKENS = 256
MAX_WAITING = 3
PROMPT, MAX_TOKENS = 100, 32
FLAGS = ("--model", "smollm2-135m", "--device", "cpu", "--dtype", "float32", "--max-model-len", str(POOL_TOKENS),
         "--kv-cache-memory-bytes", str(POOL_TOKENS * KV_BYTES_PER_TOKEN), "--max-num-seqs", "8",
         "--max-waiting", str(MAX_WAITING))


@pytest.mark.slow
def test_requests_twice_the_kv_pool_are_served_or_refused_with_retry_after_and_none_hangs(tmp_path: Path) -> None:
    out = tmp_path / "overload.json"
    with engine_server(tmp_path, *FLAGS, timeout=300) as server:
        # One request of the same shape first: what the process holds once it has served one.
        warm = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "smollm2-135m", "prompt": list(range(1000, 1000 + PROMPT)), "max_tokens": MAX_TOKENS})
        assert warm.status_code == 200
        rss_warm = server.stats()["rss_bytes"]
        done = subprocess.run([sys.executable, str(BENCHMARKS / "overload.py"), "--url", server.url, "--requests", "6",
                               "--streams", "3", "--prompt-tokens", str(PROMPT), "--max-tokens", str(MAX_TOKENS),
                               "--timeout", "300", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=400)
        rss_after = server.stats()["rss_bytes"]
    assert done.returncode == 0, done.stdout + done.stderr  # no rule of the script's was broken
    # Queueing, preempting and refusing cost the process no memory beyond what one request took.
    assert rss_after - rss_warm < 64 << 20, (rss_warm, rss_after)
    report = json.loads(out.read_text())
    assert report["violations"] == [] and report["requests"] == 9
    assert report["served"] >= 1 and report["refused"] >= 1 and report["refused_streams"] >= 1
    assert report["served"] + report["refused"] == 9  # none hung, none got anything else
    # The queue and what runs beside it need at least twice the pool.
    assert (MAX_WAITING + 1) * (PROMPT + MAX_TOKENS) >= 2 * POOL_TOKENS
    assert report["pool_tokens"] == POOL_TOKENS and report["max_blocks_in_use"] <= report["pool_blocks"]
    # The queue filled; requests preempted back into it may take it past --max-waiting, new ones never.
    assert report["max_waiting_seen"] >= MAX_WAITING and report["longest_queue_wait_s"] > 0
    assert report["preemptions"] >= 1 and report["refused_by_stats"] == report["refused"]
    for r in report["results"]:
        if r["status"] == 503:
            assert r["error"]["type"] == "service_unavailable"
            assert r["error"]["message"] == (f"{MAX_WAITING} requests are already waiting (--max-waiting "
                                             f"{MAX_WAITING}); retry later")
    last = report["samples"][-1]
    assert last["kv_pool"]["bytes"] <= POOL_TOKENS * KV_BYTES_PER_TOKEN  # the configured pool, not more
    assert (last["queue"]["waiting"], last["running"], last["queue"]["max_waiting"]) == (0, 0, MAX_WAITING)
    assert last["queue"]["retry_after_s"] >= 1

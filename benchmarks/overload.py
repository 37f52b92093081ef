"""The bundled server under overload: more requests than its KV pool holds and its queue takes.

Sends `--requests` completions of `--prompt-tokens` token ids, each run to `--max-tokens`
(ignore_eos), one every `--spacing-ms` (so the queue fills as requests leave it for a step, as under
a steady crowd), then `--streams` streamed ones as soon as /v1/stats shows the waiting queue full,
while it samples /v1/stats every 100 ms. The rules it checks, each broken one a line
of `violations` and exit status 1: every request is served in full (a stream to `[DONE]`, no error
event) or refused with 503, an OpenAI error body and a Retry-After of at least 1 s (a stream too,
before its response starts); none runs past `--timeout`; the KV blocks in use never exceed the
pool; /v1/stats counts every refusal. It prints one JSON summary (`--json PATH` also writes it,
with every request's outcome and the stats samples).

Usage: start `python -m lab.engine serve ... --max-waiting N`, then
    python benchmarks/overload.py --url http://127.0.0.1:8000 --requests 32 --streams 8 --prompt-tokens 8192
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import httpx


async def ask(client: httpx.AsyncClient, model: str, i: int, prompt_tokens: int, max_tokens: int,
              stream: bool) -> dict[str, Any]:
    """One completion: its status, Retry-After, completion tokens, error and seconds taken."""
    body = {"model": model, "prompt": [1000 + 7 * i + j for j in range(prompt_tokens)], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    started = time.monotonic()
    got: dict[str, Any] = {"i": i, "stream": stream}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            raw = (await response.aread()).decode()
    except httpx.HTTPError as exc:
        return {**got, "status": None, "error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    got.update(status=response.status_code, retry_after=response.headers.get("retry-after"),
               seconds=time.monotonic() - started)
    if response.status_code == 200 and stream:
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        errors = [e["error"] for e in events if "error" in e]
        got.update(completion_tokens=(events[-1].get("usage") or {}).get("completion_tokens") if events else None,
                   done=raw.rstrip().endswith("data: [DONE]"), error=errors[0] if errors else None)
    else:
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {"error": {"message": f"not JSON: {raw[:200]!r}"}}
        got.update(completion_tokens=(parsed.get("usage") or {}).get("completion_tokens"), error=parsed.get("error"))
    return got


async def overload(url: str, requests: int, streams: int, prompt_tokens: int, max_tokens: int,
                   timeout_s: float, spacing_s: float) -> dict[str, Any]:
    """Every request's outcome and the /v1/stats samples taken meanwhile."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        samples: list[dict[str, Any]] = []

        async def sample() -> None:
            while True:
                samples.append((await client.get("/v1/stats")).json())
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample())
        started = time.monotonic()
        tasks = []
        for i in range(requests):
            tasks.append(asyncio.create_task(ask(client, model, i, prompt_tokens, max_tokens, False)))
            await asyncio.sleep(spacing_s)
        if streams:
            while not any(s["queue"]["waiting"] >= s["queue"]["max_waiting"] for s in samples):
                if all(t.done() for t in tasks):
                    break  # the queue never filled: the streams go anyway
                await asyncio.sleep(0.05)
            tasks += [asyncio.create_task(ask(client, model, requests + i, prompt_tokens, max_tokens, True))
                      for i in range(streams)]
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
            hung = 0
        except asyncio.TimeoutError:
            results = [t.result() for t in tasks if t.done() and not t.cancelled()]
            hung = len(tasks) - len(results)
        sampler.cancel()
        samples.append((await client.get("/v1/stats")).json())
        return {"model": model, "wall_s": time.monotonic() - started, "hung": hung, "results": results,
                "samples": samples, "max_tokens": max_tokens, "prompt_tokens": prompt_tokens}


def violations(report: dict[str, Any]) -> list[str]:
    """Each broken rule of the module docstring, one line each."""
    broken = []
    if report["hung"]:
        broken.append(f"{report['hung']} requests were still running after the timeout")
    refused = 0
    for r in report["results"]:
        what = f"request {r['i']}{' (stream)' if r['stream'] else ''}"
        if r["status"] == 200:
            if r["completion_tokens"] != report["max_tokens"]:
                broken.append(f"{what}: {r['completion_tokens']} tokens, not {report['max_tokens']}")
            if r["stream"] and (not r.get("done") or r.get("error")):
                broken.append(f"{what}: a 200 stream that ended with {r.get('error') or 'no [DONE]'}")
        elif r["status"] == 503:
            refused += 1
            if not (r["retry_after"] or "").isdigit() or int(r["retry_after"]) < 1:
                broken.append(f"{what}: 503 without a Retry-After of at least 1 s ({r['retry_after']!r})")
            if not isinstance(r.get("error"), dict) or not r["error"].get("message"):
                broken.append(f"{what}: 503 without an OpenAI error body")
        else:
            broken.append(f"{what}: status {r['status']}: {r.get('error')}")
    last = report["samples"][-1]
    pool = last["kv_pool"]["blocks"]
    most = max(s["blocks_in_use"] for s in report["samples"])
    if most > pool:
        broken.append(f"{most} KV blocks in use, more than the pool's {pool}")
    if last["queue"]["refused"] < refused:
        broken.append(f"/v1/stats counts {last['queue']['refused']} refusals, the clients saw {refused}")
    return broken


def summary(report: dict[str, Any]) -> dict[str, Any]:
    results, samples, last = report["results"], report["samples"], report["samples"][-1]
    served = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 503]
    demand = len(results) * (report["prompt_tokens"] + report["max_tokens"])
    waits = sorted(r["seconds"] for r in served)
    return {"requests": len(results) + report["hung"], "served": len(served), "refused": len(refused),
            "refused_streams": sum(r["stream"] for r in refused),
            "retry_after_s": sorted({int(r["retry_after"]) for r in refused if (r["retry_after"] or "").isdigit()}),
            "demand_tokens": demand, "pool_tokens": last["kv_pool"]["tokens"],
            "demand_over_pool": round(demand / last["kv_pool"]["tokens"], 2),
            "max_blocks_in_use": max(s["blocks_in_use"] for s in samples), "pool_blocks": last["kv_pool"]["blocks"],
            "max_waiting_seen": max(s["queue"]["waiting"] for s in samples),
            "longest_queue_wait_s": round(max(s["queue"]["oldest_wait_s"] for s in samples), 3),
            "preemptions": last["queue"]["preemptions"], "refused_by_stats": last["queue"]["refused"],
            "served_s_median": round(waits[len(waits) // 2], 3) if waits else None,
            "served_s_max": round(waits[-1], 3) if waits else None, "wall_s": round(report["wall_s"], 3),
            "violations": violations(report)}


def wait_healthy(url: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"overload.py: {url}/health did not answer in {wait_s:g} s")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's root")
    parser.add_argument("--requests", type=int, default=16, help="completions sent at once")
    parser.add_argument("--streams", type=int, default=4, help="streamed completions sent once the queue is full")
    parser.add_argument("--spacing-ms", type=float, default=20.0, help="between two of the first completions")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any request, and the whole, may take")
    parser.add_argument("--wait", type=float, default=600.0, help="seconds to wait for /health first")
    parser.add_argument("--json", metavar="PATH", help="also write the summary, every outcome and the samples here")
    args = parser.parse_args(argv)
    url = args.url.rstrip("/").removesuffix("/v1")
    wait_healthy(url, args.wait)
    report = asyncio.run(overload(url, args.requests, args.streams, args.prompt_tokens, args.max_tokens, args.timeout,
                                  args.spacing_ms / 1000))
    result = summary(report)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**result, "results": report["results"], "samples": report["samples"]}, out, indent=1)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the noise of "a short chat behind a long prefill" comes from, on the served engine.

The mixed instrument's chat waits for the whole long prefill (the long prompt fills each step's
token budget), so the chat's time to first token is the long prefill's time minus the delay, and
any scatter of that prefill lands on the chat, amplified by long / (long - delay). In the lab's
H200 runs the long prompt of the mixed probe scattered about twice as much, request to request,
as the same-length prompts of the prefill instrument. This script boots one engine and sends, in
interleaved rounds, the same kind of cold long prompt under each condition that differs between
the two instruments:

    alone      the long prompt by itself (as the prefill instrument sends it)
    after-chat a short chat first, then the long prompt (the mixed probe's order, nothing concurrent)
    chat       the long prompt, and `--delay` s later a short chat (the mixed probe)
    ids        the long prompt, and `--delay` s later a short completion given as token ids
               (no chat template, no tokenizer: only the scheduling of a second request)

Every long prompt is cold: fresh text, and the prefix cache is reset before it. Prints, per
condition, the median and the request-to-request spread (SD of the log) of the long prompt's
time to first token and of the short request's, and the server's garbage-collector pauses per
round (from its /v1/stats): a full collection that lands in a prefill delays it.

    python benchmarks/mixed_noise.py --model dummy:llama3-8b --device cuda --long-tokens 32000 --rounds 12 \\
        -- --dtype bfloat16 --max-model-len 40960 --max-num-batched-tokens 8192 --cuda-graph-max-batch-size 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from lab.instruments.client import StreamingClient
from lab.instruments.receipt import Receipt
from lab.runner.boot import EngineProcess, child_env, free_port

CONDITIONS = ("alone", "after-chat", "chat", "ids")
WORDS = ("harbour lantern meadow courier garden valley teacher kettle library frost market tower "
         "station wagon fence engineer baker chapel pantry village").split()


def seconds_to_first_token(receipt: Receipt) -> float:
    if receipt.error is not None or receipt.ttft_ns is None:
        raise RuntimeError(f"{receipt.endpoint}: {receipt.error or 'no token arrived'}")
    return receipt.ttft_ns / 1e9


async def one_round(client: StreamingClient, control: httpx.AsyncClient, model: str, condition: str,
                    long_text: str, short_ids: list[int], salt: str, delay: float) -> dict[str, float]:
    chat = {"model": model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "system", "content": f"Session {salt}. You are a helpful AI assistant."},
                         {"role": "user", "content": "In two or three sentences, why do leaves change colour?"}]}
    if condition == "after-chat":
        seconds_to_first_token(await client.request(chat))
    (await control.post("/reset_prefix_cache")).raise_for_status()
    before = await server_counters(control)
    payloads: list[dict] = [{"model": model, "prompt": long_text, "max_tokens": 1, "temperature": 0}]
    if condition in ("chat", "ids"):
        payloads.append(chat if condition == "chat" else
                        {"model": model, "prompt": short_ids, "max_tokens": 16, "temperature": 0})
    receipts = await client.run_all(payloads, 2, offsets_s=[0.0, delay][:len(payloads)])
    after = await server_counters(control)
    out = {"long_s": seconds_to_first_token(receipts[0]), "gc_ms": after[0] - before[0],
           "gc_full": after[1] - before[1], "device_allocs": after[2] - before[2]}
    if len(receipts) > 1:
        out["short_s"] = seconds_to_first_token(receipts[1])
    return out


async def server_counters(client: httpx.AsyncClient) -> tuple[float, int, int]:
    """(the server's garbage-collector pauses so far in ms, its full collections so far, the CUDA
    caching allocator's trips to the driver so far); zeros from an engine whose /v1/stats does not
    report them."""
    stats = (await client.get("/v1/stats")).json()
    gens = stats.get("gc", {}).get("generations", [])
    allocs = stats.get("allocator", {}).get("device_allocs", 0)
    return sum(g["pause_ms"] for g in gens), (gens[2]["collections"] if len(gens) > 2 else 0), allocs


def long_text(rng: random.Random, words: int) -> str:
    return f"Session {rng.getrandbits(48):012x}. " + " ".join(rng.choice(WORDS) for _ in range(words))


async def words_for(client: httpx.AsyncClient, model: str, tokens: int) -> int:
    """Words of filler that make about `tokens` tokens with this model's tokenizer (each condition
    draws its prompts from the same lengths; the exact count does not matter here)."""
    sample = long_text(random.Random(0), 1000)
    response = await client.post("/tokenize", json={"model": model, "prompt": sample})
    response.raise_for_status()
    return int(1000 * tokens / response.json()["count"])


async def measure(url: str, model: str, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    rng = random.Random(args.seed)
    found: dict[str, list[dict[str, float]]] = {c: [] for c in args.conditions}
    # The timed requests go through the lab's own streaming client (the mixed instrument's), the
    # engine's extra routes through a plain one.
    async with StreamingClient(url, max_connections=2) as client, \
            httpx.AsyncClient(base_url=url, timeout=600) as control:
        words = await words_for(control, model, args.long_tokens)
        # One warm-up of every condition: the first long prompt of a fresh engine is slower.
        for rnd in range(args.rounds + 1):
            order = list(args.conditions)
            rng.shuffle(order)
            for condition in order:
                text = long_text(rng, words)
                ids = [rng.randrange(100, 30000) for _ in range(60)]
                row = await one_round(client, control, model, condition, text, ids,
                                      f"{rng.getrandbits(48):012x}", args.delay)
                if rnd:
                    found[condition].append(row)
    return found


def spread(values: list[float]) -> tuple[float, float]:
    """(median, SD of the log as a percentage)."""
    logs = [math.log(v) for v in values]
    return statistics.median(values), 100 * statistics.stdev(logs) if len(logs) > 1 else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--long-tokens", type=int, default=1536)
    ap.add_argument("--delay", type=float, default=0.5, help="seconds after the long prompt that the short one goes")
    ap.add_argument("--rounds", type=int, default=12, help="measured rounds (one more, first, is a warm-up)")
    ap.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("engine_flags", nargs="*", help="more engine flags, after --")
    args = ap.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env, _ = child_env({})
    log = Path(tempfile.mkdtemp(prefix="mixed-noise-")) / "engine.log"
    proc = EngineProcess([sys.executable, "-m", "lab.engine", "serve", "--port", str(port), "--model", args.model,
                          "--device", args.device, *args.engine_flags], env, log)
    proc.start()
    try:
        ready = proc.wait_ready(f"{url}/v1", args.model, None, timeout_s=900)
        if not ready.ok:
            raise SystemExit(f"engine not ready: {ready.reason}\n{proc.log_tail()}")
        found = asyncio.run(measure(url, args.model, args))
    finally:
        proc.stop(grace_s=30)
    print(f"{args.model} on {args.device}, long prompt ~{args.long_tokens} tokens, short {args.delay} s later, "
          f"{args.rounds} rounds (median; request-to-request SD of the log)")
    for condition, rows in found.items():
        med, sd = spread([r["long_s"] for r in rows])
        line = f"  {condition:<11} long {med:.4f} s (SD {sd:.2f} %)"
        if rows and "short_s" in rows[0]:
            smed, ssd = spread([r["short_s"] for r in rows])
            line += f"   short behind {smed:.4f} s (SD {ssd:.2f} %)"
        gc_ms = [r["gc_ms"] for r in rows]
        line += (f"   server GC: {sum(r['gc_full'] for r in rows)} full passes, "
                 f"{statistics.median(gc_ms):.1f} ms a round (max {max(gc_ms):.1f}); "
                 f"{sum(r['device_allocs'] for r in rows)} cudaMalloc")
        print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": found},
                                        indent=1))


if __name__ == "__main__":
    main()

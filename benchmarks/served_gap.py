"""Where the served path's time to first token goes beyond the engine's own prefill, per length.

Boots `python -m lab.engine serve` with the engine flags given (as `lab engine bench --served`
does) and sends each length's cold prompts one at a time, streamed, `max_tokens: 1`, the prefix
cache reset before each: as text (the server tokenizes it) and as token ids (it does not). Each
request's time is split with the server's own Prometheus histograms, read before and after it:

  http      client's time to first token less the server's (request parsing and body transfer
            before the handler, the first chunk's way back to the client after it)
  host      the server's time to first token less the engine's queue and prefill phases:
            tokenizing, checks, the hand-over to the engine thread and back to the event loop
  queue     from the engine taking the request to its first step
  prefill   the engine's prefill phase, first step to first token

The server is then stopped and the same engine config times the same token ids offline, in this
process, as `lab engine bench` does. Printed per length: medians of each part, served/offline.

    python benchmarks/served_gap.py --lengths 2000,8000 --reps 3 --model smollm2-135m
    python benchmarks/served_gap.py --lengths 2000,8000,32000,131000 --model dummy:llama3-8b --device cuda \\
        --dtype bfloat16 --max-model-len 131072 --max-num-batched-tokens 8192 --enable-prefix-caching true
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lab.engine.core import config as knobs
from lab.engine.serve.llm import LLM
from lab.engine.tools.bench import engine_prefill_s, served_engine
from lab.instruments.prompts import filler_words

PHASES = {"server_ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
          "prefill": "vllm:request_prefill_time_seconds"}


@dataclass
class Timed:
    """One served request: the client's time to first token and the server's phases, in seconds."""
    client_ttft: float
    prompt_tokens: int
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def http(self) -> float:
        return self.client_ttft - self.phases["server_ttft"]

    @property
    def host(self) -> float:
        return self.phases["server_ttft"] - self.phases["queue"] - self.phases["prefill"]


def histogram_sums(client: httpx.Client, url: str) -> dict[str, float]:
    sums = {}
    for family in text_string_to_metric_families(client.get(f"{url}/metrics").text):
        for sample in family.samples:
            for key, name in PHASES.items():
                if sample.name == f"{name}_sum":
                    sums[key] = sample.value
    return sums


def text_of(client: httpx.Client, url: str, n: int, seed: str) -> str:
    """A prompt the server tokenizes to about `n` tokens: filler cut at `n` tokens and decoded."""
    words = filler_words(seed, n)
    ids = client.post(f"{url}/tokenize", json={"prompt": f"{seed}. " + " ".join(words)}).json()["tokens"]
    while len(ids) < n:
        words += words
        ids = client.post(f"{url}/tokenize", json={"prompt": f"{seed}. " + " ".join(words)}).json()["tokens"]
    return client.post(f"{url}/detokenize", json={"tokens": ids[:n]}).json()["prompt"]


def timed_request(client: httpx.Client, url: str, prompt: str | list[int]) -> Timed:
    client.post(f"{url}/reset_prefix_cache")
    before = histogram_sums(client, url)
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    ttft, tokens = None, 0
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"served_gap: /v1/completions answered {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            payload = json.loads(line[6:])
            if payload.get("usage"):
                tokens = payload["usage"]["prompt_tokens"]
    # The request's histograms are observed when it ends, on the server's event loop, by now.
    after = histogram_sums(client, url)
    assert ttft is not None
    return Timed(ttft, tokens, {k: after[k] - before[k] for k in PHASES})


def ms(values: Iterable[float]) -> float:
    return 1000 * statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2000,8000", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="timed prompts per length and form (one more warms up)")
    knobs.add_arguments(parser)
    ns = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = knobs.from_namespace(ns)
    lengths = [int(n) for n in ns.lengths.split(",")]
    rng = random.Random(0)
    served: dict[tuple[int, str], list[Timed]] = {}
    ids_sent: dict[int, list[list[int]]] = {}
    log_path = Path(tempfile.mkstemp(prefix="served-gap-", suffix=".log")[1])
    with served_engine(cfg, log_path, 900) as url, httpx.Client(timeout=None) as client:
        for n in lengths:
            texts = [text_of(client, url, n, f"gap {n} {r}") for r in range(ns.reps + 1)]
            ids = [[rng.randrange(100, 30000) for _ in range(n)] for _ in range(ns.reps + 1)]
            ids_sent[n] = ids
            for form, prompts in (("text", texts), ("ids", ids)):
                runs = [timed_request(client, url, p) for p in prompts]
                served[(n, form)] = runs[1:]  # the first of each length and form warms up
    offline = {}
    llm = LLM(config=cfg)
    for n in lengths:
        engine_prefill_s(llm, ids_sent[n][0])
        offline[n] = statistics.median(engine_prefill_s(llm, ids) for ids in ids_sent[n][1:])
    print(f"{cfg.model}, step budget {cfg.max_num_batched_tokens}, device {cfg.device}; medians of {ns.reps}, ms")
    print(f"{'length':>7} {'form':>5} {'client':>9} {'http':>7} {'host':>7} {'queue':>7} {'prefill':>9} "
          f"{'offline':>9} {'served/offline':>15}")
    for n in lengths:
        for form in ("text", "ids"):
            runs = served[(n, form)]
            client_ms = ms(r.client_ttft for r in runs)
            print(f"{n:7d} {form:>5} {client_ms:9.1f} {ms(r.http for r in runs):7.1f} {ms(r.host for r in runs):7.1f} "
                  f"{ms(r.phases['queue'] for r in runs):7.2f} {ms(r.phases['prefill'] for r in runs):9.1f} "
                  f"{1000 * offline[n]:9.1f} {1000 * offline[n] / client_ms:15.3f}")
    print(f"(server log: {log_path})")


if __name__ == "__main__":
    main()

"""A long conversation resumed after an engine restart: time to first token with and without the
KV file tier, on the real served engine.

For each setting (`off`: no tiers; `file`: a file tier, write-through) the script boots the
engine, plays a conversation turn by turn (each turn's prompt is the history so far plus a new
user chunk of seeded token ids; greedy, a few output tokens), stops the engine, boots it again with the same
flags and sends the conversation's next turn (the whole history): the first request after a
restart, which with the file tier finds the history's KV on disk instead of recomputing it. Each
setting repeats restart + resume `--repeats` times (every boot starts with an empty device
cache); the conversation is played once per setting, on a fresh file, and every resume starts
from the file as the play left it.

    python benchmarks/tier_restart.py                                   # CPU, SmolLM2, ~6K tokens
    python benchmarks/tier_restart.py --model dummy:llama3-8b --device cuda \\
        --context-tokens 100000 --turn-tokens 10000 --repeats 3         # GPU, 100K tokens

The file tier must change nothing but time, so the `off` setting also sends the next turn on the
engine that played (its history still in device memory, computed in the same chunks the file
holds): every resume from the file must answer that greedy text.

Prints one line per boot and a summary; `--json PATH` also writes the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from lab.runner.boot import EngineProcess, child_env, free_port

SETTINGS = ("off", "file")


def stream_ttft(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, dict, str]:
    """(seconds to the first streamed text, usage, the text) of one greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    first, usage, text = None, {}, []
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if first is None and choice.get("text"):
                    first = time.perf_counter() - started
                text.append(choice.get("text") or "")
    return (first if first is not None else float("nan")), usage, "".join(text)


class Engine:
    def __init__(self, flags: list[str], log: Path, model: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env, _ = child_env({})
        self.proc = EngineProcess([sys.executable, "-m", "lab.engine", "serve", "--port", str(self.port), *flags],
                                  env, log)
        self.model = model

    def __enter__(self) -> "Engine":
        self.proc.start()
        ready = self.proc.wait_ready(f"{self.url}/v1", self.model, None, timeout_s=1800)
        if not ready.ok:
            raise SystemExit(f"engine not ready: {ready.reason}\n{self.proc.log_tail()}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop(grace_s=30)

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/stats", timeout=30).json()


def conversation(args: argparse.Namespace) -> list[list[int]]:
    """The user chunks of each turn, the last one kept for the resume: seeded token ids (inside
    every preset's vocabulary), so every setting plays the same conversation."""
    rng = random.Random(args.seed)
    turns = max(1, args.context_tokens // args.turn_tokens)
    return [[rng.randrange(100, 30000) for _ in range(args.turn_tokens)] for _ in range(turns + 1)]


def run_setting(setting: str, args: argparse.Namespace, base: list[str], workdir: Path) -> dict:
    flags = list(base)
    path = workdir / "conversation.kvtier"
    played = workdir / "conversation.kvtier.played"
    if setting == "file":
        path.unlink(missing_ok=True)
        flags += ["--kv-file-tier-bytes", str(args.file_tier_bytes), "--kv-file-tier-path", str(path)]
    logs = workdir / f"engine-{setting}.log"
    history: list[int] = []
    play_ttfts = []
    with Engine(flags, logs, args.model) as engine:
        chunks = conversation(args)
        started = time.perf_counter()
        for chunk in chunks[:-1]:
            history += chunk
            ttft, _, _ = stream_ttft(engine.url, args.model, history, args.max_tokens)
            play_ttfts.append(ttft)
        play_s = time.perf_counter() - started
        stats = engine.stats()
        resume = history + chunks[-1]
        warm = None
        if setting == "off":
            # The reference a tier must reproduce: the next turn on the engine that played, its
            # history's KV still in device memory, computed in the same chunks as the file's.
            ttft, _, text = stream_ttft(engine.url, args.model, resume, args.max_tokens)
            warm = {"ttft_s": ttft, "text": text}
    result = {"setting": setting, "config_hash": stats["config_hash"], "turns": len(chunks) - 1,
              "resume_prompt_tokens": len(resume), "play_s": play_s, "play_ttft_s": play_ttfts,
              "play_tiers": stats["prefix_cache"].get("tiers"), "warm_resume": warm, "resumes": []}
    print(f"{setting}: played {len(chunks) - 1} turns in {play_s:.1f} s, history {len(history)} tokens", flush=True)
    if setting == "file":
        shutil.copyfile(path, played)
    for i in range(args.repeats):
        if setting == "file":
            # Each resume writes the new turn's blocks; every restart starts from the played file.
            shutil.copyfile(played, path)
        with Engine(flags, logs, args.model) as engine:
            ttft, usage, text = stream_ttft(engine.url, args.model, resume, args.max_tokens)
            stats = engine.stats()
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        by_tier = stats["prefix_cache"].get("hits_by_tier", {})
        result["resumes"].append({"ttft_s": ttft, "cached_tokens": cached, "cold": stats["cold"],
                                  "hits_by_tier": by_tier, "text": text})
        print(f"{setting}: restart {i + 1}: resume of {len(resume)} tokens, TTFT {ttft:.3f} s, cached {cached} "
              f"(file {by_tier.get('file', {}).get('tokens', 0)})", flush=True)
    result["resume_ttft_median_s"] = statistics.median(r["ttft_s"] for r in result["resumes"])
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context-tokens", type=int, default=6000, help="user tokens in the conversation played")
    ap.add_argument("--turn-tokens", type=int, default=500, help="user tokens added per turn")
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per turn")
    ap.add_argument("--repeats", type=int, default=3, help="restart + resume per setting")
    ap.add_argument("--max-model-len", type=int, default=0, help="default: the resumed prompt plus margin")
    ap.add_argument("--file-tier-bytes", type=int, default=0,
                    help="default: room for the whole conversation's KV, with margin")
    ap.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                    help="which settings to run (one per call splits a long run in two)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None, help="where the tier file and engine logs go")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("engine_flags", nargs="*", help="more engine flags, after --")
    args = ap.parse_args(argv)
    turns = max(1, args.context_tokens // args.turn_tokens) + 1
    total = turns * args.turn_tokens + args.max_tokens
    max_len = args.max_model_len or -(-(total + 64) // 1024) * 1024
    base = ["--model", args.model, "--device", args.device, "--max-model-len", str(max_len), *args.engine_flags]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tier-restart-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if "file" in args.settings and not args.file_tier_bytes:
        with Engine(base, workdir / "engine-probe.log", args.model) as engine:
            pool = engine.stats()["kv_pool"]
        per_token = pool["bytes"] / pool["tokens"]
        args.file_tier_bytes = int(per_token * max_len * 1.25) + (64 << 20)
    print(f"{args.model} on {args.device}: {turns - 1} turns of {args.turn_tokens} tokens, resume ~{total} tokens, "
          f"file tier {args.file_tier_bytes / 2**30:.2f} GiB in {workdir}", flush=True)
    results = [run_setting(s, args, base, workdir) for s in args.settings]
    medians = {r["setting"]: r["resume_ttft_median_s"] for r in results}
    print(f"resume TTFT after restart, median of {args.repeats}: "
          + ", ".join(f"{k} {v:.3f} s" for k, v in medians.items())
          + (f" ({medians['off'] / medians['file']:.1f}x)" if len(medians) == 2 else ""))
    # The file tier must change nothing but time: a resume from the file answers what the engine
    # that played answers with the history still in device memory. A resume recomputed from
    # scratch runs other chunk boundaries, so its bf16 sums may round differently (on random
    # weights, whose logits are nearly flat, enough to change a greedy token); it is shown apart.
    by = {r["setting"]: r for r in results}
    checks = {}
    if "off" in by:
        reference = by["off"]["warm_resume"]["text"]
        for setting, result in by.items():
            checks[setting] = [r["text"] == reference for r in result["resumes"]]
        print(f"greedy text of each resume equals the warm resume's ({reference!r}): "
              + "; ".join(f"{k} {v}" for k, v in checks.items()))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "equals_warm_resume": checks}, indent=1))


if __name__ == "__main__":
    main()

"""Time to first token of prompts at attention shapes the engine has not seen, by the kernel that
attends prefill chunks (`--prefill-attention`).

PyTorch builds a cuDNN plan for every new (query length, key length) and caches it; flash
attention has nothing to build. A server meets new shapes all the time. Per kernel setting, one
engine is booted and three kinds of prompt are sent one at a time, each twice: first at lengths
never seen ("first"), then at the same lengths with fresh tokens ("again": any plan is cached,
the prefix cache has nothing of the new tokens, so the same work is recomputed):

    chat   fresh prompts of --chat-lengths tokens, nothing cached
    turn   --turn-lengths new tokens after a cached --history-token history (sent once, first)
    long   fresh prompts of --long-lengths tokens, in chunks of the step budget

Prints, per setting and kind, the median time to first token of each pass and their difference
(what a new shape cost), with the device allocations (cudaMalloc) of each pass, and writes them
with every request's time to --json. --warm-largest first sends one prompt of each kind a token
longer than its longest, so the allocator has grown before the timings. With several
settings each runs in a process of its own, so no engine runs beside what an earlier one left.

    python benchmarks/new_shape_ttft.py                                  # dummy:llama3-8b on CUDA
    python benchmarks/new_shape_ttft.py --model dummy:smollm2-135m --device cpu --dtype float32 \\
        --modes auto --chat-lengths 40,70 --history 96 --turn-lengths 20,30 --long-lengths 300 \\
        --max-num-batched-tokens 128                                     # a check that it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from lab.engine.core.config import from_sources
from lab.engine.serve.llm import LLM
from lab.engine.tools.bench import PromptSource, engine_prefill_s


def ints(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def each_in_its_own_process(args: argparse.Namespace, modes: list[str]) -> None:
    """Runs this script once per setting and joins their tables and JSON."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, mode in enumerate(modes):
            out = Path(tmp) / f"{mode}.json"
            argv = [sys.executable, __file__, "--model", args.model, "--device", args.device, "--dtype", args.dtype,
                    "--modes", mode, "--chat-lengths", args.chat_lengths, "--history", str(args.history),
                    "--turn-lengths", args.turn_lengths, "--long-lengths", args.long_lengths,
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--json", str(out),
                    *(["--warm-largest"] if args.warm_largest else [])]
            lines = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines()
            print("\n".join(lines if i == 0 else lines[2:]), flush=True)
            found = json.loads(out.read_text())
            results.extend(found["results"])
    if args.json:
        args.json.write_text(json.dumps({**found, "results": results}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", default="cudnn,flash,auto", help="--prefill-attention settings, one engine each")
    parser.add_argument("--chat-lengths", default="97,211,389,602,877,1190,1533,2011,2466,3001")
    parser.add_argument("--history", type=int, default=8000, help="tokens of the cached history before each turn")
    parser.add_argument("--turn-lengths", default="113,187,245,301,377,419,488,523,577,641")
    parser.add_argument("--long-lengths", default="20011,23459,27103")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--warm-largest", action="store_true",
                        help="first send one prompt of each kind a token longer than its longest")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if len(modes) > 1:
        each_in_its_own_process(args, modes)
        return
    kinds = {"chat": ints(args.chat_lengths), "turn": ints(args.turn_lengths), "long": ints(args.long_lengths)}
    print(f"{args.model}, step budget {args.max_num_batched_tokens}: median time to first token, ms; "
          "device allocations (cudaMalloc) per pass")
    print(f"{'setting':8} {'kind':5} {'prompts':>7} {'first':>9} {'again':>9} {'first - again':>14} {'mallocs':>9}")
    row = run_setting(args, modes[0], kinds)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "history": args.history,
                                         "max_num_batched_tokens": args.max_num_batched_tokens,
                                         "warm_largest": args.warm_largest, "results": [row]}, indent=1))


def device_allocations() -> int:
    return torch.cuda.memory_stats().get("num_device_alloc", 0) if torch.cuda.is_available() else 0


def run_setting(args: argparse.Namespace, mode: str, kinds: dict[str, list[int]]) -> dict:
    # + 1: --warm-largest sends one token past each kind's longest.
    longest = max(max(kinds["long"], default=0), args.history + max(kinds["turn"], default=0),
                  max(kinds["chat"], default=0)) + 1
    cfg = from_sources({"model": args.model, "device": args.device, "dtype": args.dtype,
                        "max_model_len": longest + 64, "max_num_batched_tokens": args.max_num_batched_tokens,
                        "max_num_seqs": 4, "cuda_graphs": False, "prefill_attention": mode,
                        "kv_cache_memory_bytes": 8_000_000_000 if args.device == "cuda" else 0}, environ={})
    llm = LLM(config=cfg)
    prompts = PromptSource(llm.engine.model_config.vocab_size, seed=7)
    history = prompts(args.history)
    engine_prefill_s(llm, prompts(64))
    engine_prefill_s(llm, history)  # cached from here on

    def made(kind: str, n: int) -> list[int]:
        return history + prompts(n) if kind == "turn" else prompts(n)

    if args.warm_largest:
        # One prompt of each kind a token longer than its longest: the allocator's pool grows to
        # the largest activations before the timings, at a shape none of them uses.
        for kind, lengths in kinds.items():
            if lengths:
                engine_prefill_s(llm, made(kind, max(lengths) + 1))
    row = {"setting": mode, "kinds": {}}
    for kind, lengths in kinds.items():
        if not lengths:
            continue
        passes, mallocs = {}, {}
        for name in ("first", "again"):
            before = device_allocations()
            passes[name] = [engine_prefill_s(llm, made(kind, n)) for n in lengths]
            mallocs[name] = device_allocations() - before
        first, again = statistics.median(passes["first"]), statistics.median(passes["again"])
        row["kinds"][kind] = {"lengths": lengths, **passes, "device_allocations": mallocs}
        print(f"{mode:8} {kind:5} {len(lengths):7} {first * 1e3:9.2f} {again * 1e3:9.2f} "
              f"{(first - again) * 1e3:14.2f} {mallocs['first']:4}/{mallocs['again']:<4}", flush=True)
    return row


if __name__ == "__main__":
    main()

"""Prompt lookup against plain decoding, per decode category, in one process.

Each prompt of the decode instrument's categories is decoded alone (batch 1, greedy, ignore_eos)
by two engines on the same weights, one with prompt lookup off and one with it on, one after the
other. Per category: per-stream decode tok/s of each (tokens after the first over the time from
the first token to the last), the same as CPU milliseconds per token (the process's CPU time over
that span: on a host shared with other work this counts the work done, not the waits for a
core), the speed-up by each, acceptance (accepted / drafted tokens), tokens per verify step
(1 + accepted / drafts), and whether the greedy outputs are identical. Torch runs one thread.

    python benchmarks/prompt_lookup.py --max-tokens 64 --k 3 --prompts 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lab.engine.core.sampling_params import SamplingParams
from lab.engine.serve.llm import LLM
from lab.instruments.decode_prompts import CATEGORIES


def stream(llm: LLM, ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """The greedy output of one prompt alone, its per-stream decode tok/s and CPU ms per token."""
    engine = llm.engine
    engine.add_request(f"r{time.monotonic_ns()}", ids,
                       SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    tokens: list[int] = []
    first = last = cpu_first = cpu_last = 0.0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                last, cpu_last = time.perf_counter(), time.process_time()
                if not first:
                    first, cpu_first = last, cpu_last
                tokens += out.new_token_ids
    return tokens, (len(tokens) - 1) / (last - first), 1e3 * (cpu_last - cpu_first) / (len(tokens) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3, help="--num-speculative-tokens")
    parser.add_argument("--ngram-max", type=int, default=3)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category (at most 3)")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    knobs = {"max_model_len": 2048, "kv_cache_memory_bytes": 256 << 20}
    plain = LLM("smollm2-135m", **knobs)
    spec = LLM("smollm2-135m", prompt_lookup=True, num_speculative_tokens=args.k, prompt_lookup_max=args.ngram_max,
               prompt_lookup_min=args.ngram_min, **knobs)
    counters = spec.engine.drafter.counters
    warm = spec.tokenizer.encode("Hello, hello, hello, hello")
    stream(plain, warm, 8), stream(spec, warm, 8)
    print(f"k={args.k} n={args.ngram_min}..{args.ngram_max} max_tokens={args.max_tokens}, batch 1, greedy")
    print(f"{'category':<12} {'plain tok/s':>11} {'spec tok/s':>10} {'speed-up':>8} {'plain cpu ms/tok':>16} "
          f"{'spec cpu ms/tok':>15} {'speed-up':>8} {'accept':>7} {'tok/step':>8}  same output")
    for name in args.categories.split(","):
        plain_rates, spec_rates, plain_cpu, spec_cpu, same = [], [], [], [], []
        before = (counters.drafts, counters.draft_tokens, counters.accepted_tokens)
        for text in CATEGORIES[name][:args.prompts]:
            chat = plain.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            ids = plain.tokenizer.encode(chat, add_special_tokens=False)
            want, rate, cpu = stream(plain, ids, args.max_tokens)
            plain_rates.append(rate)
            plain_cpu.append(cpu)
            got, rate, cpu = stream(spec, ids, args.max_tokens)
            spec_rates.append(rate)
            spec_cpu.append(cpu)
            same.append(got == want)
        drafts, drafted, accepted = (now - was for now, was in
                                     zip((counters.drafts, counters.draft_tokens, counters.accepted_tokens), before))
        p, s = statistics.mean(plain_rates), statistics.mean(spec_rates)
        pc, sc = statistics.mean(plain_cpu), statistics.mean(spec_cpu)
        acceptance = f"{accepted / drafted:.2f}" if drafted else "-"
        per_step = f"{1 + accepted / drafts:.2f}" if drafts else "-"
        print(f"{name:<12} {p:>11.1f} {s:>10.1f} {s / p:>7.2f}x {pc:>16.1f} {sc:>15.1f} {pc / sc:>7.2f}x "
              f"{acceptance:>7} {per_step:>8}  {sum(same)}/{len(same)}", flush=True)


if __name__ == "__main__":
    main()

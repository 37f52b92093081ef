"""Where the first long prompt of a process spends the time the next ones do not.

A freshly booted engine answers its first long prompt later than the next one of about the same
length (benchmarks/new_shape_ttft.py). This boots the engine as that script does,
sends a short prompt, then long prompts one at a time, each at a length not seen before, each
under cProfile, and prints per prompt its time to first token and the functions with the most
cumulative time: Triton compiling a kernel, PyTorch building a cuDNN plan (inside
`attention_lse`), the allocator, and so on. Run it twice on a fresh machine to separate what
on-disk caches (Triton's, the driver's) save from what every process pays.

    python benchmarks/first_long_prompt.py [--lengths 20011,23459,27103] [--top 14]
    python benchmarks/first_long_prompt.py --model dummy:smollm2-135m --device cpu --lengths 300,400 \
        --max-num-batched-tokens 128                       # a check that it runs
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from lab.engine.core.config import from_sources
from lab.engine.serve.llm import LLM
from lab.engine.tools.bench import PromptSource, engine_prefill_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:llama3-8b")
    parser.add_argument("--lengths", default="20011,23459,27103")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--device", default="cuda", help="cpu: a check that it runs (with a small --model)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    t0 = time.perf_counter()
    cuda = args.device == "cuda"
    cfg = from_sources({"model": args.model, "device": args.device, "dtype": "bfloat16" if cuda else "float32",
                        "max_model_len": max(lengths) + 64, "max_num_batched_tokens": args.max_num_batched_tokens,
                        "max_num_seqs": 4, "cuda_graphs": False,
                        "kv_cache_memory_bytes": 8_000_000_000 if cuda else 0}, environ={})
    llm = LLM(config=cfg)
    print(f"boot {time.perf_counter() - t0:.2f} s", flush=True)
    prompts = PromptSource(llm.engine.model_config.vocab_size, seed=7)
    print(f"64-token prompt {engine_prefill_s(llm, prompts(64)) * 1e3:.1f} ms", flush=True)
    for n in lengths:
        profiler = cProfile.Profile()
        ids = prompts(n)
        profiler.enable()
        seconds = engine_prefill_s(llm, ids)
        profiler.disable()
        print(f"\n{n}-token prompt: {seconds * 1e3:.1f} ms", flush=True)
        for order in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(args.top)
            print(f"  by {order}:\n   ncalls{text.getvalue().split('ncalls', 1)[-1].rstrip()}", flush=True)


if __name__ == "__main__":
    main()

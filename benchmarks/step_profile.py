"""Where one decode step's GPU time goes, by kernel, with many requests running.

The engine runs `--requests` prompts of `--prompt-tokens` until every sequence is
`--decode-before` tokens into decode, then torch.profiler records `--steps` steps (CUDA graphs as
the engine replays them).
Beside the kernels, the step's compute-aware floor at the ceilings measured in the same run: per
part, the larger of its bytes at the copy ceiling and its FLOPs at the matmul ceiling (products:
every weight but the embedding table, 2 FLOPs a weight a row; attention: the KV of every running
sequence).

    python benchmarks/step_profile.py --kv-cache-dtype fp8      # dummy:llama3-8b, 256 x 1024

On the CPU (a check that the script runs) it profiles CPU operators instead of kernels.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from lab.engine.core.config import from_sources
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.model.roofline import decode_step_part_floors_s, measure_ceilings
from lab.engine.serve.llm import LLM

# Kernel-name fragments, first match wins: what each part of a step is.
PARTS = [("attention", ("_decode_split", "_decode_merge", "scaled_dot_product")), ("gemv", ("_skinny",)),
         ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "Kernel2", "aten::mm", "aten::addmm")),
         ("norm", ("rms",)), ("rope/kv write", ("rope", "kv_cache", "_write_kv")),
         ("activation", ("silu", "act_and_mul")), ("sampling", ("argmax", "sort", "topk"))]


def part(name: str) -> str:
    lowered = name.lower()
    return next((p for p, keys in PARTS if any(k.lower() in lowered for k in keys)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama3-8b")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-before", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    cfg = from_sources({"model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                        "device": args.device, "max_model_len": args.max_model_len, "max_num_seqs": args.requests,
                        "max_num_batched_tokens": 8192}, environ={})
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # Before the engine: its KV pool takes most of the device memory.
    ceilings = measure_ceilings(torch.device(args.device), getattr(torch, args.dtype))
    if cuda:
        torch.cuda.empty_cache()
    engine = LLM(config=cfg).engine
    gen = torch.Generator().manual_seed(0)
    # Sequences start decoding a few steps apart (prefill is chunked), so none may finish before
    # the last one is `decode_before` tokens in.
    params = SamplingParams(max_tokens=args.max_model_len - args.prompt_tokens, temperature=0, ignore_eos=True,
                            detokenize=False)
    vocab = min(30000, engine.model_config.vocab_size)
    for i in range(args.requests):
        engine.add_request(f"r{i}", torch.randint(10, vocab, (args.prompt_tokens,), generator=gen).tolist(), params)
    for _ in range(10_000):
        engine.step()
        running = engine.scheduler.running
        if (len(running) == args.requests
                and min(s.num_tokens for s in running) >= args.prompt_tokens + args.decode_before):
            break
    sync()
    context = sum(s.num_tokens for s in engine.scheduler.running) / args.requests
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if cuda and event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time / args.steps
        elif not cuda and event.device_type == torch.autograd.DeviceType.CPU:
            per_kernel[event.name] += event.self_cpu_time_total / args.steps
    total = sum(per_kernel.values()) or float("nan")
    print(f"{args.model} kv {args.kv_cache_dtype}: {args.requests} sequences at {context:.0f} tokens of context, "
          f"{total / 1e3:.2f} ms of {'kernels' if cuda else 'operators'} per step ({args.steps} steps)")
    by_part: dict[str, float] = collections.defaultdict(float)
    for name, us in per_kernel.items():
        by_part[part(name)] += us
    for name, us in sorted(by_part.items(), key=lambda x: -x[1]):
        print(f"  {name:14} {us / 1e3:7.3f} ms  {us / total:6.1%}")
    floors = decode_step_part_floors_s(engine.model_config, getattr(torch, args.dtype).itemsize,
                                       engine.runner.kv_dtype.itemsize, args.requests,
                                       round(context * args.requests), ceilings)
    products_floor, attention_floor = floors["products"] * 1e6, floors["attention"] * 1e6
    products = by_part.get("matmul", 0.0) + by_part.get("gemv", 0.0)
    floor = products_floor + attention_floor
    print(f"floor at this run's ceilings (copy {ceilings.copy_bytes_per_s / 1e9:,.1f} GB/s, matmul "
          f"{ceilings.matmul_flops_per_s / 1e12:.1f} TFLOP/s): products {products_floor / 1e3:.3f} ms "
          f"(measured {products / products_floor:.2f}x), attention {attention_floor / 1e3:.3f} ms "
          f"(measured {by_part.get('attention', 0.0) / attention_floor:.2f}x); step {floor / 1e3:.3f} ms, "
          f"kernels {total / floor:.2f}x")
    print("top kernels:")
    for name, us in sorted(per_kernel.items(), key=lambda x: -x[1])[:14]:
        print(f"  {us / 1e3:7.3f} ms  {name[:110]}")


if __name__ == "__main__":
    main()

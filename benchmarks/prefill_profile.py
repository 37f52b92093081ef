"""Where a cold long prefill's time goes, by part, beside each part's floor.

One prompt of each `--lengths`, alone, first timed, then run again under torch.profiler, its
kernels summed by part (products, attention, the gather of the cached prefix, norms, RoPE and KV
writes, activation, the rest). Each part stands beside its floor
at the ceilings measured in the same run: the products' FLOPs (blocks for every token, the LM head
for the last) and causal attention's FLOPs at the matmul ceiling.

    python benchmarks/prefill_profile.py --lengths 32768,131000                 # dummy:llama3-8b, bf16 KV
    python benchmarks/prefill_profile.py --model dummy:llama3-8b-1m --kv-cache-dtype fp8 --lengths 131000

On the CPU (a check that the script runs) it profiles CPU operators instead of kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lab.engine.core.config import from_sources
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.model.roofline import measure_ceilings, prefill_attention_flops, prefill_flops
from lab.engine.serve.llm import LLM

# Kernel (or CPU operator) name fragments, first match wins. Attention comes before products:
# PyTorch's memory-efficient attention kernel is a CUTLASS one.
PARTS = [("attention", ("sdpa", "flash", "fmha", "attention", "_prefill", "attn")),
         ("products", ("gemm", "nvjet", "sm90_xmma", "cublas", "cutlass", "aten::mm", "aten::addmm", "aten::bmm")),
         ("gather", ("index", "gather")),
         ("norm", ("rms",)), ("rope/kv write", ("rope", "kv_cache", "_write_kv")),
         ("activation", ("silu", "act_and_mul"))]


def part(name: str) -> str:
    lowered = name.lower()
    return next((p for p, keys in PARTS if any(k.lower() in lowered for k in keys)), "other")


def prefill_once(engine, tokens: list[int], request_id: str) -> float:
    """Seconds from adding the prompt to its first (only) token."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    engine.add_request(request_id, tokens, params)
    while engine.has_unfinished():
        engine.step()
    sync()
    return time.perf_counter() - start


def idle_gaps(events, profiled_s: float, largest: int = 8) -> dict:
    """Where the GPU waited during a profiled prefill: the time before its first kernel (host
    preparation), the sum of gaps between kernels, and the `largest` gaps (ms) each with the
    longest host operators that started inside it, which say what the GPU waited for."""
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == torch.autograd.DeviceType.CPU]
    if not kernels:
        return {"idle_s": profiled_s, "lead_s": profiled_s, "between_s": 0.0, "largest": []}
    first = min(start for start, _, _ in host) if host else kernels[0][0]
    gaps, busy_until = [], kernels[0][1]
    for start, end in kernels[1:]:
        if start > busy_until:
            gaps.append((busy_until, start))
        busy_until = max(busy_until, end)
    lead_s = max(0.0, (kernels[0][0] - first) * 1e-6)
    between_s = sum(b - a for a, b in gaps) * 1e-6
    top = []
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:largest]:
        inside = sorted((h for h in host if a <= h[0] < b), key=lambda h: h[0] - h[1])[:3]
        top.append(((b - a) * 1e-3, ", ".join(f"{name} {(end - start) * 1e-3:.2f} ms" for start, end, name in inside)))
    busy_s = (busy_until - kernels[0][0]) * 1e-6 - between_s
    return {"idle_s": max(0.0, profiled_s - busy_s), "lead_s": lead_s, "between_s": between_s, "largest": top}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama3-8b")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--lengths", default="32768,131000", help="prompt lengths, comma-separated")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    cfg = from_sources({"model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                        "device": args.device, "max_model_len": max(lengths) + 64, "max_num_seqs": 4,
                        "max_num_batched_tokens": args.max_num_batched_tokens, "enable_prefix_caching": False},
                       environ={})
    engine = LLM(config=cfg).engine
    mc = engine.model_config
    device = torch.device(args.device)
    ceilings = measure_ceilings(device, getattr(torch, args.dtype))
    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model} kv {args.kv_cache_dtype}, step budget {args.max_num_batched_tokens}; matmul ceiling "
          f"{ceilings.matmul_flops_per_s / 1e12:.1f} TFLOP/s")
    results = []
    for n in lengths:
        tokens = torch.randint(10, min(30000, mc.vocab_size), (n,), generator=gen).tolist()
        prefill_once(engine, tokens[:256], f"warm-{n}")  # kernels chosen and compiled outside the timings
        seconds = prefill_once(engine, tokens, f"timed-{n}")
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            began = time.perf_counter()
            prefill_once(engine, tokens, f"profiled-{n}")
            profiled_s = time.perf_counter() - began
        per_name: dict[str, float] = collections.defaultdict(float)
        for event in prof.events():
            if cuda and event.device_type == torch.autograd.DeviceType.CUDA:
                per_name[event.name] += event.device_time * 1e-6
            elif not cuda and event.device_type == torch.autograd.DeviceType.CPU:
                per_name[event.name] += event.self_cpu_time_total * 1e-6
        by_part: dict[str, float] = collections.defaultdict(float)
        for name, secs in per_name.items():
            by_part[part(name)] += secs
        total = sum(by_part.values()) or float("nan")
        flops = prefill_flops(mc, n)
        attn_flops = prefill_attention_flops(mc, n)
        floors = {"products": (flops - attn_flops) / ceilings.matmul_flops_per_s,
                  "attention": attn_flops / ceilings.matmul_flops_per_s}
        print(f"\n{n} tokens: {seconds:.2f} s ({n / seconds:,.0f} tok/s), floor {flops / ceilings.matmul_flops_per_s:.2f} s "
              f"({flops / ceilings.matmul_flops_per_s / seconds:.0%} of it); profiled: {total:.2f} s of "
              f"{'kernels' if cuda else 'operators'}")
        for name, secs in sorted(by_part.items(), key=lambda x: -x[1]):
            floor = floors.get(name)
            beside = f"  floor {floor:6.2f} s ({floor / secs:.0%} of it)" if floor else ""
            print(f"  {name:14} {secs:7.2f} s {secs / total:6.1%}{beside}")
        if cuda:
            idle = idle_gaps(prof.events(), profiled_s)
            print(f"  GPU idle {idle['idle_s'] * 1e3:.1f} ms of the profiled {profiled_s:.3f} s "
                  f"(before the first kernel {idle['lead_s'] * 1e3:.1f} ms, between kernels {idle['between_s'] * 1e3:.1f} ms); "
                  "largest gaps, with the host operators that ran in them:")
            for gap_ms, ops in idle["largest"]:
                print(f"    {gap_ms:7.2f} ms  {ops}")
        print("  top kernels:" if cuda else "  top operators:")
        for name, secs in sorted(per_name.items(), key=lambda x: -x[1])[:12]:
            print(f"    {secs:7.3f} s  {name[:110]}")
        results.append({"tokens": n, "seconds": seconds, "floor_s": flops / ceilings.matmul_flops_per_s,
                        "parts_s": dict(by_part), "part_floors_s": floors,
                        "top": sorted(per_name.items(), key=lambda x: -x[1])[:12]})
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
                                         "max_num_batched_tokens": args.max_num_batched_tokens,
                                         "matmul_flops_per_s": ceilings.matmul_flops_per_s,
                                         "copy_bytes_per_s": ceilings.copy_bytes_per_s, "lengths": results}, indent=1))


if __name__ == "__main__":
    main()

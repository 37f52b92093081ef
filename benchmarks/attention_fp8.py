"""fp8-cache decode attention variants on a GPU, one call: launch configurations beside the
default and, when a staged copy of an older kernel is on the path (module old_attn), that kernel
beside the current one. Llama-3-8B shapes, graph-replayed steps (bench_kernels).

    python benchmarks/attention_fp8.py              # the table
    python benchmarks/attention_fp8.py --ncu LABEL  # a few eager launches of one variant, for ncu
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch
from kernels import bench_kernels as bk

from lab.engine.kernels.decode_attention import decode_attention

FP8 = torch.float8_e4m3fn
SHAPES = [(FP8, 256, 1536, None), (FP8, 64, 4096, None), (FP8, 32, 2048, None), (FP8, 1, 1024, 131072),
          (torch.bfloat16, 256, 1536, None), (torch.bfloat16, 1, 1024, 131072)]
FP8_CONFIGS = {
    "default": {},
    "4 warps": {"num_warps": 4},
    "n32 s4": {"BLOCK_N": 32, "num_stages": 4},
    "n128 s2": {"BLOCK_N": 128, "num_stages": 2},
    "n64 s2": {"num_stages": 2},
    "n32 1 warp": {"BLOCK_N": 32, "num_warps": 1},
}
BF16_CONFIGS = {"default": {}}


def old_kernel():
    try:
        return importlib.import_module("old_attn.decode_attention").decode_attention
    except ImportError:
        return None


def variants(cache_dtype: torch.dtype):
    yield from ((name, decode_attention, cfg) for name, cfg in
                (FP8_CONFIGS if cache_dtype == FP8 else BF16_CONFIGS).items())
    old = old_kernel()
    if old is not None:
        yield "old-default", old, {}


def time_variant(case: bk.DecodeCase, fn, config: dict, splits: int) -> float:
    def step(i: int) -> None:
        k_cache, v_cache, tables, lens = case.caches[i]
        fn(case.q, k_cache, v_cache, tables, lens, bk.HEAD_DIM ** -0.5, case.out, num_splits=splits,
           config=config or None)
    step(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(case.copies):
            step(i)
    return bk.median_ms(graph.replay) * 1e3 / case.copies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ncu", help="run this fp8 variant eagerly at batch 256 / 1536 (for ncu) and exit")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.ncu:
        case = bk.DecodeCase(256, 1536, FP8)
        fn, cfg = dict((n, (f, c)) for n, f, c in variants(FP8))[args.ncu]
        for _ in range(5):
            k_cache, v_cache, tables, lens = case.caches[0]
            fn(case.q, k_cache, v_cache, tables, lens, bk.HEAD_DIM ** -0.5, case.out, config=cfg or None)
        torch.cuda.synchronize()
        return
    ceiling = bk.copy_bandwidth()
    print(f"copy ceiling {ceiling / 1e9:.0f} GB/s")
    print(f"{'cache':6} {'batch':>5} {'ctx':>6} {'splits':>6} {'variant':14} {'us':>8} {'GB/s':>7} {'of copy':>7} {'max err':>8}")
    for cache_dtype, batch, context, max_model_len in SHAPES:
        case = bk.DecodeCase(batch, context, cache_dtype, max_model_len)
        splits = case.default_splits()
        reference = None
        for name, fn, cfg in variants(cache_dtype):
            try:
                us = time_variant(case, fn, cfg, splits)
            except Exception as e:  # a config that does not compile or fit is a row, not a stop
                print(f"{str(cache_dtype)[6:]:6} {batch:5} {context:6} {splits:6} {name:14} failed: {str(e)[:80]}")
                continue
            k_cache, v_cache, tables, lens = case.caches[0]
            out = fn(case.q, k_cache, v_cache, tables, lens, bk.HEAD_DIM ** -0.5, torch.empty_like(case.q),
                     num_splits=splits, config=cfg or None).float()
            reference = out if reference is None else reference
            err = (out - reference).abs().max().item()
            rate = (case.kv_bytes + case.io_bytes) / (us / 1e6)
            print(f"{str(cache_dtype)[6:]:6} {batch:5} {context:6} {splits:6} {name:14} {us:8.1f} {rate / 1e9:7.0f} "
                  f"{rate / ceiling:7.1%} {err:8.1e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Micro-benchmark of the Triton attention kernels on a GPU, at Llama-3-8B shapes (32 query / 8
KV heads, head dim 128, 16-token blocks, bf16):

    python -m lab.engine.kernels.bench_kernels                                  # the tables
    python -m lab.engine.kernels.bench_kernels --sweep decode --sweep prefill   # plus tuning sweeps

Decode reports achieved bandwidth: bytes of K/V read (every context token of every KV head,
once) plus q read and out written, over the median time of a step replayed from a CUDA graph (as
the engine runs decode); the ceiling printed beside it is a device-to-device copy measured at
start. Prefill reports causal attention TFLOP/s (4 * heads *
head_dim per visible query-key pair) beside PyTorch's SDPA on the same shape, contiguous.
Times are triton.testing.do_bench medians, which flush the L2 between repetitions.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from lab.engine.kernels import choose_num_splits, decode_attention, prefill_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_BATCHES = (1, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 16384, 32768)
PREFILL_LENGTHS = (2048, 8192, 32768)
# Bytes of distinct KV that one timed decode graph reads: several times the H200's 60 MB L2.
ROTATION_BYTES = 512 << 20


def median_ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy, read plus written: the practical ceiling."""
    src = torch.empty(1 << 31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = median_ms(lambda: dst.copy_(src)) / 1e3
    return 2 * src.numel() * src.element_size() / seconds


def paged_kv(context_lens: list[int], cache_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Random caches holding exactly these contexts in shuffled blocks, their block tables and
    lengths."""
    blocks = [math.ceil(c / BLOCK_SIZE) for c in context_lens]
    order = torch.randperm(sum(blocks), device="cuda", dtype=torch.int32)
    width = max(blocks)
    tables = torch.zeros(len(blocks), width, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used:used + n]
        used += n
    shape = (sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables, lens


def bench_decode(batch: int, context: int, cache_dtype: torch.dtype, num_splits: int | None = None,
                 config: dict[str, int] | None = None) -> tuple[float, float, float, int]:
    """(graph us, eager us, bytes/s from the graph time, splits) of one decode step over `batch`
    contexts of `context`. The engine replays decode steps as CUDA graphs, so the graph time is
    the kernels' own; eager adds Python and launch overhead. The graph runs the step over enough
    distinct caches that their sum far exceeds the L2."""
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * torch.empty((), dtype=cache_dtype).element_size()
    copies = max(1, math.ceil(ROTATION_BYTES / kv_bytes))
    caches = [paged_kv([context] * batch, cache_dtype) for _ in range(copies)]
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    splits = num_splits or choose_num_splits(batch, KV_HEADS, context,
                                             torch.cuda.get_device_properties(0).multi_processor_count)

    def step(i: int) -> None:
        k_cache, v_cache, tables, lens = caches[i]
        decode_attention(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5, out, num_splits=splits, config=config)

    step(0)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            step(i)
    graph_us = median_ms(graph.replay) * 1e3 / copies
    eager_us = median_ms(lambda: step(0)) * 1e3
    io_bytes = 2 * q.numel() * q.element_size()
    return graph_us, eager_us, (kv_bytes + io_bytes) / (graph_us / 1e6), splits


def bench_prefill(query_len: int, context: int, config: dict[str, int] | None = None) -> tuple[float, float]:
    """(milliseconds, FLOP/s) of one causal prefill of `query_len` tokens ending a `context`."""
    k_cache, v_cache, tables, lens = paged_kv([context], torch.bfloat16)
    q = torch.randn(query_len, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    starts = torch.tensor([0, query_len], dtype=torch.int32, device="cuda")
    ms = median_ms(lambda: prefill_attention(q, k_cache, v_cache, tables, starts, lens, HEAD_DIM ** -0.5, out,
                                             first_seq=0, num_seqs=1, max_query_len=query_len, config=config))
    return ms, causal_flops(query_len, context) / (ms / 1e3)


def causal_flops(query_len: int, context: int) -> float:
    prefix = context - query_len
    pairs = query_len * prefix + query_len * (query_len + 1) / 2
    return 4 * HEADS * HEAD_DIM * pairs


def bench_sdpa(length: int) -> float | None:
    """FLOP/s of PyTorch's SDPA (flash where it applies) on a contiguous causal prefill."""
    q = torch.randn(1, HEADS, length, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, KV_HEADS, length, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    try:
        ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    except RuntimeError:
        return None
    return causal_flops(length, length) / (ms / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="append", choices=("decode", "prefill"), default=[],
                        help="also time launch configs (and split counts) of this kernel; repeatable")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    ceiling = copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs; device copy {ceiling / 1e12:.2f} TB/s")

    print("\ndecode (Llama-3-8B shapes): batch x context, K/V + q/out bytes over the graph time")
    print(f"{'batch':>5} {'context':>7} {'kv':>5} {'splits':>6} {'graph us':>9} {'eager us':>9} {'TB/s':>6} "
          f"{'of copy':>7}")
    for cache_dtype, label in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8")):
        for batch in DECODE_BATCHES:
            for context in DECODE_CONTEXTS:
                graph_us, eager_us, bandwidth, splits = bench_decode(batch, context, cache_dtype)
                print(f"{batch:>5} {context:>7} {label:>5} {splits:>6} {graph_us:>9.1f} {eager_us:>9.1f} "
                      f"{bandwidth / 1e12:>6.2f} {bandwidth / ceiling:>7.0%}")
                torch.cuda.empty_cache()

    print("\nprefill (Llama-3-8B shapes, bf16), causal")
    print(f"{'query':>6} {'context':>7} {'ms':>8} {'TFLOP/s':>8} {'SDPA TFLOP/s':>13}")
    for length in PREFILL_LENGTHS:
        ms, flops = bench_prefill(length, length)
        sdpa = bench_sdpa(length)
        print(f"{length:>6} {length:>7} {ms:>8.2f} {flops / 1e12:>8.1f} "
              f"{(f'{sdpa / 1e12:.1f}' if sdpa else '-'):>13}")
    ms, flops = bench_prefill(2048, 32768)
    print(f"{2048:>6} {32768:>7} {ms:>8.2f} {flops / 1e12:>8.1f} {'-':>13}")

    if "decode" in args.sweep:
        sweep_decode()
    if "prefill" in args.sweep:
        sweep_prefill()


def sweep_decode() -> None:
    print("\nsweep: decode launch configs, graph us at batch x context")
    shapes = ((1, 32768), (64, 8192), (256, 4096))
    print(f"{'kv':>5} {'BLOCK_N':>7} {'warps':>5} " + " ".join(f"{f'{b}x{c}':>9}" for b, c in shapes))
    for cache_dtype, label in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8")):
        for block_n in (64, 128, 256):
            for warps in (4, 8):
                config = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": 2}
                times = [bench_decode(b, c, cache_dtype, config=config)[0] for b, c in shapes]
                print(f"{label:>5} {block_n:>7} {warps:>5} " + " ".join(f"{t:>9.1f}" for t in times))

    print("\nsweep: decode split counts, graph us")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, context in ((1, 1024), (1, 4096), (1, 32768), (4, 16384), (8, 16384), (16, 8192), (32, 4096)):
        row = [f"{s}:{bench_decode(batch, context, torch.bfloat16, num_splits=s)[0]:.1f}"
               for s in (1, 2, 4, 8, 16, 33, 64)]
        print(f"{batch}x{context} (chosen {choose_num_splits(batch, KV_HEADS, context, sms)}): " + " ".join(row))


def sweep_prefill() -> None:
    print("\nsweep: prefill launch configs, TFLOP/s at query/context")
    shapes = ((8192, 8192), (2048, 32768))
    header = " ".join(f"{f'{q}/{c}':>11}" for q, c in shapes)
    print(f"{'BLOCK_M':>7} {'BLOCK_N':>7} {'warps':>5} {'stages':>6} {header}")
    for block_m in (64, 128):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
                    try:
                        rates = [f"{bench_prefill(q, c, config)[1] / 1e12:>11.1f}" for q, c in shapes]
                    except Exception as error:  # out of shared memory or registers for this config
                        rates = [f"{type(error).__name__:>11}"]
                    print(f"{block_m:>7} {block_n:>7} {warps:>5} {stages:>6} " + " ".join(rates))


if __name__ == "__main__":
    main()

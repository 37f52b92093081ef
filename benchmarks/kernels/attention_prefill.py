"""Long-prefill attention on a GPU, one call: which of PyTorch's attention kernels (flash, cuDNN,
memory-efficient) is fastest for each part of a prefill chunk over a long cached prefix, and what
the engine's chunk attention achieves. Llama-3-8B shapes (32 query heads, 8 KV heads, D = 128),
bf16, TFLOP/s counted on the FLOPs the mask keeps.

A chunk of L new tokens after P cached ones splits in two: the prefix (every query sees every
key: no mask, GQA folded into the query rows) and the chunk itself (causal, square). Each part
returns its log-sum-exp and the two are merged. The older path gathers the context, repeats K/V
to every head and runs one bottom-right causal call.

    python benchmarks/attention_prefill.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from lab.engine.model.attention import causal_attention
from lab.engine.model.chunk_attention import attention_lse, chunk_attention

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def median_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def square_causal(length: int, repeats: int) -> None:
    q = torch.randn(1, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ke, ve = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    flops = 4 * HEADS * HEAD_DIM * length * length / 2
    ref = F.scaled_dot_product_attention(q.float(), ke.float(), ve.float(), is_causal=True)
    for backend in ("flash", "cudnn", "efficient"):
        for gqa in (False, True):
            try:
                fn = (lambda b=backend, g=gqa: attention_lse(q, k if g else ke, v if g else ve, causal=True,
                                                             scale=HEAD_DIM ** -0.5, backend=b))
                out, _ = fn()
                err = (out.float() - ref).abs().max().item()
                ms = median_ms(fn, repeats)
                print(f"square causal L={length:>6} {backend:>9} gqa={gqa!s:5}: {ms:8.2f} ms "
                      f"{tflops(flops, ms):6.0f} TFLOP/s  max err {err:.3g}")
            except Exception as exc:  # noqa: BLE001 - a table row per backend the build lacks
                print(f"square causal L={length:>6} {backend:>9} gqa={gqa!s:5}: unsupported "
                      f"({type(exc).__name__}: {str(exc).splitlines()[0][:90]})")
    ms = median_ms(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True), repeats)
    print(f"square causal L={length:>6} F.sdpa dispatch     : {ms:8.2f} ms {tflops(flops, ms):6.0f} TFLOP/s")


def prefix_dense(rows: int, prefix: int, repeats: int) -> None:
    """A chunk's queries against its cached prefix, GQA folded: KV_HEADS heads of group x rows."""
    group = HEADS // KV_HEADS
    q = torch.randn(1, KV_HEADS, group * rows, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, KV_HEADS, prefix, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = 4 * HEADS * HEAD_DIM * rows * prefix
    for backend in ("flash", "cudnn", "efficient"):
        try:
            fn = lambda b=backend: attention_lse(q, k, v, causal=False, scale=HEAD_DIM ** -0.5, backend=b)  # noqa: E731
            ms = median_ms(fn, repeats)
            print(f"prefix dense rows={rows:>5} P={prefix:>8} {backend:>9}: {ms:8.2f} ms "
                  f"{tflops(flops, ms):6.0f} TFLOP/s")
        except Exception as exc:  # noqa: BLE001
            print(f"prefix dense rows={rows:>5} P={prefix:>8} {backend:>9}: unsupported "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:90]})")


def chunk_over_prefix(rows: int, prefix: int, repeats: int) -> None:
    """The whole chunk's attention, [L, H, D] over a contiguous context: the old bottom-right call
    (heads repeated) against the split-and-merge, with their difference."""
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(prefix + rows, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scale = HEAD_DIM ** -0.5
    flops = 4 * HEADS * HEAD_DIM * rows * (prefix + rows / 2)
    # The older path: K/V repeated to every head keeps the bottom-right call on flash attention.
    ke, ve = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    old = causal_attention(q, ke, ve, scale)
    new = chunk_attention(q, k, v, scale)
    err = (old.float() - new.float()).abs().max().item()
    ms_old = median_ms(lambda: causal_attention(q, *(x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v)),
                                                scale), repeats)
    ms_new = median_ms(lambda: chunk_attention(q, k, v, scale), repeats)
    print(f"chunk L={rows:>5} over P={prefix:>8}: bottom-right {ms_old:8.2f} ms {tflops(flops, ms_old):5.0f} TFLOP/s"
          f" | split+merge {ms_new:8.2f} ms {tflops(flops, ms_new):5.0f} TFLOP/s | max diff {err:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefixes", default="8192,32768,131072,1048576")
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    for length in (2048, 8192, 16384):
        square_causal(length, args.repeats)
    prefixes = [int(p) for p in args.prefixes.split(",")]
    for rows in (8192, 16384):
        for prefix in prefixes:
            prefix_dense(rows, prefix, args.repeats if prefix < 500_000 else 2)
    for rows in (8192, 16384):
        for prefix in prefixes:
            if prefix <= 131072:
                chunk_over_prefix(rows, prefix, args.repeats)


if __name__ == "__main__":
    main()

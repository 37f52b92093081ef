"""Which of PyTorch's attention kernels (flash, cuDNN, memory-efficient) is fastest for each part of a long prefill.

One call on a GPU times each kernel on each part of a prefill chunk over a long cached prefix,
and what the engine's chunk attention achieves. Llama-3-8B shapes (32 query heads, 8 KV heads,
D = 128), bf16, TFLOP/s counted on the FLOPs the mask keeps; each row gives its largest
difference from float32 attention on the same inputs (the prefix part: over its first 32 rows).

A chunk of L new tokens after P cached ones splits in two: the prefix (every query sees every
key: no mask, GQA folded into the query rows) and the chunk itself (causal, square). Each part
returns its log-sum-exp and the two are merged. The older path gathers the context, repeats K/V
to every head and runs one bottom-right causal call.

    python benchmarks/kernels/attention_prefill.py
    python benchmarks/kernels/attention_prefill.py --device cpu --dtype float32 --lengths 64 --rows 32 \
        --prefixes 100 --repeats 2                                        # a check that it runs

On the CPU PyTorch has one attention kernel whatever backend is asked for (its CPU flash kernel),
so each table has one row per shape, labelled cpu; its times say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lab.engine.model.attention import causal_attention
from lab.engine.model.chunk_attention import attention_lse, chunk_attention

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BACKENDS = ("flash", "cudnn", "efficient")


@dataclass(frozen=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    repeats: int

    @property
    def backends(self) -> tuple[str, ...]:
        # attention_lse ignores the backend on the CPU: one row, under the name of what runs.
        return BACKENDS if self.device.type == "cuda" else ("cpu",)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.dtype)

    def median_ms(self, fn: Callable[[], object], repeats: int | None = None) -> float:
        """Median milliseconds of a call after one warm-up: CUDA events around each call on a GPU,
        the wall clock on the CPU."""
        fn()
        times = []
        for _ in range(repeats or self.repeats):
            if self.device.type != "cuda":
                start_s = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start_s) * 1e3)
                continue
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def unsupported(exc: Exception) -> str:
    return f"unsupported ({type(exc).__name__}: {str(exc).splitlines()[0][:90]})"


def square_causal(setup: Setup, length: int) -> None:
    q = setup.randn(1, HEADS, length, HEAD_DIM)
    k = setup.randn(1, KV_HEADS, length, HEAD_DIM)
    v = torch.randn_like(k)
    ke, ve = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    flops = 4 * HEADS * HEAD_DIM * length * length / 2
    ref = F.scaled_dot_product_attention(q.float(), ke.float(), ve.float(), is_causal=True)
    for backend in setup.backends:
        for gqa in (False, True):
            label = f"square causal L={length:>6} {backend:>9} gqa={gqa!s:5}"
            try:
                fn = (lambda b=backend, g=gqa: attention_lse(q, k if g else ke, v if g else ve, causal=True,
                                                             scale=HEAD_DIM ** -0.5, backend=b))
                out, _ = fn()
                err = (out.float() - ref).abs().max().item()
                ms = setup.median_ms(fn)
                print(f"{label}: {ms:8.2f} ms {tflops(flops, ms):6.3g} TFLOP/s  max err {err:.3g}")
            except Exception as exc:  # noqa: BLE001 - a table row per backend the build lacks
                print(f"{label}: {unsupported(exc)}")
    ms = setup.median_ms(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True))
    print(f"square causal L={length:>6} F.sdpa dispatch     : {ms:8.2f} ms {tflops(flops, ms):6.3g} TFLOP/s")


def prefix_dense(setup: Setup, rows: int, prefix: int, repeats: int) -> None:
    """A chunk's queries against its cached prefix, GQA folded: KV_HEADS heads of group x rows."""
    group = HEADS // KV_HEADS
    q = setup.randn(1, KV_HEADS, group * rows, HEAD_DIM)
    k = setup.randn(1, KV_HEADS, prefix, HEAD_DIM)
    v = torch.randn_like(k)
    flops = 4 * HEADS * HEAD_DIM * rows * prefix
    # Each query row attends alone: a few rows keep the float32 reference cheap at a 1M prefix.
    checked = min(group * rows, 32)
    ref = F.scaled_dot_product_attention(q[:, :, :checked].float(), k.float(), v.float())
    for backend in setup.backends:
        label = f"prefix dense rows={rows:>5} P={prefix:>8} {backend:>9}"
        try:
            fn = lambda b=backend: attention_lse(q, k, v, causal=False, scale=HEAD_DIM ** -0.5, backend=b)  # noqa: E731
            out, _ = fn()
            err = (out[:, :, :checked].float() - ref).abs().max().item()
            ms = setup.median_ms(fn, repeats)
            print(f"{label}: {ms:8.2f} ms {tflops(flops, ms):6.3g} TFLOP/s  max err {err:.3g}")
        except Exception as exc:  # noqa: BLE001
            print(f"{label}: {unsupported(exc)}")


def chunk_over_prefix(setup: Setup, rows: int, prefix: int) -> None:
    """The whole chunk's attention, [L, H, D] over a contiguous context: the old bottom-right call
    (heads repeated) against the split-and-merge, with their difference."""
    q = setup.randn(rows, HEADS, HEAD_DIM)
    k = setup.randn(prefix + rows, KV_HEADS, HEAD_DIM)
    v = torch.randn_like(k)
    scale = HEAD_DIM ** -0.5
    flops = 4 * HEADS * HEAD_DIM * rows * (prefix + rows / 2)
    # The older path: K/V repeated to every head keeps the bottom-right call on flash attention.
    ke, ve = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    old = causal_attention(q, ke, ve, scale)
    new = chunk_attention(q, k, v, scale)
    err = (old.float() - new.float()).abs().max().item()
    ms_old = setup.median_ms(lambda: causal_attention(q, *(x.repeat_interleave(HEADS // KV_HEADS, dim=1)
                                                            for x in (k, v)), scale))
    ms_new = setup.median_ms(lambda: chunk_attention(q, k, v, scale))
    print(f"chunk L={rows:>5} over P={prefix:>8}: bottom-right {ms_old:8.2f} ms {tflops(flops, ms_old):5.3g} TFLOP/s"
          f" | split+merge {ms_new:8.2f} ms {tflops(flops, ms_new):5.3g} TFLOP/s | max diff {err:.3g}")


def numbers(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=numbers, default="2048,8192,16384", help="square causal lengths")
    parser.add_argument("--rows", type=numbers, default="8192,16384", help="chunk lengths over each prefix")
    parser.add_argument("--prefixes", type=numbers, default="8192,32768,131072,1048576",
                        help="cached prefix lengths (the whole chunk's attention only up to 131072)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    setup = Setup(torch.device(args.device), getattr(torch, args.dtype), args.repeats)
    if setup.device.type == "cuda":
        print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    else:
        print(torch.__version__, "cpu,", torch.get_num_threads(), "threads")
    for length in args.lengths:
        square_causal(setup, length)
    for rows in args.rows:
        for prefix in args.prefixes:
            prefix_dense(setup, rows, prefix, args.repeats if prefix < 500_000 else 2)
    for rows in args.rows:
        for prefix in args.prefixes:
            if prefix <= 131072:
                chunk_over_prefix(setup, rows, prefix)


if __name__ == "__main__":
    main()

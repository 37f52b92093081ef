"""A batch-1 decode step's kernel chain at Llama-3-8B shapes on a GPU (32 layers of the fused
q|k|v product, decode attention, the o projection, gate|up and SiLU-and-multiply with down), with
and without the o projection's weight prefetched into L2 beside attention
(lab.engine.kernels.l2_prefetch). Each row is the median over replays of one CUDA graph of the
whole chain (15 GB of distinct weights, so no product finds its weights in L2 by chance).

    python benchmarks/l2_prefetch.py [--contexts 192 1024] [--bound 512]

`--bound` sizes the attention's split count as the engine's graphs do (a graph per context bound).
Printed per row: ms a step, µs a layer saved against no prefetch, and the chain's weight bytes
over its time against a 4 GiB copy (bytes read plus written) measured at start.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent / "kernels"))
from bench_kernels import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, copy_bandwidth, paged_kv  # noqa: E402

from lab.engine.kernels.decode_attention import decode_attention, num_splits_for  # noqa: E402
from lab.engine.kernels.gemv import skinny_linear, skinny_silu_mul_linear  # noqa: E402
from lab.engine.kernels.l2_prefetch import L2Prefetch  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS = 4096, 14336, 32
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def build_layers() -> list[dict[str, torch.Tensor]]:
    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5)
    return [{"qkv": w(QKV, HIDDEN), "o": w(HIDDEN, HIDDEN), "gate_up": w(2 * INTERMEDIATE, HIDDEN),
             "down": w(HIDDEN, INTERMEDIATE)} for _ in range(LAYERS)]


def chain(layers, caches, x, splits, prefetch: L2Prefetch | None, fraction: float) -> torch.Tensor:
    for layer, (k_cache, v_cache, tables, lens) in zip(layers, caches):
        qkv = skinny_linear(x, layer["qkv"])
        if prefetch is not None:
            prefetch.start(layer["o"], fraction)
        q = qkv[:, :HEADS * HEAD_DIM].view(1, HEADS, HEAD_DIM)
        attn = decode_attention(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5, num_splits=splits)
        if prefetch is not None:
            prefetch.join()
        x = skinny_linear(attn.view(1, HIDDEN), layer["o"], residual=x)
        gate_up = skinny_linear(x, layer["gate_up"])
        x = skinny_silu_mul_linear(gate_up, layer["down"], residual=x)
    return x


def time_graph(fn, replays: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[192, 1024])
    parser.add_argument("--bound", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2, help="ABAB rounds of the whole table")
    args = parser.parse_args()
    torch.manual_seed(0)
    ceiling = copy_bandwidth()
    layers = build_layers()
    weight_bytes = sum(t.numel() * t.element_size() for layer in layers for t in layer.values())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants: list[tuple[str, L2Prefetch | None, float]] = [("none", None, 1.0)]
    for mode in ("load", "prefetch", "bulk"):
        for programs in (sms // 2, sms):
            variants.append((f"{mode} x{programs}", L2Prefetch(torch.device("cuda"), programs, mode), 1.0))
    variants.append((f"prefetch x{sms} 3/4", L2Prefetch(torch.device("cuda"), sms, "prefetch"), 0.75))
    print(f"copy ceiling {ceiling / 1e9:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB; {torch.cuda.get_device_name()}",
          flush=True)
    for context in args.contexts:
        bound = max(args.bound, context)
        caches = [paged_kv([context], torch.bfloat16) for _ in range(LAYERS)]
        splits = num_splits_for(1, KV_HEADS, bound, torch.device("cuda"), torch.bfloat16)
        x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
        print(f"\ncontext {context} (splits {splits}, block {BLOCK_SIZE})", flush=True)
        print(f"{'variant':>22} {'ms a step':>10} {'saved us/layer':>15} {'of copy':>8}")
        results: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, prefetch, fraction in variants:
                try:
                    ms = time_graph(lambda: chain(layers, caches, x, splits, prefetch, fraction))
                except Exception as error:  # a mode the GPU or compiler refuses is a result too
                    print(f"{name:>22} failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}",
                          flush=True)
                    continue
                results.setdefault(name, []).append(ms)
        base = statistics.median(results["none"])
        for name, times in results.items():
            ms = statistics.median(times)
            print(f"{name:>22} {ms:>10.4f} {(base - ms) * 1e3 / LAYERS:>15.2f} "
                  f"{weight_bytes / (ms / 1e3) / ceiling:>8.1%}  ({', '.join(f'{t:.4f}' for t in times)})", flush=True)


if __name__ == "__main__":
    main()

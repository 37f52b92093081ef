"""What a prefill chunk's attention costs the first time its shape is seen, per PyTorch backend.

PyTorch builds and caches a cuDNN graph for each (query length, key length) it runs; flash
attention has nothing to build. A chunk whose shape (its own length L, its cached prefix P) is
new pays for one build. A server sees new shapes all the time: every prompt length, every chat
turn over a cached prefix, and every later chunk of a long prompt once another request shifted
its chunk boundaries. For each backend and each (L, P), fresh shapes in a row: the first call's
wall time (build and run), then the same shape again (run only), both synchronised, in ms.
Llama-3-8B heads (32 query, 8 KV, D 128), bf16.

    python benchmarks/kernels/attention_shapes.py
    python benchmarks/kernels/attention_shapes.py --device cpu --dtype float32 --shapes 37x0,5x40  # it runs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lab.engine.model.chunk_attention import chunk_attention

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# (chunk length, prefix length): a chat, a chat turn over a history, a tool output over a long
# session, and a long prompt's chunk; each is stepped by `--step` tokens between repeats so that
# every repeat is a shape never seen before.
DEFAULT_SHAPES = "60x0,500x2000,4000x100000,8192x40000"


def call_ms(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="LxP pairs, comma-separated")
    parser.add_argument("--backends", default="cudnn,flash")
    parser.add_argument("--repeats", type=int, default=5, help="new shapes per (L, P) and backend")
    parser.add_argument("--step", type=int, default=7, help="tokens added to L and P between repeats")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    shapes = [tuple(int(n) for n in pair.split("x")) for pair in args.shapes.split(",")]
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"{'backend':8} {'L':>6} {'P':>7}  {'first call ms':>14}  {'again ms':>9}  {'first - again':>13}")
    def inputs(n: int, p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(n, HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
        k = torch.randn(p + n, KV_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
        v = torch.randn(p + n, KV_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
        return q, k, v

    for backend in args.backends.split(","):
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return chunk_attention(q, k, v, HEAD_DIM ** -0.5, prefix_backend=backend, chunk_backend=backend)

        run(*inputs(3, 5))  # the backend's one-time set-up, outside every figure
        for length, prefix in shapes:
            firsts, agains = [], []
            for i in range(args.repeats):
                tensors = inputs(length + i * args.step, prefix + i * args.step if prefix else 0)
                firsts.append(call_ms(lambda: run(*tensors), sync))
                agains.append(call_ms(lambda: run(*tensors), sync))
            first, again = statistics.median(firsts), statistics.median(agains)
            print(f"{backend:8} {length:>6} {prefix:>7}  {first:>14.2f}  {again:>9.2f}  {first - again:>13.2f}")


if __name__ == "__main__":
    main()

"""The sampler's batched draw of seeded sampled rows against one row at a time.

Times `sampler.sample()` for a batch of seeded sampled rows against the per-row draw it replaced
(target_probs + draw in a loop, one row at a time): milliseconds per call, the median of the
timed calls after warm-up, on CUDA if there is one, else the CPU. Both draw the same tokens from
the same seeds, which the run checks before it times them.

    PYTHONPATH=. python benchmarks/kernels/sampler_batch.py [--rows 32] [--vocab 128256] [--calls 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from lab.engine.core.sampler import draw, sample, target_probs
from lab.engine.core.sampling_params import SamplingParams


def per_row(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]) -> torch.Tensor:
    """The sampler's former loop: one temperature, softmax, noise and argmax per row."""
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        tokens[i] = draw(target_probs(logits[i], p), gens[i])
    return tokens


def ms_per_call(fn: Callable[[], torch.Tensor], device: torch.device, calls: int, warmup: int = 5) -> float:
    """Median wall time of one call, the device's queue drained before the clock stops."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32, help="seeded sampled rows in the batch")
    parser.add_argument("--vocab", type=int, default=128_256, help="logits per row (Llama-3's vocabulary)")
    parser.add_argument("--calls", type=int, default=50, help="timed calls of each, after warm-up")
    parser.add_argument("--device", help="cuda or cpu (default: cuda if there is one)")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    logits = torch.randn(args.rows, args.vocab, device=device) * 3
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(args.rows)]

    def generators() -> list[torch.Generator]:
        return [torch.Generator(device=device).manual_seed(i) for i in range(args.rows)]

    same = torch.equal(sample(logits, params, generators()), per_row(logits, params, generators()))
    gens = generators()
    batched = ms_per_call(lambda: sample(logits, params, gens), device, args.calls)
    looped = ms_per_call(lambda: per_row(logits, params, gens), device, args.calls)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, {args.rows} seeded rows x {args.vocab} vocab: batched {batched:.3f} ms/call, per-row "
          f"{looped:.3f} ms/call ({looped / batched:.2f}x); same tokens: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit("sampler_batch: the batched draw and the per-row draw gave different tokens")


if __name__ == "__main__":
    main()

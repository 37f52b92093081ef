"""Time `sampler.sample()` for a batch of seeded sampled rows against the per-row draw it replaced
(target_probs + draw in a loop, one row at a time): milliseconds per call, the median of the
timed calls after warm-up, on CUDA if there is one, else the CPU.

    PYTHONPATH=. python benchmarks/sampler_batch.py [rows] [vocab] [calls]
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from typing import Callable

import torch

from lab.engine.core.sampler import draw, sample, target_probs
from lab.engine.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)


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


def main(rows: int = 32, vocab: int = 128_256, calls: int = 50) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logits = torch.randn(rows, vocab, device=device) * 3
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(rows)]
    gens = [torch.Generator(device=device).manual_seed(i) for i in range(rows)]
    batched = ms_per_call(lambda: sample(logits, params, gens), device, calls)
    looped = ms_per_call(lambda: per_row(logits, params, gens), device, calls)
    log.info("%s, %d seeded rows x %d vocab: batched %.3f ms/call, per-row %.3f ms/call (%.2fx)",
             torch.cuda.get_device_name() if device.type == "cuda" else "cpu", rows, vocab, batched, looped,
             looped / batched)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(*(int(a) for a in sys.argv[1:]))

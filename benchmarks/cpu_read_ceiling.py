"""How fast this host's cores can read memory, against the copy ceiling the engine's floors use.

Batch-1 decode reads every weight once per token and writes almost nothing, so its floor is the
read bandwidth. `lab engine bench` prints fractions of the copy ceiling (bytes read plus bytes
written by a large copy), which on a CPU also pays for the write-allocate reads of the
destination. This prints, for the threads torch uses (`OMP_NUM_THREADS`):

- copy: 2 x bytes / time of `dst.copy_(src)` (the bench's ceiling);
- read: bytes / time of `src.sum()`;
- gemv: weight bytes / time of one-row `F.linear` over SmolLM2-135M's decode products, 30 layers
  of distinct weights (the shapes a batch-1 token reads), float32 and bfloat16.

    OMP_NUM_THREADS=2 taskset -c 0,1 python benchmarks/cpu_read_ceiling.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# (out, in) of one SmolLM2-135M layer's products: q, k, v, o, gate, up, down.
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times[1:])  # the first pays for page faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="buffer size for copy and read")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    nbytes = args.mib << 20
    src = torch.empty(nbytes // 4).uniform_()
    dst = torch.empty_like(src)
    copy = 2 * nbytes / best_seconds(lambda: dst.copy_(src), args.repeats)
    read = nbytes / best_seconds(lambda: src.sum(), args.repeats)
    del src, dst
    print(f"{torch.get_num_threads()} threads: copy {copy / 1e9:.3g} GB/s (read + write), "
          f"read {read / 1e9:.3g} GB/s ({read / copy:.2f}x the copy ceiling)")
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(n, k).to(dtype) for _ in range(args.layers) for n, k in LAYER]
        xs = {k: torch.randn(1, k).to(dtype) for _, k in LAYER}
        wbytes = sum(w.numel() * w.element_size() for w in weights)

        def step() -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        seconds = best_seconds(step, args.repeats)
        print(f"  gemv {str(dtype).removeprefix('torch.'):>8}: {wbytes / 2**20:.0f} MiB of weights in "
              f"{seconds * 1e3:.2f} ms, {wbytes / seconds / 1e9:.3g} GB/s ({100 * wbytes / seconds / read:.3g}% of read)")


if __name__ == "__main__":
    main()

"""Bring a weight matrix into the GPU's L2 cache ahead of the product that reads it.

A decode step at batch 1 streams every weight once, and its memory sits nearly idle only while
attention runs: a few short, latency-bound kernels between the q|k|v product and the o
projection. A prefetch of the o projection's weight, launched on a side stream beside attention,
lets that idle bandwidth fetch what the next product reads, which then finds its weight in L2.
The prefetch writes nothing a result depends on; with it or without it every output is the same.

Modes (how a program fetches its lines):
- "load": 16-byte loads that bypass L1 (the .cg modifier), summed into one word per program so the
  loads are not optimised away. It runs anywhere, the interpreter included.
- "prefetch": one `prefetch.global.L2` per 128-byte line: no register receives data (sm_70+).
- "bulk": one `cp.async.bulk.prefetch.L2` per CHUNK bytes, the copy engine fetching the lines
  (sm_90+).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE = 128  # bytes of an L2 line as the prefetch instructions count them
MODES = ("load", "prefetch", "bulk")


@triton.jit(do_not_specialize=["num_words"])
def _prefetch_kernel(base_ptr, sink_ptr, num_words, MODE: tl.constexpr, BLOCK: tl.constexpr,
                     WORDS_PER_ITEM: tl.constexpr):
    # base_ptr is int32 words; an item is one lane's unit of work (a 16-byte load, a line, or a chunk).
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    # Whole items only: a tail shorter than one is left to the product that reads it.
    items = num_words // WORDS_PER_ITEM
    lanes = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    for first in range(pid * BLOCK, items, num_programs * BLOCK):
        item = first + lanes
        live = item < items
        if MODE == "load":
            words = item[:, None] * WORDS_PER_ITEM + tl.arange(0, WORDS_PER_ITEM)[None, :]
            values = tl.load(base_ptr + words, mask=live[:, None], other=0, cache_modifier=".cg")
            total += tl.sum(values, 1)
        elif MODE == "prefetch":
            # A dead lane prefetches the first line again: harmless, and no branch per lane.
            address = base_ptr + tl.where(live, item, 0).to(tl.int64) * WORDS_PER_ITEM
            total += tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [address],
                                               dtype=tl.int32, is_pure=False, pack=1)
        else:
            address = base_ptr + tl.where(live, item, 0).to(tl.int64) * WORDS_PER_ITEM
            total += tl.inline_asm_elementwise(
                f"cp.async.bulk.prefetch.L2.global [$1], {WORDS_PER_ITEM * 4}; mov.u32 $0, 0;", "=r,l",
                [address], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + pid, tl.sum(total, 0))


class L2Prefetch:
    """Prefetches on a stream of its own: `start(w)` forks from the current stream (so the fetch
    follows whatever was queued before it), `join()` makes the current stream wait for it. Both
    are recorded into a CUDA graph being captured, as a branch beside the kernels queued between."""

    def __init__(self, device: torch.device, programs: int, mode: str = "prefetch", chunk: int = 16384) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown L2 prefetch mode {mode!r} ({', '.join(MODES)})")
        self.mode, self.programs = mode, programs
        self.words_per_item = {"load": 4, "prefetch": LINE // 4, "bulk": chunk // 4}[mode]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.sink = torch.zeros(programs, dtype=torch.int32, device=device)

    def fetch(self, w: torch.Tensor, fraction: float = 1.0) -> None:
        """Launch the prefetch of the first `fraction` of w's bytes on the current stream."""
        assert w.is_contiguous() and w.data_ptr() % 16 == 0
        words = w.view(-1).view(torch.int32) if w.element_size() <= 4 else w.view(torch.int32)
        num_words = int(words.numel() * fraction)
        block = 64 if self.mode == "load" else 128
        _prefetch_kernel[(self.programs,)](words, self.sink, num_words, MODE=self.mode, BLOCK=block,
                                           WORDS_PER_ITEM=self.words_per_item, num_warps=4)

    def start(self, w: torch.Tensor, fraction: float = 1.0) -> None:
        if self.stream is None:
            self.fetch(w, fraction)
            return
        self.stream.wait_stream(torch.cuda.current_stream(w.device))
        with torch.cuda.stream(self.stream):
            self.fetch(w, fraction)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

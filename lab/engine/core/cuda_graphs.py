"""Decode steps replayed as CUDA graphs.

A decode step of a small model is hundreds of short kernels; launched one by one from Python,
the launches, not the GPU, set the pace. Each batch size in `capture_sizes` is captured (forward
pass and LM head) over static input buffers; a step copies its inputs into the buffers of the
smallest captured size that holds it and replays. Rows past the real batch are padding: they
write their K/V into the null block (one block past the pool, never handed out) and attend to
that one slot, so no kernel needs a special case for them.

A graph fixes its kernels' launch shapes, and split-KV decode attention sizes its grid for the
longest context it may see. A batch size gets one graph per context bound at which the
attention backend's launch changes (`context_bounds`; at batch 1 of Llama-3-8B the split count
grows up to 4K), and a step replays the one for the smallest bound that holds its longest
context. Correctness never depends on the bound: the kernels read each sequence's own length."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import numpy as np
import torch

from lab.engine.model.attention_metadata import AttentionMetadata
from lab.engine.model.model import Model

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model: Model, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], null_block: int,
                 block_size: int, max_model_len: int, max_batch: int,
                 context_bounds: Callable[[int], list[int]] | None = None) -> None:
        """`context_bounds(batch)`: increasing contexts ending with max_model_len, one graph each
        (default: one graph per batch size, sized for max_model_len)."""
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.null_block = null_block
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.bounds = {bs: context_bounds(bs) if context_bounds else [max_model_len] for bs in self.sizes}
        for bs, bounds in self.bounds.items():
            assert bounds and bounds == sorted(bounds) and bounds[-1] == max_model_len, (bs, bounds)
        device = model.device
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, self.max_blocks), null_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.src_rows = torch.full((n,), -1, dtype=torch.long, device=device)
        # Pinned staging buffers, one host-to-device copy per buffer per step, in two sets used
        # alternately (`run`'s parity): with overlapped decode the host fills step N+1's set while
        # step N's copies may still be queued, and step N-1 (the last user of the other set) has
        # finished.
        pin = device.type == "cuda"
        self.host_rows = torch.zeros((2, 4, n), dtype=torch.long, pin_memory=pin)
        self.host_context = torch.zeros((2, n), dtype=torch.int32, pin_memory=pin)
        self.host_tables = torch.zeros((2, n, self.max_blocks), dtype=torch.int32, pin_memory=pin)
        # Keyed by (batch size, context bound).
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int, bound: int) -> AttentionMetadata:
        # Host-side lengths only size the attention split count: the bound's, so the graph serves
        # every step whose contexts are at most that long.
        return AttentionMetadata(
            num_decodes=bs, slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            max_query_len=1, max_context_len=bound, query_lens_cpu=[1] * bs, context_lens_cpu=[bound] * bs)

    def _forward(self, bs: int, bound: int) -> torch.Tensor:
        hidden = self.model.forward(self.input_ids[:bs], self.positions[:bs], self._meta(bs, bound), self.kv_layers)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        null_slot = self.null_block * self.block_size
        self.slot_mapping.fill_(null_slot)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
                for bound in reversed(self.bounds[bs]):
                    for _ in range(2):  # compile and autotune outside the capture
                        self._forward(bs, bound)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self.logits[bs, bound] = self._forward(bs, bound)
                    if self.pool is None:
                        self.pool = graph.pool()
                    self.graphs[bs, bound] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        split = {bs: bounds for bs, bounds in self.bounds.items() if len(bounds) > 1}
        log.info("captured %d decode CUDA graphs for batch sizes %s (context bounds %s)", len(self.graphs),
                 self.sizes, split or "none")

    def batch_size_for(self, n: int) -> int | None:
        for bs in self.sizes:
            if bs >= n:
                return bs
        return None

    def bound_for(self, bs: int, context: int) -> int:
        """The smallest context bound of batch size `bs` that holds `context` (the largest if none:
        the model's positions stop at max_model_len)."""
        bounds = self.bounds[bs]
        return bounds[min(bisect.bisect_left(bounds, context), len(bounds) - 1)]

    @torch.inference_mode()
    def run(self, parity: int, input_ids: list[int], positions: list[int], block_tables: list[list[int]],
            prev_tokens: torch.Tensor | None = None, src_rows: list[int] | None = None) -> torch.Tensor:
        """Logits [n, vocab] of one decode step of n sequences (each one new token at `positions`),
        staged through buffer set `parity` (the runner's step parity). With `prev_tokens`, row i
        whose `src_rows[i]` is not -1 takes its input token from `prev_tokens[src_rows[i]]` on the
        device (a token sampled by a step not yet read back)."""
        n = len(input_ids)
        bs = self.batch_size_for(n)
        assert bs is not None, f"decode batch {n} exceeds the largest captured graph {self.max_batch}"
        bsz = self.block_size
        host_rows, host_context, host_tables = self.host_rows[parity], self.host_context[parity], \
            self.host_tables[parity]
        rows = host_rows.numpy()
        rows[0, :n] = input_ids
        pos = np.asarray(positions, dtype=np.int64)
        rows[1, :n] = pos
        tables = host_tables.numpy()
        width = 1
        slots = np.empty(n, dtype=np.int64)
        for i, table in enumerate(block_tables):
            tables[i, :len(table)] = table
            width = max(width, len(table))
            slots[i] = table[pos[i] // bsz] * bsz + pos[i] % bsz
        rows[2, :n] = slots
        context = host_context.numpy()
        context[:n] = pos + 1
        # Padding rows: null block, one token of context.
        rows[0, n:bs] = 0
        rows[1, n:bs] = 0
        rows[2, n:bs] = self.null_block * bsz
        context[n:bs] = 1
        tables[n:bs, 0] = self.null_block
        self.input_ids[:bs].copy_(host_rows[0, :bs], non_blocking=True)
        self.positions[:bs].copy_(host_rows[1, :bs], non_blocking=True)
        self.slot_mapping[:bs].copy_(host_rows[2, :bs], non_blocking=True)
        self.context_lens[:bs].copy_(host_context[:bs], non_blocking=True)
        self.block_tables[:bs, :width].copy_(host_tables[:bs, :width], non_blocking=True)
        if prev_tokens is not None and src_rows == list(range(n)):
            # The usual overlapped step: the same sequences in the same order as the last one.
            self.input_ids[:n].copy_(prev_tokens[:n])
        elif prev_tokens is not None:
            assert src_rows is not None
            rows[3, :n] = src_rows
            rows[3, n:bs] = -1
            src = self.src_rows[:bs]
            src.copy_(host_rows[3, :bs], non_blocking=True)
            fed = prev_tokens.index_select(0, src.clamp(min=0))
            self.input_ids[:bs].copy_(torch.where(src >= 0, fed, self.input_ids[:bs]))
        key = (bs, self.bound_for(bs, int(context[:n].max())))
        self.graphs[key].replay()
        return self.logits[key][:n]

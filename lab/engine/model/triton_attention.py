"""Paged attention on Triton kernels: the CUDA path behind the same interface and metadata as
the PyTorch reference (`lab.engine.model.attention.TorchAttention`)."""

from __future__ import annotations

import dataclasses
import logging
from bisect import bisect_left

import torch

from lab.engine.kernels.cache_dtypes import FP8_DTYPES
from lab.engine.model.attention_metadata import AttentionMetadata
from lab.engine.kernels.decode_attention import (MAX_SPLITS, decode_attention, num_splits_for,
                                                split_context_bounds)
from lab.engine.kernels.kv_write import write_kv_cache
from lab.engine.kernels.prefill_attention import prefill_attention
from lab.engine.model.attention import gather_context
from lab.engine.model.chunk_attention import PrefillKernels, chunk_attention

logger = logging.getLogger(__name__)

# Up to this many prefill chunks in a step go to PyTorch's fused attention one by one; more (many short
# prompts, e.g. a burst of chats) go to the paged varlen kernel in a single launch.
FEW_PREFILLS = 4


class TritonAttention:
    """`AttentionBackend` on Triton: the KV write, then split-KV decode attention for the first
    `meta.num_decodes` sequences and prefill attention (cached prefix + causal chunk) for the
    rest, all into one output. An fp8 cache holds K / k_scale and V / v_scale."""

    name = "triton"

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0, num_splits: int | None = None,
                 max_model_len: int | None = None, pdl: bool = False,
                 prefill_kernels: PrefillKernels = PrefillKernels()) -> None:
        self.k_scale = k_scale
        self.v_scale = v_scale
        # None: chosen per step from the decode batch and its longest context.
        self.num_splits = num_splits
        # Given max_model_len, an eager decode step (CUDA graphs off, or a batch past the largest
        # graph) sizes its split count by the context bound a graph would be captured at, not by
        # the exact context: the same split, hence the same sums in the same order, with graphs or
        # without, so turning graphs off changes no token.
        self.max_model_len = max_model_len
        self._bounds: dict[int, list[int]] = {}
        # Which of PyTorch's kernels attend a prefill chunk's prefix and its own tokens (warm_up
        # falls back to flash attention where this build's cuDNN cannot run them).
        self.prefill_kernels = prefill_kernels
        # Decode attention launched with programmatic dependent launch (engine knob `pdl`).
        self.pdl = pdl

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None, kv_written: bool = False) -> torch.Tensor:
        if not kv_written:
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        if out is None:
            # Contiguous whatever q's strides (q may be a view of the fused qkv product).
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = meta.num_decodes
        if num_decodes:
            decode_attention(q[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
                             meta.context_lens[:num_decodes], scale, out[:num_decodes],
                             max_context_len=self._max_decode_context(meta, k_cache), k_scale=self.k_scale,
                             v_scale=self.v_scale, num_splits=self.num_splits, pdl=self.pdl)
        num_prefills = meta.num_seqs - num_decodes
        if 0 < num_prefills <= FEW_PREFILLS:
            self._flash_prefills(q, k, v, k_cache, v_cache, meta, scale, out)
        elif num_prefills:
            # meta.max_query_len is the longest prefill: decodes have query length 1.
            prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                              scale, out, first_seq=num_decodes, num_seqs=num_prefills,
                              max_query_len=meta.max_query_len, k_scale=self.k_scale,
                              v_scale=self.v_scale)
        return out

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, null_block: int, num_heads: int,
                dtype: torch.dtype) -> None:
        """Compile, before the engine serves, every variant of the attention kernels that a step
        may launch: the paged prefill kernel (bursts of more than FEW_PREFILLS prompts) and the
        decode kernels at every split count of an eager step (no CUDA graph: graphs off, or a
        batch past the largest one). Without this a first boot compiles them while it is being
        measured, and its figures include the compile. Reads and writes only the null block."""
        device = k_cache.device
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        # q as the model passes it: a view of the fused qkv rows, so strides specialise alike.
        qkv = torch.zeros(2, num_heads + 2 * kv_heads, head_dim, dtype=dtype, device=device)
        q = qkv[:, :num_heads]
        table = torch.full((2, 1), null_block, dtype=torch.int32, device=device)
        context = torch.ones(2, dtype=torch.int32, device=device)
        out = torch.empty(q.shape, dtype=dtype, device=device)
        # Split count 1 runs the direct variant; each power-of-two bucket above it is a merge width.
        splits = [1] + [width // 2 + 1 for width in (2 ** i for i in range(1, MAX_SPLITS.bit_length()))
                        if width // 2 + 1 <= MAX_SPLITS]
        for num_splits in sorted(set(splits)):
            decode_attention(q[:1], k_cache, v_cache, table[:1], context[:1], 1.0, out[:1],
                             k_scale=self.k_scale, v_scale=self.v_scale, num_splits=num_splits, pdl=self.pdl)
        starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
        prefill_attention(q, k_cache, v_cache, table, starts, context, 1.0, out, first_seq=1, num_seqs=1,
                          max_query_len=1, k_scale=self.k_scale, v_scale=self.v_scale)
        kernels = ("flash",) if self.prefill_kernels.mode == "flash" else ("flash", "cudnn")
        for kernel in kernels:
            try:
                chunk_attention(q, qkv[:, num_heads:num_heads + kv_heads].contiguous().repeat(2, 1, 1),
                                qkv[:, num_heads + kv_heads:].contiguous().repeat(2, 1, 1), 1.0, kernel, kernel)
            except RuntimeError as exc:
                if kernel == "flash":
                    raise
                logger.warning("prefill attention: cuDNN's kernels cannot run here (%s); using flash attention",
                               str(exc).splitlines()[0])
                self.prefill_kernels = dataclasses.replace(self.prefill_kernels, mode="flash")
        torch.cuda.synchronize(device)

    def context_bounds(self, batch: int, k_cache: torch.Tensor, max_model_len: int) -> list[int]:
        """Longest contexts at which a decode launch of `batch` sequences changes shape (its split
        count), ending with max_model_len: one CUDA graph each."""
        if self.num_splits is not None:
            return [max_model_len]
        return split_context_bounds(
            lambda context: num_splits_for(batch, k_cache.shape[2], context, k_cache.device, k_cache.dtype),
            max_model_len)

    def _flash_prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """A few long chunks: PyTorch's fused attention kernels, fed contiguous K/V (the chunk's own
        when it has no cached prefix, else gathered from the cache), beat the paged kernel, which
        cannot pipeline its gathered loads. The gather costs one pass over the context per layer;
        the prefix and the chunk are attended separately and merged (`chunk_attention`)."""
        start = meta.num_decodes
        for i in range(meta.num_decodes, meta.num_seqs):
            qlen, ctx = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
            end = start + qlen
            if ctx == qlen and k_cache.dtype not in FP8_DTYPES:
                ki, vi = k[start:end], v[start:end]
            else:
                # A prefix, or an fp8 cache: attend to exactly what later steps will read back
                # (quantised as x / scale, widened times the scale).
                ki = gather_context(k_cache, meta.block_tables[i], ctx, q.dtype, self.k_scale)
                vi = gather_context(v_cache, meta.block_tables[i], ctx, q.dtype, self.v_scale)
            kernels = self.prefill_kernels.for_chunk(qlen, ctx - qlen, q.shape[1], q.shape[2])
            chunk_attention(q[start:end], ki, vi, scale, *kernels, out=out[start:end])
            start = end

    def _max_decode_context(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> int:
        # Sizes the split count only. From the host-side lengths, once per step for all layers.
        if "triton_max_decode_context" not in meta.scratch:
            context = max(meta.context_lens_cpu[:meta.num_decodes])
            if self.max_model_len is not None and self.num_splits is None:
                batch = meta.num_decodes
                if batch not in self._bounds:
                    self._bounds[batch] = self.context_bounds(batch, k_cache, self.max_model_len)
                bounds = self._bounds[batch]
                context = bounds[min(bisect_left(bounds, context), len(bounds) - 1)]
            meta.scratch["triton_max_decode_context"] = context
        return meta.scratch["triton_max_decode_context"]

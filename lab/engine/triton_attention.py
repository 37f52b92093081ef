"""Paged attention on Triton kernels: the CUDA path behind the same interface and metadata as
the PyTorch reference (`lab.engine.attention.TorchAttention`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lab.engine.attention import FP8_DTYPES
from lab.engine.attention_metadata import AttentionMetadata
from lab.engine.kernels import decode_attention, prefill_attention, write_kv_cache


class TritonAttention:
    """`AttentionBackend` on Triton: the KV write, then split-KV decode attention for the first
    `meta.num_decodes` sequences and prefill attention (cached prefix + causal chunk) for the
    rest, all into one output. An fp8 cache holds K / k_scale and V / v_scale."""

    name = "triton"

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0, num_splits: int | None = None) -> None:
        self.k_scale = k_scale
        self.v_scale = v_scale
        # None: chosen per step from the decode batch and its longest context.
        self.num_splits = num_splits

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        if out is None:
            # Contiguous whatever q's strides (q may be a view of the fused qkv product).
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = meta.num_decodes
        if num_decodes:
            decode_attention(q[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
                             meta.context_lens[:num_decodes], scale, out[:num_decodes],
                             max_context_len=self._max_decode_context(meta), k_scale=self.k_scale,
                             v_scale=self.v_scale, num_splits=self.num_splits)
        num_prefills = meta.num_seqs - num_decodes
        if num_prefills and self._all_cold(meta):
            self._cold_prefills(q, k, v, k_cache.dtype, meta, scale, out)
        elif num_prefills:
            # meta.max_query_len is the longest prefill: decodes have query length 1.
            prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                              scale, out, first_seq=num_decodes, num_seqs=num_prefills,
                              max_query_len=meta.max_query_len, k_scale=self.k_scale,
                              v_scale=self.v_scale)
        return out

    @staticmethod
    def _all_cold(meta: AttentionMetadata) -> bool:
        """Every prefill chunk of the step starts at position 0 (no cached prefix)."""
        nd = meta.num_decodes
        return all(q == c for q, c in zip(meta.query_lens_cpu[nd:], meta.context_lens_cpu[nd:]))

    @staticmethod
    def _cold_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype,
                       meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """A chunk with no cached prefix attends only to its own fresh K/V, which are contiguous:
        PyTorch's flash attention runs that faster than a paged kernel can (it needs no block
        table and pipelines its loads)."""
        start = meta.num_decodes
        group = q.shape[1] // k.shape[1]
        for qlen in meta.query_lens_cpu[meta.num_decodes:]:
            end = start + qlen
            ki, vi = k[start:end], v[start:end]
            if cache_dtype in FP8_DTYPES:
                # Attend to what later steps will read back from the cache.
                ki, vi = ki.to(cache_dtype).to(q.dtype), vi.to(cache_dtype).to(q.dtype)
            qi = q[start:end].transpose(0, 1).unsqueeze(0)
            ki = ki.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
            vi = vi.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
            out[start:end] = oi.squeeze(0).transpose(0, 1)
            start = end

    @staticmethod
    def _max_decode_context(meta: AttentionMetadata) -> int:
        # Sizes the split count only. From the host-side lengths, once per step for all layers.
        if "triton_max_decode_context" not in meta.scratch:
            meta.scratch["triton_max_decode_context"] = max(meta.context_lens_cpu[:meta.num_decodes])
        return meta.scratch["triton_max_decode_context"]

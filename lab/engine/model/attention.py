"""Paged attention, PyTorch reference path: the CPU implementation and the oracle for the
Triton kernels. Both paths share `AttentionMetadata` and the KV-cache layout."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from lab.engine.kernels.cache_dtypes import FP8_DTYPES
from lab.engine.model.attention_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_written: bool = False) -> torch.Tensor:
        """Write this step's K/V ([T, KVH, D]) into the caches (unless a fused kernel already
        did), then return attention output [T, H, D] for queries q ([T, H, D])."""
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    kvh, d = k_cache.shape[-2:]
    if k_cache.dtype in FP8_DTYPES:
        # index_copy_ has no float8 kernel on the CPU; indexed assignment does.
        k_cache.view(-1, kvh, d)[slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(-1, kvh, d)[slot_mapping] = v.to(v_cache.dtype)
        return
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    kvh, d = cache.shape[-2:]
    # index_select on the flat slot axis: several times faster than advanced indexing on the CPU.
    out = cache.view(-1, kvh, d).index_select(0, slots.reshape(-1)).view(*slots.shape, kvh, d)
    return out.to(dtype) if out.dtype != dtype else out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last `len(q)` positions of a `len(k)`-token context, causal and aligned
    bottom-right (query i sits at position len(k) - len(q) + i). q: [Lq, H, D], k/v: [Lk, KVH, D]
    in q's dtype."""
    lq, lk = q.shape[0], k.shape[0]
    qi, ki, vi = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if lq == lk:
        out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
    elif q.device.type == "cpu":
        # The mask PyTorch's CausalBias builds on the CPU (its flash and efficient paths are CUDA's),
        # built here: importing torch.nn.attention.bias pulls in torch._dynamo, seconds of the first
        # prefix-cache hit of every boot.
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        # Imported here for the same reason (the CUDA path attends to a prefix in
        # lab.engine.model.chunk_attention).
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=causal_lower_right(lq, lk), scale=scale,
                                             enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int, dtype: torch.dtype,
                   scale: float = 1.0) -> torch.Tensor:
    """The first `context_len` tokens of one sequence's K or V, contiguous: [context_len, KVH, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(context_len, device=cache.device)
    table = block_table[: (context_len + block_size - 1) // block_size].long()
    out = gather_kv(cache, table[pos // block_size] * block_size + pos % block_size, dtype)
    return out * scale if scale != 1.0 else out


def _decode_index(meta: AttentionMetadata, block_size: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Slots [nd, max_ctx] of the decode sequences and an additive mask [nd, 1, 1, max_ctx] for
    the padding of shorter contexts (None when every context has the same length), built once
    per step and shared by all layers."""
    cached = meta.scratch.get("torch_decode_index")
    if cached is not None:
        return cached
    nd = meta.num_decodes
    max_ctx = max(meta.context_lens_cpu[:nd])
    device = meta.block_tables.device
    pos = torch.arange(max_ctx, device=device)
    blocks = meta.block_tables[:nd, pos // block_size].long()
    slots = blocks * block_size + (pos % block_size)
    mask = None
    # Decided on the lengths tensor, not the host copy: CUDA-graph metadata reports the longest
    # possible context on the host for every row.
    if not bool((meta.context_lens[:nd] == max_ctx).all()):
        valid = pos[None, :] < meta.context_lens[:nd, None]
        mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))
        mask = mask[:, None, None, :]
    meta.scratch["torch_decode_index"] = (slots, mask)
    return slots, mask


class TorchAttention:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_written: bool = False) -> torch.Tensor:
        if not kv_written:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        nd = meta.num_decodes
        if nd:
            slots, mask = _decode_index(meta, block_size, q.dtype)
            kd = gather_kv(k_cache, slots, q.dtype).transpose(1, 2)  # [nd, KVH, max_ctx, D]
            vd = gather_kv(v_cache, slots, q.dtype).transpose(1, 2)
            qd = q[:nd].unsqueeze(2)  # [nd, H, 1, D]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)
            out[:nd] = od.squeeze(2)
        start = nd
        for i in range(nd, meta.num_seqs):
            qlen, ctx = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
            end = start + qlen
            if ctx == qlen:
                # No cached prefix: attend to this chunk's own K/V, as the cache holds them.
                ki, vi = k[start:end], v[start:end]
                if k_cache.dtype in FP8_DTYPES:
                    ki, vi = ki.to(k_cache.dtype), vi.to(v_cache.dtype)
                ki, vi = ki.to(q.dtype), vi.to(q.dtype)
            else:
                ki = gather_context(k_cache, meta.block_tables[i], ctx, q.dtype)
                vi = gather_context(v_cache, meta.block_tables[i], ctx, q.dtype)
            out[start:end] = causal_attention(q[start:end], ki, vi, scale)
            start = end
        return out

"""The inner loop shared by the decode and prefill attention kernels: online softmax over KV
tiles read through a block table.

A tile is BLOCK_N consecutive KV positions of one sequence; each position finds its page in the
block table, so a tile may span several cache blocks and a block size need not divide BLOCK_N.
Scores are kept in the log2 domain (`qk_scale` includes log2(e)) so the loop uses exp2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lab.engine.attention import FP8_DTYPES


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 runs are the exactness reference, so their tl.dot stays IEEE fp32 rather than tf32;
    16-bit inputs use the tensor cores whatever this says."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_in_fp16(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether a 16-bit query meets an fp8 cache in fp16 dots rather than in q's dtype. fp8 widens
    to fp16 in one instruction per pair and to bf16 in several (decode at batch 256 ran 9% faster
    on an H200); fp16 holds every fp8 value and every softmax weight exactly, and a bf16 query
    exactly from 6e-5 to 65504 in magnitude (larger ones would overflow)."""
    return cache_dtype in FP8_DTYPES and q_dtype in (torch.bfloat16, torch.float16)


@triton.jit
def attend_tiles(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, head_offset,
                 start, end, qk_scale, stride_cache_block, stride_cache_slot, block_size, dims, dim_mask,
                 CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold KV positions [start, end) into the running (acc, l_i, m_i) of the query rows q.
    CAUSAL masks position n for a row whose query position q_pos < n; otherwise only n >= end is
    masked. Positions past `end` are never loaded, so stale or poisoned cache slots are not read."""
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        in_range = pos < end
        page = tl.load(table_ptr + pos // block_size, mask=in_range, other=0).to(tl.int64)
        offsets = page * stride_cache_block + (pos % block_size) * stride_cache_slot + head_offset
        kv_mask = in_range[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        # An fp8 cache widens exactly to the dot dtype (q's); its scale is folded into qk_scale.
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        if CAUSAL:
            visible = (pos[None, :] <= q_pos[:, None]) & in_range[None, :]
        else:
            visible = in_range[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Every row the caller stores has seen a visible position by the end of this tile (the
        # callers order their ranges so), so m_new is finite and no exponent is (-inf) - (-inf).
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i

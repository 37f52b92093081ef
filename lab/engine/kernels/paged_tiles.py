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

from lab.engine.kernels.cache_dtypes import FP8_DTYPES


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
def fp8_pairs_to_f16(words, ASM: tl.constexpr):
    """Widen fp8 e4m3 pairs (int16 words, low byte first) to fp16; returns (low, high) elements.
    ASM (GPU, sm_89+): one cvt.rn.f16x2.e4m3x2 per pair. Otherwise (the interpreter, which cannot
    run inline PTX) integer ops: e4m3's sign, exponent and mantissa fields moved into fp16's
    places give the value times 2^-8 exactly (subnormals included), then times 2^8 exactly.
    (e4m3's NaN encodings would come out as +-480; callers never load unwritten slots.)"""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }", "=h,=h,h", [words],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        low = (((words & 0x80) << 8) | ((words & 0x7F) << 7)).to(tl.int16)
        high = ((words & -32768) | ((words >> 1) & 0x3F80)).to(tl.int16)
        return low.to(tl.float16, bitcast=True) * 256.0, high.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def kv_offsets(page, pos, head_offset, stride_cache_block, stride_cache_slot, BLOCK_SIZE: tl.constexpr):
    """Element offsets of positions `pos` (in cache blocks `page`) of one KV head in a cache."""
    # int64 before multiplying: a layer's cache can exceed 2^31 elements.
    return page.to(tl.int64) * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot + head_offset


@triton.jit
def load_v(v_cache_ptr, offsets, in_range, kv_mask, dims, BLOCK_D: tl.constexpr, V_FP8_PAIRS: tl.constexpr):
    """A V tile; as int16 words (pairs of fp8 values) when V_FP8_PAIRS, for widen_v."""
    if V_FP8_PAIRS:
        # The caller guarantees head_dim == BLOCK_D and an aligned cache (all offsets are even).
        pairs = tl.arange(0, BLOCK_D // 2)
        return tl.load(v_cache_ptr.to(tl.pointer_type(tl.int16)) + (offsets // 2)[:, None] + pairs[None, :],
                       mask=in_range[:, None], other=0)
    else:
        return tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)


@triton.jit
def widen_v(v, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, V_FP8_PAIRS: tl.constexpr, FP8_ASM: tl.constexpr):
    """V_FP8_PAIRS (fp8 cache, fp16 dots): the int16 words of load_v widened to an fp16 tile, in
    the layout they were loaded in. Left to itself (an fp8 tile and .to()), Triton moves the
    widening after V's conversion to the dot-operand layout, which for V (contracted over
    positions, not over its contiguous dims) is one shared-memory load per byte (128 per thread
    per 128-token tile); widened first (the join/reshape keeps Triton from moving it), the fp16
    tile reaches the dot through transposing 16-bit ldmatrix, as a bf16 cache's does."""
    if V_FP8_PAIRS:
        low, high = fp8_pairs_to_f16(v, FP8_ASM)
        return tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_D))
    else:
        return v


@triton.jit
def softmax_step(q, k, q_pos, pos, in_range, l_i, m_i, qk_scale, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DEFER_SUM: tl.constexpr = False):
    """Scores of the query rows against a K tile folded into the running softmax: returns the
    tile's weights p, the rescale alpha of what came before, and the new (l_i, m_i). DEFER_SUM:
    l_i is [rows, BLOCK_N], the sums per tile column, which the caller sums at the end."""
    # An fp8 cache widens exactly to the dot dtype (q's); its scale is folded into qk_scale.
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL:
        visible = (pos[None, :] <= q_pos[:, None]) & in_range[None, :]
    else:
        visible = in_range[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Every row the caller stores has seen a visible position by the end of the first tile (the
    # callers order their ranges so, and a range's first tile starts inside it), so m_new is
    # finite and no exponent is (-inf) - (-inf).
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    if DEFER_SUM:
        return p, alpha, l_i * alpha[:, None] + p, m_new
    else:
        return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def attend_tiles(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, head_offset,
                 start, end, qk_scale, stride_cache_block, stride_cache_slot, dims, dim_mask,
                 BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_D: tl.constexpr = 0, V_FP8_PAIRS: tl.constexpr = False, FP8_ASM: tl.constexpr = False,
                 PAGES_AHEAD: tl.constexpr = False, DEFER_SUM: tl.constexpr = False):
    """Fold KV positions [start, end) into the running (acc, l_i, m_i) of the query rows q.
    CAUSAL masks position n for a row whose query position q_pos < n; otherwise only n >= end is
    masked. Positions past `end` are never loaded, so stale or poisoned cache slots are not read.

    Triton's software pipeliner turns the K/V loads into asynchronous copies to shared memory.
    When a tile's block-table lookup happens in the same loop step as its K/V loads, the lookup
    takes a pipeline stage of its own and the K/V tile gets a single buffer: the next tile's copy
    is issued only after this tile's last use, so nothing is in flight while a program computes.
    PAGES_AHEAD looks the next tile's cache blocks up one step early (a loop-carried value), so
    the K/V loads depend on no load of their own step and get num_stages - 1 buffers: the next
    tile streams in while this one is folded (used by fp8 decode; see decode_attention)."""
    if PAGES_AHEAD:
        pos = start + tl.arange(0, BLOCK_N)
        pages = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos < end, other=0)
        for tile_start in range(start, end, BLOCK_N):
            pos = tile_start + tl.arange(0, BLOCK_N)
            in_range = pos < end
            next_pos = pos + BLOCK_N
            next_pages = tl.load(table_ptr + next_pos // BLOCK_SIZE, mask=next_pos < end, other=0)
            offsets = kv_offsets(pages, pos, head_offset, stride_cache_block, stride_cache_slot, BLOCK_SIZE)
            kv_mask = in_range[:, None] & dim_mask[None, :]
            k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            v = widen_v(load_v(v_cache_ptr, offsets, in_range, kv_mask, dims, BLOCK_D, V_FP8_PAIRS),
                        BLOCK_N, BLOCK_D, V_FP8_PAIRS, FP8_ASM)
            p, alpha, l_i, m_i = softmax_step(q, k, q_pos, pos, in_range, l_i, m_i, qk_scale, CAUSAL, DOT_PRECISION,
                                                DEFER_SUM)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
            pages = next_pages
    else:
        for tile_start in range(start, end, BLOCK_N):
            pos = tile_start + tl.arange(0, BLOCK_N)
            in_range = pos < end
            page = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0)
            offsets = kv_offsets(page, pos, head_offset, stride_cache_block, stride_cache_slot, BLOCK_SIZE)
            kv_mask = in_range[:, None] & dim_mask[None, :]
            k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            p, alpha, l_i, m_i = softmax_step(q, k, q_pos, pos, in_range, l_i, m_i, qk_scale, CAUSAL, DOT_PRECISION,
                                                DEFER_SUM)
            v = widen_v(load_v(v_cache_ptr, offsets, in_range, kv_mask, dims, BLOCK_D, V_FP8_PAIRS),
                        BLOCK_N, BLOCK_D, V_FP8_PAIRS, FP8_ASM)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, l_i, m_i

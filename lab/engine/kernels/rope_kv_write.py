"""RoPE fused with the KV-cache write: one launch rotates this step's q and k (rotate-half layout,
float32 math, each result rounded once to the input dtype, as `lab.engine.model.layers.apply_rope_rows`
does), writes the rotated k back in place, and stores the rotated k and the unrotated v at their
cache slots (an fp8 cache holds x / scale, rounded as `kv_write.write_kv_cache` rounds).

One program per token: it loads the token's cos|sin row once, then rotates all query heads, all
key heads and copies all value heads. q, k and v may be strided views of one fused qkv product
(rows of the product's width, heads contiguous), which is how the model hands them over; the
rotation is in place, so callers keep using q and k (k, e.g., for a fresh prefill chunk's own
attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lab.engine.kernels.cache_dtypes import FP8_DTYPES


@triton.jit
def _rotate(x1, x2, cos, sin):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in float32: the two halves of a rotate-half RoPE."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def to_cache(x, scale, cache_ptr, QUANTIZE: tl.constexpr):
    # Per-tensor scaled fp8: the cache holds x / scale; IEEE division so the byte is exactly what
    # PyTorch's (x.float() / scale).to(fp8) gives (kv_write does the same).
    if QUANTIZE:
        x = tl.div_rn(x.to(tl.float32), scale)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos_sin,
                    stride_cache_block, stride_cache_slot, stride_cache_head,
                    block_size, num_heads, num_kv_heads, half,
                    QUANTIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
                    BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half
    row = cos_sin_ptr + token * stride_cos_sin
    cos = tl.load(row + dims, mask=dim_mask, other=0.0)
    sin = tl.load(row + half + dims, mask=dim_mask, other=0.0)

    # Query heads, in place.
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < num_heads) & dim_mask[None, :]
    q = q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    y1, y2 = _rotate(tl.load(q, mask=mask, other=0.0), tl.load(q + half, mask=mask, other=0.0), cos, sin)
    tl.store(q, y1.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(q + half, y2.to(q_ptr.dtype.element_ty), mask=mask)

    # Key heads: rounded to k's dtype once, stored in place and (from that rounded value) in
    # the cache, so the cache holds exactly what writing the returned k would store.
    kv_heads = tl.arange(0, BLOCK_KVH)
    kv_mask = (kv_heads[:, None] < num_kv_heads) & dim_mask[None, :]
    k = k_ptr + token * stride_kt + kv_heads[:, None] * stride_kh + dims[None, :]
    y1, y2 = _rotate(tl.load(k, mask=kv_mask, other=0.0), tl.load(k + half, mask=kv_mask, other=0.0), cos, sin)
    k1 = y1.to(k_ptr.dtype.element_ty)
    k2 = y2.to(k_ptr.dtype.element_ty)
    tl.store(k, k1, mask=kv_mask)
    tl.store(k + half, k2, mask=kv_mask)

    slot = tl.load(slot_ptr + token)
    # int64 before multiplying: a layer's cache can exceed 2^31 elements.
    block = (slot // block_size).to(tl.int64)
    dst = block * stride_cache_block + (slot % block_size) * stride_cache_slot \
        + kv_heads[:, None] * stride_cache_head + dims[None, :]
    tl.store(k_cache_ptr + dst, to_cache(k1, k_scale, k_cache_ptr, QUANTIZE), mask=kv_mask)
    tl.store(k_cache_ptr + dst + half, to_cache(k2, k_scale, k_cache_ptr, QUANTIZE), mask=kv_mask)

    # Value heads: copied (quantized) as they are, in the same two halves.
    v = v_ptr + token * stride_vt + kv_heads[:, None] * stride_vh + dims[None, :]
    v1 = tl.load(v, mask=kv_mask, other=0.0)
    v2 = tl.load(v + half, mask=kv_mask, other=0.0)
    tl.store(v_cache_ptr + dst, to_cache(v1, v_scale, v_cache_ptr, QUANTIZE), mask=kv_mask)
    tl.store(v_cache_ptr + dst + half, to_cache(v2, v_scale, v_cache_ptr, QUANTIZE), mask=kv_mask)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_rows: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ([T, H, D]) and k ([T, KVH, D]) in place with `cos_sin_rows` ([T, D] float32, cos
    in the first half, sin in the second, one row per token), and store the rotated k and v
    ([T, KVH, D]) at `slot_mapping` ([T]; slot = block * block_size + offset, never negative) of
    the caches ([num_blocks, block_size, KVH, D]; an fp8 cache holds x / scale, other caches need
    scale 1). q, k, v may be strided views (e.g. of a fused qkv product) with unit last stride.
    Returns (q, k), rotated. One kernel launch."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and v.shape == k.shape and head_dim % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert q.dtype == k.dtype == v.dtype
    assert cos_sin_rows.dtype == torch.float32 and cos_sin_rows.shape == (num_tokens, head_dim)
    assert cos_sin_rows.stride(-1) == 1
    assert slot_mapping.shape == (num_tokens,)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    quantize = k_cache.dtype in FP8_DTYPES
    assert quantize or (k_scale == 1.0 and v_scale == 1.0), "KV scales apply to fp8 caches only"
    if num_tokens:
        half = head_dim // 2
        _rope_kv_kernel[(num_tokens,)](
            q, k, v, cos_sin_rows, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_rows.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            k_cache.shape[1], num_heads, num_kv_heads, half,
            QUANTIZE=quantize, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_KVH=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        )
    return q, k

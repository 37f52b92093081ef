"""KV-cache write: scatter this step's K and V into the paged caches.

One program per new token copies all of its KV heads (a [KVH, D] tile, 2 KiB for Llama-3-8B in
bf16) for K and for V. The copy is purely memory bound; one launch for both caches halves the
launch overhead that two `index_copy_` calls would pay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lab.engine.kernels.cache_dtypes import FP8_DTYPES


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cache_block, stride_cache_slot, stride_cache_head,
                     block_size, num_kv_heads, head_dim,
                     QUANTIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    # A negative slot marks a padding token (a CUDA-graph batch padded to its captured size):
    # it owns no cache slot and must not overwrite one.
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    # int64 before multiplying: a layer's cache can exceed 2^31 elements.
    block = (slot // block_size).to(tl.int64)
    dst = block * stride_cache_block + (slot % block_size) * stride_cache_slot \
        + heads[:, None] * stride_cache_head + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if QUANTIZE:
        # Per-tensor scaled fp8: the cache holds x / scale, readers multiply by scale. IEEE
        # division so the stored byte is exactly what PyTorch's (x / scale).to(fp8) gives.
        k = tl.div_rn(k.to(tl.float32), k_scale)
        v = tl.div_rn(v.to(tl.float32), v_scale)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store k, v ([T, KVH, D]) at `slot_mapping` ([T]; negative = skip) of the caches
    ([num_blocks, block_size, KVH, D]). An fp8 cache stores x / scale; other caches need scale 1."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert v.shape == k.shape and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    quantize = k_cache.dtype in FP8_DTYPES
    assert quantize or (k_scale == 1.0 and v_scale == 1.0), "KV scales apply to fp8 caches only"
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim,
        QUANTIZE=quantize, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
    )

"""Rotary position embedding in the rotate-half layout, fused over q and k and over heads: one
program per token loads its cos/sin row once and rotates all query and key heads. Same
semantics as `lab.engine.layers.apply_rope` (float32 math, result rounded to the input dtype),
in place or into new tensors."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, stride_src_t, stride_src_h, stride_dst_t, stride_dst_h,
                  cos, sin, num_heads, half,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half)
    src = src_ptr + token * stride_src_t + heads[:, None] * stride_src_h + dims[None, :]
    dst = dst_ptr + token * stride_dst_t + heads[:, None] * stride_dst_h + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    y1 = x1.to(tl.float32) * cos[None, :] - x2.to(tl.float32) * sin[None, :]
    y2 = x2.to(tl.float32) * cos[None, :] + x1.to(tl.float32) * sin[None, :]
    tl.store(dst, y1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, y2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                 stride_cos_sin, num_heads, num_kv_heads, half,
                 BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    dims = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cos_sin
    cos = tl.load(row + dims, mask=dims < half, other=0.0)
    sin = tl.load(row + half + dims, mask=dims < half, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  num_heads, half, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  num_kv_heads, half, BLOCK_KVH, BLOCK_HALF)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               inplace: bool = False,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ([T, H, D]) and k ([T, KVH, D]) at `positions` ([T]) with `cos_sin_cache`
    ([max_pos, D] float32, cos in the first half). Returns (q, k) themselves when `inplace`, the
    tensors of `out` when given, else new tensors. All may be strided views (e.g. of a fused qkv
    projection) with a unit last stride."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == head_dim
    assert cos_sin_cache.stride(-1) == 1
    assert not (inplace and out is not None), "inplace and out exclude each other"
    if inplace:
        q_out, k_out = q, k
    elif out is not None:
        q_out, k_out = out
        assert q_out.shape == q.shape and k_out.shape == k.shape
        assert q_out.stride(-1) == 1 and k_out.stride(-1) == 1
    else:
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if num_tokens:
        half = head_dim // 2
        _rope_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos_sin_cache.stride(0), num_heads, num_kv_heads, half,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        )
    return q_out, k_out

"""The merge of a prefill chunk's two attentions (over its cached prefix, and over itself) in one
pass, written straight into the step's output.

`lab.engine.model.chunk_attention.merge` in PyTorch widens both outputs to float32, scales each,
adds them and rounds back: six elementwise kernels, most of them reading or writing a float32
[L, H, D] tensor, then a permuted copy of the prefix's folded rows and a copy into the output.
Here each output row is read once from each part (the prefix part in its folded layout, the
chunk part in whatever strides its kernel wrote) and written once. Same arithmetic as `merge`:
weights exp(lse - max) over their sum in float32, the weighted sum in float32, rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32


# The chunk length and the strides that scale with it change with every prompt. Triton would
# compile a variant per class of their values (1, a multiple of 16, other) the first time each
# class came, while the engine serves: a chat turn of 488 tokens after one of 113 paid a compile.
# The strides of the outputs' rows stay multiples of 16 (the head dimension is), so the loads keep
# their alignment.
@triton.jit(do_not_specialize=["length", "s_plse_h", "s_clse_h"])
def _merge_kernel(po_ptr, plse_ptr, co_ptr, clse_ptr, out_ptr, length,
                  s_po_h, s_po_r, s_plse_h, s_plse_r, s_co_h, s_co_t, s_clse_h, s_clse_t, s_out_t, s_out_h,
                  GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    head = tl.program_id(1)
    kv_head = head // GROUP
    # Row r of KV head h in the folded prefix attention is query head h * GROUP + r // length at token r % length.
    prow0 = (head % GROUP) * length
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    rows_ok = tokens < length
    tile_ok = rows_ok[:, None] & (dims[None, :] < DIM)
    t64 = tokens.to(tl.int64)
    lse_a = tl.load(plse_ptr + kv_head * s_plse_h + (prow0 + t64) * s_plse_r, mask=rows_ok, other=0.0)
    lse_b = tl.load(clse_ptr + head * s_clse_h + t64 * s_clse_t, mask=rows_ok, other=0.0)
    top = tl.maximum(lse_a, lse_b)
    w_a = tl.exp(lse_a - top)
    w_b = tl.exp(lse_b - top)
    total = w_a + w_b
    a = tl.load(po_ptr + kv_head * s_po_h + (prow0 + t64)[:, None] * s_po_r + dims[None, :], mask=tile_ok, other=0.0)
    b = tl.load(co_ptr + head * s_co_h + t64[:, None] * s_co_t + dims[None, :], mask=tile_ok, other=0.0)
    merged = a.to(tl.float32) * (w_a / total)[:, None] + b.to(tl.float32) * (w_b / total)[:, None]
    tl.store(out_ptr + t64[:, None] * s_out_t + head * s_out_h + dims[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=tile_ok)


def merge_into(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, chunk_out: torch.Tensor,
               chunk_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [L, H, D] = the softmax-weighted sum of the prefix attention (folded: prefix_out
    [KVH, G * L, D], prefix_lse [KVH, G * L]) and the chunk's own (chunk_out [H, L, D], chunk_lse
    [H, L]); lse in float32, the last dimension of every tensor contiguous. Returns out."""
    length, heads, dim = out.shape
    kv_heads = prefix_out.shape[0]
    if (heads % kv_heads or prefix_out.shape != (kv_heads, heads // kv_heads * length, dim)
            or chunk_out.shape != (heads, length, dim) or prefix_lse.shape != prefix_out.shape[:2]
            or chunk_lse.shape != (heads, length)):
        raise ValueError(f"merge_into: shapes do not fit out {tuple(out.shape)}: prefix {tuple(prefix_out.shape)}, "
                         f"lse {tuple(prefix_lse.shape)}; chunk {tuple(chunk_out.shape)}, lse {tuple(chunk_lse.shape)}")
    if any(t.stride(-1) != 1 for t in (prefix_out, chunk_out, out)):
        raise ValueError("merge_into: the head dimension of every output must be contiguous")
    if length:
        _merge_kernel[(triton.cdiv(length, BLOCK_T), heads)](
            prefix_out, prefix_lse, chunk_out, chunk_lse, out, length,
            prefix_out.stride(0), prefix_out.stride(1), prefix_lse.stride(0), prefix_lse.stride(1),
            chunk_out.stride(0), chunk_out.stride(1), chunk_lse.stride(0), chunk_lse.stride(1),
            out.stride(0), out.stride(1),
            GROUP=heads // kv_heads, DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_T=BLOCK_T, num_warps=4)
    return out

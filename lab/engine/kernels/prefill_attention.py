"""Paged prefill attention over a cached prefix, varlen: the prefill sequences of a flat batch,
each with query_len >= 1 new tokens whose K/V are already in the cache after `context_len -
query_len` cached tokens; query i attends causally to positions 0 .. context_len - query_len + i.

One program per (query block, sequence, KV head). GQA is packed into the M dimension of the
tiles: a program's BLOCK_M query rows are BLOCK_Q consecutive tokens x the GROUP query heads
that share its KV head (row r = token r // GROUP, head r % GROUP), so each K/V tile read from the
cache serves every head of the group. KV tiles before the block's first query position are
visible to every row and skip the causal mask; only the tiles on the diagonal apply it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lab.engine.kernels.paged_tiles import attend_tiles, dot_in_fp16, dot_precision


# `first_seq` (the decodes ahead of the prefills in a mixed batch) and the block table's width
# change from step to step: specialising on their values would compile new variants while the
# engine serves.
@triton.jit(do_not_specialize=["first_seq", "stride_table"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
                    out_ptr, qk_scale, v_scale, first_seq,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table,
                    head_dim,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP16: tl.constexpr):
    # Query blocks further along the diagonal see more keys: launch them first so the longest
    # programs do not form the tail of the grid.
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = first_seq + tl.program_id(1)
    kv_head = tl.program_id(2)

    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    first_token = q_block * BLOCK_Q
    # The grid covers the longest prefill of the step; shorter ones have nothing here.
    if first_token >= query_len:
        return
    prefix_len = tl.load(context_lens_ptr + seq) - query_len

    rows = tl.arange(0, BLOCK_M)
    tokens = first_token + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    token_mask = (rows < BLOCK_Q * GROUP) & (tokens < query_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    row_mask = token_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + (query_start + tokens)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask, other=0.0)
    if DOT_FP16:
        q = q.to(tl.float16)
    q_pos = prefix_len + tokens

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    table = block_tables_ptr + seq * stride_table
    head_offset = kv_head * stride_cache_head
    # Positions <= the block's first query position are visible to all rows: whole tiles of them
    # go unmasked. The rest, up to the block's last query position, take the causal mask. Every
    # row sees a key in the unmasked tiles or in the first masked one, which starts at or before
    # the block's first query position.
    unmasked_end = (prefix_len + first_token + 1) // BLOCK_N * BLOCK_N
    kv_end = prefix_len + tl.minimum(first_token + BLOCK_Q, query_len)
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, table, head_offset,
                                 0, unmasked_end, qk_scale, stride_cache_block, stride_cache_slot,
                                 dims, dim_mask, BLOCK_SIZE=BLOCK_SIZE, CAUSAL=False, BLOCK_N=BLOCK_N,
                                 DOT_PRECISION=DOT_PRECISION)
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, table, head_offset,
                                 unmasked_end, kv_end, qk_scale, stride_cache_block, stride_cache_slot,
                                 dims, dim_mask, BLOCK_SIZE=BLOCK_SIZE, CAUSAL=True, BLOCK_N=BLOCK_N,
                                 DOT_PRECISION=DOT_PRECISION)
    out = acc * (v_scale / l_i)[:, None]
    tl.store(out_ptr + (query_start + tokens)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


def _launch_config(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    if device.type != "cuda":
        # Interpreter (tests): small tiles so short test sequences span several query and KV tiles.
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        # IEEE fp32 dots run on FMA units and hold fp32 operands in registers: keep tiles small.
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    # Best of a sweep on an H200 (Triton 3.6, Llama-3-8B shapes, bench_kernels.py --sweep
    # prefill): 331 TFLOP/s at 8K causal, against 281 for 128 x 64 tiles with 8 warps; PyTorch's
    # SDPA does ~555 on contiguous K/V. Not tuned for D = 64.
    return {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float, out: torch.Tensor,
                      *, first_seq: int, num_seqs: int, max_query_len: int, k_scale: float = 1.0,
                      v_scale: float = 1.0, config: dict[str, int] | None = None) -> torch.Tensor:
    """Causal attention for sequences first_seq .. first_seq + num_seqs - 1 of a flat batch
    (q, out: [T, H, D]; query_start_loc [B + 1]; context_lens, block_tables per sequence) over
    caches [num_blocks, block_size, KVH, D] that already hold this step's K/V. Writes only those
    sequences' rows of `out`. `max_query_len` bounds the query length of those sequences.
    `config` overrides the launch configuration (BLOCK_M, BLOCK_N, num_warps, num_stages), for
    tuning."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == q.shape and out.dtype == q.dtype
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    config = config or _launch_config(q.device, q.dtype, head_dim)
    block_m = max(config["BLOCK_M"], triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out,
        scale * k_scale * math.log2(math.e), float(v_scale), first_seq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        head_dim,
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"],
        BLOCK_D=triton.next_power_of_2(head_dim), DOT_PRECISION=dot_precision(q.dtype),
        DOT_FP16=dot_in_fp16(q.dtype, k_cache.dtype),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return out

"""Paged decode attention: one query token per sequence, split-KV ("flash-decoding"), GQA heads
of one KV group processed together.

Stage 1 runs one program per (sequence, KV head, split). The program loads the query rows of all
GROUP heads that share the KV head (padded to 16 rows so tl.dot can use tensor cores), so each K/V
tile is read from memory once per group rather than once per query head. Its split is a
contiguous range of whole tiles of the context; it writes a partial output normalised by its own
softmax sum, plus its log-sum-exp. Stage 2 merges the splits of one (sequence, head) with weights
exp(lse_i - max) / sum. With a single split stage 1 writes the final output and stage 2 is skipped.

Decode is bandwidth bound: at batch 1 a sequence has only KVH (8 for Llama-3-8B) programs without
splitting, far too few for a GPU of 132 SMs, so the split count grows until the grid holds about
as many programs as fit on the SMs at once (`choose_num_splits`). Split boundaries are computed in
the kernel from each sequence's own length, so correctness never depends on the split count: a
CUDA graph captured with one count replays correctly for any context lengths.

An fp8 cache (x / scale in float8_e4m3fn) is read at half the bytes of bf16, so each byte costs
the SM twice the work of a bf16 byte (the same dots and softmax per token), plus the widening to
fp16. Two things keep that work off the memory's critical path (paged_tiles): V is read as int16
pairs and widened in registers before its layout change (Triton would otherwise read the fp8 V
tile back from shared memory one byte per load), and the block-table lookups run one tile ahead
so Triton double-buffers the K/V copies (PAGES_AHEAD). Two warps a program, each holding half a
tile's columns, and softmax sums kept per column until the loop ends cut the exchanges between
warps per byte read (`_launch_config`). benchmarks/kernels/bench_kernels.py times the variants
against the copy bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from lab.engine.kernels.cache_dtypes import FP8_DTYPES
from lab.engine.kernels.dependent_launch import dependent_launch_prologue, pdl_arguments
from lab.engine.kernels.paged_tiles import attend_tiles, dot_in_fp16, dot_precision

# Fewest KV tokens worth a split of their own: below this the merge costs more than it hides.
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 64


# The split count follows the context length, the block table's width the longest sequence:
# specialising on them would compile new variants while the engine serves (eager steps, or a
# batch past the largest graph).
@triton.jit(do_not_specialize=["num_splits", "stride_table"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                         out_ptr, part_out_ptr, part_lse_ptr, qk_scale, v_scale, num_splits,
                         stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_cache_block, stride_cache_slot, stride_cache_head, stride_table,
                         head_dim,
                         BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         DOT_FP16: tl.constexpr, V_FP8_PAIRS: tl.constexpr, FP8_ASM: tl.constexpr,
                         PAGES_AHEAD: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        dependent_launch_prologue()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    context_len = tl.load(context_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(context_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)

    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    head_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    row_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=row_mask, other=0.0)
    if DOT_FP16:
        q = q.to(tl.float16)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # Softmax sums kept per tile column and summed once after the loop: the warps split a tile's
    # columns, so a per-tile row sum is a cross-warp reduction (shared memory and barriers).
    l_cols = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    # `rows` stands in for query positions, which only the causal mask reads.
    acc, l_cols, m_i = attend_tiles(acc, l_cols, m_i, q, rows, k_cache_ptr, v_cache_ptr,
                                    block_tables_ptr + seq * stride_table, kv_head * stride_cache_head,
                                    start, end, qk_scale, stride_cache_block, stride_cache_slot, dims, dim_mask,
                                    BLOCK_SIZE=BLOCK_SIZE, CAUSAL=False, BLOCK_N=BLOCK_N,
                                    DOT_PRECISION=DOT_PRECISION, BLOCK_D=BLOCK_D, V_FP8_PAIRS=V_FP8_PAIRS,
                                    FP8_ASM=FP8_ASM, PAGES_AHEAD=PAGES_AHEAD, DEFER_SUM=True)
    l_i = tl.sum(l_cols, 1)
    # An empty split (or a padding row with no context) has l_i == 0: it stores zeros and
    # lse = -inf, which the merge weighs by zero.
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    if DIRECT:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part = (seq * num_heads + heads) * num_splits + split  # [B, H, S] row of this split
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=head_mask)
        tl.store(part_out_ptr + part[:, None] * head_dim + dims[None, :], out, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_ot, stride_oh, head_dim,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        dependent_launch_prologue()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    lse = tl.load(part_lse_ptr + row * num_splits + splits, mask=split_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    # All splits empty only for a padding row with no context: keep its output zero, not NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    weights = tl.exp2(lse - m)
    total = tl.sum(weights, 0)
    weights = weights / tl.where(total > 0, total, 1.0)
    parts = tl.load(part_out_ptr + (row * num_splits + splits)[:, None] * head_dim + dims[None, :],
                    mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    out = tl.sum(weights[:, None] * parts, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int,
                      programs_per_sm: int = 2, tile: int = MIN_TOKENS_PER_SPLIT) -> int:
    """Splits per sequence so that batch * KVH * splits fills, without exceeding, `programs_per_sm`
    programs per SM (one wave: a second, partial wave costs as much as the first), without splits
    shorter than a `tile` of KV positions (at least MIN_TOKENS_PER_SPLIT): a split past the
    context's last tile holds nothing yet costs its program and its merge input. Batch 1 of
    Llama-3-8B at 32K on an H200 (132 SMs), two programs per SM (bf16): 33 splits of ~1K tokens;
    at 1K with 128-token tiles, 8; batch 17 and up: 1 split (the grid already has 136+ programs).
    Four per SM (fp8, FP8_PROGRAMS_PER_SM): 64 splits at batch 1."""
    wanted = programs_per_sm * num_sms // (batch * num_kv_heads)
    useful = triton.cdiv(max_context_len, max(tile, MIN_TOKENS_PER_SPLIT))
    return max(1, min(wanted, useful, MAX_SPLITS))


def split_context_bounds(splits_at: Callable[[int], int], max_model_len: int, step: int = 512) -> list[int]:
    """The longest contexts, on a grid of `step` tokens, at which the split count `splits_at(context)`
    changes, ending with max_model_len: a decode launch sized for bound b (CUDA graphs capture
    one) suits every step whose longest context is at most b. At batch 1 of Llama-3-8B on an H200
    (bf16, 128-token tiles) that is 512, 1024, ..., 4096 and max_model_len."""
    bounds: list[int] = []
    for context in [*range(step, max_model_len, step), max_model_len]:
        if bounds and splits_at(bounds[-1]) == splits_at(context):
            bounds[-1] = context
        else:
            bounds.append(context)
    return bounds


def num_splits_for(batch: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                   cache_dtype: torch.dtype) -> int:
    """The split count decode_attention chooses for `batch` sequences whose longest context is
    `max_context_len`."""
    fp8 = cache_dtype in FP8_DTYPES
    tile = _launch_config(device, 2, cache_dtype)["BLOCK_N"]  # the tile of a split launch
    return choose_num_splits(batch, num_kv_heads, max_context_len, _num_sms(device),
                             FP8_PROGRAMS_PER_SM if fp8 else 2, tile)


def _num_sms(device: torch.device) -> int:
    # The interpreter runs programs one after another: a CPU "device" gains nothing from splits.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _fp8_asm(device: torch.device) -> bool:
    """Whether fp8 widens through inline PTX (cvt.rn.f16x2.e4m3x2 needs sm_89 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# Programs of the fp8 configuration that fit on one SM at once (Triton 3.6, sm_90: 104-107
# registers a thread, 55 KB of shared memory a program); the split heuristic fills them. At batch
# 1 / 32K on an H200 its 64 splits ran in 36 us against 42 us with 33.
FP8_PROGRAMS_PER_SM = 4


def _launch_config(device: torch.device, num_splits: int, cache_dtype: torch.dtype) -> dict[str, int]:
    if device.type != "cuda":
        # Interpreter (tests): small tiles so short test contexts still span several tiles; the
        # fp8 path's loop (pages looked up ahead) for every cache, so the tests cover it.
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "PAGES_AHEAD": True}
    # Chosen on an H200 with Triton 3.6 at Llama-3-8B shapes, from the candidates that
    # benchmarks/kernels/bench_kernels.py --sweep decode / --sweep configs times. Triton pipelines
    # the K/V loads as asynchronous copies but, with the block-table lookup in the same loop step,
    # into a single buffer: a program has nothing in flight while it computes, and latency is
    # hidden by programs per SM and bytes per tile. bf16, many programs (no split, large batch):
    # 64-token tiles; few programs (split, small batch): 128-token tiles, more bytes in flight for
    # each. bf16's work per byte is small enough that looking the pages up ahead (double-buffered
    # copies) did not pay. fp8 does twice the work per byte, so its copies must overlap its
    # compute: pages ahead, 64-token tiles, 3 stages (two buffers), four programs per SM, and two
    # warps rather than four: each warp holds half the tile's columns instead of a quarter, so
    # fewer exchanges between warps per byte (the softmax sums, kept per column until the loop
    # ends, need none inside it).
    if cache_dtype in FP8_DTYPES:
        return {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3, "PAGES_AHEAD": True}
    block_n = 128 if num_splits > 1 else 64
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                     max_context_len: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                     num_splits: int | None = None, config: dict[str, int] | None = None,
                     pdl: bool = False) -> torch.Tensor:
    """Attention of one query per sequence (q: [B, H, D]) over `context_lens` KV tokens read
    through `block_tables` ([B, max_blocks]) from caches [num_blocks, block_size, KVH, D] (model
    dtype, or fp8 holding x / scale). Returns `out` ([B, H, D], q's dtype; may be a view).
    `max_context_len` only sizes the split count (defaults to the block table's capacity).
    `config` overrides entries of the launch configuration, for tuning: BLOCK_N, num_warps,
    num_stages, PAGES_AHEAD (look block-table entries up a tile ahead), V_FP8_PAIRS (False: widen
    an fp8 V tile the way Triton does by itself), maxnreg (register cap). `pdl` launches both
    kernels with programmatic dependent launch (lab.engine.kernels.dependent_launch)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0:
        return out
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if num_splits is None:
        if max_context_len is None:
            max_context_len = block_tables.shape[1] * block_size
        num_splits = num_splits_for(batch, num_kv_heads, max_context_len, q.device, k_cache.dtype)
    config = {**_launch_config(q.device, num_splits, k_cache.dtype), **(config or {})}
    dot_fp16 = dot_in_fp16(q.dtype, k_cache.dtype)
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused: stage 1 writes the output itself
    else:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    # fp8 V as int16 pairs: every pair offset is even when head_dim is the tile width and the
    # cache is aligned (its strides are multiples of head_dim).
    v_pairs = dot_fp16 and block_d == head_dim and v_cache.data_ptr() % 4 == 0 and config.get("V_FP8_PAIRS", True)
    extra = {"maxnreg": config["maxnreg"]} if config.get("maxnreg") else {}
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        scale * k_scale * math.log2(math.e), float(v_scale), num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        head_dim,
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=config["BLOCK_N"],
        BLOCK_D=block_d,
        DIRECT=direct, DOT_PRECISION=dot_precision(q.dtype), DOT_FP16=dot_fp16, V_FP8_PAIRS=v_pairs,
        FP8_ASM=_fp8_asm(q.device), PAGES_AHEAD=config.get("PAGES_AHEAD", False),
        num_warps=config["num_warps"], num_stages=config["num_stages"], **extra, **pdl_arguments(pdl),
    )
    if not direct:
        _decode_merge_kernel[(batch, num_heads)](
            part_out, part_lse, out, num_splits, out.stride(0), out.stride(1), head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4, **pdl_arguments(pdl),
        )
    return out


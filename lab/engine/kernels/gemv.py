"""Skinny matrix products y[M, N] = x[M, K] @ w[N, K]^T for M <= 16 rows (decode batches), and the
same with SiLU-and-multiply fused into the load of x (the MLP's down projection), with a pre-norm
(RMSNorm of x) fused in, or with a residual added to the result. With those two a decoder layer's
norms need no kernels of their own: at batch 1 of a 32-layer model, 64 launches fewer a step.

At these M a product reads each weight once and does almost no arithmetic per byte, so its time
is the time to stream w from HBM. What decides that rate is (a) enough bytes in flight on every
SM for the whole run, and (b) little fixed cost per launch (ramp-up, tail, epilogue), which is
what separates a 33 MB product (o: 4096 x 4096) from the 1 GB lm_head. Measured on an H200
(bench_gemv.py, CUDA graphs, weights never in L2): the 32-layer Llama-3-8B chain at M = 1 runs
at 95.7 % of the device copy bandwidth against cuBLAS's 90.4 % (1.06x; 1.08x with the SiLU
fused and float32 logits), 1.02-1.04x at M = 2..16. Small products gain most (o: 1.13-1.20x);
gate_up at M >= 4 is within 1 % of cuBLAS either way.

Design:
- One program owns BLOCK_N rows of w and a contiguous range of K. Its loop is a `tl.range` with
  an explicit `num_stages`, so Triton's software pipeliner keeps NUM_STAGES - 1 tiles of w in
  flight through cp.async (for the FMA path too: an explicit stage count on the loop enables
  pipelining of loads that feed no tl.dot).
- Two ways to multiply, chosen per (shape, M) from measurements:
  * FMA (M <= 4): a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 accumulator of plain multiply-adds, summed
    over K once at the end. No padding rows, no shared-memory shuffle for x, but BLOCK_M FMAs per
    weight element, so CUDA-core throughput caps it at small M.
  * DOT: tl.dot with w as the left operand (BLOCK_N rows in the MMA's M slot) and x^T as the right
    one padded to 16 columns, i.e. y^T = w @ x^T. Tensor cores make the arithmetic free at any
    M <= 16; BLOCK_N >= 64 with 4 warps lets Triton use Hopper's wgmma.
- Split-K without a second kernel: when N / BLOCK_N tiles are too few to keep enough loads in
  flight (the fused down projection, 4096 rows by 14336), SPLIT_K programs share a tile. Each writes its fp32 partial to a workspace, then
  bumps a per-tile arrival counter (acq_rel, gpu scope, after a CTA barrier: the same pattern as
  CUTLASS's semaphore). The program that arrives last sums all partials in split order (0, 1,
  ...) and writes y, then resets the counter to zero for the next launch. The sum order never
  depends on arrival order, so results are bitwise reproducible; the only atomics are the
  integer counters. A second reduce kernel would cost a launch gap per product (~2 us, ~5 % of
  a 32-layer chain), which is the whole margin we are after.
- Rows past N (or M) load a valid row instead of masking (`offs % N`); only stores are masked,
  so the loads stay unpredicated full-width vectors.
- The counters are one small int32 buffer per device, zeroed once on the first split-K call.
  That first call must happen outside CUDA-graph capture (the engine's warm-up does it); a call
  under capture before any eager one falls back to a single split, which is correct but slower.
  Every split-K launch leaves the counters zero, so launches in one stream (or one graph) can
  share them; launches on two streams at once on one device must not (the engine uses one).

Configs come from a table keyed on (N, K) and an M bucket, measured on an H200 (bench_gemv.py
--sweep); other shapes get a heuristic drawn from the same sweeps. Every config is a plain launch with no host sync, and
the only allocations are torch.empty of fixed size per shape, so calls are CUDA-graph capturable.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lab.engine.kernels.dependent_launch import dependent_launch_prologue, pdl_arguments
from lab.engine.kernels.cache_dtypes import FP8_DTYPES
from lab.engine.kernels.rmsnorm import rms_norm
from lab.engine.kernels.rope_kv_write import rope_and_write_kv, to_cache

MAX_ROWS = 16
# Largest tile grid that split-K supports: one counter per N tile.
_MAX_COUNTERS = 1 << 16
# Rows of the FMA path's accumulator are registers: beyond 4 rows the per-element FMAs cost more
# than the bandwidth leaves time for.
MAX_FMA_ROWS = 4


class RopeKV(NamedTuple):
    """What a q|k|v product needs to finish a decoder's attention input in its epilogue: RoPE on
    q and k, and k and v stored at their cache slots (see rope_kv_write.rope_and_write_kv)."""
    cos_sin_rows: torch.Tensor  # [M, D] float32, cos | sin per token
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [M]
    k_scale: float = 1.0  # fp8 caches hold x / scale
    v_scale: float = 1.0


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _activation(ptrs, up_offset, mask, MASKED: tl.constexpr, SILU_MUL: tl.constexpr):
    """x, or silu(gate) * up rounded as PyTorch rounds it: silu in fp32 rounded to the input
    dtype, then the product in fp32 rounded again."""
    if SILU_MUL:
        gate = _load(ptrs, mask, MASKED)
        up = _load(ptrs + up_offset, mask, MASKED)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    else:
        return _load(ptrs, mask, MASKED)


@triton.jit
def _rope_kv_epilogue(res, y_ptr, stride_ym, offs_m, M, pid_n, cs_ptr, stride_cs, slot_ptr, kc_ptr, vc_ptr,
                      k_scale, v_scale, stride_cache_block, stride_cache_slot, stride_cache_head, block_size,
                      num_heads, num_kv_heads, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, QUANTIZE: tl.constexpr):
    """Rotates a qkv tile of BLOCK_N / 2 pairs (see the row order in _skinny_kernel) and stores it
    into y; a key or value tile also goes to its cache slot. As rope_kv_write does it: float32
    rotation, rounded once to y's dtype, and the cache takes that rounded value (x / scale in fp8)."""
    tiles_per_head: tl.constexpr = HEAD_DIM // BLOCK_N
    half: tl.constexpr = BLOCK_N // 2
    head = pid_n // tiles_per_head
    dims = (pid_n % tiles_per_head) * half + tl.arange(0, half)  # the first-half dims of the pairs
    x1, x2 = tl.split(tl.permute(tl.reshape(res, (BLOCK_M, 2, half)), (0, 2, 1)))
    row_mask = (offs_m < M)[:, None]
    rows = offs_m.to(tl.int64)[:, None]
    cs = cs_ptr + rows * stride_cs + dims[None, :]
    rotate = head < num_heads + num_kv_heads  # values are not rotated
    cos = tl.where(rotate, tl.load(cs, mask=row_mask, other=1.0), 1.0)
    sin = tl.where(rotate, tl.load(cs + HEAD_DIM // 2, mask=row_mask, other=0.0), 0.0)
    y1 = (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(y_ptr.dtype.element_ty)
    y = y_ptr + rows * stride_ym + head * HEAD_DIM + dims[None, :]
    tl.store(y, y1, mask=row_mask)
    tl.store(y + HEAD_DIM // 2, y2, mask=row_mask)
    if head >= num_heads:
        is_value = head >= num_heads + num_kv_heads
        kv_head = tl.where(is_value, head - num_heads - num_kv_heads, head - num_heads)
        slot = tl.load(slot_ptr + offs_m, mask=offs_m < M, other=0)
        # int64 before multiplying: a layer's cache can exceed 2^31 elements.
        dst = ((slot // block_size).to(tl.int64) * stride_cache_block + (slot % block_size) * stride_cache_slot
               + kv_head * stride_cache_head)[:, None] + dims[None, :]
        if is_value:
            tl.store(vc_ptr + dst, to_cache(y1, v_scale, vc_ptr, QUANTIZE), mask=row_mask)
            tl.store(vc_ptr + dst + HEAD_DIM // 2, to_cache(y2, v_scale, vc_ptr, QUANTIZE), mask=row_mask)
        else:
            tl.store(kc_ptr + dst, to_cache(y1, k_scale, kc_ptr, QUANTIZE), mask=row_mask)
            tl.store(kc_ptr + dst + HEAD_DIM // 2, to_cache(y2, k_scale, kc_ptr, QUANTIZE), mask=row_mask)


@triton.jit(do_not_specialize=["M", "split_k"])
def _skinny_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, g_ptr, r_ptr,
                   M, N, K, stride_xm, stride_ym, stride_rm, k_chunk, split_k, eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   NUM_STAGES: tl.constexpr, USE_DOT: tl.constexpr, SILU_MUL: tl.constexpr,
                   NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                   EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                   cs_ptr, slot_ptr, kc_ptr, vc_ptr, k_scale, v_scale, stride_cs,
                   stride_cache_block, stride_cache_slot, stride_cache_head, block_size, num_heads, num_kv_heads,
                   ROPE: tl.constexpr = False, HEAD_DIM: tl.constexpr = 1, QUANTIZE: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    if PDL:
        dependent_launch_prologue()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ROPE:
        # A tile holds BLOCK_N / 2 rotation pairs of one head: rows d and d + HEAD_DIM / 2, first
        # halves in its first BLOCK_N / 2 columns, so the epilogue can rotate in registers.
        tiles_per_head: tl.constexpr = HEAD_DIM // BLOCK_N
        half: tl.constexpr = BLOCK_N // 2
        cols = tl.arange(0, BLOCK_N)
        offs_n = (pid_n // tiles_per_head) * HEAD_DIM + (pid_n % tiles_per_head) * half + cols % half \
            + (cols // half) * (HEAD_DIM // 2)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # int64: the last row of a large lm_head (or of a K-wide x view) can pass 2**31 elements.
    w_rows = (offs_n % N).to(tl.int64) * K
    x_rows = (offs_m % M).to(tl.int64) * stride_xm
    k_begin = pid_k * k_chunk
    k_end = tl.minimum(k_begin + k_chunk, K)

    if USE_DOT:  # NORM and ROPE are never set here (see _product)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        w_ptrs = w_ptr + w_rows[:, None] + offs_k[None, :]
        x_ptrs = x_ptr + x_rows[None, :] + offs_k[:, None]
        for k in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs + k, eviction_policy="evict_first")
                x = _activation(x_ptrs + k, K, None, False, SILU_MUL)
            else:
                k_mask = (k + offs_k) < K
                w = tl.load(w_ptrs + k, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
                x = _activation(x_ptrs + k, K, k_mask[:, None], True, SILU_MUL)
            acc = tl.dot(w, x, acc, input_precision=PRECISION)
        res = tl.trans(acc)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        sq = tl.zeros((BLOCK_M, 1, BLOCK_K), dtype=tl.float32)
        w_ptrs = w_ptr + w_rows[None, :, None] + offs_k[None, None, :]
        x_ptrs = x_ptr + x_rows[:, None, None] + offs_k[None, None, :]
        for k in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs + k, eviction_policy="evict_first")
                x = _activation(x_ptrs + k, K, None, False, SILU_MUL)
                if NORM:
                    g = tl.load(g_ptr + k + offs_k)
            else:
                k_mask = (k + offs_k) < K
                w = tl.load(w_ptrs + k, mask=k_mask[None, None, :], other=0.0, eviction_policy="evict_first")
                x = _activation(x_ptrs + k, K, k_mask[None, None, :], True, SILU_MUL)
                if NORM:
                    g = tl.load(g_ptr + k + offs_k, mask=k_mask, other=0.0)
            xf = x.to(tl.float32)
            if NORM:
                sq += xf * xf
                xf = xf * g.to(tl.float32)[None, None, :]
            acc += xf * w.to(tl.float32)
        res = tl.sum(acc, axis=2)
        if NORM:
            res = res * tl.rsqrt(tl.sum(sq, axis=2) / K + eps)

    if ROPE:
        _rope_kv_epilogue(res, y_ptr, stride_ym, offs_m, M, pid_n, cs_ptr, stride_cs, slot_ptr, kc_ptr, vc_ptr,
                          k_scale, v_scale, stride_cache_block, stride_cache_slot, stride_cache_head,
                          block_size, num_heads, num_kv_heads, BLOCK_M, BLOCK_N, HEAD_DIM, QUANTIZE)
    else:
        out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        if RESIDUAL:
            r_ptrs = r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]
        if split_k == 1:
            if RESIDUAL:
                res += tl.load(r_ptrs, mask=out_mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, res.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            part_offs = offs_m[:, None] * N + offs_n[None, :]
            tl.store(part_ptr + pid_k * M * N + part_offs, res, mask=out_mask)
            # Every thread's partial is stored before one thread's release publishes the arrival.
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, split_k):
                    # .cg: read L2, where the other programs' partials are, never a stale L1 line.
                    total += tl.load(part_ptr + s * M * N + part_offs, mask=out_mask, other=0.0,
                                     cache_modifier=".cg")
                if RESIDUAL:
                    total += tl.load(r_ptrs, mask=out_mask, other=0.0).to(tl.float32)
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.store(count_ptr + pid_n, 0)


# ----------------------------------------------------------------------------------------------
# Configs

# Measured on an H200 (132 SMs, copy 4.26 TB/s) with bench_gemv.py --sweep, the winners of its
# third run verbatim; keyed on (N, K, fused SiLU), then on the largest M of a bucket. Shapes are
# Llama-3-8B's. What the sweeps showed: at M <= 2 the FMA path on 4- or 8-row tiles, unsplit,
# wins everywhere (split-K never helped it); above, tensor cores over 64-row tiles with a deep
# pipeline (6 to 8 stages) and no split win on the 4096- and 6144-row shapes, where cuBLAS
# leaves 25 to 35 % of the bandwidth unused. With the fused SiLU, deep pipelines lose (the
# gate and up tiles double the shared memory per stage) and 4 stages with split-K 4 win.
_M_BUCKETS = (1, 2, 4, 8, 16)
_TABLE: dict[tuple[int, int, bool], dict[int, GemvConfig]] = {
    (6144, 4096, False): {1: GemvConfig(8, 256, 1, 2, 4, False), 2: GemvConfig(8, 256, 1, 2, 3, False),
                          4: GemvConfig(64, 128, 1, 4, 6, True), 8: GemvConfig(64, 128, 1, 4, 6, True),
                          16: GemvConfig(64, 128, 1, 4, 6, True)},
    (4096, 4096, False): {1: GemvConfig(8, 512, 1, 2, 3, False), 2: GemvConfig(4, 512, 1, 2, 3, False),
                          4: GemvConfig(64, 128, 1, 4, 8, True), 8: GemvConfig(64, 128, 1, 4, 8, True),
                          16: GemvConfig(64, 128, 1, 4, 8, True)},
    (28672, 4096, False): {1: GemvConfig(8, 1024, 1, 4, 3, False), 2: GemvConfig(4, 512, 1, 2, 3, False),
                           4: GemvConfig(64, 128, 1, 4, 4, True), 8: GemvConfig(64, 128, 1, 4, 4, True),
                           16: GemvConfig(128, 128, 1, 4, 3, True)},
    (4096, 14336, False): {1: GemvConfig(8, 512, 1, 4, 3, False), 2: GemvConfig(8, 512, 1, 4, 3, False),
                           4: GemvConfig(64, 128, 2, 4, 6, True), 8: GemvConfig(64, 128, 1, 4, 8, True),
                           16: GemvConfig(64, 128, 1, 4, 8, True)},
    (4096, 14336, True): {1: GemvConfig(8, 512, 1, 4, 3, False), 2: GemvConfig(8, 512, 1, 4, 3, False),
                          4: GemvConfig(64, 128, 4, 4, 4, True), 8: GemvConfig(64, 128, 4, 4, 4, True),
                          16: GemvConfig(64, 128, 4, 4, 4, True)},
    (128256, 4096, False): {1: GemvConfig(8, 256, 1, 2, 4, False), 2: GemvConfig(128, 128, 1, 4, 3, True),
                            4: GemvConfig(64, 128, 1, 4, 4, True), 8: GemvConfig(64, 128, 1, 4, 4, True),
                            16: GemvConfig(128, 128, 1, 8, 3, True)},
}

_counters: dict[torch.device, torch.Tensor] = {}
_sm_counts: dict[torch.device, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any number exercises the same code
    if device not in _sm_counts:
        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_counts[device]


def _bucket(m: int) -> int:
    return next(b for b in _M_BUCKETS if m <= b)


def default_config(m: int, n: int, k: int, sms: int = 132) -> GemvConfig:
    """A heuristic for shapes the table lacks (SmolLM2's, say), drawn from the first H200 sweep:
    FMA over 8-row tiles, unsplit, for M <= 2; above, tensor cores over 64-row tiles, 4 stages,
    split over K while the grid stays within two programs per SM and every split keeps at least
    16 K tiles. (The later sweeps found 6 to 8 stages better on the Llama shapes; that is not
    carried over here untested.)"""
    if m <= 2:
        return GemvConfig(8, min(512, max(64, triton.next_power_of_2(k))), 1, 4, 3, False)
    block_k = 128
    tiles = triton.cdiv(n, 64)
    k_blocks = triton.cdiv(k, block_k)
    split = 1
    while tiles * split * 2 <= 2 * sms and k_blocks // (split * 2) >= 16:
        split *= 2
    return GemvConfig(64, block_k, split, 4, 4, True)


def pick_config(m: int, n: int, k: int, sms: int = 132, silu_mul: bool = False) -> GemvConfig:
    by_m = _TABLE.get((n, k, silu_mul))
    if by_m is not None and _bucket(m) in by_m:
        return by_m[_bucket(m)]
    return default_config(m, n, k, sms)


def _counter_buffer(device: torch.device) -> torch.Tensor | None:
    buffer = _counters.get(device)
    if buffer is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # a zero-fill recorded into the graph would leave it garbage for eager calls
        buffer = _counters[device] = torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)
    return buffer


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, out_dtype: torch.dtype | None,
           silu_mul: bool, name: str, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
           rope: RopeKV | None) -> torch.Tensor:
    """Refuse, with the reason, what the kernel cannot take; `out`, allocated when not given."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"{name} takes 2-D x and w, got {tuple(x.shape)} and {tuple(w.shape)}")
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    if m > MAX_ROWS:
        raise ValueError(f"{name} handles at most {MAX_ROWS} rows of x, got {m}; use F.linear")
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"{name}: x has {x.shape[1]} columns, w has {k}")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: x and w must share a dtype of bf16, fp16 or fp32, got {x.dtype}, {w.dtype}")
    if x.stride(1) != 1 or not w.is_contiguous():
        raise ValueError(f"{name}: x rows and w must be contiguous")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or (out_dtype is not None and out.dtype != out_dtype):
        raise ValueError(f"{name}: out must be a [{m}, {n}] row-contiguous tensor of dtype {out_dtype or out.dtype}")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.dtype != x.dtype
                                    or not norm_weight.is_contiguous()):
        raise ValueError(f"{name}: norm_weight must be a contiguous [{k}] tensor of {x.dtype}")
    if residual is not None and (residual.shape != (m, n) or residual.dtype != out.dtype or residual.stride(1) != 1):
        raise ValueError(f"{name}: residual must be a [{m}, {n}] row-contiguous tensor of {out.dtype}")
    if rope is not None:
        kv_heads, head_dim = rope.k_cache.shape[2:]
        if residual is not None or head_dim % 2 or n % head_dim or n // head_dim <= 2 * kv_heads:
            raise ValueError(f"{name}: rope takes a q|k|v product of whole {head_dim}-wide heads, "
                             f"{2 * kv_heads} of them k and v, and no residual; got {n} rows")
        if rope.cos_sin_rows.shape != (m, head_dim) or rope.slot_mapping.shape != (m,):
            raise ValueError(f"{name}: rope needs a [{m}, {head_dim}] cos|sin row and a slot per row of x")
        kc, vc = rope.k_cache, rope.v_cache
        if kc.shape != vc.shape or kc.stride() != vc.stride() or kc.stride(-1) != 1 \
                or rope.cos_sin_rows.stride(-1) != 1:
            raise ValueError(f"{name}: rope needs k and v caches of one shape and layout, rows contiguous")
        if kc.dtype not in FP8_DTYPES and (rope.k_scale != 1.0 or rope.v_scale != 1.0):
            raise ValueError(f"{name}: KV scales apply to fp8 caches only")
    return out


class _Plan(NamedTuple):
    """How one product is launched: the config, the grid (N tiles x K splits) and the split-K
    bookkeeping."""

    cfg: GemvConfig
    block_m: int
    tiles: int
    split: int
    blocks_per_split: int
    counters: torch.Tensor


def _plan(cfg: GemvConfig, m: int, n: int, k: int, one_pass: bool, device: torch.device, name: str) -> _Plan:
    """The grid for `cfg`; `one_pass` (a fused norm or rotation) keeps K in one program."""
    if one_pass:
        # The norm's scale needs the sum of squares of the whole row, and the rotation the whole
        # dot product of both rows of a pair: one program must see all of K.
        cfg = cfg._replace(split_k=1)
    block_m = 16 if cfg.use_dot else triton.next_power_of_2(m)
    if not cfg.use_dot and m > MAX_FMA_ROWS:
        raise ValueError(f"{name}: the FMA path takes at most {MAX_FMA_ROWS} rows, got {m}")
    tiles = triton.cdiv(n, cfg.block_n)
    k_blocks = triton.cdiv(k, cfg.block_k)
    # No empty splits: every split gets ceil(blocks / split) tiles of K, the last one fewer.
    blocks_per_split = triton.cdiv(k_blocks, max(1, min(cfg.split_k, k_blocks)))
    split = triton.cdiv(k_blocks, blocks_per_split)
    counters = None
    if split > 1 and tiles <= _MAX_COUNTERS:
        counters = _counter_buffer(device)
    if counters is None:
        # Empty stand-ins (null pointers, never dereferenced) keep the argument types of a split
        # launch, so both share one compiled kernel.
        split, blocks_per_split = 1, k_blocks
        counters = torch.empty(0, dtype=torch.int32, device=device)
    return _Plan(cfg, block_m, tiles, split, blocks_per_split, counters)


def _launch(plan: _Plan, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, silu_mul: bool,
            norm_weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None,
            rope: RopeKV | None, pdl: bool) -> None:
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    cfg, counters = plan.cfg, plan.counters
    part = torch.empty((plan.split if plan.split > 1 else 0, m, n), dtype=torch.float32, device=x.device)
    _skinny_kernel[(plan.tiles, plan.split)](
        x, w, out, part, counters,
        norm_weight if norm_weight is not None else counters, residual if residual is not None else out,
        m, n, k, x.stride(0), out.stride(0), residual.stride(0) if residual is not None else 0,
        plan.blocks_per_split * cfg.block_k, plan.split, float(eps),
        BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        USE_DOT=cfg.use_dot, SILU_MUL=silu_mul, NORM=norm_weight is not None, RESIDUAL=residual is not None,
        EVEN_K=k % cfg.block_k == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, **_rope_arguments(rope, n, out), **pdl_arguments(pdl),
    )


def _product(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, out_dtype: torch.dtype | None,
             config: GemvConfig | None, silu_mul: bool, name: str, norm_weight: torch.Tensor | None = None,
             eps: float = 0.0, residual: torch.Tensor | None = None, rope: RopeKV | None = None,
             pdl: bool = False) -> torch.Tensor:
    """Check, plan and launch one product; the parts a config's path cannot fuse run as their own
    kernels."""
    out = _check(x, w, out, out_dtype, silu_mul, name, norm_weight, residual, rope)
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(residual) if residual is not None else out.zero_()

    cfg = config or pick_config(m, n, k, _sm_count(x.device), silu_mul)
    if norm_weight is not None and cfg.use_dot:
        # The tensor-core path feeds x to the MMA from shared memory; scaling it in registers
        # first costs a round trip per tile (the whole chain 0.86x at M = 4..16 on an H200,
        # bench_gemv's norms table), more than the separate norm's launch.
        x, _ = rms_norm(x, norm_weight, eps)
        norm_weight = None
    if rope is not None:
        kv_heads, head_dim = rope.k_cache.shape[2:]
        if cfg.use_dot or head_dim % cfg.block_n:
            # The rotation pairs rows d and d + D/2; only the FMA path's tiles (a few rows each,
            # any rows) are ordered to hold both. Elsewhere the separate kernel does it after the
            # product.
            y = _product(x, w, out, out_dtype, config, silu_mul, name, norm_weight, eps, pdl=pdl)
            q, k, v = y.view(m, -1, head_dim).split([n // head_dim - 2 * kv_heads, kv_heads, kv_heads], dim=1)
            rope_and_write_kv(q, k, v, *rope)
            return y
    plan = _plan(cfg, m, n, k, norm_weight is not None or rope is not None, x.device, name)
    _launch(plan, x, w, out, silu_mul, norm_weight, eps, residual, rope, pdl)
    return out


def _rope_arguments(rope: RopeKV | None, n: int, out: torch.Tensor) -> dict:
    if rope is None:
        # Never dereferenced without ROPE; any tensor serves as the pointer arguments.
        return dict(cs_ptr=out, slot_ptr=out, kc_ptr=out, vc_ptr=out, k_scale=1.0, v_scale=1.0, stride_cs=0,
                    stride_cache_block=0, stride_cache_slot=0, stride_cache_head=0, block_size=1, num_heads=0,
                    num_kv_heads=0)
    kc, vc = rope.k_cache, rope.v_cache  # checked in _check
    kv_heads, head_dim = kc.shape[2:]
    return dict(cs_ptr=rope.cos_sin_rows, slot_ptr=rope.slot_mapping, kc_ptr=kc, vc_ptr=vc,
                k_scale=float(rope.k_scale), v_scale=float(rope.v_scale), stride_cs=rope.cos_sin_rows.stride(0),
                stride_cache_block=kc.stride(0), stride_cache_slot=kc.stride(1), stride_cache_head=kc.stride(2),
                block_size=kc.shape[1], num_heads=n // head_dim - 2 * kv_heads, num_kv_heads=kv_heads,
                ROPE=True, HEAD_DIM=head_dim, QUANTIZE=kc.dtype in FP8_DTYPES)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, *, norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, residual: torch.Tensor | None = None, rope: RopeKV | None = None,
                  config: GemvConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """x[M, K] @ w[N, K]^T for M <= MAX_ROWS, fp32 accumulation, result in out_dtype (default x's
    dtype; float32 is allowed, e.g. for logits) or into `out`. x may be a row view (stride(1) == 1);
    w must be contiguous. `config` overrides the tuned launch config (benchmarks, tests).

    With `norm_weight` ([K]) the product is of RMSNorm(x) * norm_weight, the norm taken in fp32
    over each row of x: a decoder's pre-norm and the product after it in one kernel. Each program
    folds the scale in at the end (y = rsqrt(mean(x^2) + eps) * sum_k w * x * g), summing x^2 over
    the same tiles of x it already loads, so the norm costs no launch and no extra pass; it never
    splits K. That is on the FMA path (M <= 2 with the tuned configs); the tensor-core path
    normalises x with rmsnorm.rms_norm first. With `residual` ([M, N], out's dtype) the result is
    x @ w^T + residual, rounded once: the residual add after an attention or MLP output projection.

    With `rope` the product is a decoder's q|k|v ([M, (H + 2 KVH) * D]): the result comes back
    with q and k rotated, and k and v are stored at their cache slots, as
    rope_kv_write.rope_and_write_kv would do after the product. On the FMA path the epilogue does
    it (no launch of its own; each tile is ordered to hold whole rotation pairs); on the others
    that kernel runs after the product.

    `pdl` launches the kernel with programmatic dependent launch (lab.engine.kernels.dependent_launch)."""
    return _product(x, w, out, out_dtype, config, silu_mul=False, name="skinny_linear",
                    norm_weight=norm_weight, eps=eps, residual=residual, rope=rope, pdl=pdl)


def skinny_silu_mul_linear(gate_up: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                           out_dtype: torch.dtype | None = None, *, residual: torch.Tensor | None = None,
                           config: GemvConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """(silu(gate) * up) @ w^T with gate, up = gate_up[:, :K], gate_up[:, K:] for w[N, K]: the
    MLP's activation and down projection in one kernel, rounded like layers.silu_and_mul; plus
    `residual` when given, as in skinny_linear."""
    return _product(gate_up, w, out, out_dtype, config, silu_mul=True, name="skinny_silu_mul_linear",
                    residual=residual, pdl=pdl)

"""Test cases for the Triton kernels (lab/engine/kernels), shared by the CPU interpreter tests
and the GPU tests in test_kernels.py.

Each `check_*` function draws fresh random inputs from its seed, runs a kernel into outputs
poisoned with NaN, runs the PyTorch reference (lab.engine.model.attention / lab.engine.model.layers) and
returns plain numbers and flags for the test to assert on. Attention caches are poisoned too:
every slot outside the sequences' contexts (the tail of each last block, unreferenced blocks,
block 0 that pads the block tables) holds NaN in the cache the kernels read, so a kernel that
reads past a context or writes a stray slot shows up as NaN or as a changed poison slot.

Run as a script, this module is the interpreter worker: `triton.jit` picks the interpreter or
the GPU compiler when a kernel module is first imported, so the CPU tests run every case in one
child process started with TRITON_INTERPRET=1 (see `InterpreterWorker`), and the variable never
touches the pytest process or other test modules, whatever they imported first.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lab.engine.kernels.cache_dtypes import FP8_DTYPES
from lab.engine.model import layers
from lab.engine.model.attention import TorchAttention
from lab.engine.model.attention_metadata import AttentionMetadata, build_metadata

REPO_ROOT = Path(__file__).resolve().parents[2]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out has NaN)."""
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, device=generator.device)


def _isnan(t: torch.Tensor) -> torch.Tensor:
    return t.float().isnan()


# ----------------------------------------------------------------------------------------------
# Attention


@dataclass
class AttentionCase:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor  # what the kernels get: live prefix slots random, everything else NaN
    v_cache: torch.Tensor
    ref_k_cache: torch.Tensor  # what the reference gets: the same prefix, zeros elsewhere
    ref_v_cache: torch.Tensor
    meta: AttentionMetadata
    live_slots: torch.Tensor  # [num_slots] bool: slots inside some sequence's context
    scale: float


def make_attention_case(seqs: list[tuple[int, int]], num_decodes: int, num_heads: int, num_kv_heads: int,
                        head_dim: int, block_size: int, dtype: torch.dtype, cache_dtype: torch.dtype,
                        k_scale: float, v_scale: float, seed: int, device: str) -> AttentionCase:
    """A flat batch of (query_len, context_len) sequences, decodes first. The cached prefix of
    each sequence is random; this step's K/V are not yet in the cache. Blocks are shuffled so no
    sequence's pages are contiguous, and block tables carry padding columns."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [math.ceil(ctx / block_size) for _, ctx in seqs]
    # Block 0 only pads block tables; two more blocks are never referenced.
    num_blocks = 1 + sum(blocks_per_seq) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).tolist()
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used:used + n])
        used += n
    query_lens = [q for q, _ in seqs]
    meta = build_metadata(query_lens, [c for _, c in seqs], tables, block_size, device=device,
                          num_decodes=num_decodes, pad_block_table_to=max(blocks_per_seq) + 2)
    num_tokens = sum(query_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    q, k, v = randn(num_tokens, num_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim), \
        randn(num_tokens, num_kv_heads, head_dim)
    live_slots = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    prefix_slots = []
    for (qlen, ctx), table in zip(seqs, tables):
        pos = torch.arange(ctx, device=device)
        slots = torch.tensor(table, device=device)[pos // block_size] * block_size + pos % block_size
        live_slots[slots] = True
        prefix_slots.append(slots[:ctx - qlen])
    prefix_slots_t = torch.cat(prefix_slots)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = []
    for scale in (k_scale, v_scale):
        prefix = (randn(len(prefix_slots_t), num_kv_heads, head_dim).float() / scale).to(cache_dtype)
        poisoned = torch.full(shape, float("nan"), device=device).to(cache_dtype)
        clean = torch.zeros(shape, device=device).to(cache_dtype)
        for cache in (poisoned, clean):
            cache.view(-1, num_kv_heads, head_dim)[prefix_slots_t] = prefix
        caches.append((poisoned, clean))
    (k_cache, ref_k_cache), (v_cache, ref_v_cache) = caches
    return AttentionCase(q, k, v, k_cache, v_cache, ref_k_cache, ref_v_cache, meta, live_slots, head_dim ** -0.5)


def _reference_attention(case: AttentionCase, k_scale: float, v_scale: float) -> torch.Tensor:
    """TorchAttention on the clean caches (it writes this step's K/V into them).

    An fp8 cache goes through its dequantized image instead: this step's K/V are quantized as
    x / scale into the clean fp8 cache here, which is then widened (times the scale) to the
    query dtype, or to float32 with non-unit scales, and TorchAttention runs on that with the
    dequantized new K/V. With unit scales this is exactly TorchAttention on an fp8 cache (fp8
    widens exactly to bf16/fp32), which PyTorch cannot run on the CPU itself: its write_kv uses
    index_copy_, which has no Float8_e4m3fn CPU kernel in torch 2.13."""
    if case.k_cache.dtype not in FP8_DTYPES:
        return TorchAttention().forward(case.q, case.k, case.v, case.ref_k_cache, case.ref_v_cache, case.meta,
                                        case.scale)
    dtype = case.q.dtype if k_scale == 1.0 and v_scale == 1.0 else torch.float32
    kvh, d = case.k.shape[1:]
    slots = case.meta.slot_mapping
    dequantized = []
    for new, cache, scale in ((case.k, case.ref_k_cache, k_scale), (case.v, case.ref_v_cache, v_scale)):
        cache.view(-1, kvh, d)[slots] = (new.float() / scale).to(cache.dtype)
        dequantized.append((cache.float() * scale).to(dtype))
    k_deq, v_deq = dequantized
    return TorchAttention().forward(case.q.to(dtype), k_deq.view(-1, kvh, d)[slots], v_deq.view(-1, kvh, d)[slots],
                                    k_deq, v_deq, case.meta, case.scale)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_attention(seqs: list[tuple[int, int]], num_decodes: int, num_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int = 16, dtype: str = "float32", cache_dtype: str | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0, num_splits: int | None = None, seed: int = 0,
                    device: str = "cpu") -> dict[str, Any]:
    """TritonAttention.forward against TorchAttention on one flat batch. Returns the relative
    error overall and of the decode / prefill parts, and flags: every output row written,
    the written cache slots byte-identical to the reference's, the poison slots untouched."""
    from lab.engine.model.triton_attention import TritonAttention

    torch_dtype = _dtype(dtype)
    torch_cache_dtype = _dtype(cache_dtype) if cache_dtype else torch_dtype
    case = make_attention_case([tuple(s) for s in seqs], num_decodes, num_heads, num_kv_heads, head_dim,
                               block_size, torch_dtype, torch_cache_dtype, k_scale, v_scale, seed, device)
    out = torch.full_like(case.q, float("nan"))
    TritonAttention(k_scale, v_scale, num_splits).forward(case.q, case.k, case.v, case.k_cache, case.v_cache,
                                                          case.meta, case.scale, out=out)
    ref = _reference_attention(case, k_scale, v_scale)
    nd = num_decodes
    kvh, d = case.k.shape[1:]
    live = case.live_slots
    result: dict[str, Any] = {
        "rel_err": relative_error(out, ref),
        "decode_rel_err": relative_error(out[:nd], ref[:nd]) if nd else None,
        "prefill_rel_err": relative_error(out[nd:], ref[nd:]) if nd < len(seqs) else None,
        "all_written": not bool(_isnan(out).any()),
        "cache_match": all(_same_bytes(c.view(-1, kvh, d)[live], r.view(-1, kvh, d)[live])
                           for c, r in ((case.k_cache, case.ref_k_cache), (case.v_cache, case.ref_v_cache))),
        "poison_intact": all(bool(_isnan(c.view(-1, kvh, d)[~live]).all()) for c in (case.k_cache, case.v_cache)),
    }
    return result


def check_padding_rows(device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """A decode batch padded the way a CUDA graph pads it: padding rows have slot -1 and
    context_len 0. Real rows must match the reference without them; padding rows must come out
    zero (not NaN) and write nothing."""
    from lab.engine.model.triton_attention import TritonAttention

    seqs = [(1, 37), (1, 5)]
    case = make_attention_case(seqs, 2, 4, 2, 64, 16, torch.float32, torch.float32, 1.0, 1.0, seed, device)
    ref = TorchAttention().forward(case.q, case.k, case.v, case.ref_k_cache, case.ref_v_cache, case.meta, case.scale)
    # Insert a padding row between and after the real rows.
    rows = [0, None, 1, None]

    def pad(t: torch.Tensor, fill: float | int) -> torch.Tensor:
        filler = torch.full_like(t[:1], fill)
        return torch.cat([t[i:i + 1] if i is not None else filler for i in rows])

    meta = case.meta
    padded = AttentionMetadata(
        num_decodes=4, slot_mapping=pad(meta.slot_mapping, -1), block_tables=pad(meta.block_tables, 0),
        context_lens=pad(meta.context_lens, 0), query_start_loc=torch.arange(5, dtype=torch.int32, device=device),
        max_query_len=1, max_context_len=meta.max_context_len, query_lens_cpu=[1] * 4,
        context_lens_cpu=[37, 0, 5, 0])
    out = torch.full((4,) + case.q.shape[1:], float("nan"), device=device)
    TritonAttention(num_splits=3).forward(pad(case.q, 1.0), pad(case.k, 1.0), pad(case.v, 1.0), case.k_cache,
                                          case.v_cache, padded, case.scale, out=out)
    kvh, d = case.k.shape[1:]
    live = case.live_slots
    return {
        "rel_err": relative_error(out[[0, 2]], ref),
        "padding_zero": bool((out[[1, 3]] == 0).all()),
        "cache_match": _same_bytes(case.k_cache.view(-1, kvh, d)[live], case.ref_k_cache.view(-1, kvh, d)[live]),
        "poison_intact": bool(_isnan(case.k_cache.view(-1, kvh, d)[~live]).all()),
    }


# ----------------------------------------------------------------------------------------------
# Elementwise layers


def check_rms_norm(num_tokens: int, hidden: int, dtype: str = "float32", weight_dtype: str | None = None,
                   with_residual: bool = True, seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """kernels.rms_norm against layers.rms_norm (normed output and the new residual)."""
    from lab.engine.kernels.rmsnorm import rms_norm

    gen = torch.Generator(device=device).manual_seed(seed)
    x = _randn(gen, num_tokens, hidden).to(_dtype(dtype))
    residual = _randn(gen, num_tokens, hidden).to(_dtype(dtype)) if with_residual else None
    weight = (1 + 0.1 * _randn(gen, hidden)).to(_dtype(weight_dtype or dtype))
    eps = 1e-5
    ref_normed, ref_residual = layers.rms_norm(x, weight, eps, residual)
    out = torch.full_like(ref_normed, float("nan"))
    residual_out = torch.full_like(x, float("nan")) if with_residual else None
    normed, new_residual = rms_norm(x, weight, eps, residual, out=out, residual_out=residual_out)
    return {
        "normed_rel_err": relative_error(normed, ref_normed),
        "residual_rel_err": relative_error(new_residual, ref_residual),
        "dtype_match": normed.dtype == ref_normed.dtype and new_residual.dtype == ref_residual.dtype,
        "all_written": not bool(_isnan(normed).any() or _isnan(new_residual).any()),
    }


def check_silu_and_mul(num_tokens: int, inter: int, dtype: str = "float32", seed: int = 0,
                       device: str = "cpu") -> dict[str, Any]:
    """kernels.silu_and_mul against layers.silu_and_mul, on gate | up with gates out to +-12 (where
    SiLU saturates and underflows), into a NaN-poisoned output."""
    from lab.engine.kernels.silu_mul import silu_and_mul

    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up = (4 * _randn(gen, num_tokens, 2 * inter)).clamp(-12, 12).to(_dtype(dtype))
    ref = layers.silu_and_mul(gate_up)
    out = torch.full_like(ref, float("nan"))
    got = silu_and_mul(gate_up, out=out)
    mismatch = (got.float() != ref.float())
    return {
        "rel_err": relative_error(got, ref),
        "mismatch_fraction": mismatch.float().mean().item(),
        "dtype_match": got.dtype == ref.dtype and got.shape == ref.shape,
        "all_written": not bool(_isnan(got).any()),
        "returned_out": got.data_ptr() == out.data_ptr(),
    }


def check_attention_merge(length: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: str = "float32",
                          seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """kernels.attention_merge.merge_into against chunk_attention.merge, on the layouts the chunk's
    attention produces (the prefix part folded [KVH, G * L, D], the chunk part a head-major view of
    token-major memory, log-sum-exps a few units apart), written into rows 3 .. 3 + L of a
    NaN-poisoned [L + 5, H, D] output as a step writes its slice."""
    from lab.engine.kernels.attention_merge import merge_into
    from lab.engine.model.chunk_attention import merge

    gen = torch.Generator(device=device).manual_seed(seed)
    group = num_heads // num_kv_heads
    prefix_out = _randn(gen, num_kv_heads, group * length, head_dim).to(_dtype(dtype))
    prefix_lse = 4 * _randn(gen, num_kv_heads, group * length)
    chunk_out = _randn(gen, length, num_heads, head_dim).to(_dtype(dtype)).transpose(0, 1)
    chunk_lse = 4 * _randn(gen, num_heads, length)
    ref = merge(prefix_out.view(num_kv_heads, group, length, head_dim).permute(2, 0, 1, 3)
                .reshape(length, num_heads, head_dim),
                prefix_lse.view(num_kv_heads, group, length).permute(2, 0, 1).reshape(length, num_heads),
                chunk_out.transpose(0, 1), chunk_lse.transpose(0, 1)).to(_dtype(dtype))
    buffer = torch.full((length + 5, num_heads, head_dim), float("nan"), dtype=_dtype(dtype), device=device)
    got = merge_into(prefix_out, prefix_lse, chunk_out, chunk_lse, buffer[3:3 + length])
    return {
        "rel_err": relative_error(got, ref),
        "mismatch_fraction": (got.float() != ref.float()).float().mean().item(),
        "all_written": not bool(_isnan(got).any()),
        "poison_intact": bool(_isnan(buffer[:3]).all() and _isnan(buffer[3 + length:]).all()),
        "returned_out": got.data_ptr() == buffer[3:].data_ptr(),
    }


def check_rope_kv_write(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: str = "float32",
                        cache_dtype: str | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                        block_size: int = 16, max_positions: int = 4096, seed: int = 0,
                        device: str = "cpu") -> dict[str, Any]:
    """kernels.rope_and_write_kv against layers.apply_rope_rows plus the reference cache write
    (TorchAttention's write_kv; for fp8 caches x / scale, IEEE-divided and rounded by PyTorch, as
    kv_write stores it), on q, k, v that are views of one fused qkv product. The caches are
    NaN-poisoned; this step's slots are scattered over them and every other slot must keep its
    poison bytes."""
    from lab.engine.kernels.rope_kv_write import rope_and_write_kv
    from lab.engine.model.attention import write_kv

    gen = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = _dtype(dtype)
    torch_cache_dtype = _dtype(cache_dtype) if cache_dtype else torch_dtype
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(gen, num_tokens, q_width + 2 * kv_width).to(torch_dtype)
    q = qkv[:, :q_width].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_width:q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_width + kv_width:].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen, device=device)
    rows = layers.rope_cos_sin_cache(head_dim, max_positions, 500000.0, None, device=device)[positions]
    ref_q, ref_k = layers.apply_rope_rows(q, k, rows)
    v_before = v.clone()

    # Two spare blocks beyond what the tokens need, and the slots in random order.
    num_blocks = math.ceil(num_tokens / block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    poison = torch.full(shape, float("nan"), device=device).to(torch_cache_dtype)
    k_cache, v_cache, ref_k_cache, ref_v_cache = (poison.clone() for _ in range(4))
    def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
        # IEEE division by a tensor: PyTorch divides a CUDA tensor by a Python scalar as a
        # multiplication by its reciprocal, which rounds differently now and then.
        return (x.float() / torch.tensor(scale, dtype=torch.float32, device=device)).to(torch_cache_dtype)

    if torch_cache_dtype in FP8_DTYPES:
        for new, cache, scale in ((ref_k, ref_k_cache, k_scale), (v, ref_v_cache, v_scale)):
            cache.view(-1, num_kv_heads, head_dim)[slots] = quantize(new, scale)
    else:
        write_kv(ref_k, v, ref_k_cache, ref_v_cache, slots)

    out_q, out_k = rope_and_write_kv(q, k, v, rows, k_cache, v_cache, slots, k_scale, v_scale)

    def at_slots(cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, num_kv_heads, head_dim)[slots]

    def dequantized(cache: torch.Tensor, scale: float) -> torch.Tensor:
        return at_slots(cache).float() * scale

    # The cache must hold exactly what writing the returned (rotated) k would store.
    own_k = quantize(out_k, k_scale) if torch_cache_dtype in FP8_DTYPES else out_k.to(torch_cache_dtype)
    others = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    others[slots] = False
    return {
        "returns_views": out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr(),
        "q_rel_err": relative_error(q, ref_q),
        "k_rel_err": relative_error(k, ref_k),
        "k_cache_rel_err": relative_error(dequantized(k_cache, k_scale), dequantized(ref_k_cache, k_scale)),
        "k_cache_is_returned_k": _same_bytes(at_slots(k_cache), own_k),
        "v_cache_match": _same_bytes(at_slots(v_cache), at_slots(ref_v_cache)),
        "all_written": not bool(_isnan(q).any() or _isnan(k).any() or _isnan(at_slots(k_cache)).any()
                                or _isnan(at_slots(v_cache)).any()),
        "others_untouched": all(_same_bytes(c.view(-1, num_kv_heads, head_dim)[others],
                                            poison.view(-1, num_kv_heads, head_dim)[others])
                                for c in (k_cache, v_cache)),
        "v_untouched": torch.equal(v, v_before),
    }


def check_fp8_pairs(device: str = "cpu") -> dict[str, Any]:
    """paged_tiles.fp8_pairs_to_f16 (the inline-PTX widening on a GPU, the integer one in the
    interpreter) on every pair of fp8 e4m3 values but NaN, against PyTorch's fp8 -> fp16."""
    # Module globals, not closure variables: the interpreter resolves a kernel's names in its
    # module only. Imported here so that importing this module never imports the kernels.
    global tl, fp8_pairs_to_f16
    import triton
    import triton.language as tl

    from lab.engine.kernels.paged_tiles import fp8_pairs_to_f16

    @triton.jit
    def widen(words_ptr, out_ptr, n, ASM: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        low, high = fp8_pairs_to_f16(tl.load(words_ptr + offs, mask=offs < n, other=0), ASM)
        tl.store(out_ptr + 2 * offs, low, mask=offs < n)
        tl.store(out_ptr + 2 * offs + 1, high, mask=offs < n)

    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = values[~values.float().isnan()].to(device)
    pairs = torch.cartesian_prod(torch.arange(len(values)), torch.arange(len(values))).to(device)
    fp8 = values[pairs.reshape(-1)].contiguous()  # low byte first, as in memory
    out = torch.full((fp8.numel(),), float("nan"), dtype=torch.float16, device=device)
    words = fp8.view(torch.int16)
    widen[(triton.cdiv(words.numel(), 1024),)](words, out, words.numel(), ASM=device != "cpu", BLOCK=1024)
    return {"exact": torch.equal(out.view(torch.int16), fp8.to(torch.float16).view(torch.int16)),
            "pairs": words.numel()}


def check_num_splits(shapes: list[list[int]], bounds_for: list[list[int]] = ()) -> dict[str, Any]:
    """choose_num_splits for (batch, num_kv_heads, max_context_len, num_sms[, programs_per_sm[,
    tile]]) shapes; and split_context_bounds over the same heuristic for (batch, num_kv_heads,
    max_model_len, num_sms, programs_per_sm, tile) in `bounds_for`, with each bound's split count."""
    from lab.engine.kernels.decode_attention import choose_num_splits, split_context_bounds

    bounds = []
    for batch, kv_heads, max_model_len, sms, per_sm, tile in bounds_for:
        def splits(context: int) -> int:
            return choose_num_splits(batch, kv_heads, context, sms, per_sm, tile)
        found = split_context_bounds(splits, max_model_len)
        bounds.append([[b, splits(b)] for b in found])
    return {"splits": [choose_num_splits(*shape) for shape in shapes], "bounds": bounds}


CHECKS = {f.__name__: f for f in (check_attention, check_padding_rows, check_rms_norm, check_rope_kv_write,
                                  check_silu_and_mul, check_attention_merge, check_fp8_pairs, check_num_splits)}


# ----------------------------------------------------------------------------------------------
# The interpreter worker


def interpreter_env() -> dict[str, str]:
    """This process's environment plus TRITON_INTERPRET=1 and the repository on PYTHONPATH."""
    return dict(os.environ, TRITON_INTERPRET="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))


def run_script_under_interpreter(script: str, timeout: float = 300) -> Any:
    """Run a test file as a script in a child with TRITON_INTERPRET=1 (its `__main__` writes JSON
    to the path given as its argument) and return what it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "results.json"
        proc = subprocess.run([sys.executable, script, str(path)], env=interpreter_env(), cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"interpreter child failed:\n{proc.stderr[-4000:]}")
        return json.loads(path.read_text())


class InterpreterWorker:
    """A child Python that runs `CHECKS` under TRITON_INTERPRET=1, one JSON request per line on
    its stdin, one JSON reply per line on a protocol pipe. One process serves a whole test
    module, so torch and triton are imported once (a few seconds) rather than per case."""

    def __init__(self) -> None:
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, env=interpreter_env(), cwd=REPO_ROOT, text=True)

    def run(self, check: str, **kwargs: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps({"check": check, "kwargs": kwargs}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            self._stderr.seek(0)
            raise RuntimeError("interpreter worker died:\n" + self._stderr.read().decode(errors="replace")[-4000:])
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"{check}({kwargs}) failed in the interpreter worker:\n{reply['error']}")
        return reply["result"]

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=30)
        self._stderr.close()


def _patch_interpreter() -> None:
    """Three emulations of Triton's CPU interpreter (3.6 to 3.9) disagree with the GPU; make them
    agree.
    - tl.dot on bfloat16: the interpreter keeps bf16 as raw uint16 and np.matmul multiplies the
      bit patterns. Widen to float32 first, which is exact, as the GPU's fp32-accumulating MMA is.
    - float32 -> bfloat16 truncates; the GPU (and PyTorch) round to nearest even.
    - float32 -> float8e4nv: its rounding does not carry a rounded-up mantissa into the exponent
      (1.97 becomes 1.0). The GPU's cvt.rn rounds to nearest even, as PyTorch does.
    The two roundings are delegated to PyTorch.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot, create_fp_to_fp, cast_impl = builder.create_dot, builder.create_fp_to_fp, builder.cast_impl
    torch_types = {tl.bfloat16: (torch.bfloat16, torch.uint16), tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8)}

    def round_from_fp32(src, dst):
        data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        target, storage = torch_types[dst]
        return interpreter.TensorHandle(data.to(target).view(storage).numpy(), dst)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (cast_impl(self, x, tl.float32) if x.dtype == tl.bfloat16 else x for x in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return round_from_fp32(src, tl.bfloat16)
        return cast_impl(self, src, dst_type)

    def fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return round_from_fp32(src, tl.float8e4nv)
        return create_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot, builder.cast_impl, builder.create_fp_to_fp = dot, cast, fp_to_fp

    # Scalars are 1-element arrays in the interpreter, and Triton 3.6 turns a loop bound into an
    # int with int(array), which numpy >= 2.5 refuses for arrays of one dimension (later Triton
    # squeezes first). Re-set tl.tensor.__index__ after the interpreter patches it per launch.
    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_tensor(tensor, *args):
        patch_lang_tensor(tensor, *args)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    interpreter._patch_lang_tensor = patch_tensor


def _serve() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the worker must start with TRITON_INTERPRET=1"
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    # Anything else written to stdout (warnings, stray prints) goes to stderr, not the protocol.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    torch.set_num_threads(1)
    _patch_interpreter()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"ok": True, "result": CHECKS[request["check"]](**request["kwargs"])}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


if __name__ == "__main__":
    _serve()

"""Triton kernels of the engine (lab/engine/kernels, lab/engine/model/triton_attention.py) against the
PyTorch reference path.

CPU: Triton's interpreter at small shapes. `triton.jit` reads TRITON_INTERPRET when a kernel
module is first imported, so setting it in this process could be defeated by any module that
imported the kernels earlier, and would leak into every test module after this one. Instead all
interpreter cases run in one child process started with the variable set (kernel_cases.
InterpreterWorker); this process never imports the kernels for them.

GPU (`gpu` marker, skipped without CUDA): the same checks at Llama-3-8B shapes (32 query / 8 KV
heads, head dim 128, block 16), contexts up to 32K, batches up to 256, in this process with
compiled kernels.

Every attention check also asserts that the output has no NaN left from its poisoning, that this
step's cache slots hold exactly what the reference wrote, and that every other cache slot still
holds its NaN poison (see kernel_cases).
"""

from __future__ import annotations

import importlib
import random
from typing import Any

import pytest

from tests.engine.kernel_cases import (InterpreterWorker, check_attention, check_attention_merge, check_fp8_pairs,
                                       check_padding_rows, check_rms_norm, check_rope_kv_write, check_silu_and_mul)

# ||out - ref|| / ||ref||. fp32 attention runs IEEE fp32 dots (no tf32), so 1e-4 leaves room only
# for summation order; bf16 rounds P and the output.
ATTENTION_TOL = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 5e-3}
# Elementwise kernels do the reference's arithmetic: at most an ulp of the output dtype apart.
ELEMENTWISE_TOL = {"float32": 1e-6, "bfloat16": 4e-3, "float16": 5e-4}


def assert_attention_ok(result: dict[str, Any], dtype: str) -> None:
    assert result["all_written"], f"output left NaN: {result}"
    assert result["cache_match"], f"written cache slots differ from the reference: {result}"
    assert result["poison_intact"], f"a slot outside every context was written: {result}"
    assert result["rel_err"] < ATTENTION_TOL[dtype], result


# ----------------------------------------------------------------------------------------------
# CPU: the interpreter


@pytest.fixture(scope="module")
def interpreter():
    pytest.importorskip("triton")
    worker = InterpreterWorker()
    yield worker
    worker.close()


def _case(seqs: list[tuple[int, int]], num_decodes: int, heads: tuple[int, int], head_dim: int,
          dtype: str = "float32", **extra: Any) -> dict[str, Any]:
    return dict(seqs=seqs, num_decodes=num_decodes, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                dtype=dtype, **extra)


# (query_len, context_len) per sequence, decodes first. The interpreter uses 16-token KV tiles and
# 16-row query tiles, so these lengths span several tiles and cross 16-token cache blocks.
INTERPRETER_ATTENTION_CASES = [
    pytest.param(_case([(1, 1), (1, 17), (1, 50)], 3, (2, 2), 64), id="decode-mha-d64-fp32"),
    pytest.param(_case([(1, 16), (1, 33), (1, 70)], 3, (8, 2), 128, num_splits=3), id="decode-gqa4-d128-fp32-split3"),
    pytest.param(_case([(1, 5), (1, 48), (1, 81)], 3, (6, 2), 64, "bfloat16", num_splits=4),
                 id="decode-gqa3-d64-bf16-split4"),
    pytest.param(_case([(1, 3), (1, 64)], 2, (8, 2), 128, "bfloat16", num_splits=8),
                 id="decode-gqa4-d128-bf16-split8-empty-splits"),
    pytest.param(_case([(5, 5), (33, 33)], 0, (6, 2), 64), id="prefill-gqa3-d64-fp32"),
    pytest.param(_case([(17, 50), (32, 32)], 0, (2, 2), 128), id="prefill-prefix-mha-d128-fp32"),
    pytest.param(_case([(7, 40), (20, 20), (16, 64), (1, 35)], 0, (8, 2), 128, "bfloat16"),
                 id="prefill-chunks-on-prefix-gqa4-d128-bf16"),
    pytest.param(_case([(1, 30), (1, 9), (12, 12), (9, 45)], 2, (8, 2), 64, "bfloat16"), id="mixed-gqa4-d64-bf16"),
    pytest.param(_case([(1, 47), (3, 19), (25, 60)], 1, (6, 2), 128, num_splits=2), id="mixed-gqa3-d128-fp32"),
    pytest.param(_case([(1, 70), (1, 33), (40, 100)], 2, (4, 1), 64, block_size=32, num_splits=2),
                 id="mixed-gqa4-d64-fp32-block32"),
    pytest.param(_case([(1, 20), (1, 41), (5, 5), (9, 30)], 2, (8, 2), 64, "bfloat16",
                       cache_dtype="float8_e4m3fn", num_splits=2), id="mixed-bf16-fp8-cache"),
    pytest.param(_case([(1, 20), (1, 41), (5, 5), (9, 30)], 2, (6, 2), 128, cache_dtype="float8_e4m3fn",
                       k_scale=0.37, v_scale=1.9, num_splits=3), id="mixed-fp32-fp8-cache-scaled"),
]


@pytest.mark.parametrize("case", INTERPRETER_ATTENTION_CASES)
def test_attention_interpreter(interpreter: InterpreterWorker, case: dict[str, Any]) -> None:
    assert_attention_ok(interpreter.run("check_attention", **case), case["dtype"])


def test_attention_fresh_inputs_per_seed(interpreter: InterpreterWorker) -> None:
    # Same shapes, other random draws: errors are not an accident of one draw.
    case = _case([(1, 25), (6, 40)], 1, (8, 2), 64, "bfloat16", num_splits=2)
    for seed in (1, 2):
        assert_attention_ok(interpreter.run("check_attention", seed=seed, **case), "bfloat16")


def test_decode_padding_rows_interpreter(interpreter: InterpreterWorker) -> None:
    result = interpreter.run("check_padding_rows")
    assert result["padding_zero"] and result["cache_match"] and result["poison_intact"], result
    assert result["rel_err"] < ATTENTION_TOL["float32"], result


def test_num_splits_heuristic(interpreter: InterpreterWorker) -> None:
    shapes = [(1, 8, 32768, 132), (1, 8, 1024, 132), (1, 8, 100, 132), (16, 8, 8192, 132), (64, 8, 32768, 132),
              (256, 8, 32768, 132), (1, 1, 1 << 20, 132)]
    # Batch 1 at 32K gets two programs per SM; short contexts keep 64 tokens a split; batch 16
    # rounds down to stay in one wave; batch 64 and up already has enough programs; MAX_SPLITS
    # bounds the rest.
    assert interpreter.run("check_num_splits", shapes=shapes)["splits"] == [33, 16, 2, 2, 1, 1, 64]
    # Four programs per SM (the fp8 configuration): twice the splits below batch 64; batch 64 of
    # 8 KV heads (512 programs) already fills the 528.
    fp8 = [(1, 8, 32768, 132, 4), (16, 8, 8192, 132, 4), (32, 8, 4096, 132, 4), (64, 8, 32768, 132, 4),
           (256, 8, 2048, 132, 4)]
    assert interpreter.run("check_num_splits", shapes=fp8)["splits"] == [64, 4, 2, 1, 1]
    # No split shorter than a tile: 128-token tiles (bf16 split launches) at a 1K context.
    assert interpreter.run("check_num_splits", shapes=[(1, 8, 1024, 132, 2, 128)])["splits"] == [8]


def test_split_context_bounds(interpreter: InterpreterWorker) -> None:
    # One CUDA graph per bound: batch 1 on an H200 (bf16, 128-token tiles) grows its split count
    # every 512 tokens up to 4K, then stays at 33; batch 4 is at its 8 from 1K on; batch 32 never
    # splits.
    result = interpreter.run("check_num_splits", shapes=[], bounds_for=[
        (1, 8, 131072, 132, 2, 128), (4, 8, 131072, 132, 2, 128), (32, 8, 131072, 132, 2, 128),
        (1, 8, 300, 132, 2, 128)])
    b1, b4, b32, short = result["bounds"]
    assert b1 == [[512 * i, 4 * i] for i in range(1, 9)] + [[131072, 33]]
    assert b4 == [[512, 4], [131072, 8]]
    assert b32 == [[131072, 1]]
    assert short == [[300, 3]]


@pytest.mark.parametrize("case", [
    pytest.param(dict(num_tokens=5, hidden=576, dtype="float32"), id="fp32-residual"),
    pytest.param(dict(num_tokens=7, hidden=576, dtype="bfloat16"), id="bf16-residual"),
    pytest.param(dict(num_tokens=3, hidden=4096, dtype="float16"), id="fp16-residual-4096"),
    pytest.param(dict(num_tokens=4, hidden=576, dtype="bfloat16", weight_dtype="float32", with_residual=False),
                 id="bf16-fp32-weight-no-residual"),
])
def test_rms_norm_interpreter(interpreter: InterpreterWorker, case: dict[str, Any]) -> None:
    result = interpreter.run("check_rms_norm", **case)
    assert result["all_written"] and result["dtype_match"], result
    assert result["normed_rel_err"] < ELEMENTWISE_TOL[case["dtype"]], result
    assert result["residual_rel_err"] < ELEMENTWISE_TOL[case["dtype"]], result


def assert_elementwise_ok(result: dict[str, Any], dtype: str, *flags: str) -> None:
    """A fused elementwise kernel against the reference's arithmetic: every flag true, within an
    ulp of the output dtype, and in 16 bits rarely a different rounding (a float32 exp an ulp
    apart from PyTorch's may tip one now and then, never often)."""
    assert all(result[flag] for flag in flags), result
    assert result["rel_err"] < ELEMENTWISE_TOL[dtype], result
    if dtype != "float32":
        assert result["mismatch_fraction"] < 0.01, result


def assert_silu_and_mul_ok(result: dict[str, Any], dtype: str) -> None:
    assert_elementwise_ok(result, dtype, "all_written", "dtype_match", "returned_out")


@pytest.mark.parametrize("case", [
    pytest.param(dict(num_tokens=3, inter=1536, dtype="float32"), id="fp32"),
    pytest.param(dict(num_tokens=5, inter=1000, dtype="bfloat16"), id="bf16-ragged"),
    pytest.param(dict(num_tokens=2, inter=700, dtype="float16"), id="fp16-ragged"),
])
def test_silu_and_mul_interpreter(interpreter: InterpreterWorker, case: dict[str, Any]) -> None:
    assert_silu_and_mul_ok(interpreter.run("check_silu_and_mul", **case), case["dtype"])


def assert_attention_merge_ok(result: dict[str, Any], dtype: str) -> None:
    assert_elementwise_ok(result, dtype, "all_written", "poison_intact", "returned_out")


@pytest.mark.parametrize("case", [
    pytest.param(dict(length=5, num_heads=8, num_kv_heads=2, head_dim=16, dtype="float32"), id="fp32-gqa"),
    pytest.param(dict(length=40, num_heads=6, num_kv_heads=2, head_dim=64, dtype="bfloat16"), id="bf16-ragged"),
    pytest.param(dict(length=33, num_heads=9, num_kv_heads=3, head_dim=96, dtype="float16"), id="fp16-dim96"),
    pytest.param(dict(length=7, num_heads=4, num_kv_heads=4, head_dim=32, dtype="bfloat16"), id="bf16-mha"),
])
def test_attention_merge_interpreter(interpreter: InterpreterWorker, case: dict[str, Any]) -> None:
    assert_attention_merge_ok(interpreter.run("check_attention_merge", **case), case["dtype"])


def test_attention_merge_refuses_shapes_that_do_not_fit() -> None:
    from lab.engine.kernels.attention_merge import merge_into

    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="shapes do not fit"):
        merge_into(torch.zeros(2, 12, 8), torch.zeros(2, 12), torch.zeros(8, 3, 8), torch.zeros(8, 3),
                   torch.zeros(4, 8, 8))


def test_silu_and_mul_rejects_an_odd_width() -> None:
    from lab.engine.kernels.silu_mul import silu_and_mul

    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="even last dimension"):
        silu_and_mul(torch.zeros(2, 7))


def assert_rope_kv_write_ok(result: dict[str, Any], dtype: str, fp8: bool) -> None:
    assert result["returns_views"] and result["v_untouched"] and result["all_written"], result
    assert result["others_untouched"], f"a cache slot outside slot_mapping was written: {result}"
    # The cache holds exactly the returned k, stored as a KV write would store it, and exactly
    # the reference's v.
    assert result["k_cache_is_returned_k"] and result["v_cache_match"], result
    assert max(result["q_rel_err"], result["k_rel_err"]) < ELEMENTWISE_TOL[dtype], result
    # An ulp of difference in k can move an fp8 byte by one step (1/8 relative) now and then.
    assert result["k_cache_rel_err"] < (1e-2 if fp8 else ELEMENTWISE_TOL[dtype]), result


@pytest.mark.parametrize("case", [
    pytest.param(dict(num_tokens=5, num_heads=4, num_kv_heads=2, head_dim=64), id="fp32-d64"),
    pytest.param(dict(num_tokens=7, num_heads=8, num_kv_heads=2, head_dim=128, dtype="bfloat16"), id="bf16-d128"),
    pytest.param(dict(num_tokens=6, num_heads=6, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                      cache_dtype="float8_e4m3fn", k_scale=0.37, v_scale=1.9), id="bf16-fp8-cache-scaled"),
    pytest.param(dict(num_tokens=4, num_heads=3, num_kv_heads=3, head_dim=64, cache_dtype="float8_e4m3fn"),
                 id="fp32-fp8-cache"),
])
def test_rope_kv_write_interpreter(interpreter: InterpreterWorker, case: dict[str, Any]) -> None:
    result = interpreter.run("check_rope_kv_write", **case)
    assert_rope_kv_write_ok(result, case.get("dtype", "float32"), "cache_dtype" in case)


def test_fp8_pairs_interpreter(interpreter: InterpreterWorker) -> None:
    # The integer widening the interpreter runs in place of the GPU's cvt instruction.
    assert interpreter.run("check_fp8_pairs")["exact"]


# ----------------------------------------------------------------------------------------------
# GPU: compiled kernels at real shapes

LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


@pytest.fixture(scope="module")
def compiled_kernels() -> None:
    """Fail, rather than crawl, if something imported the kernels under the interpreter."""
    from triton.runtime.jit import JITFunction

    decode_module = importlib.import_module("lab.engine.kernels.decode_attention")
    assert isinstance(decode_module._decode_split_kernel, JITFunction), "kernels were built for the interpreter"


def _ragged(batch: int, low: int, high: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(1, rng.randint(low, high)) for _ in range(batch)]


GPU_ATTENTION_CASES = [
    pytest.param(dict(seqs=[(1, 32768)], num_decodes=1), id="decode-b1-32k"),
    pytest.param(dict(seqs=[(1, 1000)], num_decodes=1), id="decode-b1-1k"),
    pytest.param(dict(seqs=_ragged(64, 1, 8192, 0), num_decodes=64), id="decode-b64-ragged-8k"),
    pytest.param(dict(seqs=_ragged(256, 1, 2048, 1), num_decodes=256), id="decode-b256-ragged-2k"),
    pytest.param(dict(seqs=_ragged(4, 4000, 9000, 2), num_decodes=4, num_splits=64), id="decode-b4-split64"),
    # Batch 1 at 1K with the split counts the engine's graphs use at batch 1 (sized for
    # max_model_len: 33 bf16, 64 fp8), so most splits hold no tile.
    pytest.param(dict(seqs=[(1, 1088)], num_decodes=1, num_splits=33), id="decode-b1-1k-split33"),
    pytest.param(dict(seqs=[(1, 1088)], num_decodes=1, num_splits=64, cache_dtype="float8_e4m3fn",
                      k_scale=0.05, v_scale=0.02), id="decode-b1-1k-split64-fp8"),
    pytest.param(dict(seqs=[(2048, 2048)], num_decodes=0), id="prefill-2k"),
    pytest.param(dict(seqs=[(2048, 32768)], num_decodes=0), id="prefill-chunk-2k-on-30k-prefix"),
    pytest.param(dict(seqs=[(1000, 1000), (517, 3000), (1, 40), (2048, 10000)], num_decodes=0),
                 id="prefill-ragged-chunks"),
    pytest.param(dict(seqs=_ragged(128, 1, 4096, 3) + [(300, 300), (1500, 7000), (77, 5000)], num_decodes=128),
                 id="mixed-128-decodes-3-prefills"),
    pytest.param(dict(seqs=_ragged(64, 1, 8192, 4) + [(1024, 3000)], num_decodes=64, cache_dtype="float8_e4m3fn"),
                 id="mixed-fp8-cache"),
    pytest.param(dict(seqs=_ragged(8, 1, 4096, 5) + [(1024, 3000)], num_decodes=8, cache_dtype="float8_e4m3fn",
                      k_scale=0.05, v_scale=0.02), id="mixed-fp8-cache-scaled"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_ATTENTION_CASES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_attention_gpu(compiled_kernels: None, case: dict[str, Any], dtype: str) -> None:
    assert_attention_ok(check_attention(**case, **LLAMA3_8B, dtype=dtype, device="cuda"), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    pytest.param(dict(seqs=_ragged(16, 1, 4096, 6) + [(700, 2000)], num_decodes=16), id="mixed-llama3"),
    pytest.param(dict(seqs=[(1, 3000), (1, 40), (129, 129), (64, 900)], num_decodes=2, num_heads=9, num_kv_heads=3,
                      head_dim=64, block_size=16), id="mixed-smollm2"),
])
def test_attention_gpu_fp32(compiled_kernels: None, case: dict[str, Any]) -> None:
    shape = {**LLAMA3_8B, **case}
    assert_attention_ok(check_attention(**shape, dtype="float32", device="cuda"), "float32")


@pytest.mark.gpu
def test_decode_padding_rows_gpu(compiled_kernels: None) -> None:
    result = check_padding_rows(device="cuda")
    assert result["padding_zero"] and result["cache_match"] and result["poison_intact"], result
    assert result["rel_err"] < ATTENTION_TOL["float32"], result


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("hidden", [576, 4096, 8192])
def test_rms_norm_gpu(compiled_kernels: None, dtype: str, hidden: int) -> None:
    for with_residual in (True, False):
        result = check_rms_norm(4099, hidden, dtype, with_residual=with_residual, device="cuda")
        assert result["all_written"] and result["dtype_match"], result
        assert result["normed_rel_err"] < ELEMENTWISE_TOL[dtype], result
        assert result["residual_rel_err"] < ELEMENTWISE_TOL[dtype], result


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("cache", [None, "float8_e4m3fn"])
def test_rope_kv_write_gpu(compiled_kernels: None, dtype: str, cache: str | None) -> None:
    scales = dict(k_scale=0.05, v_scale=0.02) if cache else {}
    result = check_rope_kv_write(4099, 32, 8, 128, dtype, cache_dtype=cache, max_positions=131072, device="cuda",
                                 **scales)
    assert_rope_kv_write_ok(result, dtype, cache is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_attention_merge_gpu(compiled_kernels: None, dtype: str) -> None:
    assert_attention_merge_ok(check_attention_merge(4099, 32, 8, 128, dtype, device="cuda"), dtype)


@pytest.mark.gpu
def test_attention_merge_compiles_once_for_every_chunk_length(compiled_kernels: None) -> None:
    """Chunk lengths of every class Triton would tell apart (1, multiples of 16, multiples of 4,
    odd), each after the first, compile nothing: a server meets them all while it serves."""
    import torch

    from lab.engine.kernels.attention_merge import _merge_kernel

    check_attention_merge(7, 32, 8, 128, "bfloat16", device="cuda")
    device = torch.cuda.current_device()
    compiled = len(_merge_kernel.device_caches[device][0])
    for length in (1, 2, 4, 16, 113, 488, 8192):
        assert_attention_merge_ok(check_attention_merge(length, 32, 8, 128, "bfloat16", device="cuda"), "bfloat16")
    assert len(_merge_kernel.device_caches[device][0]) == compiled


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("inter", [1536, 14336])
def test_silu_and_mul_gpu(compiled_kernels: None, dtype: str, inter: int) -> None:
    assert_silu_and_mul_ok(check_silu_and_mul(4099, inter, dtype, device="cuda"), dtype)


@pytest.mark.gpu
def test_fp8_pairs_gpu(compiled_kernels: None) -> None:
    # The inline cvt.rn.f16x2.e4m3x2 that widens fp8 V tiles in decode attention.
    assert check_fp8_pairs(device="cuda")["exact"]

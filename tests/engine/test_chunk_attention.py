"""A prefill chunk's attention over its cached prefix, split and merged (lab/engine/
chunk_attention.py), against the one bottom-right causal call of the PyTorch reference path."""

from __future__ import annotations

import pytest
import torch

from lab.engine.model.attention import causal_attention
from lab.engine.model.chunk_attention import PrefillKernels, chunk_attention, merge

# (chunk length, prefix length, query heads, KV heads, head dim)
SHAPES = [(5, 0, 4, 4, 16), (7, 13, 8, 2, 16), (33, 100, 6, 2, 64), (1, 50, 9, 3, 64), (64, 64, 32, 8, 128)]


def _inputs(length: int, prefix: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
            device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(length * 1000 + prefix)
    q = torch.randn(length, heads, dim, generator=gen).to(device, dtype)
    k = torch.randn(prefix + length, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(prefix + length, kv_heads, dim, generator=gen).to(device, dtype)
    return q, k, v


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_attention_matches_bottom_right_causal_cpu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    q, k, v = _inputs(*shape, dtype, "cpu")
    out = chunk_attention(q, k, v, shape[-1] ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    ref = causal_attention(q.float(), k.float(), v.float(), shape[-1] ** -0.5)
    assert _rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("prefix", [0, 21])
def test_chunk_attention_writes_into_the_given_rows_only(prefix: int) -> None:
    q, k, v = _inputs(9, prefix, 8, 2, 16, torch.float32, "cpu")
    buffer = torch.full((13, 8, 16), float("nan"))
    got = chunk_attention(q, k, v, 0.25, out=buffer[2:11])
    assert got.data_ptr() == buffer[2:].data_ptr()
    torch.testing.assert_close(got, chunk_attention(q, k, v, 0.25), rtol=0, atol=0)
    assert buffer[:2].isnan().all() and buffer[11:].isnan().all()


def test_merge_of_two_halves_is_attention_over_both() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 1, 4, 8, generator=gen) for _ in range(3))
    scores = q @ k.transpose(-1, -2)
    full = torch.softmax(scores, -1) @ v
    parts = []
    for keys in (slice(0, 2), slice(2, 4)):
        s = scores[..., keys]
        parts.append((torch.softmax(s, -1) @ v[..., keys, :], torch.logsumexp(s, -1)))
    (out_a, lse_a), (out_b, lse_b) = parts
    # [B, 1, L, D] -> [L, B, D] as merge takes [L, H, D] and [L, H]
    merged = merge(out_a[:, 0].transpose(0, 1), lse_a[:, 0].transpose(0, 1),
                   out_b[:, 0].transpose(0, 1), lse_b[:, 0].transpose(0, 1))
    torch.testing.assert_close(merged, full[:, 0].transpose(0, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("backends", [("flash", "flash"), ("cudnn", "cudnn"), ("efficient", "efficient"),
                                      ("cudnn", "flash"), ("flash", "cudnn")])
@pytest.mark.parametrize("shape", [(2048, 30720, 32, 8, 128), (8192, 8192, 32, 8, 128), (700, 1300, 9, 3, 64),
                                   (512, 0, 32, 8, 128)])
def test_chunk_attention_gpu_backends(backends: tuple[str, str], shape: tuple[int, ...]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    q, k, v = _inputs(*shape, torch.bfloat16, "cuda")
    out = chunk_attention(q, k, v, shape[-1] ** -0.5, prefix_backend=backends[0], chunk_backend=backends[1])
    ref = causal_attention(q.float(), k.float(), v.float(), shape[-1] ** -0.5)
    assert _rel_err(out, ref) < 1e-2


# Llama-3-8B: 32 layers, 32 query heads of 128.
LLAMA = dict(heads=32, head_dim=128)


def test_auto_keeps_chat_sized_prompts_off_cudnn_whose_plan_costs_more_than_it_saves() -> None:
    kernels = PrefillKernels("auto", num_layers=32, recurring_lengths=frozenset({8192}))
    # A chat, a chat turn over a history, a tool output over a long session: a new shape each time.
    assert kernels.for_chunk(60, 0, **LLAMA) == ("flash", "flash")
    assert kernels.for_chunk(500, 2000, **LLAMA) == ("flash", "flash")
    assert kernels.for_chunk(2000, 6000, **LLAMA) == ("flash", "flash")


def test_auto_takes_cudnn_where_one_use_pays_for_the_plan_part_by_part() -> None:
    kernels = PrefillKernels("auto", num_layers=32, recurring_lengths=frozenset({8192}))
    # 4,000 tokens over 100K: the prefix part is worth a plan, the small causal part is not.
    assert kernels.for_chunk(4000, 100_000, **LLAMA) == ("cudnn", "flash")
    # A lone 32K prompt in one step: its causal part alone saves more than a plan.
    assert kernels.for_chunk(32_768, 0, **LLAMA) == ("flash", "cudnn")
    # The same attention in a 2-layer model saves too little.
    assert PrefillKernels("auto", num_layers=2).for_chunk(4000, 100_000, **LLAMA) == ("flash", "flash")


def test_auto_takes_cudnn_for_the_shapes_every_long_prompt_repeats() -> None:
    kernels = PrefillKernels("auto", num_layers=32, recurring_lengths=frozenset({8192}))
    # Whole 8,192-token chunks over whole chunks: built once, reused by every long prompt.
    assert kernels.for_chunk(8192, 0, **LLAMA)[1] == "cudnn"
    assert kernels.for_chunk(8192, 3 * 8192, **LLAMA) == ("cudnn", "cudnn")
    # A chunk of the budget over a prefix that is not whole chunks (a request shifted its
    # boundaries), too short to pay for its own plan.
    assert kernels.for_chunk(8192, 1000, **LLAMA) == ("flash", "cudnn")
    # The same chunk under a budget of 4,096 is a one-off: flash for its causal part.
    assert PrefillKernels("auto", 32, frozenset({4096})).for_chunk(8192, 0, **LLAMA)[1] == "flash"


@pytest.mark.parametrize("mode", ["cudnn", "flash"])
def test_a_fixed_kernel_serves_every_shape(mode: str) -> None:
    kernels = PrefillKernels(mode, num_layers=32, recurring_lengths=frozenset({8192}))
    for shape in [(60, 0), (8192, 8192), (32_768, 0), (4000, 100_000)]:
        assert kernels.for_chunk(*shape, **LLAMA) == (mode, mode)

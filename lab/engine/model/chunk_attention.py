"""Attention of a prefill chunk over a long cached prefix, split in two and merged.

A chunk of L new tokens after P cached ones attends to the prefix without a mask (every query is
past every prefix position) and to itself causally. PyTorch's bottom-right causal call over the
whole context runs on flash attention with K/V repeated to every query head; split in two, the
prefix part is a plain dense attention whose query heads fold onto their shared KV head (the
group's rows stacked, so K/V are read once per KV head and never repeated), and each part can use
whichever of PyTorch's kernels is fastest for its shape. The parts return their log-sum-exp and
are merged exactly: out = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2), on CUDA in one kernel
(`lab.engine.kernels.attention_merge`) that writes the step's output in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.engine.kernels.attention_merge import merge_into

# PyTorch's kernels for the two parts on CUDA. Once running, cuDNN's is the fastest at every
# length measured on an H200, but PyTorch builds (and caches) a cuDNN plan for every new (query
# length, key length), which costs more than a chat-sized attention itself; flash attention has
# no plan. Their rates over the FLOPs the mask keeps at long shapes, and the cost of one plan, on
# an H200 (benchmarks/attention_prefill.py, benchmarks/attention_shapes.py).
# Any of "flash", "cudnn", "efficient" gives the same numbers to rounding.
FLASH_FLOPS_PER_S = 330e12
CUDNN_FLOPS_PER_S = 590e12
CUDNN_PLAN_S = 0.045


@dataclass(frozen=True)
class PrefillKernels:
    """Which PyTorch kernel runs each part of a chunk's attention on CUDA. `mode` "cudnn" or
    "flash" fixes it; "auto" takes cuDNN for a part whose shape recurs (a chunk of exactly one of
    `recurring_lengths`, the step budgets, over a prefix of whole such chunks: every long prompt
    repeats those shapes, so their plans are built once) or whose one use, over `num_layers`
    layers, saves more than a plan costs; flash otherwise. The choice depends on the shape and
    the configuration only, never on what ran before, so one request computes the same numbers
    whatever preceded it."""

    mode: str = "auto"
    num_layers: int = 1
    recurring_lengths: frozenset[int] = frozenset()

    def for_chunk(self, length: int, prefix: int, heads: int, head_dim: int) -> tuple[str, str]:
        """(kernel of the prefix part, kernel of the causal part) for `length` new tokens after
        `prefix` cached ones, `heads` query heads of `head_dim`."""
        if self.mode != "auto":
            return self.mode, self.mode
        recurring = length in self.recurring_lengths
        prefix_kernel = self._pick(recurring and prefix % length == 0, 4 * heads * head_dim * length * prefix)
        return prefix_kernel, self._pick(recurring, 2 * heads * head_dim * length * length)

    def _pick(self, recurring: bool, flops: float) -> str:
        saved_s = self.num_layers * flops * (1 / FLASH_FLOPS_PER_S - 1 / CUDNN_FLOPS_PER_S)
        return "cudnn" if recurring or saved_s >= CUDNN_PLAN_S else "flash"


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                  backend: str = "flash") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its natural log-sum-exp per query row. q: [B, H, Lq, D]; k, v: [B, KVH, Lk, D]
    (KVH dividing H, or equal to it for kernels without grouped heads); a causal call needs Lq ==
    Lk. Returns out [B, H, Lq, D] in q's dtype and lse [B, H, Lq] in float32. On the CPU the
    backend is ignored (PyTorch's CPU flash kernel)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if backend == "flash":
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return result[0], result[1]
    if backend == "cudnn":
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                    scale=scale)
        return result[0], result[1].reshape(q.shape[:3])
    if backend == "efficient":
        result = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                        scale=scale)
        # The kernel pads its log-sum-exp rows to a multiple of 32.
        return result[0], result[1][..., :q.shape[2]]
    raise ValueError(f"unknown attention backend {backend!r} (flash, cudnn, efficient)")


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    prefix_backend: str = "cudnn", chunk_backend: str = "cudnn",
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the last len(q) positions of a len(k)-token context, aligned bottom-right
    (as `lab.engine.model.attention.causal_attention`). q: [L, H, D]; k, v: [P + L, KVH, D] contiguous,
    in q's dtype. Returns [L, H, D], written into `out` when given."""
    if q.dtype == torch.float32:
        # Flash and cuDNN take only 16-bit inputs.
        prefix_backend = chunk_backend = "efficient"
    length, heads, dim = q.shape
    prefix, kv_heads = k.shape[0] - length, k.shape[1]
    group = heads // kv_heads
    chunk_q = q.transpose(0, 1).unsqueeze(0)
    chunk_k, chunk_v = (_repeat(x[prefix:], group, chunk_backend).transpose(0, 1).unsqueeze(0) for x in (k, v))
    chunk_out, chunk_lse = attention_lse(chunk_q, chunk_k, chunk_v, causal=True, scale=scale, backend=chunk_backend)
    if prefix == 0:
        chunk_out = chunk_out[0].transpose(0, 1)
        return chunk_out if out is None else out.copy_(chunk_out)
    # Row r of KV head h is query head h * group + r // length at token r % length.
    folded_q = q.view(length, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * length, dim)
    prefix_k, prefix_v = (x[:prefix].transpose(0, 1).unsqueeze(0) for x in (k, v))
    prefix_out, prefix_lse = attention_lse(folded_q, prefix_k, prefix_v, causal=False, scale=scale,
                                           backend=prefix_backend)
    if q.device.type == "cuda":
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        return merge_into(prefix_out[0], prefix_lse[0], chunk_out[0], chunk_lse[0], out)
    prefix_out = prefix_out.view(kv_heads, group, length, dim).permute(2, 0, 1, 3).reshape(length, heads, dim)
    prefix_lse = prefix_lse.view(kv_heads, group, length).permute(2, 0, 1).reshape(length, heads)
    merged = merge(prefix_out, prefix_lse, chunk_out[0].transpose(0, 1), chunk_lse[0].transpose(0, 1)).to(q.dtype)
    return merged if out is None else out.copy_(merged)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted sum of two attentions over disjoint key sets ([L, H, D], lse [L, H]):
    the attention over their union, in float32."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    return (out_a.float() * (weight_a / total)[..., None] + out_b.float() * (weight_b / total)[..., None])


def _repeat(x: torch.Tensor, group: int, backend: str) -> torch.Tensor:
    # The memory-efficient kernel wants as many KV heads as query heads; the chunk's own K/V are small.
    return x.repeat_interleave(group, dim=1) if backend == "efficient" and group > 1 else x

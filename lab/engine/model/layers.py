"""Elementwise layers of a Llama-family decoder in plain PyTorch: the CPU path and the oracle
for the fused Triton kernels (same signatures)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm with the residual add fused in: x' = x + residual (when given); returns
    (rmsnorm(x') * weight, x'). The norm is computed in float32 whatever the input dtype."""
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32:
        # One fused op instead of six: the per-op dispatch cost matters for one-row decode steps.
        return F.rms_norm(x, (x.shape[-1],), weight, eps), x
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # float32 arithmetic, as Hugging Face computes it: a float64 table differs by an ulp, which
    # grows into visible logit differences at long positions.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq


def rope_cos_sin_cache(head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope_rows(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding in the rotate-half (GPT-NeoX / Hugging Face Llama) layout. q: [T, H, D],
    k: [T, KVH, D]; `rows` holds each token's cos|sin row ([T, D], gathered once per forward pass
    and reused by every layer). Returns new tensors in q's dtype."""
    cos, sin = rows.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    # Written into halves of one buffer: no concatenation and no temporaries per half.
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)
    return out.to(x.dtype)

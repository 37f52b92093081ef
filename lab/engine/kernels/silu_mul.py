"""The MLP's SiLU-and-multiply in one pass: gate|up read once, the product written once, where
PyTorch runs two elementwise kernels (silu, then the multiply: three reads and two writes of a
[T, I] tensor). Both are bandwidth bound, so one pass moves three such tensors' bytes instead of
five (benchmarks/step_profile.py reports it as a step's `activation` part). Same roundings
as `lab.engine.model.layers.silu_and_mul`: SiLU in float32 rounded to the input dtype, then the
product in float32 rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up = gate | up along the last dimension ([..., 2I] -> [..., I])."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension (gate | up), got {two_i}")
    inter = two_i // 2
    x2 = gate_up.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.shape != (*gate_up.shape[:-1], inter) or out.dtype != gate_up.dtype or not out.is_contiguous():
        raise ValueError(f"silu_and_mul: out must be a contiguous {gate_up.dtype} tensor of shape "
                         f"{(*gate_up.shape[:-1], inter)}, got {out.dtype} {tuple(out.shape)}")
    out2 = out.view(-1, inter)
    if x2.shape[0]:
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, BLOCK))](
            x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=BLOCK, num_warps=4)
    return out

"""Fused RMSNorm with the residual add: one read of x and residual, one write of each result,
instead of the four elementwise passes of the PyTorch path. Same semantics as
`lab.engine.model.layers.rms_norm`, including its roundings: x + residual in x's dtype, the norm in
float32, the normed row rounded to x's dtype before the weight multiplies it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
                     stride_x, stride_r, stride_o, stride_ro, hidden,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Added in float32 and rounded once to x's dtype, as PyTorch computes a 16-bit add.
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x') * weight, x') with x' = x + residual when given, else x. The normed output
    has the dtype of weight * x in PyTorch's promotion (fp32 weights give fp32 output).
    `out` / `residual_out` receive the results when given (preallocated or in-place buffers,
    e.g. residual_out=residual)."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous()
    x2 = x.reshape(-1, hidden)
    assert x2.stride(-1) == 1
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == out_dtype
    out2 = out.view(-1, hidden)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        r2 = residual.reshape(-1, hidden)
        if residual_out is None:
            residual_out = torch.empty_like(x)
        assert residual_out.shape == x.shape and residual_out.dtype == x.dtype
        residual_out2 = residual_out.view(-1, hidden)
        assert r2.stride(-1) == 1 and residual_out2.stride(-1) == 1
    else:
        assert residual_out is None, "residual_out needs a residual"
        # Never touched without HAS_RESIDUAL; any tensor serves as the pointer argument.
        r2 = residual_out2 = x2
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        # A row is one program: 4 warps up to 2K elements (16 per thread), more for wider rows
        # so each thread keeps few elements in registers.
        num_warps = min(max(block // 512, 4), 16)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out2, residual_out2, eps,
            x2.stride(0), r2.stride(0), out2.stride(0), residual_out2.stride(0), hidden,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
        )
    return out, (residual_out if residual is not None else x)

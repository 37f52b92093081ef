"""The model wired with the CUDA path's kernels (Triton attention, fused RMSNorm, fused RoPE +
KV write, skinny GEMV with the SiLU fused into the down projection, the pre-norms, residual adds
and, on its FMA path, RoPE and the KV write folded into the products, float32 logits straight
from the kernel) against the same model on the PyTorch reference path, step by step: one prefill
step of three prompts (products of more than 16 rows: F.linear), then decode steps of three rows
and of two (the skinny kernels' two paths). On the CPU under Triton's interpreter, in a child process (see
test_kernels.py for why), with `dummy:tiny` weights in float32.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

PROMPTS = (5, 12, 20)  # prompt lengths; contexts cross 16-token blocks
DECODE_STEPS = 4
BLOCK = 16


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def _compare_steps() -> list[float]:
    from lab.engine.kernels import gemv, rmsnorm, silu_mul
    from lab.engine.kernels.rope_kv_write import rope_and_write_kv
    from lab.engine.model.attention import TorchAttention
    from lab.engine.model.attention_metadata import build_metadata
    from lab.engine.model.model import Model, Ops, SkinnyOps
    from lab.engine.model.triton_attention import TritonAttention
    from lab.engine.weights.loader import load_model

    def build(attention, ops: Ops | None) -> tuple[Model, list[tuple[torch.Tensor, torch.Tensor]]]:
        loaded = load_model("dummy:tiny", torch.float32, "cpu", seed=0)
        mc = loaded.config
        model = Model(mc, loaded.weights, attention, max_positions=256, ops=ops)
        cache = torch.zeros(mc.num_layers, 2, 4 * len(PROMPTS) + 1, BLOCK, mc.num_kv_heads, mc.head_dim)
        return model, [(cache[i, 0], cache[i, 1]) for i in range(mc.num_layers)]

    def qkv_rope_kv(x, w, norm_weight, eps, rows, k_cache, v_cache, slots):
        rope = gemv.RopeKV(rows, k_cache, v_cache, slots)
        return gemv.skinny_linear(x, w, norm_weight=norm_weight, eps=eps, rope=rope)

    ops = Ops(rms_norm=rmsnorm.rms_norm, silu_and_mul=silu_mul.silu_and_mul, rope_write_kv=rope_and_write_kv,
              skinny=SkinnyOps(rows=gemv.MAX_ROWS, linear=gemv.skinny_linear,
                               silu_mul_linear=gemv.skinny_silu_mul_linear, qkv_rope_kv=qkv_rope_kv))
    fast, fast_kv = build(TritonAttention(), ops)
    ref, ref_kv = build(TorchAttention(), None)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in PROMPTS]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(seqs))]
    errors = []
    computed = [0] * len(seqs)
    for step in range(DECODE_STEPS + 1):
        # The last prompt stops after two decode steps: three rows take the skinny kernels'
        # tensor-core path, two their FMA path (pre-norm, RoPE and KV write in the products).
        active = range(len(seqs)) if step <= 2 else range(len(seqs) - 1)
        ids, positions, qlens = [], [], []
        for i in active:
            new = seqs[i][computed[i]:]
            ids += new
            positions += range(computed[i], len(seqs[i]))
            qlens.append(len(new))
        ctx = [len(seqs[i]) for i in active]
        meta = build_metadata(qlens, ctx, [tables[i] for i in active], BLOCK, num_decodes=len(active) if step else 0)
        ids_t, pos_t = torch.tensor(ids), torch.tensor(positions)
        last = torch.tensor(qlens).cumsum(0) - 1
        want = ref.logits(ref.forward(ids_t, pos_t, meta, ref_kv)[last])
        got = fast.logits(fast.forward(ids_t, pos_t, meta, fast_kv)[last])
        assert got.dtype == torch.float32
        errors.append(_relative_error(got, want))
        for row, i in enumerate(active):
            computed[i] = len(seqs[i])
            seqs[i].append(int(want[row].argmax()))
    return errors


def _interpreter_main(path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    Path(path).write_text(json.dumps(_compare_steps()))


def test_triton_ops_model_matches_reference_under_interpreter() -> None:
    pytest.importorskip("triton")
    from tests.engine.kernel_cases import run_script_under_interpreter

    errors = run_script_under_interpreter(__file__)
    assert len(errors) == DECODE_STEPS + 1
    # fp32 throughout: only summation order differs.
    assert max(errors) < 1e-4, errors


if __name__ == "__main__":
    _interpreter_main(sys.argv[1])

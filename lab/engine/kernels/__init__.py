"""Triton kernels of the bundled engine: paged KV-cache write, split-KV decode attention,
prefill attention over a cached prefix, fused RMSNorm with residual, RoPE fused with the KV-cache
write, SiLU-and-multiply in one pass, and skinny matrix products for decode steps (gemv).

`triton.jit` decides at decoration time, i.e. when these modules are first imported, whether the
kernels compile for a GPU or run in Triton's CPU interpreter (TRITON_INTERPRET=1). The
interpreter is for tests at small shapes; see tests/engine/kernel_cases.py.
"""

from lab.engine.kernels.decode_attention import choose_num_splits, decode_attention
from lab.engine.kernels.kv_write import write_kv_cache
from lab.engine.kernels.prefill_attention import prefill_attention
from lab.engine.kernels.rmsnorm import rms_norm
from lab.engine.kernels.rope_kv_write import rope_and_write_kv
from lab.engine.kernels.silu_mul import silu_and_mul

__all__ = ["choose_num_splits", "decode_attention", "prefill_attention", "rms_norm",
           "rope_and_write_kv", "silu_and_mul", "write_kv_cache"]

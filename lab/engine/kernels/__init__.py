"""Triton kernels of the bundled engine: paged KV-cache write, split-KV decode attention,
prefill attention over a cached prefix, fused RMSNorm with residual, RoPE fused with the KV-cache
write, SiLU-and-multiply in one pass, and skinny matrix products for decode steps (gemv).

`triton.jit` decides at decoration time, i.e. when these modules are first imported, whether the
kernels compile for a GPU or run in Triton's CPU interpreter (TRITON_INTERPRET=1). The
interpreter is for tests at small shapes; see tests/engine/kernel_cases.py.

Import each kernel from its module: this package itself imports nothing, so `cache_dtypes` (the
constants the kernels share with the PyTorch reference path) loads without Triton, which a CPU
install may lack.
"""

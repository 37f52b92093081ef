"""The bundled engine: a paged-KV inference engine with an OpenAI-compatible server. It never
imports the rest of lab; the lab starts it as `python -m lab.engine serve` and speaks HTTP to it.

Public API: `LLM` (offline generation), `SamplingParams` and `EngineConfig`:

    from lab.engine import LLM, SamplingParams
    LLM("smollm2-135m").generate(["The capital of France is"], SamplingParams(max_tokens=8))

Packages, from the bottom up: `kernels/` (Triton), `model/` (the decoder and its attention
paths), `weights/` (loading weights and tokenizers), `core/` (config, scheduler, block manager,
the step loop), `serve/` (`LLM`, the async engine, the HTTP server), `tools/` (`lab engine bench`
and its transformers reference).
"""

from __future__ import annotations

from typing import Any

from lab.engine.core.config import EngineConfig

__all__ = ["LLM", "EngineConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # LLM and SamplingParams load torch: the lab imports this package for EngineConfig alone.
    if name == "LLM":
        from lab.engine.serve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from lab.engine.core.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'lab.engine' has no attribute {name!r}")

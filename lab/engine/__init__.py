"""The bundled engine: a paged-KV inference engine with an OpenAI-compatible server. It never
imports the rest of lab; the lab starts it as `python -m lab.engine serve` and speaks HTTP to it.

Public API: `LLM` (offline generation), `SamplingParams` and `EngineConfig`:

    from lab.engine import LLM, SamplingParams
    LLM("smollm2-135m").generate(["The capital of France is"], SamplingParams(max_tokens=8))

Layers, from the bottom up; a layer imports only those below it (tests/test_boundaries.py):
- `kernels/`: the Triton kernels;
- `model_config.py` (model shapes and presets) and `cache_dir.py` (where on-disk caches live):
  leaves that `model/` and `weights/` share;
- `model/` (the decoder, its attention paths and the step's attention metadata) beside
  `weights/` (loading weights and tokenizers): neither imports the other;
- `core/config.py`, `core/sampling_params.py`, `core/sequence.py` and `core/sampler.py`: the
  config, a request's state and the sampler, which `kv/` and `spec/` are written against;
- `kv/` (the block manager, the prefix cache and its host-memory and file tiers) beside `spec/`
  (speculative decoding: prompt-lookup drafts and their verification);
- the rest of `core/` (the scheduler, the step loop, the model runner);
- `serve/` (`LLM`, the async engine, the HTTP server), then `tools/` (`lab engine bench` and its
  transformers reference).

`settings.py` is the contract with the lab: the one engine module the rest of lab imports.
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

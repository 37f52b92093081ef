"""Reading a Hugging Face model directory: `config.json` (Llama, Qwen2 or Mistral shape),
safetensors weights (one file or shards with an index), and `tokenizer.json`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from lab.engine.model_config import ModelConfig
from lab.engine.weights.loader import ModelLoadError, check_weights
from lab.engine.weights.tokenizer import TOKENIZER_FILE, Tokenizer
from lab.engine.weights.weight_cache import sha256_files

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
_INDEX_FILE = "model.safetensors.index.json"
# Files whose bytes define what the model computes, hashed into source_hash.
_DEFINING_FILES = ("config.json", "generation_config.json", TOKENIZER_FILE, "tokenizer_config.json",
                   "chat_template.jinja")


def load_hf_directory(directory: Path, dtype: torch.dtype, device: torch.device,
                      ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, str]:
    """(config, weights, tokenizer, sha256 over the directory's defining files and weights)."""
    config = read_config(directory)
    files = safetensors_files(directory)
    weights = _read_weights(files, config, dtype, device)
    check_weights(weights, config, str(directory))
    if not (directory / TOKENIZER_FILE).exists():
        raise ModelLoadError(f"{directory}: no {TOKENIZER_FILE}; this engine reads tokenizers only in that format "
                             f"(save one with transformers' tokenizer.save_pretrained)")
    tokenizer = Tokenizer.from_hf_directory(directory, vocab_size=config.vocab_size,
                                            eos_token_ids=config.eos_token_ids)
    defining = [directory / n for n in _DEFINING_FILES if (directory / n).exists()]
    return config, weights, tokenizer, sha256_files(defining + files)


def read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{directory}: no config.json, so not a Hugging Face model directory "
                             f"(expected config.json, *.safetensors and tokenizer.json)")
    try:
        raw: dict[str, Any] = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read it as JSON ({exc})") from None
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{path}: model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    generation_path = directory / "generation_config.json"
    generation = json.loads(generation_path.read_text("utf-8")) if generation_path.exists() else {}
    try:
        return _config(raw, generation, model_type)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: lacks {exc.args[0]!r}") from None


def _config(raw: dict[str, Any], generation: dict[str, Any], model_type: str) -> ModelConfig:
    heads = raw["num_attention_heads"]
    # transformers 5 writes `rope_parameters` (theta included); older configs have `rope_theta`
    # and `rope_scaling` side by side.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
    if model_type == "mistral" and raw.get("sliding_window"):
        log.warning("config.json sets sliding_window=%s; this engine attends to the whole context, "
                    "so outputs past that many tokens differ from the reference", raw["sliding_window"])
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        architecture=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rope_theta=float(theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw["max_position_embeddings"],
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama says so in the config when it has them.
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        rope_scaling=rope or None,
        bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=eos_ids,
    )


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / _INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{directory}: {_INDEX_FILE} lists shards that are not there: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weights (other weight formats are not read)")
    return files


def _read_weights(files: list[Path], config: ModelConfig, dtype: torch.dtype,
                  device: torch.device) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            # Straight onto the device: a large checkpoint never needs a full copy in host memory.
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # a buffer older checkpoints saved; RoPE tables are computed
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # some tied checkpoints store the shared matrix twice
                    weights[name] = f.get_tensor(name).to(dtype)
        except (OSError, SafetensorError) as exc:
            raise ModelLoadError(f"{path}: cannot read it as safetensors ({exc})") from None
    return weights

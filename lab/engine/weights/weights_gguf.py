"""Reading a GGUF file: its config and tokenizer from the metadata, and its tensors dequantized to
float32 under Hugging Face names, equal bit for bit to what transformers loads from the same file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from lab.engine.model_config import ModelConfig
from lab.engine.weights.loader import ModelLoadError, check_weights
from lab.engine.weights.tokenizer import Tokenizer

# GGUF architectures whose tensors follow the Llama layout. Mistral files say "llama".
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    return None


def unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each q/k head's rows from HF's half-split rotary layout to
    interleaved pairs (its RoPE kernel rotates adjacent elements); this puts them back."""
    half = weight.shape[0] // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    reader = _open(path)
    meta = _Metadata(reader, path)
    config = _config(meta)
    tokenizer = _tokenizer(meta, config)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} has no place in a Llama-layout model "
                                 f"(a feature this engine does not implement)")
        weights[name] = _dequantize(tensor, path)
        if config.architecture == "llama" and ".q_proj." in name:
            weights[name] = unpermute_rope(weights[name], config.num_heads)
        elif config.architecture == "llama" and ".k_proj." in name:
            weights[name] = unpermute_rope(weights[name], config.num_kv_heads)
    check_weights(weights, config, str(path))
    return config, weights, tokenizer


def _open(path: Path) -> GGUFReader:
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        reason = " ".join(str(exc).split())
        raise ModelLoadError(f"{path}: cannot read it as GGUF, it is probably truncated or damaged; "
                             f"copy or download it again ({reason})") from None
    return reader


def _dequantize(tensor: Any, path: Path) -> torch.Tensor:
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is {tensor.tensor_type.name}, "
                             f"which gguf cannot dequantize") from None
    # ggml lists dimensions fastest-first; torch wants them the other way round.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(shape)


class _Metadata:
    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._fields = reader.fields
        self.tensor_names = {t.name for t in reader.tensors}
        self.path = path
        self.architecture = self.get("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"{path}: architecture {self.architecture!r} is not supported; "
                                 f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: metadata lacks {self.architecture}.{key}")
        return value


def _float32(value: float) -> float:
    # Metadata floats are float32; their shortest repr reads better in configs and hashes (1e-05,
    # not 9.999999747378752e-06) and rounds back to the same float32.
    return float(str(np.float32(value)))


def _config(meta: _Metadata) -> ModelConfig:
    hidden = meta.require("embedding_length")
    heads = meta.require("attention.head_count")
    rope_scaling = None
    scaling_type = meta.arch("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": _float32(meta.arch("rope.scaling.factor", 1.0))}
        original = meta.arch("rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = original
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return ModelConfig(
        architecture=meta.architecture,
        vocab_size=len(tokens) or meta.require("vocab_size"),
        hidden_size=hidden,
        intermediate_size=meta.require("feed_forward_length"),
        num_layers=meta.require("block_count"),
        num_heads=heads,
        num_kv_heads=meta.arch("attention.head_count_kv", heads),
        head_dim=meta.arch("attention.key_length", hidden // heads),
        rope_theta=_float32(meta.arch("rope.freq_base", 10000.0)),
        rms_norm_eps=_float32(meta.require("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=meta.require("context_length"),
        tie_word_embeddings="output.weight" not in meta.tensor_names,
        attention_bias=meta.architecture == "qwen2",
        rope_scaling=rope_scaling,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(meta),
    )


def _eos_ids(meta: _Metadata) -> tuple[int, ...]:
    ids = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _tokenizer(meta: _Metadata, config: ModelConfig) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{meta.path}: tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                             f"use the model's Hugging Face directory instead")
    return Tokenizer.from_gguf_vocab(
        tokens=meta.get("tokenizer.ggml.tokens"), token_types=meta.get("tokenizer.ggml.token_type") or [],
        merges=meta.get("tokenizer.ggml.merges") or [], pre=meta.get("tokenizer.ggml.pre"),
        bos_token_id=config.bos_token_id, eos_token_ids=config.eos_token_ids,
        unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"), vocab_size=config.vocab_size)

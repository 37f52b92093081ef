"""Hugging Face transformers on exactly the engine's weights: the reference `lab engine bench`
measures against."""

from __future__ import annotations

import torch

from lab.engine.model_config import ModelConfig


def hf_config(mc: ModelConfig):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    rope = {"rope_type": "default", "rope_theta": mc.rope_theta}
    if mc.rope_scaling:
        scaling = dict(mc.rope_scaling)
        scaling["rope_type"] = scaling.pop("type", scaling.get("rope_type", "default"))
        rope = {**scaling, "rope_theta": mc.rope_theta}
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[mc.architecture]
    extra = {"attention_bias": mc.attention_bias} if mc.architecture == "llama" else {}
    return cls(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
               num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads,
               num_key_value_heads=mc.num_kv_heads, head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
               max_position_embeddings=mc.max_position_embeddings, tie_word_embeddings=mc.tie_word_embeddings,
               rope_parameters=rope, bos_token_id=mc.bos_token_id,
               eos_token_id=list(mc.eos_token_ids) or None, **extra)


def build_hf_model(mc: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                   device: torch.device, attn_implementation: str = "sdpa"):
    """A transformers CausalLM holding `weights` (Hugging Face names), in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(mc), dtype=dtype,
                                                 attn_implementation=attn_implementation)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed_missing = {"lm_head.weight"} if mc.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"weights do not fit transformers' model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    if mc.tie_word_embeddings:
        model.tie_weights()
    return model.eval()

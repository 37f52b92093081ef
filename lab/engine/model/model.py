"""A Llama-family decoder (Llama, Qwen2, Mistral) over a flat varlen batch and a paged KV cache.

Projections are fused at load time (q|k|v into one matrix, gate|up into one) so a layer runs
four matrix products; norms, RoPE and attention come from pluggable implementations so the same
model runs the PyTorch path on the CPU and Triton kernels on CUDA. On the CPU, each product's
layout is the one measured fastest on the host for its shape and row count (`cpu_linear`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from lab.engine.model import layers
from lab.engine.model.attention import AttentionBackend
from lab.engine.model.attention_metadata import AttentionMetadata
from lab.engine.model.cpu_linear import CpuLinear
from lab.engine.model_config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class SkinnyOps:
    """Kernels for decode-sized steps (at most `rows` tokens): products that fold in what the
    reference runs apart, the pre-norm before them and the residual add after them."""
    rows: int
    # (x, w, out_dtype=None, norm_weight=None, eps=, residual=None) -> x @ w.T, see gemv.skinny_linear
    linear: Callable
    # (gate_up, w, residual=None) -> silu_and_mul(gate_up) @ w.T (+ residual)
    silu_mul_linear: Callable
    # The q|k|v product with its pre-norm, RoPE and KV write fused in:
    # (x, w, norm_weight, eps, rows, k_cache, v_cache, slots) -> q|k|v with q and k rotated
    qkv_rope_kv: Callable | None = None


@dataclass
class Ops:
    """The kernels a model uses beside its attention; the defaults (`layers`, `F.linear`) are the
    reference. A backend may add one that applies RoPE and writes the KV cache together, and
    kernels for decode-sized steps (`skinny`); on the CPU, `linear` is the host's measured product
    layouts (`cpu_linear`)."""
    linear: Callable = F.linear  # (x, w, bias) -> x @ w.T + bias
    rms_norm: Callable = layers.rms_norm
    silu_and_mul: Callable = layers.silu_and_mul
    apply_rope_rows: Callable = layers.apply_rope_rows
    rope_write_kv: Callable | None = None  # (q, k, v, rows, k_cache, v_cache, slots) -> rotated q, k
    skinny: SkinnyOps | None = None


class Model:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], attention: AttentionBackend,
                 max_positions: int, ops: Ops | None = None, cpu_products: str = "measured") -> None:
        self.config = config
        self.attention = attention
        self.ops = ops or Ops()
        w = weights
        self.embed = w["model.embed_tokens.weight"]
        self.on_cpu = self.embed.device.type == "cpu"
        self.norm = w["model.norm.weight"]
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            bias = None
            if config.attention_bias:
                bias = torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            self.layers.append(LayerWeights(
                input_norm=w[p + "input_layernorm.weight"],
                qkv=torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                qkv_bias=bias,
                o=w.pop(p + "self_attn.o_proj.weight"),
                post_norm=w[p + "post_attention_layernorm.weight"],
                gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                down=w.pop(p + "mlp.down_proj.weight"),
            ))
            # Drop the unfused copies as we go so peak memory stays near one model.
            for n in ("q", "k", "v"):
                w.pop(p + f"self_attn.{n}_proj.weight", None)
                w.pop(p + f"self_attn.{n}_proj.bias", None)
            w.pop(p + "mlp.gate_proj.weight", None)
            w.pop(p + "mlp.up_proj.weight", None)
        self.lm_head = self.embed if config.tie_word_embeddings else w.pop("lm_head.weight")
        device = self.embed.device
        self.cos_sin = layers.rope_cos_sin_cache(config.head_dim, max_positions, config.rope_theta,
                                                 config.rope_scaling, device=device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        if self.on_cpu and cpu_products == "measured":
            self.ops = replace(self.ops, linear=CpuLinear.for_model(
                [(lw.qkv, lw.o, lw.gate_up, lw.down) for lw in self.layers], [self.lm_head]))

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        skinny = self.ops.skinny
        if skinny is not None and x.shape[0] <= skinny.rows:
            y = skinny.linear(x, w, out_dtype=out_dtype)
            return y.add_(bias) if bias is not None else y
        y = self.ops.linear(x, w, bias)
        return y if out_dtype is None else y.to(out_dtype)

    # Two ways through a layer, chosen once per step by its size. The reference layer keeps a
    # block's output apart from the residual stream until the next norm adds it (rms_norm takes
    # and returns the stream). The skinny layer's products add the stream themselves and fold the
    # next pre-norm in, so between its blocks the hidden state is the stream.

    def _reference_layer(self, hidden: torch.Tensor, residual: torch.Tensor | None, layer: LayerWeights,
                         kv: tuple[torch.Tensor, torch.Tensor], rope_rows: torch.Tensor,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        ops, eps = self.ops, self.config.rms_norm_eps
        h, residual = ops.rms_norm(hidden, layer.input_norm, eps, residual)
        attn = self._attend(self.linear(h, layer.qkv, layer.qkv_bias), kv, rope_rows, meta, kv_written=False)
        h, residual = ops.rms_norm(self.linear(attn, layer.o), layer.post_norm, eps, residual)
        return self.linear(ops.silu_and_mul(self.linear(h, layer.gate_up)), layer.down), residual

    def _skinny_layer(self, skinny: SkinnyOps, stream: torch.Tensor, layer: LayerWeights,
                      kv: tuple[torch.Tensor, torch.Tensor], rope_rows: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if skinny.qkv_rope_kv is not None and layer.qkv_bias is None:
            qkv = skinny.qkv_rope_kv(stream, layer.qkv, layer.input_norm, eps, rope_rows, kv[0], kv[1],
                                     meta.slot_mapping)
            attn = self._attend(qkv, kv, rope_rows, meta, kv_written=True)
        else:
            qkv = skinny.linear(stream, layer.qkv, norm_weight=layer.input_norm, eps=eps)
            if layer.qkv_bias is not None:
                qkv.add_(layer.qkv_bias)
            attn = self._attend(qkv, kv, rope_rows, meta, kv_written=False)
        stream = skinny.linear(attn, layer.o, residual=stream)
        gate_up = skinny.linear(stream, layer.gate_up, norm_weight=layer.post_norm, eps=eps)
        return skinny.silu_mul_linear(gate_up, layer.down, residual=stream)

    def _attend(self, qkv: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], rope_rows: torch.Tensor,
                meta: AttentionMetadata, kv_written: bool) -> torch.Tensor:
        """Attention over a q|k|v product ([T, H * D]): RoPE and the KV write first unless a
        product already did them."""
        cfg, ops = self.config, self.ops
        t = qkv.shape[0]
        k_cache, v_cache = kv
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        if not kv_written and ops.rope_write_kv is not None:
            q, k = ops.rope_write_kv(q, k, v, rope_rows, k_cache, v_cache, meta.slot_mapping)
            kv_written = True
        elif not kv_written:
            q, k = ops.apply_rope_rows(q, k, rope_rows)
        attn = self.attention.forward(q, k, v, k_cache, v_cache, meta, self.scale, kv_written=kv_written)
        return attn.view(t, self.q_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every new token of the step."""
        eps = self.config.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed)
        rope_rows = self.cos_sin.index_select(0, positions)  # shared by every layer
        skinny = self.ops.skinny
        if skinny is not None and input_ids.shape[0] <= skinny.rows:
            for layer, kv in zip(self.layers, kv_cache):
                hidden = self._skinny_layer(skinny, hidden, layer, kv, rope_rows, meta)
            return self.ops.rms_norm(hidden, self.norm, eps, None)[0]
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_cache):
            hidden, residual = self._reference_layer(hidden, residual, layer, kv, rope_rows, meta)
        return self.ops.rms_norm(hidden, self.norm, eps, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits, whatever the model dtype, so sampling and logprobs are stable."""
        return self.linear(hidden, self.lm_head, out_dtype=torch.float32)

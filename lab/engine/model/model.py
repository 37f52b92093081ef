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

from lab.engine.core.attention_metadata import AttentionMetadata
from lab.engine.model import layers
from lab.engine.model.attention import AttentionBackend
from lab.engine.model.cpu_linear import CpuLinear
from lab.engine.model.model_config import ModelConfig


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
class Ops:
    """The kernels a model uses beside its attention; the defaults (`layers`, `F.linear`) are the
    reference. A backend may add kernels for decode-sized products (`skinny_*`, used for products
    of at most `skinny_rows` rows) and one that applies RoPE and writes the KV cache together; on
    the CPU, `linear` is the host's measured product layouts (`cpu_linear`)."""
    linear: Callable = F.linear  # (x, w, bias) -> x @ w.T + bias
    rms_norm: Callable = layers.rms_norm
    silu_and_mul: Callable = layers.silu_and_mul
    apply_rope_rows: Callable = layers.apply_rope_rows
    skinny_rows: int = 0
    # (x, w, out_dtype=None, norm_weight=None, eps=, residual=None) -> x @ w.T, see gemv.skinny_linear
    skinny_linear: Callable | None = None
    # (gate_up, w, residual=None) -> silu_and_mul(gate_up) @ w.T (+ residual)
    skinny_silu_mul_linear: Callable | None = None
    rope_write_kv: Callable | None = None  # (q, k, v, rows, k_cache, v_cache, slots) -> rotated q, k
    # The skinny q|k|v product with its pre-norm, RoPE and KV write fused in:
    # (x, w, norm_weight, eps, rows, k_cache, v_cache, slots) -> q|k|v with q and k rotated
    skinny_qkv_rope_kv: Callable | None = None


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
        rows = x.shape[0]
        ops = self.ops
        if ops.skinny_linear is not None and rows <= ops.skinny_rows:
            y = ops.skinny_linear(x, w, out_dtype=out_dtype)
            return y.add_(bias) if bias is not None else y
        y = ops.linear(x, w, bias)
        return y if out_dtype is None else y.to(out_dtype)

    # The residual stream is carried as (hidden, residual). On the reference path a block's output
    # stays apart from the stream until the next norm adds it (residual = the stream so far); on
    # the skinny path the output products add it themselves, so residual is None between blocks
    # and the norm is folded into the next product.

    def _norm_linear(self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor,
                     w: torch.Tensor, bias: torch.Tensor | None, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(stream) * norm) @ w^T (+ bias), and the stream."""
        if fused:
            y = self.ops.skinny_linear(hidden, w, norm_weight=norm, eps=self.config.rms_norm_eps)
            return (y.add_(bias) if bias is not None else y), hidden
        h, residual = self.ops.rms_norm(hidden, norm, self.config.rms_norm_eps, residual)
        return self.linear(h, w, bias), residual

    def _attention(self, hidden: torch.Tensor, residual: torch.Tensor | None, layer: LayerWeights,
                   kv: tuple[torch.Tensor, torch.Tensor], rope_rows: torch.Tensor, meta: AttentionMetadata,
                   fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention block up to its output projection: ([T, H * D], the stream)."""
        cfg, ops = self.config, self.ops
        t = hidden.shape[0]
        k_cache, v_cache = kv
        kv_written = fused and ops.skinny_qkv_rope_kv is not None and layer.qkv_bias is None
        if kv_written:
            qkv = ops.skinny_qkv_rope_kv(hidden, layer.qkv, layer.input_norm, cfg.rms_norm_eps, rope_rows,
                                         k_cache, v_cache, meta.slot_mapping)
            residual = hidden
        else:
            qkv, residual = self._norm_linear(hidden, residual, layer.input_norm, layer.qkv, layer.qkv_bias, fused)
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
        return attn.view(t, self.q_size), residual

    def _out_linear(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
                    fused: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A block's output projection: x @ w^T, added to the stream on the skinny path."""
        if fused:
            return self.ops.skinny_linear(x, w, residual=residual), None
        return self.linear(x, w), residual

    def _mlp(self, hidden: torch.Tensor, residual: torch.Tensor, layer: LayerWeights,
             fused: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        gate_up, residual = self._norm_linear(hidden, residual, layer.post_norm, layer.gate_up, None, fused)
        ops = self.ops
        if fused:
            return ops.skinny_silu_mul_linear(gate_up, layer.down, residual=residual), None
        if ops.skinny_silu_mul_linear is not None and gate_up.shape[0] <= ops.skinny_rows:
            return ops.skinny_silu_mul_linear(gate_up, layer.down), residual
        return self.linear(ops.silu_and_mul(gate_up), layer.down), residual

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every new token of the step."""
        cfg = self.config
        t = input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed)
        rope_rows = self.cos_sin.index_select(0, positions)  # shared by every layer
        residual: torch.Tensor | None = None
        ops = self.ops
        fused = ops.skinny_linear is not None and ops.skinny_silu_mul_linear is not None and t <= ops.skinny_rows
        for layer, kv in zip(self.layers, kv_cache):
            attn, residual = self._attention(hidden, residual, layer, kv, rope_rows, meta, fused)
            hidden, residual = self._out_linear(attn, layer.o, residual, fused)
            hidden, residual = self._mlp(hidden, residual, layer, fused)
        hidden, _ = ops.rms_norm(hidden, self.norm, cfg.rms_norm_eps, residual)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits, whatever the model dtype, so sampling and logprobs are stable."""
        return self.linear(hidden, self.lm_head, out_dtype=torch.float32)

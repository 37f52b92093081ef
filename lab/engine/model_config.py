"""The shape of a Llama-family decoder, and named shapes for `dummy:<preset>` weights.

A leaf below `model/` and `weights/`: the decoder is built from a shape and the loaders read one, so
both import it and neither imports the other; it loads without torch, for the lab's settings."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # llama | qwen2 | mistral
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def num_params(self) -> int:
        h, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + self.vocab_size * h + head + h

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        name="smollm2-135m"),
    "llama3-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_ids=(128001, 128009), name="llama3-8b"),
    # Llama-3-8B's shapes with a million-token context (rope base as in Gradient's 1048K Llama-3
    # extension) and room for a decode tail after a 1,048,576-token prompt: random weights only,
    # for the long-context ladders.
    "llama3-8b-1m": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=3580165449.0, rms_norm_eps=1e-5,
        max_position_embeddings=1_048_576 + 4096, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=(128001, 128009), name="llama3-8b-1m"),
    "qwen2.5-7b": ModelConfig(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=True,
        bos_token_id=None, eos_token_ids=(151645, 151643), name="qwen2.5-7b"),
    "qwen2.5-0.5b": ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
        bos_token_id=None, eos_token_ids=(151645, 151643), name="qwen2.5-0.5b"),
    "mistral-7b": ModelConfig(
        architecture="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-5,
        max_position_embeddings=32768, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
        name="mistral-7b"),
    # A few-layer shape for fast tests of code paths that do not need real weights.
    "tiny": ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(257,),
        name="tiny"),
}

"""Physical floors for the engine's figures: the bytes a decode step must read and the FLOPs a
prefill must do, over ceilings measured on the device in the same run (copy bandwidth and
matrix-multiply rate), so every speed can be printed as a fraction of what the hardware allows."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lab.engine.model_config import ModelConfig


@dataclass
class Ceilings:
    copy_bytes_per_s: float  # memory traffic of a large device copy: bytes read + bytes written, per second
    matmul_flops_per_s: float  # dense matmul rate in the model dtype
    device: str
    dtype: str


WARMUP_S = 0.3


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    """The fastest run of fn, over at least `repeats` runs and WARMUP_S seconds. A ceiling is the
    most the device showed it can do, so the best run, not the median: a low ceiling flatters
    every fraction of it. On an H200 the slow runs come at both ends: a copy is slow while the
    clocks ramp up from idle, and a long matmul loop slows once the board reaches its power limit
    (about 670 against 780 TFLOP/s). CUDA runs are timed with events, so host launch and sync
    costs stay out."""
    times = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < WARMUP_S:
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(times[1:] or times)  # the first run pays for allocation and kernel selection


def _copy_seconds(nbytes: int, device: torch.device, repeats: int) -> float:
    # Its own function so the two buffers are freed before the matmul operands are allocated.
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return _best_seconds(lambda: dst.copy_(src), device, repeats)


def measure_ceilings(device: torch.device, dtype: torch.dtype, copy_bytes: int | None = None,
                     matmul_n: int | None = None, repeats: int = 20) -> Ceilings:
    gpu = device.type == "cuda"
    copy_bytes = copy_bytes or ((2 << 30) if gpu else (256 << 20))
    t_copy = _copy_seconds(copy_bytes, device, repeats)
    n = matmul_n or (8192 if gpu else 1024)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t_mm = _best_seconds(lambda: a @ b, device, repeats)
    return Ceilings(copy_bytes_per_s=2 * copy_bytes / t_copy, matmul_flops_per_s=2 * n ** 3 / t_mm,
                    device=str(device), dtype=str(dtype).removeprefix("torch."))


def _body_params(config: ModelConfig) -> int:
    """Parameters of the decoder blocks and final norm: everything but embedding and LM head."""
    table = config.vocab_size * config.hidden_size
    return config.num_params - table * (1 if config.tie_word_embeddings else 2)


def weight_bytes_read_per_step(config: ModelConfig, element_size: int) -> int:
    """Every weight a decode step reads: the blocks plus the LM head in full (tied or not). Of the
    embedding table only a few rows are read, so it does not count."""
    return (_body_params(config) + config.vocab_size * config.hidden_size) * element_size


def decode_step_floor_s(config: ModelConfig, weight_element_size: int, kv_element_size: int,
                        context_tokens: int, ceilings: Ceilings) -> float:
    """Least time a decode step can take: its bytes (weights plus the KV of every running
    sequence, `context_tokens` in total) over the copy bandwidth (reads only count once)."""
    kv = config.kv_bytes_per_token(kv_element_size) * context_tokens
    read_bytes = weight_bytes_read_per_step(config, weight_element_size) + kv
    # The copy ceiling counts every byte that crosses the memory bus (read or written), which is
    # what a decode step's reads are limited by too.
    return read_bytes / ceilings.copy_bytes_per_s


def decode_step_part_floors_s(config: ModelConfig, weight_element_size: int, kv_element_size: int, rows: int,
                              context_tokens: int, ceilings: Ceilings) -> dict[str, float]:
    """The compute-aware floor of a decode step of `rows` sequences, per part: the larger of its
    bytes at the copy ceiling and its FLOPs at the matmul ceiling. Products read every weight but
    the embedding table and do 2 FLOPs per weight per row, which at a few hundred rows outweighs
    their bytes; attention reads the KV of `context_tokens` tokens in all, its FLOPs negligible."""
    weights = weight_bytes_read_per_step(config, 1)
    products = max(weights * weight_element_size / ceilings.copy_bytes_per_s,
                   2 * weights * rows / ceilings.matmul_flops_per_s)
    attention = config.kv_bytes_per_token(kv_element_size) * context_tokens / ceilings.copy_bytes_per_s
    return {"products": products, "attention": attention}


def prefill_attention_flops(config: ModelConfig, tokens: int) -> float:
    """Matmul FLOPs of a cold prefill's causal attention: QK^T and PV over half the square."""
    return 2 * 2 * config.num_layers * config.num_heads * config.head_dim * tokens * tokens / 2


def prefill_flops(config: ModelConfig, tokens: int) -> float:
    """Matmul FLOPs of a cold prefill of `tokens` tokens: the blocks for every token, causal
    attention, and the LM head for the last token only."""
    linear = 2 * _body_params(config) * tokens + 2 * config.vocab_size * config.hidden_size
    return linear + prefill_attention_flops(config, tokens)


def prefill_floor_s(config: ModelConfig, tokens: int, ceilings: Ceilings) -> float:
    return prefill_flops(config, tokens) / ceilings.matmul_flops_per_s

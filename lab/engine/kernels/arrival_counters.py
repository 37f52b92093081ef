"""Arrival counters for kernels that finish a reduction in their last-arriving program (gemv's
split-K): one int32 buffer per device, shared by every such launch.

Each launch leaves the counters it used at zero, so launches in one stream (or one CUDA graph)
can share the buffer; launches on two streams at once on one device must not (the engine uses
one). The buffer is zeroed when first made, which must happen outside CUDA-graph capture (the
engine's warm-up makes it): under capture before that, `counter_buffer` returns None and the
caller launches without splitting, correct but slower."""

from __future__ import annotations

import torch

# Largest grid of tiles a split launch supports: one counter each.
MAX_COUNTERS = 1 << 16

_buffers: dict[torch.device, torch.Tensor] = {}


def counter_buffer(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed counters, or None under CUDA-graph capture before they exist."""
    buffer = _buffers.get(device)
    if buffer is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # a zero-fill recorded into the graph would leave it garbage for eager calls
        buffer = _buffers[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return buffer

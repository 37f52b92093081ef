"""Host values onto the device without waiting for it.

`torch.tensor(values, device="cuda")` copies from pageable memory, which synchronises the stream:
the host waits for every queued kernel before it can go on, so it cannot prepare the next step
(or queue an overlapped decode step) while the device runs this one. A copy from pinned memory
with non_blocking=True is queued like a kernel instead; PyTorch's caching host allocator keeps the
pinned source alive until that copy has run."""

from __future__ import annotations

import torch


def to_device(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, or a tensor on the host) as a `dtype` tensor on `device`, queued behind
    the device's work rather than waiting for it."""
    if device.type != "cuda":
        return values.to(device, dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype,
                                                                                               device=device)
    if isinstance(values, torch.Tensor):
        host = values.to(dtype).pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)

"""The KV-cache dtypes stored at 8 bits (with a scale per cache), shared by the Triton kernels and
the PyTorch reference path that checks them."""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)

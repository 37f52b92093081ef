"""Where the engine keeps what it builds once and reads back later: the dequantized-weights cache
(`weights/weight_cache.py`), the CPU product layouts timed per host (`model/cpu_linear.py`) and the
KV file tier (`kv/kv_tiers.py`). A leaf: it imports no other engine module."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(explicit: Path | None = None) -> Path:
    """`explicit` if given, else $LAB_CACHE_DIR, else ~/.cache/lab."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get("LAB_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lab"

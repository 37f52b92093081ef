"""Host hygiene before a boot: enough MemAvailable, or wait for it, or give up with a reason."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import psutil

GIB = 1024**3


def mem_available_bytes() -> int:
    """The kernel's MemAvailable (what a new process can get without swapping); psutil reads it
    from /proc/meminfo on Linux."""
    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class MemoryGate:
    ok: bool
    mem_available: int  # bytes, at the last check
    waited_s: float
    reason: str | None


def wait_for_memory(floor_gib: float, wait_s: float, poll_s: float = 1.0,
                    on_wait: Callable[[int, float], None] | None = None) -> MemoryGate:
    """Pass once MemAvailable >= floor; after `wait_s` of waiting, fail with the reason."""
    floor = floor_gib * GIB
    start = time.monotonic()
    while True:
        available = mem_available_bytes()
        waited = time.monotonic() - start
        if available >= floor:
            return MemoryGate(True, available, waited, None)
        if waited >= wait_s:
            return MemoryGate(False, available, waited,
                              f"host MemAvailable {available / GIB:.1f} GiB < floor {floor_gib:g} GiB "
                              f"after waiting {waited:.0f} s")
        if on_wait:
            on_wait(available, waited)
        time.sleep(min(poll_s, max(0.0, wait_s - waited)))

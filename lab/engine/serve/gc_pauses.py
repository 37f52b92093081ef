"""Python's garbage collector in the served engine: the heap built at start-up is frozen, and every
collection's pause is counted for `/v1/stats`.

A full (generation 2) collection walks every tracked object. After start-up the engine holds
hundreds of thousands of them that live as long as it does (a Block per KV block, the model's
modules, the web framework), so a full collection that fires during a step stalls the step loop
for as long as that walk takes, at a moment set by allocation counts, not by anything a request
controls. `gc.freeze()` moves the start-up heap out of the collector's reach, as vLLM does after
its engine starts; the pauses that remain are counted per generation so a noisy figure can be
checked against them."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any


def freeze_startup_heap() -> int:
    """Collect once, then freeze what survived; returns the number of frozen objects."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Counts and times the collector's passes by generation while installed."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.longest_s = [0.0, 0.0, 0.0]
        self._started: dict[int, float] = {}  # thread id -> start of the pass it runs

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        me = threading.get_ident()
        if phase == "start":
            self._started[me] = time.perf_counter()
            return
        began = self._started.pop(me, None)
        if began is None:
            return
        generation = info["generation"]
        took = time.perf_counter() - began
        self.collections[generation] += 1
        self.pause_s[generation] += took
        self.longest_s[generation] = max(self.longest_s[generation], took)

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def stats(self) -> dict[str, Any]:
        return {"frozen_objects": gc.get_freeze_count(),
                "generations": [{"collections": n, "pause_ms": round(1000 * s, 3), "longest_ms": round(1000 * m, 3)}
                                for n, s, m in zip(self.collections, self.pause_s, self.longest_s)]}

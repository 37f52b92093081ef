"""The host's MemAvailable sampled through one boot, so instruments can report the floor it hit."""

from __future__ import annotations

import threading

from lab.runner.hygiene import mem_available_bytes


class MemSampler:
    def __init__(self, interval_s: float = 0.25) -> None:
        self._interval_s = interval_s
        self._floor: int | None = None
        self._samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mem-sampler", daemon=True)

    def start(self) -> "MemSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def floor_bytes(self) -> int | None:
        with self._lock:
            return self._floor

    def samples(self) -> int:
        with self._lock:
            return self._samples

    def _run(self) -> None:
        while True:
            value = mem_available_bytes()
            with self._lock:
                self._floor = value if self._floor is None else min(self._floor, value)
                self._samples += 1
            if self._stop.wait(self._interval_s):
                return

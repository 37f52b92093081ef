"""The known-effect knob (`--inject-step-delay-ms`): an exact cost added to every engine step with
work, so a ladder can carry arms whose true slowdown is known and the lab's power is measured.

On the CPU the step sleeps. On a GPU a sleep on the host would hide behind the device whenever
the host has slack, so the cost is a spin kernel queued on the step's stream, its length set in
clock cycles at the rate measured when the engine starts. A step that runs synchronously (host,
then device) takes their sum, so the spin alone adds the delay. An overlapped decode step (the
next step queued while the device still runs the last one) takes the longer of the two, and a
spin alone would fill the device's idle time whenever the host sets the pace; it gets the spin and
a host sleep of the same length, so the longer of the two grows by exactly the delay whichever it
is."""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)

_CALIBRATION_CYCLES = 20_000_000


def cycles_per_ms(device: torch.device) -> float:
    """The device's spin rate: the fastest of a few timed spins, since the clocks ramp up under work
    and a loaded device runs at its top clock."""
    with torch.cuda.device(device):
        torch.cuda._sleep(_CALIBRATION_CYCLES)  # wakes the clocks
        rates = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(_CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
            rates.append(_CALIBRATION_CYCLES / start.elapsed_time(end))
    return max(rates)


class KnownCost:
    """Called once per step that runs work; does nothing when the knob is 0."""

    def __init__(self, delay_ms: float, device: torch.device) -> None:
        self.delay_s = delay_ms / 1000
        self.cycles = 0
        if delay_ms and device.type == "cuda":
            rate = cycles_per_ms(device)
            self.cycles = max(1, round(delay_ms * rate))
            log.info("injected step delay %.3f ms = a spin of %d cycles (%.0f cycles/ms measured)",
                     delay_ms, self.cycles, rate)

    def __call__(self, overlapped: bool) -> None:
        if self.cycles:
            torch.cuda._sleep(self.cycles)
            if overlapped:
                time.sleep(self.delay_s)
        elif self.delay_s:
            time.sleep(self.delay_s)

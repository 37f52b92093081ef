"""The engine's least free memory while a workload runs, read from `/v1/stats` as the memory
instrument reads it (free at the allocator's peak on CUDA, free now on the CPU), polled in the
background. An engine without `/v1/stats` is asked once and left alone."""

from __future__ import annotations

import asyncio
from types import TracebackType

from lab.instruments.base import BootContext
from lab.instruments.memory import free_bytes, stats_receipt
from lab.instruments.receipt import Receipt


class FreeMemoryWatch:
    """`async with FreeMemoryWatch(ctx, interval_s) as watch:` polls until the block ends; then
    `least` is the lowest free figure seen (None when the engine gave none), `receipt` the
    `/v1/stats` answer it came from, `samples` how many answers were read."""

    def __init__(self, ctx: BootContext, interval_s: float) -> None:
        self._ctx = ctx
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self.least: int | None = None
        self.receipt: Receipt | None = None
        self.samples = 0
        self.why_none = "not polled"

    async def __aenter__(self) -> FreeMemoryWatch:
        await self._sample()
        if self.least is not None:
            self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if exc is None and self.least is not None:
            await self._sample()  # the end of the workload counts too

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self._sample()

    async def _sample(self) -> None:
        receipt = await stats_receipt(self._ctx)
        stats = receipt.response if receipt.ok and isinstance(receipt.response, dict) else None
        free = free_bytes(stats) if stats is not None else None
        if free is None:
            self.why_none = (f"/v1/stats: {receipt.error}" if receipt.error else "/v1/stats names no free memory")
            return
        self.samples += 1
        if self.least is None or free < self.least:
            self.least, self.receipt = free, receipt

"""Headroom: what the engine says it holds at peak, and how low the host's MemAvailable went.

Engine figures come from `/v1/stats` (the bundled engine; other engines answer 404 and only the
host floor is reported). The host floor covers the boot from engine start until this step runs, so
list `memory` last in a ladder to cover every other instrument's load.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import httpx
from pydantic import BaseModel, ConfigDict

from lab.instruments.base import Better, BootContext
from lab.instruments.receipt import Receipt
from lab.store.records import Cell, Step, StepResult

GIB = 1024**3


class MemoryParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MemoryInstrument:
    name: ClassVar[str] = "memory"
    Params: ClassVar[type[BaseModel]] = MemoryParams

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        return {
            "host_mem_available_floor_gib": "higher",
            "peak_memory_gib": "lower",
            "free_memory_gib": "higher",
            "kv_pool_tokens": "higher",
            "kv_pool_gib": "higher",
        }

    def plan(self, params: BaseModel) -> list[Step]:
        return [Step("snapshot")]

    def cell_params(self, params: BaseModel) -> dict[str, list[dict[str, Any]]]:
        return {metric: [{}] for metric in self.metrics(params)}

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        receipt = await stats_receipt(ctx)
        floor = ctx.mem.floor_bytes()
        cells = [Cell("host_mem_available_floor_gib", floor / GIB if floor is not None else None, "GiB",
                      valid=floor is not None, note=f"{ctx.mem.samples()} samples since engine start",
                      requests=[])]
        stats = receipt.response if receipt.status == 200 and isinstance(receipt.response, dict) else None
        if stats is not None:
            pool = stats.get("kv_pool") or {}
            cells += [
                _cell("peak_memory_gib", _gib(stats.get("peak_memory_bytes")), "GiB"),
                _cell("free_memory_gib", _gib(free_bytes(stats)), "GiB"),
                _cell("kv_pool_tokens", pool.get("tokens"), "tokens"),
                _cell("kv_pool_gib", _gib(pool.get("bytes")), "GiB"),
            ]
        return StepResult(cells=cells, receipts=[receipt])


def free_bytes(stats: dict[str, Any]) -> int | None:
    """The engine's free memory in a `/v1/stats` answer: at the allocator's peak on CUDA, where
    the engine knows it; on the CPU only what is free now."""
    value = stats.get("free_at_peak_bytes", stats.get("free_memory_bytes"))
    return value if isinstance(value, int) else None


def _cell(metric: str, value: float | None, unit: str) -> Cell:
    return Cell(metric, value, unit, valid=value is not None, note="" if value is not None else "not in /v1/stats",
                requests=[0])


def _gib(value: Any) -> float | None:
    return value / GIB if isinstance(value, (int, float)) else None


async def stats_receipt(ctx: BootContext) -> Receipt:
    """`/v1/stats` as a receipt: its body in `response`, an error for any status but 200."""
    receipt = Receipt(request_id=f"stats-{ctx.salt}", endpoint="/v1/stats", payload={},
                      t_queued_ns=time.perf_counter_ns())
    headers = {"Authorization": f"Bearer {ctx.api_key}"} if ctx.api_key else {}
    async with httpx.AsyncClient(timeout=min(30.0, ctx.request_timeout_s), headers=headers) as client:
        receipt.t_sent_ns = time.perf_counter_ns()
        try:
            response = await client.get(f"{ctx.base_url}/v1/stats")
        except httpx.HTTPError as exc:
            receipt.error = f"{type(exc).__name__}: {exc}"
            receipt.t_done_ns = time.perf_counter_ns()
            return receipt
        receipt.t_done_ns = time.perf_counter_ns()
    receipt.status = response.status_code
    try:
        receipt.response = response.json()
    except ValueError:
        receipt.text = response.text[:2000]
    if response.status_code != 200:
        receipt.error = f"HTTP {response.status_code}"
    return receipt

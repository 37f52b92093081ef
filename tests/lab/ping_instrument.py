"""A multi-step instrument for runner tests: each step is one real completion against the engine.

The registered instruments have one step per boot today; resume has to be shown finishing a boot
whose steps were only partly stored, so tests register this one next to them.
"""

from __future__ import annotations

import asyncio
import time
from typing import ClassVar

import httpx
from pydantic import BaseModel, ConfigDict

from lab.instruments.base import Better, BootContext
from lab.instruments.receipt import Receipt
from lab.store.records import Cell, Step, StepResult


class PingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = 3
    delay_s: float = 0.0


class PingInstrument:
    name: ClassVar[str] = "ping"
    Params: ClassVar[type[BaseModel]] = PingParams

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        return {"latency_ms": "lower"}

    def plan(self, params: BaseModel) -> list[Step]:
        return [Step(f"ping-{i}", {"i": i}) for i in range(params.steps)]

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        await asyncio.sleep(ctx.params.delay_s)
        body = {"model": ctx.model, "prompt": f"{ctx.salt} hello", "max_tokens": 1}
        receipt = Receipt(request_id=f"{ctx.salt}-{step.key}", endpoint="/v1/completions", payload=body,
                          t_queued_ns=time.perf_counter_ns())
        async with httpx.AsyncClient(timeout=ctx.request_timeout_s) as client:
            receipt.t_sent_ns = time.perf_counter_ns()
            response = await client.post(f"{ctx.api_base}/completions", json=body)
            receipt.t_done_ns = time.perf_counter_ns()
        receipt.status = response.status_code
        receipt.response = response.json()
        usage = receipt.response.get("usage", {})
        receipt.prompt_tokens, receipt.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        latency = (receipt.t_done_ns - receipt.t_sent_ns) / 1e6
        return StepResult(cells=[Cell("latency_ms", latency, "ms", params={"i": step.params["i"]})], receipts=[receipt])

"""Offline figures beside served ones: `lab engine bench` on the boot's own config, inside the boot.

The runner stops the engine, runs the bench with the arm's model, flags and environment and this
section's sizes (no reference model), and starts the engine again before the next instrument.
The bench measures the engine in one process, with no HTTP, no server and no client: what the
served figures lose to them is the served overhead, stored here as a cell rather than noted.

Cells: `prefill_tok_s` and `prefill_floor_frac` `{length}` (the bench's prefill of a cold prompt
of that many tokens; the fraction of the FLOP floor it reaches); `decode_tok_s` and
`decode_floor_frac` `{batch}` (batch 1, and the aggregate of `concurrency` sequences; the
fraction of the bytes floor); `throughput_tok_s` `{requests, phase}` where `throughput` is given;
and `served_over_offline`: this boot's served figure over the offline one, `{length}` for the
prefill instrument's `prefill_tok_s_median` at the same length, `{level}` for the decode
instrument's `steady_agg_tok_s` at a level equal to `concurrency` or 1. Only figures the ladder
measured before this section (list `offline` after `prefill` and `decode`) get a ratio; the decode
ratio compares different prompts (the decode instrument's chats against the bench's random
token ids of `prompt_tokens`), which its note says.

Only the bundled engine can be measured offline; on any other the cells say so.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, Field, confloat, conint, field_validator

from lab.instruments.base import NOT_APPLICABLE, Better, BootContext
from lab.instruments.presets import PresetParams
from lab.store.records import Cell, Step, StepResult

FRACTIONS = ("prefill_floor_frac", "decode_floor_frac", "served_over_offline")


class OfflineParams(PresetParams):
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "gpu": {"prefill_lengths": [2000, 8000, 32000], "concurrency": 64, "prompt_tokens": 1024,
                "decode_tokens": 128},
    }

    prefill_lengths: list[conint(ge=16)] = Field(  # type: ignore[valid-type]
        default_factory=lambda: [256], description="cold prefill lengths in tokens (match the prefill "
                                                   "instrument's lengths to get served/offline ratios)")
    concurrency: conint(ge=1) = Field(  # type: ignore[valid-type]
        4, description="sequences of the aggregate decode figure (match a decode level for its ratio)")
    prompt_tokens: conint(ge=1) = Field(128, description="prompt length of the decode figures")  # type: ignore[valid-type]
    decode_tokens: conint(ge=2) = Field(32, description="tokens generated per decode figure")  # type: ignore[valid-type]
    decode_temperature: confloat(ge=0) = Field(  # type: ignore[valid-type]
        0.0, description="0: greedy decode; above 0, sampled and seeded (random weights then make drafts miss)")
    repeats: conint(ge=1) = Field(2, description="repeats per figure; the median is stored")  # type: ignore[valid-type]
    throughput: list[conint(ge=1)] = Field(  # type: ignore[valid-type]
        default_factory=list, description="request counts of throughput runs (each request prompt_tokens long)")

    @field_validator("prefill_lengths", "throughput")
    @classmethod
    def _distinct(cls, values: list[int]) -> list[int]:
        if len(set(values)) != len(values):
            raise ValueError("a value is listed twice")
        return values

    def bench_args(self) -> list[str]:
        return ["--prefill-lengths", ",".join(map(str, self.prefill_lengths)), "--concurrency", str(self.concurrency),
                "--prompt-tokens", str(self.prompt_tokens), "--decode-tokens", str(self.decode_tokens),
                "--decode-temperature", str(self.decode_temperature), "--repeats", str(self.repeats),
                "--throughput", ",".join(map(str, self.throughput)), "--throughput-tokens", str(self.prompt_tokens),
                "--reference", "none"]


class OfflineInstrument:
    name: ClassVar[str] = "offline"
    Params: ClassVar[type[BaseModel]] = OfflineParams

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        return {"prefill_tok_s": "higher", "prefill_floor_frac": "higher", "decode_tok_s": "higher",
                "decode_floor_frac": "higher", "throughput_tok_s": "higher", "served_over_offline": "higher"}

    def plan(self, params: BaseModel) -> list[Step]:
        return [Step("bench")]

    def cell_params(self, params: BaseModel) -> dict[str, list[dict[str, Any]]]:
        assert isinstance(params, OfflineParams)
        lengths = [{"length": n} for n in params.prefill_lengths]
        batches = [{"batch": b} for b in dict.fromkeys((1, params.concurrency))]
        return {"prefill_tok_s": lengths, "prefill_floor_frac": lengths, "decode_tok_s": batches,
                "decode_floor_frac": batches,
                "throughput_tok_s": [{"requests": n, "phase": p} for n in params.throughput for p in ("output", "decode")],
                "served_over_offline": lengths + [{"level": b["batch"]} for b in batches]}

    def prompt_tokens(self, params: BaseModel) -> dict[str, int]:
        assert isinstance(params, OfflineParams)
        return {"prefill_lengths": max(params.prefill_lengths) + 1,
                "prompt_tokens": params.prompt_tokens + max(params.decode_tokens, params.prompt_tokens if
                                                             params.throughput else 0)}

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        params = ctx.params
        assert isinstance(params, OfflineParams)
        result = StepResult()

        def cell(metric: str, value: float | None, why: str | None = None, note: str = "",
                 **cell_params: Any) -> None:
            unit = "ratio" if metric in FRACTIONS else "tok/s"
            result.cells.append(Cell(metric, None if why else value, unit, cell_params, valid=why is None,
                                     note=why or note, requests=[]))

        def fail_all(why: str) -> StepResult:
            for metric, many in self.cell_params(params).items():
                for cell_params in many:
                    cell(metric, None, why, **cell_params)
            return result

        if ctx.engine is None:
            return fail_all(f"{NOT_APPLICABLE}offline figures need `lab run`, which owns the engine's process")
        try:
            bench = await ctx.engine.offline(params.bench_args())
        except NotImplementedError as exc:
            return fail_all(f"{NOT_APPLICABLE}{exc}")
        figures = {(f.get("kind"), _key(f.get("params"))): f for f in bench.get("figures", [])}
        note = f"lab engine bench, config {bench.get('config_hash')}"

        def figure(kind: str, **key: Any) -> dict[str, Any] | None:
            return figures.get((kind, _key(key)))

        for n in params.prefill_lengths:
            found = figure("prefill", length=n)
            missing = None if found else f"the bench stored no prefill figure at {n} tokens"
            cell("prefill_tok_s", found and found.get("ours"), missing, note, length=n)
            cell("prefill_floor_frac", found and found.get("floor_fraction"), missing or _no_floor(found), note,
                 length=n)
            cell("served_over_offline", *self._served_prefill(ctx, n, found), length=n)
        for batch in dict.fromkeys((1, params.concurrency)):
            found = figure("decode", batch=batch)
            missing = None if found else f"the bench stored no decode figure at batch {batch}"
            cell("decode_tok_s", found and found.get("ours"), missing, f"{note}; {found and found.get('note')}",
                 batch=batch)
            cell("decode_floor_frac", found and found.get("floor_fraction"), missing or _no_floor(found), note,
                 batch=batch)
            cell("served_over_offline", *self._served_decode(ctx, params, batch, found), level=batch)
        for n in params.throughput:
            for phase in ("output", "decode"):
                found = figure("throughput", requests=n, phase=phase)
                cell("throughput_tok_s", found and found.get("ours"),
                     None if found else f"the bench stored no throughput figure for {n} requests", note,
                     requests=n, phase=phase)
        return result

    def _served_prefill(self, ctx: BootContext, length: int,
                        offline: dict[str, Any] | None) -> tuple[float | None, str | None, str]:
        served = _served_value(ctx, "prefill", "prefill_tok_s_median", {"length": length})
        if served is None:
            return None, f"{NOT_APPLICABLE}this boot measured no served prefill at {length} tokens before offline", ""
        if not offline or not offline.get("ours"):
            return None, f"the bench stored no prefill figure at {length} tokens", ""
        return served / offline["ours"], None, f"served {served:,.1f} tok/s, offline {offline['ours']:,.1f} tok/s"

    def _served_decode(self, ctx: BootContext, params: OfflineParams, batch: int,
                       offline: dict[str, Any] | None) -> tuple[float | None, str | None, str]:
        served = _served_value(ctx, "decode", "steady_agg_tok_s", {"level": batch})
        if served is None:
            return None, f"{NOT_APPLICABLE}this boot measured no served decode at level {batch} before offline", ""
        if not offline or not offline.get("ours"):
            return None, f"the bench stored no decode figure at batch {batch}", ""
        return (served / offline["ours"], None,
                f"served {served:,.1f} tok/s (the decode instrument's chats), offline {offline['ours']:,.1f} tok/s "
                f"({params.prompt_tokens}-token random prompts)")


def _served_value(ctx: BootContext, instrument: str, metric: str, where: dict[str, Any]) -> float | None:
    """The median of this slot's valid `metric` cells whose params include `where`."""
    values = sorted(c.value for c in ctx.stored.slot_cells(ctx.slot_id, instrument, metric)
                    if c.valid and c.value is not None and all(c.params.get(k) == v for k, v in where.items()))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _no_floor(found: dict[str, Any] | None) -> str | None:
    return None if found and found.get("floor_fraction") else "the bench has no floor for this figure on this device"


def _key(params: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((params or {}).items()))

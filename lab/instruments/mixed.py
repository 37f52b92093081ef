"""How a long prefill stalls a short chat: the chat alone, then the same chat sent `delay_s`
after a cold long prompt.

One step per repeat. First the short chat alone (its own salt): its time to first token and its
completion time (send to the end of the response). Then a cold `long_tokens`-token prompt (salted,
sized through `/tokenize`, `max_tokens: 1`, the prefix cache reset first where the engine has
that), and `delay_s` after it is handed to the client the same short chat with a fresh salt. The
long prompt's time to first token is its prefill time.

Cells (params `{}`, repeat = rep): `short_ttft_alone_s`, `short_e2e_alone_s`,
`short_ttft_behind_s`, `short_e2e_behind_s`, `long_prefill_s`, and `stall_ratio` = TTFT behind /
TTFT alone. The behind cells are invalid when the long prefill was already over before the short
chat was sent (nothing was measured behind it) or when the long prompt was not cold.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, Field, confloat, conint

from lab.instruments.base import Better, BootContext
from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.presets import PresetParams
from lab.instruments.prompts import PromptTooShort, chat_messages, filler_words, request_salt, salt_line
from lab.instruments.receipt import Receipt
from lab.instruments.receipt_checks import failure, prefill_problem
from lab.instruments.shared_prompts import window_prompt
from lab.instruments.token_count import count_missing_usage, sized_note
from lab.store.records import Cell, Step, StepResult

SHORT_QUESTION = "In two or three sentences, why do leaves change colour in autumn?"
ALONE = ("short_ttft_alone_s", "short_e2e_alone_s")
BEHIND = ("short_ttft_behind_s", "short_e2e_behind_s", "stall_ratio")


class MixedParams(PresetParams):
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "gpu": {"long_tokens": 93000, "delay_s": 1.0, "short_max_tokens": 32},
    }

    long_tokens: conint(ge=64) = Field(1536, description="length of the cold long prompt")  # type: ignore[valid-type]
    delay_s: confloat(ge=0) = Field(  # type: ignore[valid-type]
        0.5, description="seconds after the long prompt that the short chat is sent")
    short_max_tokens: conint(ge=1) = Field(16, description="max_tokens of the short chat")  # type: ignore[valid-type]
    reps: conint(ge=1) = Field(1, description="repeats of the whole probe")  # type: ignore[valid-type]


class MixedInstrument:
    name: ClassVar[str] = "mixed"
    Params: ClassVar[type[BaseModel]] = MixedParams

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        return {name: "lower" for name in (*ALONE, *BEHIND, "long_prefill_s")}

    def plan(self, params: BaseModel) -> list[Step]:
        assert isinstance(params, MixedParams)
        return [Step(f"rep={r}", {"rep": r}) for r in range(params.reps)]

    def cell_params(self, params: BaseModel) -> dict[str, list[dict[str, Any]]]:
        return {metric: [{}] for metric in self.metrics(params)}

    def sends_overlapping(self, params: BaseModel) -> bool:
        return True

    def prompt_tokens(self, params: BaseModel) -> dict[str, int]:
        assert isinstance(params, MixedParams)
        return {"long_tokens": params.long_tokens + 1}

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        params = ctx.params
        assert isinstance(params, MixedParams)
        rep: int = step.params["rep"]
        result = StepResult()

        def cell(metric: str, value: float | None, index: list[int], why: str | None = None, note: str = "") -> None:
            unit = "ratio" if metric == "stall_ratio" else "s"
            result.cells.append(Cell(metric, value if why is None else None, unit, {}, rep, valid=why is None,
                                     note=why or note, requests=index))

        def short(salt_part: str) -> dict[str, Any]:
            return {"model": ctx.model, "max_tokens": params.short_max_tokens, "temperature": 0,
                    "messages": chat_messages(request_salt(ctx.salt, self.name, rep, salt_part), SHORT_QUESTION)}

        async with EngineExtras(ctx) as extras, StreamingClient(ctx.base_url, ctx.api_key,
                                                                 timeout=ctx.request_timeout_s,
                                                                 max_connections=2) as client:
            alone = await client.request(short("alone"))
            result.receipts.append(alone)
            counted = await count_missing_usage(extras, ctx.capabilities, [alone])
            why_alone = failure(alone)
            cell("short_ttft_alone_s", _s(alone.ttft_ns), [0], why_alone, counted)
            cell("short_e2e_alone_s", _s(alone.e2e_ns), [0], why_alone, counted)

            limit = await extras.max_model_len()
            long_prompt, why_long = None, None
            if limit is not None and params.long_tokens + 1 > limit:
                why_long = f"{params.long_tokens} prompt tokens + 1 output token exceed the engine's context of {limit}"
            else:
                salt = request_salt(ctx.salt, self.name, rep, "long")
                words = filler_words(salt, params.long_tokens)
                try:
                    long_prompt, shared = await window_prompt(
                        ctx, extras, self.name, salt, params.long_tokens,
                        lambda k, tail: f"{salt_line(salt)} {' '.join(words[:k])}{tail}", len(words))
                except PromptTooShort as exc:
                    why_long = str(exc)
            if long_prompt is None:
                for metric in ("long_prefill_s", *BEHIND):
                    cell(metric, None, [], why_long)
                return result
            await extras.reset_prefix_cache()
            long_request = {"model": ctx.model, "prompt": long_prompt.form, "max_tokens": 1, "temperature": 0}
            long, behind = await client.run_all([long_request, short("behind")], 2, offsets_s=[0.0, params.delay_s])
            await count_missing_usage(extras, ctx.capabilities, [long, behind])
        result.receipts += [long, behind]
        why_long = prefill_problem(long, long_prompt.tokens if long_prompt.exact else None)
        cell("long_prefill_s", _s(long.ttft_ns), [1], why_long,
             note="; ".join(part for part in (f"{long.prompt_tokens} prompt tokens", counted or sized_note(extras),
                                              shared) if part))
        why_behind = failure(behind) or _not_behind(long, behind) or (
            f"the long prompt is not a cold prefill: {why_long}" if why_long else None)
        note = "; ".join(part for part in (counted, "" if alone.completion_tokens == behind.completion_tokens else (
            f"the short chat generated {alone.completion_tokens} tokens alone, {behind.completion_tokens} behind"))
            if part)
        cell("short_ttft_behind_s", _s(behind.ttft_ns), [2], why_behind, note)
        cell("short_e2e_behind_s", _s(behind.e2e_ns), [2], why_behind, note)
        ratio = None
        if why_behind is None and why_alone is None and alone.ttft_ns and behind.ttft_ns:
            ratio = behind.ttft_ns / alone.ttft_ns
        cell("stall_ratio", ratio, [0, 2], why_behind or why_alone)
        return result


def _not_behind(long: Receipt, short: Receipt) -> str | None:
    if long.t_first_token_ns is not None and short.t_sent_ns is not None and long.t_first_token_ns <= short.t_sent_ns:
        return ("the long prefill was over before the short chat was sent: raise long_tokens or lower delay_s "
                f"(prefill {_s(long.ttft_ns):.2f} s)")
    return None


def _s(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e9

"""Cold prefill throughput: prompt tokens / time to first token, one length per step.

Each repeat is a fresh prompt: its own salt at the start, its own filler, sized through
`/tokenize` to exactly the target length, sent to `/v1/completions` with `max_tokens: 1` and
streamed so the first token's arrival is real. The prefix cache is reset first where the engine
offers it. A repeat is invalid when any of its prompt tokens came from the cache, when
`usage.prompt_tokens` differs from the count `/tokenize` gave, or when it failed.

Cells, all with params `{length}`: `prefill_tok_s` and `ttft_s` for each repeat (repeat = rep),
and `prefill_tok_s_median` over the valid repeats. `warmup_reps: w` sends w such prompts first at
each length and leaves them out of every cell (their receipts stay with the step): on a GPU the
first request of a length is slower than the rest in every boot. The KEEP
rule's median of repeats of `prefill_tok_s` is that same median.

With `tail_tokens: n` each repeat goes on to generate n more tokens (`ignore_eos`) after its
first: `tail_tok_s` is their rate, from the first token's arrival to the last's, the decode speed
of one sequence at that context. A stream that ends before its n tokens has an invalid tail cell.
On an engine that ignores `ignore_eos` (or refuses it: then it is not sent), the tail carries the
EOS ban by `logit_bias` where the capability probe found it works, and its cell says so.
"""

from __future__ import annotations

import statistics
from typing import Any, ClassVar

from pydantic import BaseModel, Field, conint, field_validator

from lab.instruments.base import Better, BootContext
from lab.instruments.capabilities import eos_ban_bias, eos_ban_note
from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.presets import PresetParams
from lab.instruments.prompts import PromptTooShort, filler_words, request_salt, salt_line
from lab.instruments.receipt import Receipt
from lab.instruments.receipt_checks import cache_note, prefill_problem, prefill_tok_s
from lab.instruments.shared_prompts import window_prompt
from lab.instruments.token_count import count_missing_usage, sized_note
from lab.store.records import Cell, Step, StepResult

# Below this a prompt is mostly its salt.
MIN_LENGTH = 32


class PrefillParams(PresetParams):
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "gpu": {"lengths": [2000, 8000, 32000, 64000, 131072, 300000], "reps": 3},
    }

    lengths: list[conint(ge=MIN_LENGTH)] = Field(  # type: ignore[valid-type]
        default_factory=lambda: [256, 1024], min_length=1, description="prompt lengths in tokens")
    reps: conint(ge=1) = Field(  # type: ignore[valid-type]
        2, description="cold repeats per length; the median is reported")
    warmup_reps: conint(ge=0) = Field(  # type: ignore[valid-type]
        0, description="cold requests sent first at each length and left out of every cell (their receipts are kept)")
    tail_tokens: conint(ge=0) = Field(  # type: ignore[valid-type]
        0, description="tokens generated after the first (ignore_eos), timed as decode at that context; 0: none")

    @field_validator("lengths")
    @classmethod
    def _distinct(cls, lengths: list[int]) -> list[int]:
        if len(set(lengths)) != len(lengths):
            raise ValueError("a length is listed twice")
        return lengths


class PrefillInstrument:
    name: ClassVar[str] = "prefill"
    Params: ClassVar[type[BaseModel]] = PrefillParams

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        assert isinstance(params, PrefillParams)
        tail: dict[str, Better] = {"tail_tok_s": "higher"} if params.tail_tokens else {}
        return {"prefill_tok_s": "higher", "prefill_tok_s_median": "higher", "ttft_s": "lower", **tail}

    def plan(self, params: BaseModel) -> list[Step]:
        assert isinstance(params, PrefillParams)
        return [Step(f"length={n}", {"length": n}) for n in params.lengths]

    def cell_params(self, params: BaseModel) -> dict[str, list[dict[str, Any]]]:
        assert isinstance(params, PrefillParams)
        lengths = [{"length": n} for n in params.lengths]
        return {metric: lengths for metric in self.metrics(params)}

    def prompt_tokens(self, params: BaseModel) -> dict[str, int]:
        assert isinstance(params, PrefillParams)
        return {"lengths": max(params.lengths) + 1 + params.tail_tokens}

    def sends_ignore_eos(self, params: BaseModel) -> bool:
        assert isinstance(params, PrefillParams)
        return params.tail_tokens > 0

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        params = ctx.params
        assert isinstance(params, PrefillParams)
        length: int = step.params["length"]
        cell_params = {"length": length}
        result = StepResult()
        rates: list[tuple[float, int]] = []  # (tok/s, receipt index) of the valid repeats
        async with EngineExtras(ctx) as extras, StreamingClient(ctx.base_url, ctx.api_key,
                                                                 timeout=ctx.request_timeout_s,
                                                                 max_connections=1) as client:
            limit = await extras.max_model_len()
            for warmup in range(params.warmup_reps):
                await self._one_shot(ctx, extras, client, length, f"warmup-{warmup}", limit, params.tail_tokens,
                                     result, warmup=True)
            for rep in range(params.reps):
                rate = await self._one_shot(ctx, extras, client, length, rep, limit, params.tail_tokens, result)
                if rate is not None:
                    rates.append((rate, len(result.receipts) - 1))
        after = (f" after {params.warmup_reps} warm-up request{'s' * (params.warmup_reps > 1)}"
                 if params.warmup_reps else "")
        if rates:
            median = statistics.median(rate for rate, _ in rates)
            result.cells.append(Cell("prefill_tok_s_median", median, "tok/s", cell_params,
                                     note=f"median of {len(rates)} valid of {params.reps} repeats{after}",
                                     requests=[i for _, i in rates]))
        else:
            result.cells.append(Cell("prefill_tok_s_median", None, "tok/s", cell_params, valid=False,
                                     note=f"none of {params.reps} repeats is valid", requests=[]))
        return result

    async def _one_shot(self, ctx: BootContext, extras: EngineExtras, client: StreamingClient, length: int,
                        rep: int | str, limit: int | None, tail: int, result: StepResult,
                        warmup: bool = False) -> float | None:
        """Send one cold prompt, adding its receipt and cells to `result`; its tok/s when valid. A warm-up
        request adds its receipt only: the first requests of a length in a fresh engine pay for
        allocator growth and first-use work that no later request sees."""
        cell_params = {"length": length}

        def invalid(why: str, requests: list[int]) -> None:
            ctx.log.warning("prefill length %d rep %s invalid: %s", length, rep, why)
            if warmup:
                return
            for metric, unit in (("prefill_tok_s", "tok/s"), ("ttft_s", "s")) + ((("tail_tok_s", "tok/s"),)
                                                                                   if tail else ()):
                result.cells.append(Cell(metric, None, unit, cell_params, rep, valid=False, note=why,
                                         requests=requests))

        if limit is not None and length + 1 + tail > limit:
            outputs = f"{1 + tail} output tokens" if tail else "1 output token"
            return invalid(f"{length} prompt tokens + {outputs} exceed the engine's context of {limit}", [])
        salt = request_salt(ctx.salt, self.name, length, rep)
        words = filler_words(salt, length)

        def render(k: int, tail: str) -> str:
            return f"{salt_line(salt)} {' '.join(words[:k])}{tail}"

        try:
            fitted, shared = await window_prompt(ctx, extras, self.name, salt, length, render, len(words))
        except PromptTooShort as exc:
            return invalid(str(exc), [])
        if fitted.exact and fitted.tokens != length and not shared:
            return invalid(f"no prompt of exactly {length} tokens was found (closest: {fitted.tokens})", [])
        await extras.reset_prefix_cache()
        body: dict[str, Any] = {"model": ctx.model, "prompt": fitted.form, "max_tokens": 1 + tail, "temperature": 0}
        if tail:
            if (ctx.capabilities or {}).get("ignore_eos") != "refused":
                body["ignore_eos"] = True
            if (ban := eos_ban_bias(ctx.capabilities)) is not None:
                body["logit_bias"] = ban
        receipt = await client.request(body)
        result.receipts.append(receipt)
        if warmup:
            return None
        index = len(result.receipts) - 1
        counted = await count_missing_usage(extras, ctx.capabilities, [receipt])
        problem = prefill_problem(receipt, fitted.tokens if fitted.exact else None)
        if problem is not None:
            return invalid(problem, [index])
        sized = sized_note(extras) if not counted else ""
        note = "; ".join(part for part in (cache_note(receipt), counted, sized, shared) if part)
        if not fitted.exact:
            note += "; no tokenizer endpoint, so the length is an estimate"
        rate = prefill_tok_s(receipt)
        assert receipt.ttft_ns is not None
        result.cells += [Cell("prefill_tok_s", rate, "tok/s", cell_params, rep, note=note, requests=[index]),
                         Cell("ttft_s", receipt.ttft_ns / 1e9, "s", cell_params, rep, note=note, requests=[index])]
        if tail:
            result.cells.append(_tail_cell(receipt, tail, cell_params, rep, index, eos_ban_note(ctx.capabilities)))
        return rate


def _tail_cell(receipt: Receipt, tail: int, cell_params: dict[str, Any], rep: int, index: int,
               banned: str = "") -> Cell:
    """Tokens after the first over the time from the first token's arrival to the last's; `banned`
    notes a stream that carried the EOS ban."""
    after_first = receipt.completion_tokens - 1
    also = f"; {banned}" if banned else ""
    if after_first < tail:
        return Cell("tail_tok_s", None, "tok/s", cell_params, rep, valid=False, requests=[index],
                    note=f"the stream ended after {receipt.completion_tokens} of {1 + tail} tokens{also}")
    assert receipt.t_first_token_ns is not None and receipt.t_last_token_ns is not None
    span_ns = receipt.t_last_token_ns - receipt.t_first_token_ns
    if span_ns <= 0:
        return Cell("tail_tok_s", None, "tok/s", cell_params, rep, valid=False, requests=[index],
                    note="every token arrived in one chunk: nothing to time")
    return Cell("tail_tok_s", after_first * 1e9 / span_ns, "tok/s", cell_params, rep, requests=[index],
                note=f"{after_first} tokens after the first, at a context of {receipt.prompt_tokens}+{also}")

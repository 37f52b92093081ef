"""The decode ladder C1...Cn: C concurrent greedy streams of a fixed length, one level per step.

A level sends C x ceil(categories / C) chat requests, so every category is asked at every level
and every wave is full: request i is category i mod 8. Each has its own salt at the start of its
system message, T=0, a fixed `max_tokens`, and `ignore_eos` when the engine accepts it (a probe
request with it is sent first; a 400 means it is refused), or as the capability probe found at
boot: an engine that ignores (or refuses) it ends some streams early, so where the probe found that
banning the end-of-sequence ids with `logit_bias` works, every stream carries that ban and the cells
say "EOS banned by logit_bias (the engine ignores ignore_eos)"; streams that still end early are
counted in the cells' notes. The client keeps exactly C requests in flight while any are waiting.

Per level (params `{level}`, repeat = run): `agg_tok_s`, every completion token of the level
(from `usage`) over the wall span from the first request handed over to the last response's end;
`stream_tok_s`, the mean over streams of (completion tokens - 1) / (last token - first token);
`ttft_s`, the median time to first token; `steady_agg_tok_s`, the tokens that arrived while all C
streams were decoding at once, over the time they were (the ramp, where prompts queue and
prefill, and the tail, where streams finish, are left out: what the engine sustains at C, the
figure an offline decode benchmark at batch C gives). C1 runs twice, so its cells have repeats 0 and 1: the
KEEP rule's median of two repeats is their mean. Per category: `category_stream_tok_s` with
params `{level, category}`. Where the engine's `/metrics` counts speculative decoding (vLLM's
`spec_decode_num_accepted_tokens` and friends), the counters' change over the level gives
`spec_acceptance` and `spec_tokens_per_step`; otherwise those cells are not written. At C1 the
streams run one at a time and the counters are read around each, so the change over a stream is
its category's: `category_spec_acceptance` with params `{level: 1, category}`.

`context_tokens: N` puts about N tokens of filler text, different for every stream, before each
question: every decode step then reads N tokens of KV per stream, as in a long conversation.

Streams the client cannot vouch for (chunks that arrived coalesced, or a read later than
`late_read_ms` after arrival: `Receipt.unvouched`) are counted in every cell built from them (the
store's `cell.unvouched_streams`, and the note). With `unvouched: exclude` the per-stream figures
(`stream_tok_s`, `category_stream_tok_s`, `ttft_s`) leave them out and hold only the rest; the
wall-clock figures (`agg_tok_s`, `steady_agg_tok_s`) count every token either way.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_right
from collections import defaultdict
from typing import Any, ClassVar, Literal

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field, conint, field_validator

from lab.instruments.base import Better, BootContext
from lab.instruments.capabilities import eos_ban_bias, eos_ban_note, interrupts
from lab.instruments.client import StreamingClient
from lab.instruments.decode_prompts import CATEGORIES
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.presets import PresetParams
from lab.instruments.prompts import chat_messages, estimated_tokens, filler_words, request_salt
from lab.instruments.receipt import DEFAULT_LATE_READ_MS, Receipt
from lab.instruments.receipt_checks import failure
from lab.instruments.token_count import count_missing_usage
from lab.store.records import Cell, Step, StepResult

C1_RUNS = 2
# A bound on the chat-templated decode prompts' length, for checking a ladder against a context.
DECODE_PROMPT_TOKENS = 256
MAX_LEVEL = 256  # the streaming client's connection pool
# vLLM's counter names without the `vllm:` prefix and `_total` suffix.
SPEC_COUNTERS = {"accepted": "spec_decode_num_accepted_tokens", "drafted": "spec_decode_num_draft_tokens",
                 "drafts": "spec_decode_num_drafts"}

# Why a stream rate is missing when a stream delivered all its tokens with its first chunk.
NO_TOKEN_TIMING = "a stream gave no per-token timing"


class DecodeParams(PresetParams):
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "gpu": {"levels": list(range(1, 17)), "max_tokens": 256},
    }

    levels: list[conint(ge=1, le=MAX_LEVEL)] = Field(  # type: ignore[valid-type]
        default_factory=lambda: [1, 2, 4], min_length=1, description="concurrent streams per level")
    max_tokens: conint(ge=2) = Field(  # type: ignore[valid-type]
        16, description="tokens every stream generates (ignore_eos where accepted)")
    context_tokens: conint(ge=0) = Field(  # type: ignore[valid-type]
        0, description="each stream's prompt starts with its own filler text of about this many tokens, so every "
                        "decode step reads that much KV per stream (0: the bare prompts, a few dozen to 250 tokens)")
    late_read_ms: float = Field(DEFAULT_LATE_READ_MS, gt=0, allow_inf_nan=False,
                                description="a stream read later than this after its bytes arrived is unvouched")
    unvouched: Literal["count", "exclude"] = Field(
        "count", description="streams whose timing the client cannot vouch for (coalesced chunks, late reads): "
                             "count them in each cell, or exclude them from the per-stream figures")

    @field_validator("levels")
    @classmethod
    def _distinct(cls, levels: list[int]) -> list[int]:
        if len(set(levels)) != len(levels):
            raise ValueError("a level is listed twice")
        return levels


class DecodeInstrument:
    name: ClassVar[str] = "decode"
    Params: ClassVar[type[BaseModel]] = DecodeParams

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        return {"agg_tok_s": "higher", "steady_agg_tok_s": "higher", "stream_tok_s": "higher", "ttft_s": "lower",
                "category_stream_tok_s": "higher", "category_spec_acceptance": "higher",
                "spec_acceptance": "higher", "spec_tokens_per_step": "higher"}

    def plan(self, params: BaseModel) -> list[Step]:
        assert isinstance(params, DecodeParams)
        return [Step(f"C{c}", {"level": c}) for c in params.levels]

    def cell_params(self, params: BaseModel) -> dict[str, list[dict[str, Any]]]:
        assert isinstance(params, DecodeParams)
        levels = [{"level": c} for c in params.levels]
        # Every level sends at least one prompt of each category (see _payloads).
        by_category = [{"level": c, "category": name} for c in params.levels for name in CATEGORIES]
        return {"agg_tok_s": levels, "steady_agg_tok_s": levels, "stream_tok_s": levels, "ttft_s": levels,
                "category_stream_tok_s": by_category, "spec_acceptance": levels, "spec_tokens_per_step": levels,
                "category_spec_acceptance": [c for c in by_category if c["level"] == 1]}

    def prompt_tokens(self, params: BaseModel) -> dict[str, int]:
        assert isinstance(params, DecodeParams)
        return {"max_tokens": params.max_tokens + params.context_tokens + DECODE_PROMPT_TOKENS}

    def sends_ignore_eos(self, params: BaseModel) -> bool:
        return True

    def sends_overlapping(self, params: BaseModel) -> bool:
        assert isinstance(params, DecodeParams)
        return max(params.levels) > 1

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        params = ctx.params
        assert isinstance(params, DecodeParams)
        level: int = step.params["level"]
        result = StepResult()
        cut = interrupts(ctx.capabilities) if level > 1 else None
        if cut:  # every stream of the level but one would be cut short: nothing to measure
            for metric, many in self.cell_params(params).items():
                result.cells += [Cell(metric, None, "", p, valid=False, note=cut, requests=[])
                                 for p in many if p["level"] == level]
            return result
        async with EngineExtras(ctx) as extras, StreamingClient(ctx.base_url, ctx.api_key,
                                                                 timeout=ctx.request_timeout_s, max_connections=level,
                                                                 late_read_ms=params.late_read_ms) as client:
            eos = (ctx.capabilities or {}).get("ignore_eos")
            if eos is None:  # not probed at boot: a 400 to a request with it means it is refused
                probe = await client.request({"model": ctx.model, "max_tokens": 1, "temperature": 0,
                                              "ignore_eos": True, "messages": chat_messages(
                                                  request_salt(ctx.salt, self.name, level), "Hi")})
                result.receipts.append(probe)
                eos = "refused" if probe.status == 400 else "honoured"
            words = await filler_word_count(extras, params.context_tokens) if params.context_tokens else 0
            ban, banned = eos_ban_bias(ctx.capabilities), eos_ban_note(ctx.capabilities)
            for run in range(C1_RUNS if level == 1 else 1):
                payloads = self._payloads(ctx, params, level, run, eos != "refused", words, ban)
                before = spec_counters(await extras.metrics_text())
                first = len(result.receipts)
                if level == 1:
                    result.cells += await self._one_at_a_time(client, extras, payloads, run, result)
                else:
                    result.receipts += await client.run_all(payloads, level)
                after = spec_counters(await extras.metrics_text())
                counted = await count_missing_usage(extras, ctx.capabilities, result.receipts[first:])
                result.cells += _level_cells(level, run, result.receipts, first, params.max_tokens, eos,
                                             exclude=params.unvouched == "exclude", counted=counted, banned=banned)
                result.cells += spec_cells(level, run, before, after)
        return result

    @staticmethod
    async def _one_at_a_time(client: StreamingClient, extras: EngineExtras, payloads: list[dict[str, Any]],
                             run: int, result: StepResult) -> list[Cell]:
        """C1's streams, each between two reads of the speculative counters: their change over a
        stream is its category's acceptance."""
        names = list(CATEGORIES)
        cells = []
        for i, payload in enumerate(payloads):
            before = spec_counters(await extras.metrics_text())
            result.receipts += await client.run_all([payload], 1)
            after = spec_counters(await extras.metrics_text())
            cells += [Cell("category_spec_acceptance", c.value, c.unit, {"level": 1, "category": names[i % len(names)]},
                           run, note=c.note, requests=[len(result.receipts) - 1])
                      for c in spec_cells(1, run, before, after) if c.metric == "spec_acceptance"]
        return cells

    def _payloads(self, ctx: BootContext, params: DecodeParams, level: int, run: int,
                  ignore_eos: bool, filler: int = 0, ban: dict[str, int] | None = None) -> list[dict[str, Any]]:
        names = list(CATEGORIES)
        payloads = []
        for i in range(level * math.ceil(len(names) / level)):
            prompts = CATEGORIES[names[i % len(names)]]
            salt = request_salt(ctx.salt, self.name, level, run, i)
            question = prompts[i // len(names) % len(prompts)]
            if filler:  # the stream's own text, so no two streams share a cached prefix
                question = " ".join(filler_words(salt, filler)) + "\n\n" + question
            payload: dict[str, Any] = {
                "model": ctx.model, "max_tokens": params.max_tokens, "temperature": 0,
                "messages": chat_messages(salt, question)}
            if ignore_eos:
                payload["ignore_eos"] = True
            if ban:
                payload["logit_bias"] = ban
            payloads.append(payload)
        return payloads


async def filler_word_count(extras: EngineExtras, tokens: int) -> int:
    """How many filler words make about `tokens` tokens: the engine's count of a sample when it has a
    tokenizer route, else the characters-per-token estimate."""
    sample = " ".join(filler_words("decode-context", 1000))
    ids = await extras.tokenize(prompt=sample)
    per_word = (len(ids) if ids is not None else estimated_tokens(sample)) / 1000
    return max(1, round(tokens / per_word))


def _level_cells(level: int, run: int, receipts: list[Receipt], first: int, max_tokens: int,
                 ignore_eos: str, exclude: bool = False, counted: str = "", banned: str = "") -> list[Cell]:
    """The level's and its categories' cells from the receipts `receipts[first:]`; with `exclude`,
    the per-stream figures leave out the streams the client cannot vouch for. `ignore_eos` is what
    the engine does with it (capabilities.py); `counted` notes tokens counted by a tokenizer,
    `banned` streams that carried the EOS ban instead."""
    names = list(CATEGORIES)
    indexes = list(range(first, len(receipts)))
    level_params = {"level": level}
    failed = [(i, why) for i in indexes if (why := failure(receipts[i])) is not None]
    by_category: dict[str, list[int]] = defaultdict(list)
    for n, i in enumerate(indexes):
        by_category[names[n % len(names)]].append(i)
    left_out = {i for i in indexes if exclude and receipts[i].unvouched is not None}
    cells = []
    for category, members in by_category.items():
        kept = [i for i in members if i not in left_out]
        rates = [r for i in kept if (r := receipts[i].decode_tokens_per_s) is not None]
        why = next((w for i, w in failed if i in members), None) or (
            "every stream was unvouched and excluded" if not kept else
            None if len(rates) == len(kept) else NO_TOKEN_TIMING)
        cells.append(Cell("category_stream_tok_s", statistics.fmean(rates) if why is None else None, "tok/s",
                          {**level_params, "category": category}, run, valid=why is None,
                          note=why or _unvouched_note(receipts, members, left_out), requests=kept or members))
    if failed:
        why = f"{len(failed)} of {len(indexes)} requests failed, first: {failed[0][1]}"
        return cells + [Cell(metric, None, unit, level_params, run, valid=False, note=why, requests=indexes)
                        for metric, unit in (("agg_tok_s", "tok/s"), ("stream_tok_s", "tok/s"), ("ttft_s", "s"))]
    mine = [receipts[i] for i in indexes]
    short = sum(r.completion_tokens != max_tokens for r in mine)
    note = f"{len(mine)} streams of {max_tokens} tokens" + (
        "" if ignore_eos == "honoured" else f"; {banned}" if banned else f"; ignore_eos {ignore_eos} by the engine")
    if short:
        note += f"; {short} streams did not produce exactly max_tokens" + (
            "" if ignore_eos == "honoured" else " (they ended early: fewer tokens, same figures per token)")
    if counted:
        note += f"; {counted}"
    span_ns = max(r.t_done_ns or 0 for r in mine) - min(r.t_queued_ns for r in mine)
    agg = sum(r.completion_tokens for r in mine) * 1e9 / span_ns
    kept = [i for i in indexes if i not in left_out]
    stream_note = note + _unvouched_note(receipts, indexes, left_out, lead="; ")
    stream_rates = [receipts[i].decode_tokens_per_s for i in kept]
    stream = None if not kept or None in stream_rates else statistics.fmean(x for x in stream_rates if x is not None)
    ttft = statistics.median((receipts[i].ttft_ns or 0) / 1e9 for i in kept) if kept else None
    no_stream = "every stream was unvouched and excluded" if not kept else NO_TOKEN_TIMING
    steady, steady_note = steady_agg_tok_s(mine, level)
    return cells + [
        Cell("agg_tok_s", agg, "tok/s", level_params, run, note=note + _unvouched_note(receipts, indexes, set(), "; "),
             requests=indexes),
        Cell("steady_agg_tok_s", steady, "tok/s", level_params, run, valid=steady is not None,
             note=steady_note, requests=indexes),
        Cell("stream_tok_s", stream, "tok/s", level_params, run, valid=stream is not None,
             note=stream_note if stream is not None else no_stream, requests=kept or indexes),
        Cell("ttft_s", ttft, "s", level_params, run, valid=ttft is not None, note=stream_note if kept else no_stream,
             requests=kept or indexes),
    ]


def _unvouched_note(receipts: list[Receipt], members: list[int], left_out: set[int], lead: str = "") -> str:
    """How many of a cell's streams the client cannot vouch for, and whether they were left out."""
    unvouched = [i for i in members if receipts[i].unvouched is not None]
    if not unvouched:
        return ""
    excluded = sum(i in left_out for i in unvouched)
    return (f"{lead}{len(unvouched)} of {len(members)} streams unvouched"
            + (", excluded" if excluded else "") + f" (first: {receipts[unvouched[0]].unvouched})")


def steady_agg_tok_s(streams: list[Receipt], level: int) -> tuple[float | None, str]:
    """Tokens per second over the spans in which `level` streams were all between their first and
    last token, counting the tokens that arrived inside those spans; (None, why) when there was
    no such span."""
    events = sorted(ev for r in streams if len(r.token_times_ns) >= 2
                    for ev in ((r.token_times_ns[0], 1), (r.token_times_ns[-1], -1)))
    spans: list[tuple[int, int]] = []
    active, start = 0, 0
    for t, step in events:  # at a tie an end sorts first: a stream that ends frees its place
        if active == level and step < 0 and t > start:
            spans.append((start, t))
        active += step
        if active == level:
            start = t
    if not spans:
        return None, f"no moment had all {level} streams decoding at once"
    tokens = 0
    for r in streams:
        times = r.token_times_ns
        weights = r.chunk_tokens if r.chunk_tokens and len(r.chunk_tokens) == len(times) else [1] * len(times)
        for lo, hi in spans:
            first, last = bisect_right(times, lo), bisect_right(times, hi)
            tokens += sum(weights[first:last])
    seconds = sum(hi - lo for lo, hi in spans) / 1e9
    return tokens / seconds, f"{tokens} tokens in {seconds:.3f} s with all {level} streams decoding"


def spec_counters(metrics: str | None) -> dict[str, float]:
    """Totals of vLLM's speculative-decoding counters in a Prometheus exposition, summed over
    label sets; empty when the engine exposes none or the exposition does not parse."""
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(metrics or ""):
            for sample in family.samples:
                # Counters' `_created` samples never match: only `_total` is stripped.
                base = sample.name.rpartition(":")[2].removesuffix("_total")
                for key, counter in SPEC_COUNTERS.items():
                    if base == counter:
                        totals[key] = totals.get(key, 0.0) + sample.value
    except ValueError:
        # Half a malformed exposition would give a before/after pair of different sums.
        return {}
    return totals


def spec_cells(level: int, run: int, before: dict[str, float], after: dict[str, float]) -> list[Cell]:
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    drafted, accepted = delta.get("drafted", 0.0), delta.get("accepted")
    if accepted is None or drafted <= 0:
        return []
    note = f"{accepted:g} of {drafted:g} drafted tokens accepted"
    cells = [Cell("spec_acceptance", accepted / drafted, "fraction", {"level": level}, run, note=note, requests=[])]
    if delta.get("drafts", 0.0) > 0:
        cells.append(Cell("spec_tokens_per_step", 1 + accepted / delta["drafts"], "tokens", {"level": level}, run,
                          note=f"{note} over {delta['drafts']:g} drafts", requests=[]))
    return cells

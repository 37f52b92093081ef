"""An agentic soak: several long chat sessions at once, with tool outputs, subagents and compaction
(lab/instruments/soak_sessions.py says how the sessions are driven).

One step, `soak`: the sessions run together until each has done `turns` turns or the time budget
is spent. Cache reuse is judged per turn against the conversation's previous prompt: a turn's
prompt is the previous prompt plus the answer, a tool output and a reminder, so only the previous
prompt can be served from a prefix cache, and `cached_tokens / previous prompt tokens` (at most 1)
is the figure that says whether the cache worked. The whole-prompt figure `cached_tokens / prompt
tokens` stands beside it: it is low on small contexts with big tool outputs even when the cache
served everything it could. Judged turns are those with a previous prompt (not a conversation's
first turn, nor the first after a compaction).

Cells (params as listed; counts in "requests"):
- `requests`, `errors`; `compactions`, `compaction_s` (slowest summary request, send to end) and
  `compaction_reuse` (least fraction of the previous prompt a summary request read from cache);
- `turn_latency_s` {band, stat}: a turn's send-to-end time, stat median / p90 / max, over all turns
  (band "all") and per context band of its prompt tokens;
- `subagent_cold_start_s` (slowest subagent's time to first token), `subagent_alone_s` (the same
  cold start sent alone before the sessions), `subagent_queued_s` (the slowest one's time to first
  token beyond the alone figure: how long it waited behind the sessions);
- `reuse_prev` and `reuse_whole` {session, turn}: each judged turn's two figures, each cell naming
  its denominator; `reuse_prev_worst` (the worst judged turn, named in the note),
  `reuse_prev_median`, `reuse_whole_median`;
- `engine_free_memory_min_gib`: the least free memory `/v1/stats` reported during the soak;
- `pass` (1/0): no errors, worst reuse at or above `reuse_floor`, slowest turn at or under
  `latency_ceiling_s`; a KEEP gate `{metric: soak.pass, min: 1}`.
An engine whose `usage` has no `prompt_tokens_details.cached_tokens` gets invalid reuse cells that
say so, and `pass` judges errors and latency only, saying so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, Field, confloat, conint, field_validator, model_validator

from lab.instruments.base import Better, BootContext
from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.free_memory_watch import FreeMemoryWatch
from lab.instruments.presets import PresetParams
from lab.instruments.soak_sessions import Exchange, Sessions
from lab.store.records import Cell, Step, StepResult

GIB = 1024**3
STATS = ("median", "p90", "max")
# Room for the chat template, the reminder and the compaction instruction beside the sized text.
TEMPLATE_SLACK_TOKENS = 128
NO_CACHED_TOKENS = "the engine does not report usage.prompt_tokens_details.cached_tokens, so cache reuse is unknown"


class SoakParams(PresetParams):
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "gpu": {"sessions": 3, "turns": 10, "start_tokens": 100000, "tool_tokens": [3000, 15000],
                "answer_tokens": 64, "subagent_every": 4, "subagents": 2, "subagent_tokens": 4000,
                "subagent_answer_tokens": 64, "compact_at_tokens": 112000, "summary_tokens": 128,
                "time_budget_s": 420, "latency_ceiling_s": 60, "bands": [32768, 65536, 100000]},
    }

    sessions: conint(ge=1) = Field(2, description="agent sessions running at once")  # type: ignore[valid-type]
    turns: conint(ge=1) = Field(6, description="turns per session")  # type: ignore[valid-type]
    start_tokens: conint(ge=16) = Field(  # type: ignore[valid-type]
        600, description="the task a session starts from, in tokens")
    tool_tokens: tuple[conint(ge=1), conint(ge=1)] = Field(  # type: ignore[valid-type]
        (128, 768), description="[least, most] tokens of a turn's tool output, drawn uniformly")
    answer_tokens: conint(ge=1) = Field(16, description="max_tokens of a turn")  # type: ignore[valid-type]
    subagent_every: conint(ge=1) = Field(3, description="a session starts subagents every k turns")  # type: ignore[valid-type]
    subagents: conint(ge=0) = Field(1, description="subagents started each time (0: none)")  # type: ignore[valid-type]
    subagent_tokens: conint(ge=16) = Field(256, description="a subagent's prompt, in tokens")  # type: ignore[valid-type]
    subagent_answer_tokens: conint(ge=1) = Field(16, description="max_tokens of a subagent")  # type: ignore[valid-type]
    compact_at_tokens: conint(ge=64) = Field(  # type: ignore[valid-type]
        2500, description="a session whose turn prompt reaches this many tokens is compacted")
    summary_tokens: conint(ge=1) = Field(32, description="max_tokens of a compaction's summary")  # type: ignore[valid-type]
    seed: int = Field(0, description="seeds the tool output sizes")
    time_budget_s: confloat(gt=0) = Field(  # type: ignore[valid-type]
        180, description="no session starts a turn after this many seconds")
    reuse_floor: confloat(ge=0, le=1) = Field(  # type: ignore[valid-type]
        0.9, description="pass needs every judged turn's reuse of its previous prompt at or above this")
    latency_ceiling_s: confloat(gt=0) = Field(  # type: ignore[valid-type]
        60, description="pass needs every turn to end within this many seconds")
    bands: list[conint(ge=1)] = Field(  # type: ignore[valid-type]
        default_factory=lambda: [1024, 2048], description="context band edges in prompt tokens, increasing")
    stats_interval_s: confloat(gt=0) = Field(  # type: ignore[valid-type]
        0.5, description="how often /v1/stats is read for the engine's free memory")

    @field_validator("tool_tokens")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] > value[1]:
            raise ValueError("write it as [least, most]")
        return value

    @field_validator("bands")
    @classmethod
    def _increasing(cls, value: list[int]) -> list[int]:
        if any(b <= a for a, b in zip(value, value[1:])):
            raise ValueError("band edges must increase")
        return value

    @model_validator(mode="after")
    def _compaction_reachable(self) -> SoakParams:
        if self.compact_at_tokens <= self.start_tokens:
            raise ValueError(f"compact_at_tokens ({self.compact_at_tokens}) must exceed start_tokens "
                             f"({self.start_tokens}): every session would compact after its first turn")
        return self


def band_names(edges: Sequence[int]) -> list[str]:
    bounds = [0, *edges]
    return [f"{a}-{b}" for a, b in zip(bounds, bounds[1:])] + [f"{bounds[-1]}+"]


def _band(tokens: int, edges: Sequence[int]) -> str:
    names = band_names(edges)
    for edge, name in zip(edges, names):
        if tokens < edge:
            return name
    return names[-1]


class SoakInstrument:
    name: ClassVar[str] = "soak"
    Params: ClassVar[type[BaseModel]] = SoakParams

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        return {"requests": "higher", "errors": "lower", "compactions": "higher", "compaction_s": "lower",
                "compaction_reuse": "higher", "turn_latency_s": "lower", "subagent_cold_start_s": "lower",
                "subagent_alone_s": "lower", "subagent_queued_s": "lower", "reuse_prev": "higher",
                "reuse_whole": "higher", "reuse_prev_worst": "higher", "reuse_prev_median": "higher",
                "reuse_whole_median": "higher", "engine_free_memory_min_gib": "higher", "pass": "higher"}

    def plan(self, params: BaseModel) -> list[Step]:
        return [Step("soak")]

    def cell_params(self, params: BaseModel) -> dict[str, list[dict[str, Any]]]:
        assert isinstance(params, SoakParams)
        declared: dict[str, list[dict[str, Any]]] = {metric: [{}] for metric in self.metrics(params)}
        declared["turn_latency_s"] = [{"band": band, "stat": stat} for band in ["all", *band_names(params.bands)]
                                      for stat in STATS]
        turns = [{"session": i, "turn": t} for i in range(params.sessions) for t in range(1, params.turns)]
        declared["reuse_prev"] = declared["reuse_whole"] = turns
        return declared

    def prompt_tokens(self, params: BaseModel) -> dict[str, int]:
        assert isinstance(params, SoakParams)
        # A turn below the compaction limit may still add the largest tool output and an answer.
        grown = params.start_tokens + params.turns * (params.tool_tokens[1] + params.answer_tokens
                                                      + TEMPLATE_SLACK_TOKENS)
        longest = min(grown, params.compact_at_tokens + params.tool_tokens[1] + TEMPLATE_SLACK_TOKENS)
        return {"compact_at_tokens": longest + max(params.answer_tokens, params.summary_tokens)}

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        params = ctx.params
        assert isinstance(params, SoakParams)
        connections = params.sessions * (1 + params.subagents) + 1
        async with EngineExtras(ctx) as extras, StreamingClient(ctx.base_url, ctx.api_key,
                                                                 timeout=ctx.request_timeout_s,
                                                                 max_connections=connections) as client:
            sessions = Sessions(params, client, ctx.model, ctx.salt, ctx.log)
            await sessions.size_words(extras)
            async with FreeMemoryWatch(ctx, params.stats_interval_s) as memory:
                soak = await sessions.run()
        ctx.log.info("soak: %d requests in %d sessions", len(soak.exchanges), params.sessions)
        return _cells(params, soak.exchanges, memory, soak.stopped_by_budget, soak.ended_by_error)


def _cells(params: SoakParams, exchanges: list[Exchange], memory: FreeMemoryWatch, stopped: list[int],
           ended: list[int]) -> StepResult:
    result = StepResult(receipts=[e.receipt for e in exchanges])
    index = {id(e): i for i, e in enumerate(exchanges)}

    def add(metric: str, value: float | None, unit: str, of: list[Exchange] | None, note: str = "",
            why: str | None = None, **cell_params: Any) -> None:
        requests = None if of is None else [index[id(e)] for e in of]
        result.cells.append(Cell(metric, None if why else value, unit, cell_params, valid=why is None and
                                 value is not None, note=why or note, requests=requests))

    failed = [e for e in exchanges if not e.receipt.ok]
    ran = f"{len(exchanges)} requests"
    if stopped:
        ran += f"; the time budget ended sessions {stopped} early"
    if ended:
        ran += f"; a failed request ended sessions {ended}"
    add("requests", len(exchanges), "requests", None, note=ran)
    add("errors", len(failed), "requests", failed,
        note="; ".join(f"{e.kind} s{e.session} t{e.turn}: {e.receipt.error}" for e in failed[:3]))

    ok = [e for e in exchanges if e.receipt.ok]
    cached_known = all(e.receipt.cached_tokens_present for e in ok) if ok else False
    no_cache = None if cached_known else NO_CACHED_TOKENS

    compactions = [e for e in ok if e.kind == "compaction"]
    add("compactions", len(compactions), "compactions", compactions)
    slowest = max(compactions, key=lambda e: e.receipt.e2e_ns or 0, default=None)
    add("compaction_s", _s(slowest.receipt.e2e_ns) if slowest else None, "s", [slowest] if slowest else [],
        why=None if slowest else "no session reached compact_at_tokens")
    least = min(compactions, key=_reuse_prev, default=None)
    add("compaction_reuse", _reuse_prev(least) if least else None, "fraction", [least] if least else [],
        note=_reuse_note(least) if least else "",
        why=no_cache if least else "no session reached compact_at_tokens")

    turns = [e for e in ok if e.kind == "turn"]
    for band in ["all", *band_names(params.bands)]:
        members = [e for e in turns if band == "all" or _band(e.receipt.prompt_tokens, params.bands) == band]
        seconds = [_s(e.receipt.e2e_ns) for e in members]
        for stat in STATS:
            value = _stat([s for s in seconds if s is not None], stat)
            add("turn_latency_s", value, "s", members, note=f"{len(members)} turns",
                why=None if members else "no turn in this band", band=band, stat=stat)

    _subagent_cells(add, ok)
    _reuse_cells(add, params, turns, no_cache)

    least_free = memory.least
    add("engine_free_memory_min_gib", least_free / GIB if least_free is not None else None, "GiB", [],
        note=f"{memory.samples} /v1/stats samples", why=None if least_free is not None else memory.why_none)
    if memory.receipt is not None:
        result.receipts.append(memory.receipt)
        result.cells[-1].requests = [len(result.receipts) - 1]

    reasons, judged = [], ["errors", "latency"]
    if failed:
        reasons.append(f"{len(failed)} requests failed")
    slowest_turn = max((_s(e.receipt.e2e_ns) or 0.0 for e in turns), default=None)
    if slowest_turn is not None and slowest_turn > params.latency_ceiling_s:
        reasons.append(f"a turn took {slowest_turn:.2f} s > {params.latency_ceiling_s:g} s")
    judged_turns = [e for e in turns if e.previous_prompt_tokens]
    if no_cache is None:
        judged.append("reuse")
        worst = min((_reuse_prev(e) for e in judged_turns), default=None)
        if worst is not None and worst < params.reuse_floor:
            reasons.append(f"a turn reused {worst:.1%} of its previous prompt < {params.reuse_floor:.0%}")
    if not turns:
        reasons.append("no turn was answered")
    note = "; ".join(reasons) if reasons else f"judged {', '.join(judged)}"
    if no_cache is not None:
        note += f"; reuse not judged: {no_cache}"
    add("pass", 0.0 if reasons else 1.0, "bool", None, note=note)
    return result


def _subagent_cells(add: Any, ok: list[Exchange]) -> None:
    subagents = [e for e in ok if e.kind == "subagent" and e.receipt.ttft_ns is not None]
    alone = next((e for e in ok if e.kind == "subagent_alone" and e.receipt.ttft_ns is not None), None)
    slowest = max(subagents, key=lambda e: e.receipt.ttft_ns or 0, default=None)
    none = "no subagent was answered"
    add("subagent_cold_start_s", _s(slowest.receipt.ttft_ns) if slowest else None, "s",
        [slowest] if slowest else [], note=f"slowest of {len(subagents)} subagents' time to first token",
        why=None if slowest else none)
    add("subagent_alone_s", _s(alone.receipt.ttft_ns) if alone else None, "s", [alone] if alone else [],
        why=None if alone else "the subagent sent alone was not answered")
    queued = None
    if slowest and alone:
        queued = max(0.0, (slowest.receipt.ttft_ns - alone.receipt.ttft_ns) / 1e9)  # type: ignore[operator]
    add("subagent_queued_s", queued, "s", [e for e in (alone, slowest) if e],
        note="the slowest subagent's time to first token beyond the same cold start sent alone",
        why=None if queued is not None else none)


def _reuse_cells(add: Any, params: SoakParams, turns: list[Exchange], no_cache: str | None) -> None:
    judged = [e for e in turns if e.previous_prompt_tokens]
    for e in judged:
        r = e.receipt
        add("reuse_prev", _reuse_prev(e), "fraction", [e], note=_reuse_note(e), why=no_cache,
            session=e.session, turn=e.turn)
        add("reuse_whole", r.cached_tokens / r.prompt_tokens if r.prompt_tokens else None, "fraction", [e],
            note=f"cached / whole prompt: {r.cached_tokens} of {r.prompt_tokens} tokens", why=no_cache,
            session=e.session, turn=e.turn)
    why = no_cache or (None if judged else "no judged turn: no session got past its first turn")
    worst = min(judged, key=_reuse_prev, default=None)
    add("reuse_prev_worst", _reuse_prev(worst) if worst else None, "fraction", [worst] if worst else [],
        note=(f"session {worst.session} turn {worst.turn}: {_reuse_note(worst)}; whole prompt "
              f"{worst.receipt.cached_tokens} of {worst.receipt.prompt_tokens}") if worst else "", why=why)
    add("reuse_prev_median", _stat([_reuse_prev(e) for e in judged], "median"), "fraction", judged,
        note=f"cached / previous prompt, over {len(judged)} judged turns", why=why)
    add("reuse_whole_median", _stat([e.receipt.cached_tokens / e.receipt.prompt_tokens for e in judged
                                     if e.receipt.prompt_tokens], "median"), "fraction", judged,
        note=f"cached / whole prompt, over {len(judged)} judged turns", why=why)


def _reuse_prev(e: Exchange) -> float:
    """The fraction of the conversation's previous prompt this request read from cache, at most 1
    (an engine that also caches the generated answer can serve more than the previous prompt)."""
    assert e.previous_prompt_tokens
    return min(1.0, e.receipt.cached_tokens / e.previous_prompt_tokens)


def _reuse_note(e: Exchange) -> str:
    return f"cached / previous prompt: {e.receipt.cached_tokens} of {e.previous_prompt_tokens} tokens"


def _stat(values: list[float], stat: str) -> float | None:
    """median, p90 (linear interpolation between ranks) or max; None for no values."""
    if not values:
        return None
    return float(np.percentile(values, {"median": 50, "p90": 90, "max": 100}[stat]))


def _s(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e9

"""A long conversation resumed after the engine restarts (or after its device cache is evicted):
does a KV tier that survives the restart pay?

Each round plays one conversation turn by turn: every turn's prompt is the history so far plus a
new user chunk of `turn_tokens` seeded token ids (greedy, `max_tokens` out, the answer not kept
in the history), `context_tokens` in all. Then:

1. *warm resume*: the history plus a short chunk A (`check_tokens`, fewer than a KV block holds,
   so no cache ever keeps it), on the engine that played: the history's KV is in device memory,
   computed in the same chunks a tier holds; its greedy text is the reference;
2. the runner **restarts the engine** with the same argv and environment inside this boot
   (`mode: restart`), or the instrument pushes the conversation out of the device cache with
   other prompts of `evict_tokens` in all (`mode: evict`, for a host-memory tier, which a
   restart empties);
3. *resume*: the history plus a new chunk B (`resume_tokens`, by default a turn's), the first
   request after the restart: the history comes from whatever tier kept it, or is recomputed; its
   time to first token is the figure;
4. *check*: the history plus chunk A again, A computed over the history exactly as the first time;
   its greedy text must equal the warm resume's, since a tier must change nothing but time. (Where
   the history was recomputed instead, in other chunks, low-precision sums may round otherwise and
   change a token on random weights: only tiers are held to it.)

Cells (params `{mode}`, repeat = round): `play_s`, `warm_resume_ttft_s`, `restart_s` (from the stop
to the engine's first answer), `resume_ttft_s`, `resume_cached_tokens` (the resume's
`usage.prompt_tokens_details.cached_tokens`), `resume_matches_warm` (1 or 0); and where the engine
reports tier hits at `/v1/stats` (the bundled engine), `resume_tier_tokens` with params
`{mode, tier: device|host|file}`: the resume's prompt tokens each tier served, and
`play_blocks_dropped`: blocks the file tier dropped during the play because its staging was full
(a file that cannot keep up holds only part of the history). `restart_s` exists in mode `restart`
only.

Prompts are token ids in [100, 30000): every engine the lab boots accepts token-id prompts, and
every model it measures has a vocabulary larger than that. The first ids of each round come from
the boot's salt, so no boot is served from another boot's cache, a tier's file included.
"""

from __future__ import annotations

import random
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, conint, model_validator

from lab.instruments.base import NOT_APPLICABLE, Better, BootContext
from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.presets import PresetParams
from lab.instruments.prompts import request_salt
from lab.instruments.receipt_checks import failure
from lab.store.records import Cell, Step, StepResult

TOKEN_IDS = (100, 30000)
TIERS = ("device", "host", "file")
SECONDS = ("play_s", "warm_resume_ttft_s", "restart_s", "resume_ttft_s")


class RestartParams(PresetParams):
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "gpu": {"context_tokens": 100000, "turn_tokens": 10000, "max_tokens": 16},
    }

    context_tokens: conint(ge=16) = Field(  # type: ignore[valid-type]
        2000, description="user tokens in the conversation played before the restart")
    turn_tokens: conint(ge=16) = Field(  # type: ignore[valid-type]
        500, description="user tokens each turn adds")
    resume_tokens: conint(ge=1) | None = Field(  # type: ignore[valid-type]
        None, description="new user tokens the resume adds to the history (default: turn_tokens); the history "
                          "is what a tier can serve, these are computed whatever the tier")
    max_tokens: conint(ge=1) = Field(8, description="output tokens per request")  # type: ignore[valid-type]
    check_tokens: conint(ge=1) = Field(  # type: ignore[valid-type]
        8, description="tokens of the chunk the warm resume and the check add: fewer than a KV block holds "
                       "(16 on the bundled engine and vLLM), so neither is served from a cache")
    rounds: conint(ge=1, le=20) = Field(  # type: ignore[valid-type]
        1, description="conversations played and resumed per boot, each with its own restart")
    modes: list[Literal["restart", "evict"]] = Field(
        default_factory=lambda: ["restart"], min_length=1,
        description="restart: the runner restarts the engine before the resume (a file tier survives it); evict: "
                    "other prompts push the conversation out of the device cache instead (a host-memory tier)")
    evict_tokens: conint(ge=1) | None = Field(  # type: ignore[valid-type]
        None, description="mode evict: prompt tokens of other traffic sent (default: the engine's KV pool at "
                          "/v1/stats, plus a tenth)")

    @model_validator(mode="after")
    def _whole_turns(self) -> "RestartParams":
        if self.turn_tokens > self.context_tokens:
            raise ValueError("turn_tokens is longer than context_tokens: the conversation would have no turn")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError("a mode is listed twice")
        return self

    @property
    def turns(self) -> int:
        return self.context_tokens // self.turn_tokens

    @property
    def resume_chunk(self) -> int:
        return self.turn_tokens if self.resume_tokens is None else self.resume_tokens


class RestartInstrument:
    name: ClassVar[str] = "restart"
    Params: ClassVar[type[BaseModel]] = RestartParams

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        return {**{name: "lower" for name in SECONDS}, "resume_cached_tokens": "higher",
                "resume_matches_warm": "higher", "resume_tier_tokens": "higher", "play_blocks_dropped": "lower"}

    def plan(self, params: BaseModel) -> list[Step]:
        assert isinstance(params, RestartParams)
        return [Step(f"{mode}/round={r}", {"mode": mode, "round": r}) for mode in params.modes
                for r in range(params.rounds)]

    def cell_params(self, params: BaseModel) -> dict[str, list[dict[str, Any]]]:
        assert isinstance(params, RestartParams)
        cells = {metric: [{"mode": mode} for mode in params.modes] for metric in self.metrics(params)}
        cells["restart_s"] = [{"mode": "restart"}] if "restart" in params.modes else []
        cells["resume_tier_tokens"] = [{"mode": mode, "tier": tier} for mode in params.modes for tier in TIERS]
        return cells

    def prompt_tokens(self, params: BaseModel) -> dict[str, int]:
        assert isinstance(params, RestartParams)
        return {"context_tokens": params.turns * params.turn_tokens + max(params.resume_chunk, params.check_tokens)
                + params.max_tokens}

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        params = ctx.params
        assert isinstance(params, RestartParams)
        mode: str = step.params["mode"]
        rnd: int = step.params["round"]
        result = StepResult()

        def cell(metric: str, value: float | None, requests: list[int] | None, why: str | None = None,
                 note: str = "", **cell_params: Any) -> None:
            unit = "s" if metric in SECONDS else next((u for u in ("tokens", "blocks") if u in metric), "ratio")
            result.cells.append(Cell(metric, value if why is None else None, unit, {"mode": mode, **cell_params},
                                     rnd, valid=why is None, note=why or note, requests=requests))

        def fail_all(why: str) -> StepResult:
            for metric, many in self.cell_params(params).items():
                for cell_params in many:
                    if cell_params["mode"] == mode:
                        cell(metric, None, [], why, **{k: v for k, v in cell_params.items() if k != "mode"})
            return result

        if mode == "restart" and ctx.engine is None:
            return fail_all(f"{NOT_APPLICABLE}restarting the engine needs `lab run`, which owns its process")
        chunks = conversation(request_salt(ctx.salt, self.name, mode, rnd), params)
        history = [t for chunk in chunks[:params.turns] for t in chunk]
        chunk_a, chunk_b = chunks[params.turns][:params.check_tokens], chunks[params.turns + 1]

        def completion(prompt: list[int]) -> dict[str, Any]:
            return {"model": ctx.model, "prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0,
                    "ignore_eos": True}

        async with EngineExtras(ctx) as extras, StreamingClient(ctx.base_url, ctx.api_key,
                                                                 timeout=ctx.request_timeout_s,
                                                                 max_connections=1) as client:
            before_play = await extras.stats()
            started = time.perf_counter()
            for turn in range(params.turns):
                played = await client.request(completion(history[:(turn + 1) * params.turn_tokens]))
                result.receipts.append(played)
                if failure(played):
                    return fail_all(f"turn {turn + 1} of the play failed: {failure(played)}")
            cell("play_s", time.perf_counter() - started, list(range(params.turns)),
                 note=f"{params.turns} turns to {len(history)} tokens")
            dropped = file_tier_drops(before_play, await extras.stats())
            cell("play_blocks_dropped", dropped and dropped[0], list(range(params.turns)),
                 None if dropped else f"{NOT_APPLICABLE}the engine reports no file tier writes",
                 note=f"{dropped[0]:.0f} of {dropped[1]:.0f} blocks offered to the file tier during the play "
                      "found its staging full" if dropped else "")

            warm = await client.request(completion(history + chunk_a))
            result.receipts.append(warm)
            warm_at = len(result.receipts) - 1
            if failure(warm):
                return fail_all(f"the warm resume failed: {failure(warm)}")
            cell("warm_resume_ttft_s", _s(warm.ttft_ns), [warm_at])

            if mode == "restart":
                assert ctx.engine is not None
                cell("restart_s", await ctx.engine.restart(), [])
                how = "after a restart"
            else:
                evicted = await self._evict(ctx, params, extras, client, result, rnd)
                if isinstance(evicted, str):
                    return fail_all(evicted)
                how = f"after {evicted} prompt tokens of other traffic"

            before = await extras.stats()
            resume = await client.request(completion(history + chunk_b))
            result.receipts.append(resume)
            resume_at = len(result.receipts) - 1
            after = await extras.stats()
            check = await client.request(completion(history + chunk_a))
            result.receipts.append(check)

        why = failure(resume)
        cell("resume_ttft_s", _s(resume.ttft_ns), [resume_at], why,
             note=f"{how}: {resume.prompt_tokens} prompt tokens, {resume.cached_tokens} of them cached")
        cell("resume_cached_tokens", float(resume.cached_tokens), [resume_at],
             why or (None if resume.cached_tokens_present else "the engine reports no cached tokens"))
        why_check = failure(check)
        cell("resume_matches_warm", float(check.text == warm.text), [warm_at, len(result.receipts) - 1], why_check,
             note="" if check.text == warm.text else f"warm {warm.text[:60]!r}, after {check.text[:60]!r}")
        for tier in TIERS:
            served = tier_tokens(before, after, tier)
            cell("resume_tier_tokens", served, [resume_at],
                 why or (None if served is not None else f"{NOT_APPLICABLE}the engine reports no tier hits"),
                 tier=tier)
        return result

    async def _evict(self, ctx: BootContext, params: RestartParams, extras: EngineExtras, client: StreamingClient,
                     result: StepResult, rnd: int) -> int | str:
        """Send other prompts until the device cache must have dropped the conversation; the tokens
        sent, or why it could not."""
        total = params.evict_tokens
        if total is None:
            pool = ((await extras.stats()) or {}).get("kv_pool", {}).get("tokens")
            if not isinstance(pool, int):
                return "mode evict needs evict_tokens: the engine does not report its KV pool at /v1/stats"
            total = pool + pool // 10
        sent = 0
        n = 0
        while sent < total:
            size = min(params.context_tokens, total - sent)
            filler = token_ids(request_salt(ctx.salt, self.name, rnd, "evict", n), size)
            other = await client.request({"model": ctx.model, "prompt": filler, "max_tokens": 1, "temperature": 0})
            result.receipts.append(other)
            if failure(other):
                return f"a request sent to evict the conversation failed: {failure(other)}"
            sent += len(filler)
            n += 1
        return sent


def conversation(salt: str, params: RestartParams) -> list[list[int]]:
    """The user chunks of one round: the turns played, then the chunks A and B the resumes add."""
    played = [token_ids(f"{salt}/{i}", params.turn_tokens) for i in range(params.turns + 1)]
    return played + [token_ids(f"{salt}/{params.turns + 1}", params.resume_chunk)]


def token_ids(salt: str, n: int) -> list[int]:
    rng = random.Random(salt)
    return [rng.randrange(*TOKEN_IDS) for _ in range(n)]


def tier_tokens(before: dict[str, Any] | None, after: dict[str, Any] | None, tier: str) -> float | None:
    """Prompt tokens `tier` served between two `/v1/stats` answers (the bundled engine's
    `prefix_cache.hits_by_tier`); None when the engine does not report them."""
    def tokens(stats: dict[str, Any] | None) -> int | None:
        hits = ((stats or {}).get("prefix_cache") or {}).get("hits_by_tier")
        if not isinstance(hits, dict):
            return None
        return int((hits.get(tier) or {}).get("tokens", 0))

    first, last = tokens(before), tokens(after)
    return None if first is None or last is None else float(last - first)


def file_tier_drops(before: dict[str, Any] | None, after: dict[str, Any] | None) -> tuple[float, float] | None:
    """(blocks dropped, blocks offered) by the file tier between two `/v1/stats` answers (the
    bundled engine's `prefix_cache.tiers.file`); None without a file tier."""
    def counts(stats: dict[str, Any] | None) -> tuple[int, int] | None:
        file = (((stats or {}).get("prefix_cache") or {}).get("tiers") or {}).get("file")
        if not isinstance(file, dict) or "blocks_dropped" not in file:
            return None
        return int(file["blocks_dropped"]), int(file["blocks_dropped"]) + int(file.get("blocks_queued", 0))

    first, last = counts(before), counts(after)
    return None if first is None or last is None else (float(last[0] - first[0]), float(last[1] - first[1]))


def _s(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e9

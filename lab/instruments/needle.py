"""Retrieval at length x depth: a passphrase planted in filler text, asked back at T=0.

Each cell gets a fresh two-word passphrase drawn from the boot's salt (reproducible, never
repeated across boots), planted as its own paragraph at `depth` (0 = the start of the filler, 1 =
its end, snapped back to a sentence boundary). The user turn says what to look for before the
text and asks for it after; the assistant's reply is prefilled with "The secret passphrase is" by
rendering the chat template through `/tokenize` and sending the token ids to `/v1/completions`.
Small models answer far more reliably that way (SmolLM2-135M finds far more passphrases when its
answer is started for it than when asked through the chat endpoint). An engine without
`/tokenize` is asked through `/v1/chat/completions` without the prefill, and the note says so.

The match is deterministic: answer and passphrase are lower-cased with every run of
non-alphanumerics made one space, and the passphrase must occur as whole words.

Cells: `found` (1/0) and `prefill_tok_s` (prompt tokens / TTFT of that request) with params
`{length, depth}`, repeat = rep (`reps_at_longest` repeats at the longest length, one elsewhere);
then `found_rate` over the whole grid, valid only when every cell of the grid was answered.

Resident mode (`resident_sessions: S`). After the solo ask, each cell warms S long sessions and
holds them resident (lab/instruments/resident.py: each re-sent turn after turn, so it is running
or its prefix is cached) while the same passphrase in the same text is asked again under a salt
of its own, so it is prefilled afresh beside them. `found_resident` (1/0, the same params) says
whether it was found then, its note beside the solo result and how many sequences the engine
preempted meanwhile (from `/v1/stats`, where it says); `found_resident_rate` sums it up. With a KV
pool too small for the sessions and the needle at once, retrieval must not change: any difference
from `found` is the engine's doing.

On an engine that serves random weights (`/v1/stats` says so) no request is sent: every cell is
invalid with a "not applicable: ..." note, since random weights retrieve nothing; the prefill
instrument measures such an engine's prefill speed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, Field, confloat, conint, field_validator

from lab.instruments.base import NOT_APPLICABLE, Better, BootContext, random_weights_note
from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.memory import stats_receipt
from lab.instruments.presets import PresetParams
from lab.instruments.prompts import (Messages, PromptTooShort, chat_messages, filler_words, fit_messages,
                                     request_salt)
from lab.instruments.receipt import Receipt
from lab.instruments.receipt_checks import failure, prefill_problem, prefill_tok_s
from lab.instruments.resident import ResidentSessions
from lab.store.records import Cell, Step, StepResult

# One token each in the common BPE vocabularies, and none of them in the filler's word lists.
ADJECTIVES = ("silver", "golden", "copper", "purple", "orange", "yellow", "green", "blue", "pink", "violet",
              "amber", "silent", "gray", "brown")
NOUNS = ("falcon", "beetle", "comet", "glacier", "compass", "anchor", "tiger", "rabbit", "dragon", "eagle",
         "wolf", "piano", "rocket", "candle", "mountain", "island", "pencil", "mirror", "castle", "dolphin",
         "penguin", "volcano")
INSTRUCTION = "Find the secret passphrase in the text below."
QUESTION = "What is the secret passphrase mentioned in the text above?"
REPLY_PREFIX = "The secret passphrase is"
SUMMARY_KEY = "found_rate"
RESIDENT_SUMMARY_KEY = "found_resident_rate"
GRID_METRICS = (("found", "bool"), ("prefill_tok_s", "tok/s"))  # each grid step's cells, with their units


class NeedleParams(PresetParams):
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "gpu": {"lengths": [20000, 131072, 300000], "depths": [0.1, 0.5, 0.9], "reps_at_longest": 3,
                "answer_tokens": 16},
    }

    lengths: list[conint(ge=64)] = Field(  # type: ignore[valid-type]
        default_factory=lambda: [1024], min_length=1, description="prompt lengths in tokens")
    depths: list[confloat(ge=0, le=1)] = Field(  # type: ignore[valid-type]
        default_factory=lambda: [0.5], min_length=1, description="where the passphrase goes: 0 start, 1 end")
    reps_at_longest: conint(ge=1) = Field(  # type: ignore[valid-type]
        1, description="repeats of every depth at the longest length")
    answer_tokens: conint(ge=4) = Field(12, description="max_tokens of the answer")  # type: ignore[valid-type]
    resident_sessions: conint(ge=0) = Field(  # type: ignore[valid-type]
        0, description="long sessions held resident while each needle is asked again (0: solo only)")
    resident_tokens: conint(ge=64) = Field(  # type: ignore[valid-type]
        2048, description="prompt tokens of each resident session")
    resident_answer_tokens: conint(ge=1) = Field(  # type: ignore[valid-type]
        16, description="max_tokens of each resident session's turn")

    @field_validator("lengths", "depths")
    @classmethod
    def _distinct(cls, values: list[Any]) -> list[Any]:
        if len(set(values)) != len(values):
            raise ValueError("a value is listed twice")
        return values


class NeedleInstrument:
    name: ClassVar[str] = "needle"
    Params: ClassVar[type[BaseModel]] = NeedleParams
    needs_real_weights: ClassVar[bool] = True

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        assert isinstance(params, NeedleParams)
        resident: dict[str, Better] = {"found_resident": "higher", RESIDENT_SUMMARY_KEY: "higher"}
        return {"found": "higher", "found_rate": "higher", "prefill_tok_s": "higher",
                **(resident if params.resident_sessions else {})}

    def plan(self, params: BaseModel) -> list[Step]:
        assert isinstance(params, NeedleParams)
        longest = max(params.lengths)
        steps = [Step(f"length={n}/depth={d:g}/rep={r}", {"length": n, "depth": d, "rep": r})
                 for n in params.lengths for d in params.depths
                 for r in range(params.reps_at_longest if n == longest else 1)]
        return [*steps, Step(SUMMARY_KEY, {"cells": len(steps)})]

    def cell_params(self, params: BaseModel) -> dict[str, list[dict[str, Any]]]:
        assert isinstance(params, NeedleParams)
        grid = [{"length": n, "depth": d} for n in params.lengths for d in params.depths]
        resident = {"found_resident": grid, RESIDENT_SUMMARY_KEY: [{}]} if params.resident_sessions else {}
        return {"found": grid, "prefill_tok_s": grid, "found_rate": [{}], **resident}

    def prompt_tokens(self, params: BaseModel) -> dict[str, int]:
        assert isinstance(params, NeedleParams)
        resident = {"resident_tokens": params.resident_tokens + params.resident_answer_tokens}
        return {"lengths": max(params.lengths) + params.answer_tokens, **(resident if params.resident_sessions else {})}

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        params = ctx.params
        assert isinstance(params, NeedleParams)
        if step.key == SUMMARY_KEY:
            result = self._summary(ctx, step.params["cells"], "found", SUMMARY_KEY)
            if params.resident_sessions:
                result.cells += self._summary(ctx, step.params["cells"], "found_resident", RESIDENT_SUMMARY_KEY).cells
            return result
        length, depth, rep = step.params["length"], step.params["depth"], step.params["rep"]
        cell_params = {"length": length, "depth": depth}
        metrics = [*GRID_METRICS, *([("found_resident", "bool")] if params.resident_sessions else [])]

        def invalid(why: str, receipts: list[Receipt]) -> StepResult:
            ctx.log.warning("needle %s invalid: %s", step.key, why)
            return StepResult(cells=[Cell(metric, None, unit, cell_params, rep, valid=False, note=why,
                                          requests=list(range(len(receipts)))) for metric, unit in metrics],
                              receipts=receipts)

        connections = 1 + params.resident_sessions
        async with EngineExtras(ctx) as extras, StreamingClient(ctx.base_url, ctx.api_key,
                                                                 timeout=ctx.request_timeout_s,
                                                                 max_connections=connections) as client:
            if await extras.random_weights():
                note = random_weights_note(ctx.model)
                ctx.log.info("needle %s: %s", step.key, note)
                return StepResult(cells=[Cell(metric, None, unit, cell_params, rep, valid=False, note=note,
                                              requests=[]) for metric, unit in metrics])
            limit = await extras.max_model_len()
            if limit is not None and length + params.answer_tokens > limit:
                return invalid(f"{length} prompt tokens + {params.answer_tokens} answer tokens exceed the engine's "
                               f"context of {limit}", [])
            salt = request_salt(ctx.salt, self.name, length, depth, rep)
            rng = random.Random(salt)
            needle = _Needle(f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}", filler_words(salt, length), depth,
                             length, params.answer_tokens, ctx.model)
            asked = await needle.ask(extras, client, salt)
            if isinstance(asked, str):
                return invalid(asked, [])
            receipt, how, exact = asked
            resident = None
            if params.resident_sessions:
                resident = ResidentSessions(client, ctx.model, ctx.salt, params.resident_sessions,
                                            params.resident_tokens, params.resident_answer_tokens)
                await resident.build(extras)
                preempted_before = await _preemptions(ctx)
                async with resident:
                    # The same passphrase in the same text, under a salt of its own so it is prefilled again.
                    beside = await needle.ask(extras, client, request_salt(salt, "resident"))
                preempted = await _preemptions(ctx)
        # Receipts: the solo ask, every resident session's request, then the ask beside them.
        receipts = [receipt, *(resident.receipts if resident else [])]
        if resident is not None and not isinstance(beside, str):
            receipts.append(beside[0])
        why = failure(receipt)
        if why is not None:
            return invalid(why, receipts)
        found = passphrase_found(needle.passphrase, receipt.text)
        note = f"{needle.passphrase!r} -> {receipt.text.strip()[:80]!r}; {how}"
        cells = [Cell("found", float(found), "bool", cell_params, rep, note=note, requests=[0])]
        problem = prefill_problem(receipt, length if exact else None)
        cells.append(Cell("prefill_tok_s", None if problem else prefill_tok_s(receipt), "tok/s", cell_params, rep,
                          valid=problem is None, note=problem or "", requests=[0]))
        if resident is not None:
            change = (f"; the engine preempted {preempted - preempted_before} sequences meanwhile"
                      if preempted is not None and preempted_before is not None else "")
            cells.append(_resident_cell(beside, resident, found, needle.passphrase, change, cell_params, rep))
        return StepResult(cells=cells, receipts=receipts)

    def _summary(self, ctx: BootContext, planned: int, metric: str, key: str) -> StepResult:
        """The found rate over every `metric` cell this slot stored (an earlier attempt of a resumed
        slot included); not applicable when every one of them is."""
        cells = ctx.stored.slot_cells(ctx.slot_id, self.name, metric)
        if cells and all(c.note.startswith(NOT_APPLICABLE) for c in cells):
            return StepResult(cells=[Cell(key, None, "fraction", valid=False, note=cells[0].note, requests=[])])
        answered = [c.value for c in cells if c.valid and c.value is not None]
        if not answered:
            return StepResult(cells=[Cell(key, None, "fraction", valid=False, requests=[],
                                          note=f"none of {planned} needle cells was answered")])
        rate = sum(answered) / len(answered)
        complete = len(answered) == planned
        note = (f"{int(sum(answered))} of {planned} found" if complete else
                f"only {len(answered)} of {planned} needle cells were answered; {int(sum(answered))} found")
        return StepResult(cells=[Cell(key, rate, "fraction", valid=complete, note=note, requests=[])])


@dataclass(frozen=True)
class _Needle:
    """One cell's passphrase in its filler, asked under a given salt."""

    passphrase: str
    words: list[str]
    depth: float
    length: int
    answer_tokens: int
    model: str

    async def ask(self, extras: EngineExtras, client: StreamingClient, salt: str) -> tuple[Receipt, str, bool] | str:
        """The answer's receipt, how it was asked and whether the length is exact; or why no prompt
        of the cell's length could be built."""

        def render(k: int, tail: str) -> Messages:
            return _messages(salt, self.words[:k], self.depth, self.passphrase, tail)

        reply_prefix = await _reply_prefix_ids(extras)
        try:
            fitted = await fit_messages(extras, self.length, render, len(self.words),
                                        extra_tokens=len(reply_prefix or []))
        except PromptTooShort as exc:
            return str(exc)
        if fitted.exact and fitted.tokens != self.length:
            return f"no prompt of exactly {self.length} tokens was found (closest: {fitted.tokens})"
        request: dict[str, Any] = {"model": self.model, "max_tokens": self.answer_tokens, "temperature": 0}
        if fitted.exact and reply_prefix is not None:
            ids = await extras.tokenize(messages=fitted.form)
            if ids is None:
                raise RuntimeError("/tokenize stopped answering while the needle prompt was built")
            request["prompt"] = ids + reply_prefix
            how = f"reply prefilled with {REPLY_PREFIX!r}"
        else:
            request["messages"] = fitted.form
            how = "asked through chat without a reply prefix" + (
                "" if fitted.exact else "; no /tokenize, so the length is an estimate")
        return await client.request(request), how, fitted.exact


def _resident_cell(asked: tuple[Receipt, str, bool] | str, resident: ResidentSessions, solo: bool, passphrase: str,
                   preempted: str, cell_params: dict[str, Any], rep: int) -> Cell:
    """found_resident: the same needle asked while the sessions were held, beside the solo result.
    Its requests are every resident session's request (from index 1) and the ask (the last)."""
    requests = list(range(1, 2 + len(resident.receipts) - isinstance(asked, str)))
    why = asked if isinstance(asked, str) else failure(asked[0])
    if why is None and resident.failed():
        why = f"a resident session failed: {resident.failed()[0].error}"
    if why is not None or isinstance(asked, str):
        return Cell("found_resident", None, "bool", cell_params, rep, valid=False, note=str(why), requests=requests)
    receipt = asked[0]
    overlapped = resident.overlapping(receipt)
    if not overlapped:
        return Cell("found_resident", None, "bool", cell_params, rep, valid=False, requests=requests,
                    note="no resident session was running while the needle was asked")
    found = passphrase_found(passphrase, receipt.text)
    note = (f"resident: {'found' if found else 'not found'}, solo: {'found' if solo else 'not found'}; "
            f"{passphrase!r} -> {receipt.text.strip()[:80]!r}; {resident.warm} sessions resident, "
            f"{overlapped} of their turns overlapped the ask{preempted}")
    return Cell("found_resident", float(found), "bool", cell_params, rep, note=note, requests=requests)


async def _preemptions(ctx: BootContext) -> int | None:
    """The engine's preemption count from `/v1/stats`, when it reports one."""
    receipt = await stats_receipt(ctx)
    count = receipt.response.get("preemptions") if receipt.ok and isinstance(receipt.response, dict) else None
    return count if isinstance(count, int) else None


def _messages(salt: str, words: list[str], depth: float, passphrase: str, tail: str) -> Messages:
    at = round(depth * len(words))
    while at > 0 and not words[at - 1].endswith("."):
        at -= 1  # the passphrase goes between sentences, never inside one
    before, after = " ".join(words[:at]), " ".join(words[at:])
    text = "\n\n".join(part for part in (INSTRUCTION, before, f"{REPLY_PREFIX} {passphrase}.", after + tail)
                       if part)
    return chat_messages(salt, f"{text}\n\n{QUESTION}")


async def _reply_prefix_ids(extras: EngineExtras) -> list[int] | None:
    """The reply prefix's token ids as they follow the chat template, without the BOS (or other
    special tokens) the tokenizer puts before any plain prompt; None without `/tokenize`."""
    bare = await extras.tokenize(prompt="")
    full = await extras.tokenize(prompt=REPLY_PREFIX)
    if bare is None or full is None:
        return None
    return full[len(bare):] if full[:len(bare)] == bare else full


def passphrase_found(passphrase: str, answer: str) -> bool:
    """Whether the answer holds the passphrase as whole words, ignoring case and punctuation."""
    return _normalise(passphrase) in _normalise(answer)


def _normalise(text: str) -> str:
    return " " + " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split()) + " "

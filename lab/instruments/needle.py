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

On an engine that serves random weights (`/v1/stats` says so) no request is sent: every cell is
invalid with a "not applicable: ..." note, since random weights retrieve nothing; the prefill
instrument measures such an engine's prefill speed.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from pydantic import BaseModel, Field, confloat, conint, field_validator
from sqlalchemy import select

from lab.instruments.base import (NOT_APPLICABLE, Better, BootContext, Cell, Step, StepResult,
                                  random_weights_note)
from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.presets import PresetParams
from lab.instruments.prompts import (Messages, PromptTooShort, chat_messages, filler_words, fit_messages,
                                     request_salt)
from lab.instruments.receipt import Receipt
from lab.instruments.receipt_checks import failure, prefill_problem, prefill_tok_s
from lab.store import models as m

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
        return {"found": "higher", "found_rate": "higher", "prefill_tok_s": "higher"}

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
        return {"found": grid, "prefill_tok_s": grid, "found_rate": [{}]}

    def prompt_tokens(self, params: BaseModel) -> dict[str, int]:
        assert isinstance(params, NeedleParams)
        return {"lengths": max(params.lengths) + params.answer_tokens}

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        if step.key == SUMMARY_KEY:
            return self._summary(ctx, step.params["cells"])
        params = ctx.params
        assert isinstance(params, NeedleParams)
        length, depth, rep = step.params["length"], step.params["depth"], step.params["rep"]
        cell_params = {"length": length, "depth": depth}

        def invalid(why: str, receipts: list[Receipt]) -> StepResult:
            ctx.log.warning("needle %s invalid: %s", step.key, why)
            return StepResult(cells=[Cell(metric, None, unit, cell_params, rep, valid=False, note=why,
                                          requests=list(range(len(receipts)))) for metric, unit in GRID_METRICS],
                              receipts=receipts)

        async with EngineExtras(ctx) as extras, StreamingClient(ctx.base_url, ctx.api_key,
                                                                 max_connections=1) as client:
            if await extras.random_weights():
                note = random_weights_note(ctx.model)
                ctx.log.info("needle %s: %s", step.key, note)
                return StepResult(cells=[Cell(metric, None, unit, cell_params, rep, valid=False, note=note,
                                              requests=[]) for metric, unit in GRID_METRICS])
            limit = await extras.max_model_len()
            if limit is not None and length + params.answer_tokens > limit:
                return invalid(f"{length} prompt tokens + {params.answer_tokens} answer tokens exceed the engine's "
                               f"context of {limit}", [])
            salt = request_salt(ctx.salt, self.name, length, depth, rep)
            rng = random.Random(salt)
            passphrase = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
            words = filler_words(salt, length)

            def render(k: int, tail: str) -> Messages:
                return _messages(salt, words[:k], depth, passphrase, tail)

            reply_prefix = await _reply_prefix_ids(extras)
            try:
                fitted = await fit_messages(extras, length, render, len(words),
                                            extra_tokens=len(reply_prefix or []))
            except PromptTooShort as exc:
                return invalid(str(exc), [])
            if fitted.exact and fitted.tokens != length:
                return invalid(f"no prompt of exactly {length} tokens was found (closest: {fitted.tokens})", [])
            request: dict[str, Any] = {"model": ctx.model, "max_tokens": params.answer_tokens, "temperature": 0}
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
            receipt = await client.request(request)
        why = failure(receipt)
        if why is not None:
            return invalid(why, [receipt])
        found = passphrase_found(passphrase, receipt.text)
        note = f"{passphrase!r} -> {receipt.text.strip()[:80]!r}; {how}"
        cells = [Cell("found", float(found), "bool", cell_params, rep, note=note, requests=[0])]
        problem = prefill_problem(receipt, length if fitted.exact else None)
        cells.append(Cell("prefill_tok_s", None if problem else prefill_tok_s(receipt), "tok/s", cell_params, rep,
                          valid=problem is None, note=problem or "", requests=[0]))
        return StepResult(cells=cells, receipts=[receipt])

    def _summary(self, ctx: BootContext, planned: int) -> StepResult:
        """The found rate over every needle cell this slot stored (an earlier attempt of a resumed
        slot included); not applicable when every one of them is."""
        with ctx.store.session() as s:
            cells = s.scalars(select(m.Cell).where(m.Cell.slot_id == ctx.slot_id, m.Cell.instrument == self.name,
                                                   m.Cell.metric == "found")).all()
        if cells and all(c.note.startswith(NOT_APPLICABLE) for c in cells):
            return StepResult(cells=[Cell(SUMMARY_KEY, None, "fraction", valid=False, note=cells[0].note,
                                          requests=[])])
        answered = [c.value for c in cells if c.valid and c.value is not None]
        if not answered:
            return StepResult(cells=[Cell(SUMMARY_KEY, None, "fraction", valid=False, requests=[],
                                          note=f"none of {planned} needle cells was answered")])
        rate = sum(answered) / len(answered)
        complete = len(answered) == planned
        note = (f"{int(sum(answered))} of {planned} found" if complete else
                f"only {len(answered)} of {planned} needle cells were answered; {int(sum(answered))} found")
        return StepResult(cells=[Cell(SUMMARY_KEY, rate, "fraction", valid=complete, note=note, requests=[])])


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

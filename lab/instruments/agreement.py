"""agreement: did a change alter the numbers? Identical prompts at T=0 on every boot of a window,
compared token by token with what the window's opening control generated.

Each prompt is sent with `temperature: 0`, a fixed seed, `max_tokens` and the top-k logprobs of
every generated token (`logprobs`/`top_logprobs` on chat, `logprobs: k` on completions: the shapes
vLLM, SGLang and llama.cpp's server return). The opening control only stores its receipts: they
are the reference. Every later boot of the window (arms and the closing control) is compared with
them, prompt by prompt, matched on the exact request (endpoint, prompt, max_tokens).

Prompts are not salted: the identical prompt is the measurement, and each boot is a fresh engine
process, so no boot is served from another's prefix cache. The default concurrency is 1 so every
request runs alone: on engines whose kernels are not batch-invariant, a different batch mix
between boots would otherwise show up as divergence that no config caused.

Definitions, per prompt, on the generated token sequences:
- first divergence: the index of the first token that differs; when one sequence is a prefix of
  the other, the shorter one's length; identical sequences count as their full length (so the
  mean is "tokens agreed", censored at max_tokens) and are marked identical in the notes.
- compared positions: 0 .. first divergence inclusive. At the divergence both sides still saw the
  same context; after it they did not, and their distributions are no longer comparable.
- KL(control ‖ here) at a compared position, in nats, over the union U of the two returned top-k
  sets (each including its sampled token). A token of U missing from one side's top-k gets that
  side's smallest returned logprob: the most its true probability can be, so the estimate errs
  low rather than exploding on near-ties. Each side is then renormalised over U. Identical top-k
  sets with identical logprobs give exactly 0. `mean_kl` pools every compared position of every
  prompt; `max_kl` is the worst position.
- top-1 agreement: the share of compared positions where both sides' most likely token is the same.
- top-k consistent: the share of prompts that are identical, or whose two tokens at the first
  divergence each appear in the other side's top-k (vLLM's `check_logprobs_close` criterion: a
  near-tie flipped, not a different distribution). A sequence that ended where the other went on
  is not consistent: engines differ in whether they return the end token's logprobs.

Without logprobs (an engine that returns none, or `top_logprobs: 0`), only the exact match of the
generated text is reported; the token-based cells are invalid with the reason. Gate reduced
precision on `mean_kl`/`topk_consistent_rate`, not exact match: bfloat16 SmolLM2 leaves float32's
greedy path within a few tokens while staying close in distribution.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from lab.instruments.base import Better, BootContext
from lab.instruments.client import StreamingClient
from lab.instruments.opening_control import is_opening_control, load_reference
from lab.instruments.receipt import Receipt
from lab.store.records import Cell, Step, StepResult
from lab.store.rows import RequestRecord

# (id, prompt): short and varied, so the set exercises prose, code, numbers, lists and structure.
PROMPTS: tuple[tuple[str, str], ...] = (
    ("prose_harbour", "Describe a rainy morning in a small harbour town in two sentences."),
    ("code_fibonacci", "Write a Python function that returns the n-th Fibonacci number."),
    ("numbers_count", "Count from 1 to 20, separated by commas."),
    ("list_fruits", "List five fruits that are red, one per line."),
    ("json_person", "Give a JSON object with the keys name, age and city for a fictional person."),
    ("math_steps", "Explain step by step how to compute 17 times 23."),
    ("translate_french", "Translate into French: The library opens at nine in the morning."),
    ("summary_bridge", "Summarise in one sentence: The committee met on Tuesday and agreed to delay the bridge "
                       "repairs until spring, because steel now costs twice what it did last year."),
    ("qa_sky", "Why is the sky blue? Answer briefly."),
    ("code_sql", "Write an SQL query that selects the ten most recent rows of a table named orders."),
    ("table_planets", "Make a markdown table of the first three planets from the sun and their order."),
    ("story_lighthouse", "Begin a short story about a lighthouse keeper who finds a message in a bottle."),
    ("tips_plants", "Give three numbered tips for keeping a houseplant alive."),
    ("numbers_primes", "Write the first ten prime numbers."),
    ("code_bash", "Write a bash command that counts the lines of every .txt file in the current folder."),
    ("define_tuple", "What is the difference between a list and a tuple in Python?"),
)
# preset -> (prompts, max_tokens)
PRESETS: dict[str, tuple[int, int]] = {"quick": (8, 32), "full": (len(PROMPTS), 128)}


class AgreementParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    preset: Literal["quick", "full"] = Field("quick", description="quick: 8 prompts x 32 tokens; full: 16 x 128")
    prompts: int | None = Field(None, ge=1, le=len(PROMPTS), description="the first N prompts (overrides preset)")
    max_tokens: int | None = Field(None, ge=1, le=4096, description="tokens per prompt (overrides preset)")
    top_logprobs: int = Field(5, ge=0, le=20, description="top-k logprobs per token; 0 asks for none (exact match only)")
    endpoint: Literal["chat", "completions"] = "chat"
    concurrency: int = Field(1, ge=1, le=64, description="1: each request alone in its batch")
    seed: int = 0
    request_timeout_s: float = Field(300.0, gt=0)

    def size(self) -> tuple[int, int]:
        n, tokens = PRESETS[self.preset]
        return self.prompts or n, self.max_tokens or tokens


@dataclass(frozen=True)
class Generation:
    """One prompt's output on one boot, the same shape whether fresh or read from the store."""

    key: str  # the request that produced it: endpoint, prompt and max_tokens
    text: str
    tokens: list[str] | None  # None when the engine returned no logprobs
    tops: list[dict[str, float] | None] | None  # per token: its alternatives, sampled token included
    error: str | None

    @classmethod
    def from_receipt(cls, r: Receipt) -> Generation:
        lps = None if r.logprobs is None else [(t.token, t.logprob, t.top) for t in r.logprobs]
        return _generation(_key(r.endpoint, r.payload), r.text, r.error, lps)

    @classmethod
    def from_stored(cls, r: RequestRecord) -> Generation:
        lps = None if r.logprobs is None else [(t["token"], t["logprob"], t.get("top") or {}) for t in r.logprobs]
        return _generation(_key(r.endpoint, r.payload or {}), r.text or "", r.error, lps)


class AgreementInstrument:
    name: ClassVar[str] = "agreement"
    Params: ClassVar[type[BaseModel]] = AgreementParams

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        return {
            "exact_match_rate": "higher",
            "first_divergence_mean": "higher",
            "first_divergence": "higher",
            "mean_kl": "lower",
            "max_kl": "lower",
            "top1_agreement_rate": "higher",
            "topk_consistent_rate": "higher",
            "unpaired_prompts": "lower",
            "errors": "lower",
        }

    def cell_params(self, params: BaseModel) -> dict[str, list[dict[str, Any]]]:
        """One cell per summary metric, and one first_divergence per prompt the ladder asks for."""
        assert isinstance(params, AgreementParams)
        n, _ = params.size()
        cells: dict[str, list[dict[str, Any]]] = {metric: [{}] for metric in self.metrics(params)}
        cells["first_divergence"] = [{"prompt": name} for name, _ in PROMPTS[:n]]
        return cells

    def plan(self, params: BaseModel) -> list[Step]:
        assert isinstance(params, AgreementParams)
        n, max_tokens = params.size()
        return [Step("prompts", {"prompts": n, "max_tokens": max_tokens, "top_logprobs": params.top_logprobs,
                                 "endpoint": params.endpoint})]

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        params = ctx.params
        assert isinstance(params, AgreementParams)
        n, max_tokens = params.size()
        prompts = PROMPTS[:n]
        payloads = [_payload(ctx.model, text, max_tokens, params) for _, text in prompts]
        async with StreamingClient(ctx.api_base, api_key=ctx.api_key,
                                   timeout=min(params.request_timeout_s, ctx.request_timeout_s),
                                   max_connections=params.concurrency) as client:
            receipts = await client.run_all(payloads, params.concurrency)
        failed = [pid for (pid, _), r in zip(prompts, receipts) if r.error is not None]
        cells = [Cell("errors", len(failed), "requests", note=", ".join(failed))]
        if not is_opening_control(ctx):
            reference = load_reference(ctx, self.name)
            here = [Generation.from_receipt(r) for r in receipts]
            control = None if reference.problem else [Generation.from_stored(r) for r in reference.requests]
            cells += compare(control, here, [pid for pid, _ in prompts],
                             reference.problem or f"against the opening control, boot {reference.boot_id}",
                             params.top_logprobs)
        return StepResult(cells=cells, receipts=receipts)


def _payload(model: str, text: str, max_tokens: int, params: AgreementParams) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "seed": params.seed}
    if params.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        if params.top_logprobs:
            body.update(logprobs=True, top_logprobs=params.top_logprobs)
    else:
        body["prompt"] = text
        if params.top_logprobs:
            body["logprobs"] = params.top_logprobs
    return body


def _key(endpoint: str, payload: Mapping[str, Any]) -> str:
    prompt = payload.get("messages", payload.get("prompt"))
    return json.dumps([endpoint, prompt, payload.get("max_tokens")], sort_keys=True, ensure_ascii=False)


def _generation(key: str, text: str, error: str | None, logprobs: Sequence[tuple[str, float, Mapping[str, float]]]
                | None) -> Generation:
    if not logprobs:
        return Generation(key, text, None, None, error)
    tops = [{**top, token: logprob} if top else None for token, logprob, top in logprobs]
    return Generation(key, text, [token for token, _, _ in logprobs], tops, error)


def topk_kl(p_top: Mapping[str, float], q_top: Mapping[str, float]) -> float:
    """KL(P ‖ Q) in nats between two returned top-k logprob sets, as the module docstring defines."""
    support = sorted(p_top.keys() | q_top.keys())
    p_floor, q_floor = min(p_top.values()), min(q_top.values())
    lp = _log_normalise([p_top.get(t, p_floor) for t in support])
    lq = _log_normalise([q_top.get(t, q_floor) for t in support])
    # Rounding can leave a hair below zero for near-identical sets; KL itself never is.
    return max(0.0, sum(math.exp(a) * (a - b) for a, b in zip(lp, lq)))


def _log_normalise(logprobs: list[float]) -> list[float]:
    top = max(logprobs)
    log_total = top + math.log(sum(math.exp(x - top) for x in logprobs))
    return [x - log_total for x in logprobs]


def _argmax(top: Mapping[str, float]) -> str:
    return max(top, key=lambda t: top[t])


@dataclass
class _Pair:
    prompt: str
    request: int  # index into this boot's receipts
    divergence: int | None  # None: identical
    length: int  # tokens compared for "agreed": the full length when identical
    kls: list[float]
    top1: list[bool]
    consistent: bool


def _pair_tokens(prompt: str, request: int, ref: Generation, here: Generation) -> _Pair:
    a, b = ref.tokens or [], here.tokens or []
    shorter = min(len(a), len(b))
    divergence = next((i for i in range(shorter) if a[i] != b[i]), None)
    if divergence is None and len(a) != len(b):
        divergence = shorter
    end = shorter if divergence is None else min(divergence + 1, shorter)
    kls, top1 = [], []
    for i in range(end):
        p, q = (ref.tops or [])[i], (here.tops or [])[i]
        if p and q:
            kls.append(topk_kl(p, q))
            top1.append(_argmax(p) == _argmax(q))
    consistent = divergence is None
    if divergence is not None and divergence < shorter:
        p, q = (ref.tops or [])[divergence], (here.tops or [])[divergence]
        consistent = bool(p and q and a[divergence] in q and b[divergence] in p)
    return _Pair(prompt, request, divergence, len(a) if divergence is None else divergence, kls, top1, consistent)


def compare(control: list[Generation] | None, here: list[Generation], prompt_ids: list[str], against: str,
            top_logprobs: int) -> list[Cell]:
    """This boot's generations against the opening control's: the comparison cells. Everything is
    invalid, with `against` as the reason, when `control` is None."""
    names = ("exact_match_rate", "first_divergence_mean", "mean_kl", "max_kl", "top1_agreement_rate",
             "topk_consistent_rate", "unpaired_prompts")
    units = ("fraction", "tokens", "nats", "nats", "fraction", "fraction", "prompts")
    if control is None:
        return [Cell(n, None, u, valid=False, note=against, requests=[]) for n, u in zip(names, units)]
    reference = {g.key: g for g in control if g.error is None}
    paired = [(i, reference[g.key], g) for i, g in enumerate(here) if g.error is None and g.key in reference]
    unpaired = [prompt_ids[i] for i, g in enumerate(here) if g.error is not None or g.key not in reference]
    here_keys = {g.key for g in here}
    control_only = sum(g.key not in here_keys for g in control)
    unpaired_note = ", ".join(unpaired) + (f"; {control_only} prompt(s) only on the control" if control_only else "")
    cells = [Cell("unpaired_prompts", len(unpaired) + control_only, "prompts", note=unpaired_note, requests=[])]
    if not paired:
        why = f"{against}: no prompt answered on both sides"
        return cells + [Cell(n, None, u, valid=False, note=why, requests=[]) for n, u in zip(names[:-1], units)]
    requests = [i for i, _, _ in paired]
    if not all(ref.tokens and g.tokens for _, ref, g in paired):
        side = "this boot" if any(not g.tokens for _, _, g in paired) else "the opening control"
        why = (f"no logprobs from {side}" if top_logprobs else "logprobs not requested (top_logprobs: 0)")
        same = sum(ref.text == g.text for _, ref, g in paired)
        return cells + [Cell("exact_match_rate", same / len(paired), "fraction", requests=requests,
                             note=f"{against}: {same}/{len(paired)} identical texts; {why}, so text only")] + [
            Cell(n, None, u, valid=False, note=f"{why}: needs generated tokens", requests=[])
            for n, u in zip(names[1:-1], units[1:-1])]
    pairs = [_pair_tokens(prompt_ids[i], i, ref, g) for i, ref, g in paired]
    identical = sum(p.divergence is None for p in pairs)
    kls = [k for p in pairs for k in p.kls]
    top1 = [t for p in pairs for t in p.top1]
    head = f"{against}: {identical}/{len(pairs)} identical"
    cells += [
        Cell("exact_match_rate", identical / len(pairs), "fraction", note=head, requests=requests),
        Cell("first_divergence_mean", sum(p.length for p in pairs) / len(pairs), "tokens", requests=requests,
             note=f"{head}; identical outputs count as their full length"),
        Cell("topk_consistent_rate", sum(p.consistent for p in pairs) / len(pairs), "fraction", requests=requests,
             note=f"{head}; divergent prompts whose tokens at the divergence are in each other's top-k also count"),
    ]
    for p in pairs:
        state = "identical" if p.divergence is None else f"diverged at token {p.divergence}"
        mean = f", mean KL {sum(p.kls) / len(p.kls):.3g} over {len(p.kls)} positions" if p.kls else ""
        cells.append(Cell("first_divergence", p.length, "tokens", params={"prompt": p.prompt},
                          note=state + mean, requests=[p.request]))
    if kls:
        note = f"{len(kls)} compared positions (up to and including each first divergence)"
        cells += [Cell("mean_kl", sum(kls) / len(kls), "nats", note=note, requests=requests),
                  Cell("max_kl", max(kls), "nats", note=note, requests=requests),
                  Cell("top1_agreement_rate", sum(top1) / len(top1), "fraction", note=note, requests=requests)]
    else:
        why = "no top logprobs returned at any compared position"
        cells += [Cell(n, None, u, valid=False, note=why, requests=[])
                  for n, u in (("mean_kl", "nats"), ("max_kl", "nats"), ("top1_agreement_rate", "fraction"))]
    return cells

"""Prompt text for the speed instruments: per-request salts, synthetic filler, and prompts grown
to an exact token count.

Salts go at the very start of a prompt (or of its system message): a prefix cache matches from
the first token, so a salt anywhere later would let one run's prompt share a cached prefix with
another's. Filler is generated from a seed, so a run can be reproduced from its salt.

Exact length. A prompt is rendered from the first k filler words plus a short tail, and `fit`
searches k through the engine's `/tokenize` until the prompt has exactly the target count; the
few tokens a last multi-token word leaves over are filled with single-token pad words. An engine
without `/tokenize` gets a length estimated from characters, marked as not exact.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from lab.instruments.engine_extras import EngineExtras

Messages = list[dict[str, str]]
Form = TypeVar("Form")

# The filler runs at about 5 characters a token in byte-level BPE vocabularies; used only as the
# estimate for an engine that cannot tokenize.
CHARS_PER_TOKEN = 5.0
# Words that are one token on their own in the common BPE vocabularies, tried in turn to close the
# last gap of one or two tokens.
PAD_WORDS = (" and", " the", " a", " of")
# Interpolation converges in a handful of probes; bisection bounds the worst case at 300K words.
MAX_PROBES = 40

_ADJECTIVES = ("quiet", "narrow", "ancient", "busy", "gentle", "hollow", "bright", "distant", "careful",
               "steady", "rusty", "modest", "patient", "sudden", "humble", "simple", "crowded", "faded",
               "polished", "wooden", "frozen", "sturdy", "sleepy", "curious", "plain", "heavy")
_NOUNS = ("engineer", "farmer", "bridge", "letter", "window", "market", "teacher", "river", "lantern",
          "library", "garden", "ladder", "kettle", "clerk", "harbour", "wagon", "meadow", "baker",
          "workshop", "tower", "fence", "ledger", "courier", "pantry", "chapel", "orchard")
_VERBS = ("repaired", "visited", "painted", "counted", "carried", "watched", "described", "cleaned",
          "measured", "opened", "followed", "sketched", "mentioned", "inspected", "borrowed", "moved")
_PLACES = ("village", "valley", "station", "square", "hillside", "warehouse", "coast", "town hall",
           "old mill", "north road", "courtyard", "school")
_TIMES = ("dawn", "noon", "the evening bell", "the first frost", "market day", "the long winter", "supper")
_ADVERBS = ("slowly", "twice", "again", "early", "quietly", "carefully", "at last", "without a word")
_TEMPLATES = (
    "The {adj} {noun} {verb} the {noun2} near the {place}.",
    "Before {time}, a {adj} {noun} {verb} every {noun2} in the {place}.",
    "Nobody in the {place} {verb} the {adj} {noun} {adv}.",
    "A {noun} from the {place} {verb} the {adj} {noun2} {adv}.",
    "By {time} the {noun} had {verb} the {adj} {noun2}.",
)


def request_salt(boot_salt: str, *parts: object) -> str:
    """A salt for one request of one boot; the same boot salt and parts give the same salt."""
    return hashlib.sha256("/".join([boot_salt, *map(str, parts)]).encode()).hexdigest()[:12]


def salt_line(salt: str) -> str:
    return f"Session {salt}."


def chat_messages(salt: str, user: str) -> Messages:
    """A system message that starts with the salt, so not even the chat template's opening is shared
    with another request, then the user's turn."""
    return [{"role": "system", "content": f"{salt_line(salt)} You are a helpful AI assistant."},
            {"role": "user", "content": user}]


def filler_words(seed: str, n: int) -> list[str]:
    """`n` words of synthetic sentences; a word ending in "." ends its sentence."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < n:
        sentence = rng.choice(_TEMPLATES).format(
            adj=rng.choice(_ADJECTIVES), noun=rng.choice(_NOUNS), noun2=rng.choice(_NOUNS),
            verb=rng.choice(_VERBS), place=rng.choice(_PLACES), time=rng.choice(_TIMES),
            adv=rng.choice(_ADVERBS))
        words += sentence.split()
    return words[:n]


@dataclass(frozen=True)
class Fitted(Generic[Form]):
    form: Form  # what to send: a completion prompt, or chat messages
    tokens: int  # its length: the engine's count when `exact`, else an estimate
    exact: bool


class PromptTooShort(ValueError):
    """The target is below what the prompt holds without any filler."""


async def fit(target: int, render: Callable[[int, str], Form], count: Callable[[Form], Awaitable[int]],
              max_words: int) -> tuple[Form, int]:
    """The prompt `render(k, tail)` with exactly `target` tokens by `count`, or the longest one
    below it when no word count and pad reach it. `render(k, tail)` uses the first k filler
    words followed by `tail` (pad words)."""
    c0 = await count(render(0, ""))
    if c0 > target:
        raise PromptTooShort(f"the prompt holds {c0} tokens before any filler, more than {target}")
    lo, c_lo = 0, c0  # most words known to fit
    hi: int | None = None  # fewest words known to overshoot
    c_hi = 0
    probes = 0
    while c_lo < target and (hi is None or hi - lo > 1) and probes < MAX_PROBES:
        if hi is None:
            if lo == max_words:
                break
            per_word = (c_lo - c0) / lo if lo else 1.3
            k = min(max_words, lo + max(1, math.ceil((target - c_lo) / max(per_word, 0.5))))
        else:
            k = lo + round((target - c_lo) * (hi - lo) / (c_hi - c_lo))
            if probes % 3 == 2:  # interpolation can creep from one side; a bisection bounds it
                k = (lo + hi) // 2
            k = min(max(k, lo + 1), hi - 1)
        c = await count(render(k, ""))
        probes += 1
        if c <= target:
            lo, c_lo = k, c
        else:
            hi, c_hi = k, c
    best, best_count = render(lo, ""), c_lo
    gap = target - c_lo
    if gap > 0:
        for pad in PAD_WORDS:
            padded = render(lo, pad * gap)
            c = await count(padded)
            if c == target:
                return padded, c
    return best, best_count


def estimated_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


async def fit_prompt(extras: EngineExtras, target: int, render: Callable[[int, str], str],
                     max_words: int) -> Fitted[str]:
    """A completion prompt of `target` tokens as the engine counts them (with its BOS, if any)."""
    if await extras.tokenize(prompt=render(0, "")) is None:
        form, n = await fit(target, render, _estimate_text, max_words)
        return Fitted(form, n, exact=False)

    async def count(text: str) -> int:
        return len(await _tokens(extras, prompt=text))

    form, n = await fit(target, render, count, max_words)
    return Fitted(form, n, exact=True)


async def fit_messages(extras: EngineExtras, target: int, render: Callable[[int, str], Messages],
                       max_words: int, extra_tokens: int = 0) -> Fitted[Messages]:
    """Chat messages whose rendered prompt (template and generation prompt included), plus
    `extra_tokens` appended after it, has `target` tokens."""
    if await extras.tokenize(messages=render(0, "")) is None:
        form, n = await fit(target - extra_tokens, render, _estimate_messages, max_words)
        return Fitted(form, n + extra_tokens, exact=False)

    async def count(messages: Messages) -> int:
        return len(await _tokens(extras, messages=messages))

    form, n = await fit(target - extra_tokens, render, count, max_words)
    return Fitted(form, n + extra_tokens, exact=True)


async def _tokens(extras: EngineExtras, *, prompt: str | None = None,
                  messages: Messages | None = None) -> list[int]:
    tokens = await extras.tokenize(prompt=prompt, messages=messages)
    if tokens is None:
        raise RuntimeError("/tokenize stopped answering while a prompt was being sized")
    return tokens


async def _estimate_text(text: str) -> int:
    return estimated_tokens(text)


async def _estimate_messages(messages: Messages) -> int:
    return estimated_tokens("\n".join(m["content"] for m in messages))

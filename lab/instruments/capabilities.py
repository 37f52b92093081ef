"""The capability probe: what an engine does of what the instruments rely on, asked once per boot.

Run right after a boot answered its first completion, it finds out, each with a request of its
own:

- `answered`: a real request of the ladder's largest size (its instruments' longest request,
  prompt and output, or `hygiene.probe_prompt_tokens` where the ladder caps it: `capped_from`) was answered. Readiness means this, not a 1-token prompt: an engine that crashes on long prompts
  fails its boot here instead of storing a run of invalid cells. When it was not, `context` is the
  context the engine reports (`max_model_len`), or None.
- `streamed_usage`: a stream asked for `stream_options.include_usage` carried `usage`.
- `ignore_eos`: `honoured` (a greedy chat that stops early by itself ran to `max_tokens` with it),
  `ignored` (it stopped early anyway), `refused` (HTTP 400), `unknown` (the chat did not stop
  early without it, so there was nothing to tell), or `not asked` (no instrument of the ladder
  sends it: two generations a boot saved).
- `eos_ban`, where `ignore_eos` is `ignored` or `refused`: whether banning the end-of-sequence
  tokens with `logit_bias` (`{id: -100}`, OpenAI's field) carries the same greedy chat to
  `max_tokens`. The ids are the ladder's tokenizer's EOS ids (its metadata, `engine.tokenizer:`),
  and the special end texts (`<|im_end|>`, `<|endoftext|>`, `</s>`, …, local_tokenizer.END_TEXTS)
  that the tokenizer the probe uses makes one token each of. `{"ok": True, "ids": [...], "via": ...}`
  lets decode and prefill's tail send the ban (`eos_ban_bias`) and say so in their cells;
  `{"ok": False, "why": ...}` keeps today's behaviour: streams may end early, and are flagged.
- `chunk_count`, where a stream carries no `usage`: whether it streams one token per chunk: a
  greedy stream of CHUNK_CHECK_TOKENS tokens against the same request answered whole, its chunks
  against that answer's `usage.completion_tokens`. Where it does, a stream's completion tokens are
  its chunks (`token_count.py`): re-tokenizing streamed text undercounts where the tokenizer merges
  what the model generated as separate tokens.
- `overlap`, where an instrument of the ladder sends requests that overlap (decode above one
  stream, mixed): `kept` when a stream still gives as many tokens after a second request arrived
  as it gave alone (not max_tokens: llama.cpp's server ends it at EOS either way), `interrupted`
  when the second cut it short (llama-cpp-python's server does, unless started with
  `--interrupt_requests false`): such an engine serves one request at a time, and every figure
  of overlapping requests would be wrong, so those cells are stored invalid with the reason;
  `unknown` when the first stream ended before the second was sent.
- `logprobs`: a completion asked for `logprobs` returned them.
- `tokenizer`: the route that tokenizes a prompt (`/tokenize`, llama-cpp-python's
  `/extras/tokenize`), or None.
- `ladder_tokenizer`: where the engine has no such route and the ladder names a tokenizer
  (`engine.tokenizer:`), its name: prompts are then sized and tokens counted with it in the lab's
  process (lab/instruments/local_tokenizer.py), once it passed the check below.
- `token_count`: whether the instruments may count tokens with that tokenizer where a stream has
  no `usage`: the counts it gives for the large prompt and for the generated texts that ran to
  `max_tokens` are checked against the engine's own non-streamed `usage` of the same requests (a
  reply that ended on EOS is left out: engines differ in whether `usage` counts the EOS token; so
  is one forced past EOS: the special tokens it generated there have no text to count). The
  ladder's tokenizer is checked the same way, and on chat too (`chat`: its template's count of a
  short chat equals the engine's `usage.prompt_tokens`; without that, chats go uncounted). A
  tokenizer that counts otherwise is not used, and the instruments that needed it refuse, saying so.
- `metrics`, `stats`, `prefix_cache_reset`: `/metrics`, `/v1/stats` and `/reset_prefix_cache`
  answered 200.

`refusal` says, per instrument, why it cannot measure an engine with these capabilities.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx

from lab.instruments import local_tokenizer
from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.prompts import filler_words, fit_prompt, salt_line
from lab.instruments.receipt import Receipt

log = logging.getLogger("lab.capabilities")

# A chat an instruct model ends within a few tokens; `ignore_eos` must carry it to EOS_MAX_TOKENS.
EOS_QUESTION = "Reply with the single word: yes."
EOS_MAX_TOKENS = 32
# The stream whose chunks are checked against the same request's usage.
CHUNK_CHECK_TOKENS = 8
# The overlap check: a stream of OVERLAP_TOKENS, and a second request OVERLAP_DELAY_S after it.
OVERLAP_TOKENS = 64
OVERLAP_DELAY_S = 0.05
# The large prompt's reply: enough tokens to check a tokenizer's count of generated text.
LARGE_MAX_TOKENS = 8
# Instruments whose figures are token counts over time: they need `usage` or a checked tokenizer.
COUNTING = ("prefill", "decode", "mixed")
# Instruments that send prompts of an exact length: a tokenizer the ladder names must count as the engine does.
EXACT = ("prefill", "mixed")
# Instruments whose every figure rests on requests that overlap (decode's levels above one stream
# check it per level, lab/instruments/decode.py).
OVERLAPPING = ("mixed",)


@dataclass(frozen=True)
class Endpoint:
    """Where a booted engine answers; what `EngineExtras` needs of a boot."""

    base_url: str
    api_base: str
    model: str
    api_key: str | None
    capabilities: dict[str, Any] | None = None
    request_timeout_s: float = 600.0


async def probe(endpoint: Endpoint, largest_prompt: int, salt: str, ask_eos: bool = True,
                tokenizer: str | None = None, ask_overlap: bool = False) -> dict[str, Any]:
    """The capabilities of the engine at `endpoint` (module docstring), as a JSON-able dict.
    `largest_prompt` is the most tokens (prompt and output) one request of the ladder holds, at
    least LARGE_MAX_TOKENS + 32; `tokenizer` the one the ladder names (`engine.tokenizer`), used
    only where the engine has no tokenizer route. Never raises for what an engine lacks; `answered`
    False with `error` when the large request failed."""
    caps: dict[str, Any] = {}
    async with EngineExtras(endpoint) as extras, StreamingClient(endpoint.base_url, endpoint.api_key,
                                                                  timeout=endpoint.request_timeout_s,
                                                                  max_connections=1) as client:
        caps["tokenizer"] = await extras.find_tokenizer()
        via = caps["tokenizer"]
        unreadable = None
        if via is None and tokenizer is not None:
            caps["ladder_tokenizer"] = tokenizer
            via = ladder_tokenizer_name(tokenizer)
            try:
                extras.use_local(local_tokenizer.load(tokenizer))
            except local_tokenizer.TokenizerLoadError as exc:
                unreadable = str(exc)
        caps["metrics"] = await _answers(extras.http, "GET", f"{endpoint.base_url}/metrics")
        caps["stats"] = await _answers(extras.http, "GET", f"{endpoint.base_url}/v1/stats")
        caps["prefix_cache_reset"] = await extras.reset_prefix_cache()
        # Its reply's tokens count too: the request as a whole is the ladder's largest.
        large, exact, prompt_text = await _large_prompt(extras, largest_prompt - LARGE_MAX_TOKENS, salt)
        answer = await client.request({"model": endpoint.model, "prompt": prompt_text, "max_tokens": LARGE_MAX_TOKENS,
                                       "temperature": 0, "logprobs": 1, "stream": False})
        caps["largest_prompt"] = {"tokens": large, "exact": exact}
        caps["answered"] = answer.ok
        if not answer.ok:
            caps["error"] = answer.error
            # What the runner needs to say which request of the ladder does not fit, when the engine says.
            caps["context"] = await extras.max_model_len()
            return caps
        caps["logprobs"] = bool(answer.logprobs)
        short = {"model": endpoint.model, "prompt": f"{salt_line(salt)} Hello", "max_tokens": CHUNK_CHECK_TOKENS,
                 "temperature": 0}
        stream = await client.request(short)
        caps["streamed_usage"] = stream.ok and stream.usage_present
        if stream.ok and not stream.usage_present:
            caps["chunk_count"] = _check_chunks(stream, await client.request({**short, "stream": False}))
        replies = [answer]
        caps["ignore_eos"] = "not asked"
        if ask_eos:
            messages = [{"role": "user", "content": EOS_QUESTION}]
            plain = await client.request({"model": endpoint.model, "messages": messages,
                                          "max_tokens": EOS_MAX_TOKENS, "temperature": 0, "stream": False})
            caps["ignore_eos"] = await _ignore_eos(client, endpoint.model, messages, plain)
            if caps["ignore_eos"] in ("ignored", "refused"):
                caps["eos_ban"] = await _eos_ban(extras, client, endpoint.model, messages, caps["ignore_eos"],
                                                 tokenizer, via)
            # Not the forced reply: the special tokens generated past EOS leave no text to count.
            replies.append(plain)
        if ask_overlap:
            caps["overlap"] = await overlap(endpoint, salt)
        if unreadable is not None:
            caps["token_count"] = {"ok": False, "why": unreadable}
        else:
            caps["token_count"] = await _check_counts(extras, via, prompt_text, answer, replies)
            if extras.local_name is not None and caps["token_count"]["ok"]:
                caps["token_count"]["chat"] = await _check_chat(extras, client, endpoint.model, salt)
    return caps


def ladder_tokenizer_name(tokenizer: str) -> str:
    """How cells and `lab ls` name the ladder's tokenizer."""
    return f"the ladder's tokenizer {tokenizer}"


async def _check_chat(extras: EngineExtras, client: StreamingClient, model: str, salt: str) -> bool:
    """Whether the ladder's tokenizer counts a chat prompt (its template included) as the engine does."""
    messages = [{"role": "system", "content": f"{salt_line(salt)} You are a helpful AI assistant."},
                {"role": "user", "content": "Hello"}]
    counted = await extras.tokenize(messages=messages)
    if counted is None:
        return False
    answer = await client.request({"model": model, "messages": messages, "max_tokens": 1, "temperature": 0,
                                   "stream": False})
    return answer.ok and answer.usage_present and answer.prompt_tokens == len(counted)


async def _answers(http: httpx.AsyncClient, method: str, url: str) -> bool:
    try:
        return (await http.request(method, url)).status_code == 200
    except httpx.HTTPError:
        return False


async def _large_prompt(extras: EngineExtras, tokens: int, salt: str) -> tuple[int, bool, str]:
    """A completion prompt of `tokens` tokens (exact where the engine tokenizes), its count and text."""
    words = filler_words(salt, tokens)
    fitted = await fit_prompt(extras, tokens, lambda k, tail: f"{salt_line(salt)} {' '.join(words[:k])}{tail}",
                              len(words))
    return fitted.tokens, fitted.exact, fitted.form


async def _ignore_eos(client: StreamingClient, model: str, messages: list[dict[str, str]], plain: Receipt) -> str:
    """What the engine does with `ignore_eos`, given its answer to the same chat without it."""
    if not plain.ok or plain.finish_reason != "stop" or plain.completion_tokens >= EOS_MAX_TOKENS:
        return "unknown"
    forced = await client.request({"model": model, "messages": messages, "max_tokens": EOS_MAX_TOKENS,
                                   "temperature": 0, "ignore_eos": True, "stream": False})
    if forced.status == 400:
        return "refused"
    if not forced.ok or not forced.usage_present:
        return "unknown"
    return "honoured" if forced.completion_tokens == EOS_MAX_TOKENS else "ignored"


async def _eos_ban(extras: EngineExtras, client: StreamingClient, model: str, messages: list[dict[str, str]],
                   ignore_eos: str, tokenizer: str | None, via: str | None) -> dict[str, Any]:
    """Whether banning the EOS ids with `logit_bias` carries the chat `_ignore_eos` asked to
    EOS_MAX_TOKENS: {"ok", "ids", "via"} or {"ok": False, "why"} (module docstring)."""
    ids: list[int] = []
    sources = []
    if tokenizer is not None:
        try:
            ids += local_tokenizer.load(tokenizer).eos_ids
            sources.append(ladder_tokenizer_name(tokenizer))
        except local_tokenizer.TokenizerLoadError:
            pass  # the token-count check says why; the route may still know the ids
    found = await extras.single_tokens(local_tokenizer.END_TEXTS)
    if found and via is not None and via not in sources:
        sources.append(via)
    ids = list(dict.fromkeys([*ids, *found]))
    if not ids:
        return {"ok": False, "why": "no EOS token ids known (no tokenizer route, no ladder tokenizer)"}
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": EOS_MAX_TOKENS, "temperature": 0,
                            "logit_bias": eos_bias(ids), "stream": False}
    if ignore_eos == "ignored":
        body["ignore_eos"] = True
    banned = await client.request(body)
    shown = {"ids": ids, "via": " and ".join(sources)}
    if banned.status == 400:
        return {"ok": False, **shown, "why": f"logit_bias refused: {banned.error}"}
    if not banned.ok or not banned.usage_present:
        return {"ok": False, **shown, "why": f"no answer with usage: {banned.error or 'usage missing'}"}
    if banned.completion_tokens != EOS_MAX_TOKENS:
        return {"ok": False, **shown,
                "why": f"the chat still ended after {banned.completion_tokens} of {EOS_MAX_TOKENS} tokens"}
    return {"ok": True, **shown}


def eos_bias(ids: list[int]) -> dict[str, int]:
    """The `logit_bias` that bans `ids` (JSON keys are strings)."""
    return {str(i): -100 for i in ids}


def eos_ban_bias(caps: dict[str, Any] | None) -> dict[str, int] | None:
    """The `logit_bias` a request that should run to `max_tokens` adds: where the probe found that
    the engine does not honour `ignore_eos` and that banning the EOS ids works; else None."""
    ban = (caps or {}).get("eos_ban") or {}
    return eos_bias(ban["ids"]) if ban.get("ok") else None


def eos_ban_note(caps: dict[str, Any] | None) -> str:
    """The note of a cell whose streams carried the EOS ban, or ''."""
    if eos_ban_bias(caps) is None:
        return ""
    assert caps is not None
    verb = "refuses" if caps.get("ignore_eos") == "refused" else "ignores"
    return f"EOS banned by logit_bias (the engine {verb} ignore_eos)"


async def _check_counts(extras: EngineExtras, tokenizer: str | None, prompt: str, large: Receipt,
                        replies: list[Receipt]) -> dict[str, Any]:
    """Whether the tokenizer's counts (`tokenizer` names it) match the engine's `usage` on requests
    it answered whole."""
    if tokenizer is None:
        return {"ok": False, "why": "the engine has no tokenizer endpoint"}
    checks = []
    counted = await extras.tokenize(prompt=prompt)
    if large.usage_present and counted is not None:
        checks.append(("prompt", len(counted), large.prompt_tokens))
    for n, receipt in enumerate(replies):
        if receipt.ok and receipt.usage_present and receipt.finish_reason == "length":
            checks.append((f"reply {n + 1}", await extras.count_generated(receipt.text), receipt.completion_tokens))
    if not checks:
        return {"ok": False, "why": "no non-streamed usage to check the tokenizer against"}
    shown = ", ".join(f"{name} {mine} (usage {theirs})" for name, mine, theirs in checks)
    if all(mine == theirs for _, mine, theirs in checks):
        return {"ok": True, "via": tokenizer, "checked": shown}
    return {"ok": False, "why": f"{tokenizer} counts differ from the engine's usage: {shown}"}


def _check_chunks(stream: Receipt, whole: Receipt) -> dict[str, Any]:
    """Whether the stream carried one token per chunk: as many chunks as the same greedy request's
    `usage.completion_tokens`, with the same text."""
    if not whole.ok or not whole.usage_present:
        return {"ok": False, "why": "no non-streamed usage to check the chunks against"}
    chunks = len(stream.token_times_ns)
    checked = f"{chunks} chunks, usage {whole.completion_tokens}"
    if chunks == whole.completion_tokens and stream.text == whole.text:
        return {"ok": True, "checked": checked}
    return {"ok": False, "why": f"not one token per chunk: {checked}" + ("" if stream.text == whole.text else
                                                                         ", and the texts differ")}


async def overlap(endpoint: Endpoint, salt: str) -> dict[str, Any]:
    """A stream alone, then the same stream with a second request sent while it runs: whether it
    still gives as many tokens. Against the stream alone, not max_tokens: an engine that ignores
    ignore_eos (llama.cpp's server) ends it at EOS either way."""
    first = {"model": endpoint.model, "prompt": f"{salt_line(salt)} Count slowly:", "max_tokens": OVERLAP_TOKENS,
             "temperature": 0, "ignore_eos": True}
    second = {**first, "prompt": f"{salt_line(salt)} And again:", "max_tokens": 4}
    async with StreamingClient(endpoint.base_url, endpoint.api_key, max_connections=2) as client:
        alone = await client.request(first)
        a, b = await client.run_all([first, second], 2, offsets_s=[0.0, OVERLAP_DELAY_S])
    if not (alone.ok and a.ok and b.ok):
        return {"found": "unknown", "why": f"a request failed: {alone.error or a.error or b.error}"}
    if b.t_sent_ns is not None and a.t_done_ns is not None and a.t_done_ns <= b.t_sent_ns:
        return {"found": "unknown", "why": "the first stream ended before the second was sent"}
    tokens, expected = (r.completion_tokens if r.usage_present else len(r.token_times_ns) for r in (a, alone))
    if tokens >= expected and a.finish_reason == alone.finish_reason:
        return {"found": "kept"}
    return {"found": "interrupted", "why": f"a second request cut the first stream short ({tokens} tokens, "
                                            f"finish_reason {a.finish_reason!r}; alone it gave {expected}, "
                                            f"finish_reason {alone.finish_reason!r})"}


def interrupts(caps: dict[str, Any] | None) -> str | None:
    """Why the engine cannot serve overlapping requests (it interrupts the one in progress), or None."""
    found = (caps or {}).get("overlap") or {}
    if found.get("found") != "interrupted":
        return None
    return (f"the engine interrupts a request in progress when another arrives: {found['why']} (it serves one "
            "request at a time; llama-cpp-python's server: start it with --interrupt_requests false)")


def chunks_are_tokens(caps: dict[str, Any] | None) -> bool:
    """Whether a stream's completion tokens may be counted as its chunks (checked at the probe)."""
    return bool(caps and (caps.get("chunk_count") or {}).get("ok"))


def count_note(caps: dict[str, Any] | None) -> str:
    """The note of a cell whose token counts came from the tokenizer (or the stream's chunks), or ''."""
    if caps is None or caps.get("streamed_usage", True):
        return ""
    via = caps["token_count"]["via"]
    if chunks_are_tokens(caps):
        return f"prompt tokens counted by {via}, completion tokens as stream chunks (one token each, checked)"
    return f"tokens counted by {via}"


def refusal(instrument: str, caps: dict[str, Any] | None) -> str | None:
    """Why `instrument` cannot measure an engine with these capabilities, or None."""
    if caps is None:
        return None
    count = caps.get("token_count") or {}
    if instrument in COUNTING and not caps.get("streamed_usage", True):
        if not count.get("ok"):
            return f"the engine streams no usage and its tokens cannot be counted: {count.get('why', 'not probed')}"
    if instrument in OVERLAPPING and interrupts(caps):
        return interrupts(caps)
    if instrument in EXACT and caps.get("ladder_tokenizer") and not count.get("ok"):
        return f"prompts of an exact length need the ladder's tokenizer, which cannot be used: {count.get('why')}"
    return None


def summary(caps: dict[str, Any] | None) -> str:
    """One line for `lab ls` and the report, e.g.
    `1537-token prompt ✓ · usage ✗ (counted by /extras/tokenize) · ignore_eos ignored, EOS banned by
    logit_bias ✓ · logprobs ✓ · …`."""
    if not caps:
        return ""
    large = caps.get("largest_prompt") or {}
    size = f"{large.get('tokens', '?')}{'' if large.get('exact', True) else '≈'}-token prompt"
    if large.get("capped_from"):
        size += f" (capped; the ladder's largest is {large['capped_from']})"
    if not caps.get("answered"):
        return f"{size} ✗ ({caps.get('error', 'no answer')})"

    def mark(key: str) -> str:
        return "✓" if caps.get(key) else "✗"

    usage = f"usage {mark('streamed_usage')}"
    if not caps.get("streamed_usage"):
        count = caps.get("token_count") or {}
        usage += f" (counted by {count['via']})" if count.get("ok") else " (uncountable)"
        if caps.get("chunk_count"):
            usage += " · one token per chunk " + ("✓" if chunks_are_tokens(caps) else "✗")
    tok = caps.get("tokenizer") or "✗"
    if not caps.get("tokenizer") and caps.get("ladder_tokenizer"):
        checked = caps.get("token_count") or {}
        tok = f"✗, the ladder's {caps['ladder_tokenizer']} " + (
            "✓" if checked.get("ok") else f"✗ ({checked.get('why', 'not checked')})")
    eos = f"ignore_eos {caps.get('ignore_eos', '?')}"
    ban = caps.get("eos_ban")
    if ban:
        eos += ", EOS banned by logit_bias ✓" if ban.get("ok") else f", EOS ban by logit_bias ✗ ({ban.get('why')})"
    parts = [f"{size} ✓", usage, eos]
    if caps.get("overlap"):
        parts.append(f"overlapping requests {caps['overlap']['found']}")
    return " · ".join([*parts, f"logprobs {mark('logprobs')}",
                       f"tokenizer {tok}", f"metrics {mark('metrics')}",
                       f"stats {mark('stats')}", f"cache reset {mark('prefix_cache_reset')}"])


"""The optional endpoints an engine may offer beside the OpenAI API: `/tokenize` (or
llama-cpp-python's `/extras/tokenize`, which takes `input` and knows no chat template), its context
length, `/reset_prefix_cache`, `/metrics` and `/v1/stats` (whether it serves random weights).

Each one is optional. An engine that lacks one answers 404 (or 405, 501, or a 400 for a body it
does not understand) and the caller gets None and falls back. A refused or dropped connection is
not a missing endpoint but an engine that is gone, so it raises: the runner records the step as
an error.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Protocol

import httpx

from lab.instruments import local_tokenizer
from lab.instruments.local_tokenizer import LocalTokenizer

# How the bundled engine names the source of random weights in `/v1/stats` ("dummy:llama3-8b").
RANDOM_WEIGHTS_SOURCE = "dummy:"
# Tokenizer routes in the order they are tried: vLLM's, SGLang's and the bundled engine's, then
# llama-cpp-python's.
TOKENIZER_ROUTES = ("/tokenize", "/extras/tokenize")


class Boot(Protocol):
    """What the extras need of a boot: a BootContext, or the capability probe's Endpoint."""

    base_url: str
    api_base: str
    model: str
    api_key: str | None
    capabilities: dict[str, Any] | None
    request_timeout_s: float  # how long to wait for the next bytes of an answer


class EngineExtras:
    """One boot's optional endpoints. Use as `async with EngineExtras(ctx) as extras:`."""

    def __init__(self, ctx: Boot, timeout: float | None = None) -> None:
        self._ctx = ctx
        headers = {"Authorization": f"Bearer {ctx.api_key}"} if ctx.api_key else {}
        self._http = httpx.AsyncClient(timeout=timeout or ctx.request_timeout_s, headers=headers, trust_env=False)
        self._max_model_len: int | None = None
        self._max_model_len_asked = False
        # The probe's finding; without one (an instrument run outside `lab run`), `/tokenize`.
        caps = ctx.capabilities
        self._route: str | None = caps.get("tokenizer") if caps else TOKENIZER_ROUTES[0]
        self._empty_tokens: int | None = None
        # The ladder's own tokenizer, where the engine has no route and the probe found it counts
        # as the engine does (capabilities.py); its chat counts only where those were checked too.
        self._local: LocalTokenizer | None = None
        self._local_chat = False
        if caps and self._route is None and caps.get("ladder_tokenizer") and (caps.get("token_count") or {}).get("ok"):
            self.use_local(local_tokenizer.load(caps["ladder_tokenizer"]),
                           chat=bool(caps["token_count"].get("chat")))

    def use_local(self, tokenizer: LocalTokenizer, chat: bool = True) -> None:
        """Tokenize with the ladder's tokenizer in this process instead of over HTTP; chat
        messages too unless `chat` is False."""
        self._local, self._local_chat, self._route = tokenizer, chat, None

    @property
    def local_name(self) -> str | None:
        """The ladder's tokenizer when prompts are sized with it, else None."""
        return self._local.name if self._local is not None else None

    @property
    def http(self) -> httpx.AsyncClient:
        return self._http

    async def find_tokenizer(self) -> str | None:
        """The first route of TOKENIZER_ROUTES that tokenizes a prompt; it is used from now on."""
        for route in TOKENIZER_ROUTES:
            self._route = route
            if await self.tokenize(prompt="Hello world") is not None:
                return route
        self._route = None
        return None

    async def count_generated(self, text: str) -> int:
        """How many tokens the engine's tokenizer makes of generated text: the text's count less
        what it adds to any input (a BOS). Call only where a tokenizer route answered."""
        if self._empty_tokens is None:
            self._empty_tokens = len(await self._must_tokenize(""))
        return len(await self._must_tokenize(text)) - self._empty_tokens

    async def single_tokens(self, texts: tuple[str, ...]) -> list[int]:
        """The ids of those `texts` the tokenizer makes one token of (besides what it adds to any
        input, a BOS): special tokens such as `<|im_end|>`, where it reads them in a prompt (vLLM's
        and llama-cpp-python's routes and the bundled engine's do). Empty without a tokenizer."""
        empty = await self.tokenize(prompt="")
        if empty is None:
            return []
        found = []
        for text in texts:
            ids = await self.tokenize(prompt=text)
            if ids is not None and len(ids) == len(empty) + 1 and ids[:len(empty)] == empty:
                found.append(ids[-1])
        return list(dict.fromkeys(found))

    async def _must_tokenize(self, text: str) -> list[int]:
        tokens = await self.tokenize(prompt=text)
        if tokens is None:
            raise RuntimeError(f"{self._route or self.local_name} stopped answering while tokens were counted")
        return tokens

    async def __aenter__(self) -> EngineExtras:
        await self._http.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._http.__aexit__(exc_type, exc, tb)

    async def tokenize(self, *, prompt: str | None = None,
                       messages: list[dict[str, str]] | None = None) -> list[int] | None:
        """The token ids the engine makes of a completion prompt, or of chat messages rendered
        through its template with the generation prompt; None when it cannot say."""
        if self._local is not None:
            if messages is None:
                return self._local.encode(prompt or "")
            return self._local.encode_messages(messages) if self._local_chat else None
        body: dict[str, Any] = {"model": self._ctx.model}
        if self._route is None:
            return None
        if self._route == "/extras/tokenize":
            if messages is not None:
                return None  # it applies no chat template
            body["input"] = prompt
        elif messages is not None:
            body.update(messages=messages, add_generation_prompt=True)
        else:
            body["prompt"] = prompt
        answer = await self._json("POST", f"{self._ctx.base_url}{self._route}", body)
        if not isinstance(answer, dict) or not isinstance(answer.get("tokens"), list):
            return None
        if isinstance(answer.get("max_model_len"), int):
            self._max_model_len = answer["max_model_len"]
        return [int(t) for t in answer["tokens"]]

    async def max_model_len(self) -> int | None:
        """The longest prompt plus output the engine serves, from `/tokenize` or `/v1/models`."""
        if self._max_model_len is None and not self._max_model_len_asked:
            self._max_model_len_asked = True
            listing = await self._json("GET", f"{self._ctx.api_base}/models")
            models = listing.get("data") if isinstance(listing, dict) else None
            for model in models if isinstance(models, list) else []:
                if isinstance(model, dict) and model.get("id") == self._ctx.model \
                        and isinstance(model.get("max_model_len"), int):
                    self._max_model_len = model["max_model_len"]
        return self._max_model_len

    async def reset_prefix_cache(self) -> bool:
        """Drop the engine's cached prefixes; False when it has no such endpoint."""
        response = await self._http.post(f"{self._ctx.base_url}/reset_prefix_cache")
        return response.status_code == 200

    async def metrics_text(self) -> str | None:
        """The Prometheus exposition at `/metrics`, or None."""
        response = await self._http.get(f"{self._ctx.base_url}/metrics")
        return response.text if response.status_code == 200 else None

    async def stats(self) -> dict[str, Any] | None:
        """The bundled engine's `/v1/stats` (its config, KV pool, cache and tier counters), or None."""
        stats = await self._json("GET", f"{self._ctx.base_url}/v1/stats")
        return stats if isinstance(stats, dict) else None

    async def random_weights(self) -> bool | None:
        """Whether the engine serves random weights (the bundled engine's `dummy:<preset>` models), as
        `/v1/stats` says through `random_weights` or a `dummy:` source; None when it cannot say."""
        stats = await self.stats()
        if stats is None:
            return None
        if isinstance(stats.get("random_weights"), bool):
            return stats["random_weights"]
        source = stats.get("source")
        return source.startswith(RANDOM_WEIGHTS_SOURCE) if isinstance(source, str) else None

    async def _json(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        response = await self._http.request(method, url, json=body)
        if response.status_code != 200:
            return None
        try:
            return response.json()
        except ValueError:
            return None

"""`response_format` JSON modes by grammar-constrained decoding, with llguidance.

Why llguidance: it installs from PyPI as one abi3 wheel with no dependencies (no torch pin, no
compiler, no Triton), builds a matcher for a JSON schema in under a millisecond and computes a
49K-token mask in microseconds, handles full JSON (nesting is a grammar, not a bounded regex),
and is maintained by the guidance project and used by vLLM and llama.cpp. xgrammar pulls torch
and Triton into the resolve; outlines-core compiles schemas to a regex index, which is slow to
build per schema and bounds nesting.

Each request gets its own matcher, fed the request's output tokens as a logits processor (see
`SamplingParams.logits_processors`), so preemption and n > 1 need nothing special."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import llguidance
import torch

from lab.engine.core.sampling_params import BadRequestError
from lab.engine.weights.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Compact output, as OpenAI's JSON mode gives: flexible whitespace lets a small model spend its
# tokens on newlines and indentation.
JSON_OPTIONS = {"whitespace_flexible": False}
_BITS = torch.arange(32, dtype=torch.int32)


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads from a tokenizer: every id's bytes, EOS, BOS,
    the special ids, and a way to encode text."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = tokenizer.token_bytes(range(vocab_size))
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarProcessor:
    """A logits processor that allows only the tokens that keep the output inside the grammar,
    and only EOS once the grammar is complete."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.consumed = 0

    def __call__(self, output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        for token in output_ids[self.consumed:]:
            self.matcher.consume_token(token)
        self.consumed = len(output_ids)
        if self.matcher.is_error():
            log.warning("grammar matcher error: %s", self.matcher.get_error())
            return row
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        allowed = ((words.view(-1, 1) >> _BITS) & 1).view(-1)[: self.vocab_size].bool()
        return row.masked_fill(~allowed.to(row.device), float("-inf"))


class StructuredOutput:
    """Turns a request's `response_format` into per-request grammar processors. The llguidance
    tokenizer (every token's bytes, about 0.4 s for 49K tokens) is built on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                view = _TokenizerView(self.tokenizer, self.vocab_size)
                self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=self.vocab_size,
                                                  eos_token=list(self.tokenizer.eos_token_ids))
            return self._ll

    @staticmethod
    def grammar(response_format: dict[str, Any]) -> str | None:
        """The grammar of a `response_format` (None for plain text); a 400 naming the field for
        anything this engine cannot constrain to."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema: Any = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise BadRequestError("response_format.json_schema must be an object with a name and a schema",
                                      param="response_format")
            schema = spec.get("schema", {})
            if not isinstance(schema, dict):
                raise BadRequestError("response_format.json_schema.schema must be a JSON Schema object",
                                      param="response_format")
        else:
            raise BadRequestError(f"response_format.type {kind!r} is not supported "
                                  "(use 'text', 'json_object' or 'json_schema')", param="response_format")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise BadRequestError(f"response_format.json_schema.schema is not usable: {exc}",
                                  param="response_format") from exc
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            raise BadRequestError(f"response_format.json_schema.schema is not usable: {'; '.join(messages)}",
                                  param="response_format")
        return grammar

    def processor(self, grammar: str) -> GrammarProcessor:
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise BadRequestError(f"response_format cannot be compiled: {matcher.get_error()}",
                                  param="response_format")
        return GrammarProcessor(matcher, self.vocab_size)

"""Per-request sampling parameters and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch


class BadRequestError(ValueError):
    """A request the engine refuses; the message is one line naming the limit, `param` the
    request field at fault when there is one (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# A per-request logits processor: (output token ids so far, one row of logits) -> the row to sample
# from. Stateful processors (a grammar matcher) belong to one request and are never shared.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the best one's
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop ids are masked (and stop strings not matched) before this many
    repetition_penalty: float = 1.0  # vLLM's: over prompt and output, divides positive logits
    frequency_penalty: float = 0.0  # OpenAI's: over output tokens, times each one's count
    presence_penalty: float = 0.0  # OpenAI's: over output tokens, once per distinct token
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    logprobs: int | None = None  # None: no logprobs; n >= 0: the chosen token's plus n alternatives
    prompt_logprobs: int | None = None  # same, for every prompt position (OpenAI `echo`)
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # offline benchmarks turn it off to time the engine alone

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @cached_property
    def needs_processing(self) -> bool:
        """Whether the logits must be changed before sampling: requests that set none of these
        take the plain path, with no per-row work and no host-side token history. Cached: the
        engine asks for every sequence on every step, and params do not change once submitted."""
        return bool(self.min_tokens or self.repetition_penalty != 1.0 or self.frequency_penalty
                    or self.presence_penalty or self.logit_bias or self.allowed_token_ids is not None
                    or self.logits_processors)

    def validate(self, max_logprobs: int, vocab_size: int) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise BadRequestError(f"max_tokens must be at least 1 (0 only with echo), got {self.max_tokens}",
                                  param="max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise BadRequestError(f"temperature must be in [0, 100], got {self.temperature}", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < -1:
            raise BadRequestError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}", param="top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise BadRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= max_logprobs:
                raise BadRequestError(f"{name} must be in [0, {max_logprobs}], got {value}", param=name)
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise BadRequestError(f"seed must fit in 64 bits, got {self.seed}", param="seed")
        self._validate_processing(vocab_size)
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequestError(f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}", param="stop_token_ids")
        if self.stop and not self.detokenize:
            raise BadRequestError("stop strings need detokenize=True", param="stop")
        if any(s == "" for s in self.stop):
            raise BadRequestError("stop strings must not be empty", param="stop")
        if len(self.stop) > 16:
            raise BadRequestError(f"at most 16 stop strings, got {len(self.stop)}", param="stop")

    def _validate_processing(self, vocab_size: int) -> None:
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise BadRequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
                                  param="min_tokens")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise BadRequestError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}",
                                  param="repetition_penalty")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise BadRequestError(f"{name} must be in [-2, 2], got {value}", param=name)
        for token, bias in self.logit_bias.items():
            if not 0 <= token < vocab_size:
                raise BadRequestError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
                                      param="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise BadRequestError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}",
                                      param="logit_bias")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise BadRequestError("allowed_token_ids must not be empty", param="allowed_token_ids")
            bad = next((t for t in self.allowed_token_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise BadRequestError(f"allowed_token_ids must be in [0, {vocab_size}), got {bad}",
                                      param="allowed_token_ids")

"""Per-request sampling parameters and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field


class BadRequestError(ValueError):
    """A request the engine refuses; the message is one line naming the limit."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: the chosen token's plus n alternatives
    prompt_logprobs: int | None = None  # same, for every prompt position (OpenAI `echo`)
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # offline benchmarks turn it off to time the engine alone


    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, max_logprobs: int, vocab_size: int) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise BadRequestError(f"max_tokens must be at least 1 (0 only with echo), got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise BadRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise BadRequestError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= max_logprobs:
                raise BadRequestError(f"{name} must be in [0, {max_logprobs}], got {value}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise BadRequestError(f"seed must fit in 64 bits, got {self.seed}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequestError(f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}")
        if self.stop and not self.detokenize:
            raise BadRequestError("stop strings need detokenize=True")
        if any(s == "" for s in self.stop):
            raise BadRequestError("stop strings must not be empty")
        if len(self.stop) > 16:
            raise BadRequestError(f"at most 16 stop strings, got {len(self.stop)}")

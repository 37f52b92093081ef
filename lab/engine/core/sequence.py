"""One request's state inside the engine: its tokens, its KV blocks and how far it has got."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from lab.engine.core.sampling_params import SamplingParams


PENDING = -1  # the placeholder of a token still being sampled on the device


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # alternatives, best first


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hash chain of the full blocks registered so far
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_preemptions: int = 0
    scheduled_time: float | None = None  # first admitted to a step (monotonic), for the queue time
    first_token_time: float | None = None
    admitted: bool = False
    # Tokens sampled by a step still running on the device: their places at the end of
    # `token_ids` hold PENDING until the step's results are read (see LLMEngine, overlapped decode).
    num_pending: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the scheduler plans with, pending ones included."""
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values are known on the host (pending ones excluded)."""
        return len(self.token_ids) - self.num_pending

    @property
    def last_known_token(self) -> int:
        return self.token_ids[self.num_known_tokens - 1]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_known_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_known_tokens - self.num_prompt_tokens

    def add_pending(self) -> None:
        self.token_ids.append(PENDING)
        self.num_pending += 1

    def resolve_pending(self, token: int) -> None:
        """The oldest pending token's value has arrived."""
        self.token_ids[self.num_known_tokens] = token
        self.num_pending -= 1

    def drop_pending(self) -> None:
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0

    @property
    def num_remaining(self) -> int:
        """Tokens whose K/V still have to be computed before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while (re)computing the prompt or, after a preemption, prompt plus outputs."""
        return self.num_remaining > 1 or self.num_computed_tokens == 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

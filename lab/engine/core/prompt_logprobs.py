"""Prompt logprobs (`echo` with logprobs, vLLM's `prompt_logprobs`): the logprob of each prompt
token given the tokens before it, computed chunk by chunk as the prompt is prefilled.

A chunk of `n` tokens starting at position `start` has a logits row per token; row j predicts the
token at `start + j + 1`. The first prompt token has no logprob (None). After a preemption the
prompt is prefilled again, so a chunk may cover positions already kept: the first copy wins."""

from __future__ import annotations

import torch

from lab.engine.core import sampler
from lab.engine.core.sequence import Sequence, TokenLogprob


def of_chunk(seq: Sequence, start: int, n: int, logits: torch.Tensor) -> list[TokenLogprob | None]:
    """The logprobs a chunk's logits rows give, for the prompt positions they predict: positions
    `start`.. when `start` is 0 (with None for position 0), `start + 1`.. otherwise."""
    out: list[TokenLogprob | None] = [None] if start == 0 else []
    last = min(start + n, seq.num_prompt_tokens - 1)
    if last > start:
        targets = torch.tensor(seq.token_ids[start + 1:last + 1], device=logits.device)
        out.extend(sampler.logprobs_of(logits[: last - start], targets,
                                       [seq.params.prompt_logprobs] * (last - start)))
    return out


def keep(seq: Sequence, start: int, chunk: list[TokenLogprob | None]) -> None:
    """Append to `seq.prompt_logprobs` the positions of `chunk` (from `of_chunk` at `start`) that
    it does not hold yet."""
    have = len(seq.prompt_logprobs)
    first_pos = 0 if start == 0 else start + 1
    seq.prompt_logprobs.extend(chunk[max(0, have - first_pos):])

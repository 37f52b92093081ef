"""Verify one sequence's draft against the target model's logits so that the tokens emitted are
distributed exactly as plain decoding's.

The verify step scores the last known token and the k drafts together: row i holds the target's
logits for the position of draft i (row k for the token after the last draft). Greedy requests
keep drafts while they equal the argmax and then take the argmax, so their output is plain
decoding's token for token. Sampled requests use speculative sampling's rule for a deterministic
draft (the draft puts all its mass on x): keep x with probability p(x); on a rejection, draw from
p with x removed and renormalised, which is max(0, p - q) normalised for that draft. Either way,
one token past the last kept draft is always emitted, so a step yields 1 to k + 1 tokens."""

from __future__ import annotations

from typing import Sequence as Seq

import torch

from lab.engine.core import sampler
from lab.engine.core.sampling_params import SamplingParams


def _mask_min_tokens(rows: torch.Tensor, params: SamplingParams, num_output: int, eos_ids: Seq[int]) -> torch.Tensor:
    """Mask EOS and stop ids in the rows whose position comes before min_tokens, as the plain
    sampler does token by token (row i samples output token num_output + i)."""
    early = params.min_tokens - num_output
    banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))
    if early <= 0 or not banned:
        return rows
    rows = rows.clone()
    rows[:early, torch.tensor(banned, device=rows.device)] = float("-inf")
    return rows


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams, generator: torch.Generator | None,
           num_output: int, eos_ids: Seq[int] = ()) -> list[int]:
    """The tokens a verify step emits for one sequence: the kept prefix of `draft`, then one token
    from the target. `logits` is [len(draft) + 1, V] float32; `num_output` the sequence's output
    tokens before this step (for min_tokens)."""
    k = len(draft)
    rows = _mask_min_tokens(logits, params, num_output, eos_ids)
    if params.greedy:
        target = rows.argmax(dim=-1).tolist()
        kept = 0
        while kept < k and draft[kept] == target[kept]:
            kept += 1
        return draft[:kept] + [target[kept]]
    probs = torch.stack([sampler.target_probs(row, params) for row in rows])
    draft_t = torch.tensor(draft, dtype=torch.long, device=probs.device)
    p_draft = probs[torch.arange(k, device=probs.device), draft_t].cpu()
    gen_device = generator.device if generator is not None else torch.device("cpu")
    uniform = torch.rand(k, generator=generator, device=gen_device).cpu()
    rejected = (uniform >= p_draft).nonzero()
    kept = int(rejected[0]) if len(rejected) else k
    if kept == k:
        return draft + [int(sampler.draw(probs[k], generator))]
    residual = probs[kept].clone()
    residual[draft[kept]] = 0.0
    return draft[:kept] + [int(sampler.draw(residual, generator))]

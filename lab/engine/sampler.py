"""Turn a step's logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds,
and logprobs of the model's own (unscaled) distribution with top-k alternatives."""

from __future__ import annotations

import torch

from lab.engine.sampling_params import SamplingParams
from lab.engine.sequence import TokenLogprob


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus of one row."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep a token if the mass before it is below top_p (so the first token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One next token per row of `logits` ([N, V] float32). Greedy rows never draw randomness,
    so a request's output does not depend on what else is in the batch."""
    tokens = logits.argmax(dim=-1)
    if all(p.greedy for p in params):  # decided on the host: no device sync
        return tokens
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        # Per-row generator: a seeded request gets the same tokens whatever its batch.
        gen = generators[i]
        if gen is not None and gen.device != probs.device:
            draw = torch.multinomial(probs.cpu(), 1, generator=gen).to(probs.device)
        else:
            draw = torch.multinomial(probs, 1, generator=gen)
        tokens[i] = draw[0]
    return tokens


def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, top_n: list[int]) -> list[TokenLogprob]:
    """Logprob of each chosen token and its `top_n[i]` best alternatives, from the raw logits."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen_lp = logp.gather(1, chosen.view(-1, 1)).squeeze(1).tolist()
    k = max(top_n, default=0)
    top_vals, top_ids = (logp.topk(k, dim=-1) if k else (None, None))
    top_vals_l = top_vals.tolist() if k else None
    top_ids_l = top_ids.tolist() if k else None
    out = []
    for i, token in enumerate(chosen.tolist()):
        top = list(zip(top_ids_l[i][: top_n[i]], top_vals_l[i][: top_n[i]])) if k else []
        out.append(TokenLogprob(token, chosen_lp[i], top))
    return out

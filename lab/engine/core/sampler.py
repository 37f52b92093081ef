"""Turn a step's logits into next tokens: logits processing (penalties, bias, allowed ids,
min_tokens, grammars) for the requests that ask for it, then greedy, temperature, top-k, top-p,
min-p and per-request seeds; logprobs of the model's own (unprocessed, unscaled) distribution
with top-k alternatives, as vLLM reports them by default.

A step's sampled rows are drawn together: one temperature and softmax for all the rows without
a top-k, top-p or min-p filter, one noise call for all the unseeded rows, one draw and one
write-back. What stays per row: a filtered row's distribution, and a seeded row's noise, made from
its own generator so that its tokens do not depend on the rest of the batch."""

from __future__ import annotations

import logging
from typing import Sequence as Seq

import torch

from lab.engine.core.sampling_params import SamplingParams
from lab.engine.core.sequence import Sequence, TokenLogprob
from lab.engine.model.host_copy import to_device

log = logging.getLogger(__name__)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k, the top-p nucleus and the min-p floor of one row."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep a token if the mass before it is below top_p (so the first token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def _process_row(row: torch.Tensor, seq: Sequence, eos_ids: Seq[int]) -> torch.Tensor:
    """One request's logits row after its penalties, bias, allowed ids, min_tokens and processors."""
    p = seq.params
    out_ids = seq.output_token_ids
    device = row.device
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), device=device, dtype=row.dtype)
    if p.allowed_token_ids is not None:
        keep = torch.full_like(row, float("-inf"))
        ids = torch.tensor(p.allowed_token_ids, device=device)
        keep[ids] = row[ids]
        row = keep
    if len(out_ids) < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
        if banned:
            row[torch.tensor(banned, device=device)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(seq.prompt_token_ids + out_ids, device=device).unique()
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and out_ids:
        counts = torch.bincount(torch.tensor(out_ids, device=device), minlength=row.shape[-1])[: row.shape[-1]]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    for processor in p.logits_processors:
        row = processor(out_ids, row)
    return row


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_ids: Seq[int]) -> torch.Tensor:
    """`logits` with each processed request's row replaced; the input is left as it was (its
    rows give the logprobs). Rows of requests that set nothing are not touched."""
    out = logits.clone()
    for i, seq in enumerate(seqs):
        if not seq.params.needs_processing:
            continue
        try:
            row = _process_row(out[i], seq, eos_ids)
        except Exception:  # noqa: BLE001 - one request's processor must not stop the shared engine loop
            log.exception("request %s: logits processing failed; sampling unconstrained", seq.request_id)
            row = logits[i]
        if torch.isneginf(row).all():
            # Everything masked (a grammar in an error state): sampling would fail on an empty
            # distribution, so this row falls back to the model's own and the log says why.
            log.warning("request %s: logits processing masked every token; sampling unconstrained", seq.request_id)
            row = logits[i]
        out[i] = row
    return out


def _filtered(p: SamplingParams, vocab: int) -> bool:
    """Whether top-k, min-p or top-p cut a sampled row's distribution (a top-k of the whole
    vocabulary cuts nothing, so such a row can take the batched path)."""
    return 0 < p.top_k < vocab or p.min_p > 0.0 or p.top_p < 1.0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           seqs: list[Sequence] | None = None, eos_ids: Seq[int] = ()) -> torch.Tensor:
    """One next token per row of `logits` ([N, V] float32). Greedy rows never draw randomness,
    and a seeded row draws only from its own generator, so neither's output depends on what else
    is in the batch. `seqs` (the rows' sequences) are needed only when a request asks for logits
    processing. Which rows are greedy, seeded or filtered is read from the params on the host:
    nothing here waits for the device."""
    if seqs is not None and any(p.needs_processing for p in params):
        logits = process_logits(logits, seqs, eos_ids)
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    n, vocab = logits.shape
    device = logits.device
    # Sampled rows ordered filtered-unseeded, unfiltered-unseeded, unfiltered-seeded,
    # filtered-seeded: the unfiltered rows are then one slice (one temperature and softmax) and so
    # are the unseeded ones (one noise call). The sort is stable: batch order within a group.
    rank = {(True, False): 0, (False, False): 1, (False, True): 2, (True, True): 3}
    kind = {i: (_filtered(p, vocab), generators[i] is not None) for i, p in enumerate(params) if not p.greedy}
    order = sorted(kind, key=lambda i: rank[kind[i]])
    groups = [rank[kind[i]] for i in order]
    lo = groups.count(0)  # order[lo:hi] are unfiltered, order[:unseeded] unseeded
    unseeded = lo + groups.count(1)
    hi = unseeded + groups.count(2)
    idx = to_device(order, torch.long, device)
    parts = [target_probs(logits[i], params[i]).unsqueeze(0) for i in order[:lo]]
    if hi > lo:
        # In place here and in the draw below: both tensors are fresh, and on the CPU each new
        # [n, V] buffer is memory mapped anew, its page faults about 13 % of a 32 x 128k call.
        temps = to_device([params[i].temperature for i in order[lo:hi]], torch.float32, device)
        parts.append(logits.index_select(0, idx[lo:hi]).div_(temps[:, None]).softmax(-1))
    parts += [target_probs(logits[i], params[i]).unsqueeze(0) for i in order[hi:]]
    probs = parts[0] if len(parts) == 1 else torch.cat(parts)
    # Each seeded row fills its own row of the noise, which gives the values `draw` would from the
    # same generator state; the unseeded rows share the device's default generator.
    noise = torch.empty(probs.shape, dtype=torch.float32, device=device)
    if unseeded:
        noise[:unseeded].exponential_()
    for j in range(unseeded, len(order)):
        noise[j].exponential_(generator=generators[order[j]])
    chosen = probs.div_(noise).argmax(-1)
    tokens = logits.argmax(dim=-1) if len(order) < n else torch.empty(n, dtype=torch.long, device=device)
    return tokens.index_copy_(0, idx, chosen)


def target_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled (non-greedy) request draws from: temperature, then the
    top-k, min-p and top-p filters, over one row of (processed) logits."""
    return _filter_top_k_top_p(row / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One token (a 0-d tensor) from a 1-D distribution that need not sum to one, drawn on the
    distribution's device: the argmax of p / E with E ~ Exp(1), the draw torch.multinomial makes for
    one sample. torch.multinomial first checks the distribution with a value read back from the
    device, so on a GPU every sampled row of every step waited for the device and ended the lead an
    overlapped decode step has; this draw only queues kernels."""
    # Per-row generator (on the engine's device): a seeded request gets the same tokens whatever its batch.
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=gen)
    return (probs / noise).argmax(-1)


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

"""Prompt lookup's step costs, measured when the engine loads (the cost model that uses them is
`spec/draft_costs.py`).

At each of a few batch sizes (the larger ones only while the probe has taken less than
`BUDGET_S`: on a slow CPU a boot measures batch 1 and perhaps 8, and the cost model holds the
largest measured size's figures beyond it), sequences with a context of random tokens are placed straight into
the running batch (no prefill: only decode is timed) and decoded through the engine's own step,
so the figures include the host's work (scheduling, outputs): first overlapped, where this engine
overlaps decode, then plain. A step that verifies drafts is a plain step plus the model runner's
extra work for them: the runner's time for a step in which every sequence verifies d draft tokens
less its time for the same step with none, for d = 1 and k, the three alternating so that a change
in the host's load moves them alike. Each figure is the fastest of a few steps after a warm-up
(which also compiles what the verify steps need, on CUDA): on a shared host, noise only adds.

Nothing of the probe stays behind: its sequences are aborted and their blocks freed, the counters
it moved are reset, and prefix caching is off while it runs, so none of its blocks is cached or
reaches a KV tier."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Hashable

import torch

from lab.engine.core.sampling_params import SamplingParams
from lab.engine.core.scheduler import ScheduledSeq
from lab.engine.core.sequence import Sequence, Status
from lab.engine.spec.draft_costs import DraftCosts, StepTimes

if TYPE_CHECKING:
    from lab.engine.core.llm_engine import LLMEngine

SIZES = (1, 8, 32)
CONTEXT = 256  # tokens of context per sequence, at most a quarter of the model's
WARM = 1
ROUNDS = (3, 15)  # timed rounds: at least 3, more (up to 15) while they took under TIMED_S per kind
TIMED_S = 0.5
BUDGET_S = 4.0


def _fastest_s(kinds: dict[Hashable, Callable[[], object]]) -> dict[Hashable, float]:
    """The fastest of a few timed runs of each kind, the kinds alternating, after a warm-up."""
    times: dict[Hashable, list[float]] = {kind: [] for kind in kinds}
    rounds = 0
    while rounds < WARM + ROUNDS[0] or (
            rounds < WARM + ROUNDS[1] and sum(map(sum, times.values())) < TIMED_S * len(kinds)):
        for kind, run in kinds.items():
            start = time.perf_counter()
            run()
            if rounds >= WARM:
                times[kind].append(time.perf_counter() - start)
        rounds += 1
    return {kind: min(t) for kind, t in times.items()}


def _place(engine: LLMEngine, batch: int, context: int) -> list[Sequence]:
    """`batch` decoding sequences whose K/V (never computed: its values do not change a step's
    time) covers all but the last of `context` random tokens."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=engine.max_model_len, temperature=0, ignore_eos=True)
    seqs = []
    for i in range(batch):
        tokens = torch.randint(min(100, vocab // 2), vocab, (context,), generator=gen).tolist()
        seq = Sequence(-1 - i, f"draft-probe-{i}", tokens, params)  # ids no request ever gets
        engine.blocks.allocate(seq, context)
        seq.num_computed_tokens = context - 1
        seq.status, seq.admitted = Status.RUNNING, True
        engine.scheduler.running.append(seq)
        engine.requests[seq.request_id] = seq
        seqs.append(seq)
    return seqs


def _runner_extra_s(engine: LLMEngine, seqs: list[Sequence], lengths: list[int]) -> dict[int, float]:
    """The model runner's extra time for a step in which every sequence verifies d draft tokens,
    for each d in `lengths`, over the same step without drafts."""
    for seq in seqs:
        engine.blocks.allocate(seq, 1 + lengths[-1])
    steps = {d: [ScheduledSeq(seq, 1 + d, seq.token_ids[-d:] if d else []) for seq in seqs] for d in [0, *lengths]}
    fastest = _fastest_s({d: (lambda scheduled=scheduled: engine.runner.execute(scheduled))
                          for d, scheduled in steps.items()})
    return {d: fastest[d] - fastest[0] for d in lengths}


def _measure_batch(engine: LLMEngine, batch: int, context: int, lengths: list[int]) -> StepTimes:
    seqs = _place(engine, batch, context)
    overlaps = engine.overlap
    overlapped = _fastest_s({0: engine.step})[0] if overlaps else 0.0
    engine.overlap = False
    plain = _fastest_s({0: engine.step})[0]  # its warm-up step collects the last overlapped one
    engine.overlap = overlaps
    verify = {d: plain + extra for d, extra in _runner_extra_s(engine, seqs, lengths).items()}
    for seq in seqs:
        engine.abort(seq.request_id)
    return StepTimes(batch, overlapped if overlaps else plain, plain, verify)


def measure(engine: LLMEngine) -> DraftCosts:
    """The step times of this engine, on this device, at the batch sizes its pool, token budget,
    sequence limit and `BUDGET_S` allow (always batch 1)."""
    config, block_size = engine.config, engine.config.block_size
    k = config.num_speculative_tokens
    context = min(CONTEXT, engine.max_model_len // 4)
    grown = 2 * (WARM + ROUNDS[1])  # most tokens each sequence gains from the engine's steps
    longest = max(1, min(k, engine.max_model_len - context - grown - 1))
    lengths = sorted({1, longest})
    blocks_each = -(-(context + grown + longest) // block_size)
    sizes = [b for b in SIZES if b == 1 or (b <= config.max_num_seqs and b * (1 + k) <= config.max_num_batched_tokens
                                            and b * blocks_each <= engine.blocks.num_free_blocks)]
    prefix_caching, preemptions = engine.blocks.enable_prefix_caching, engine.scheduler.num_preemptions
    engine.blocks.enable_prefix_caching = False
    started = time.perf_counter()
    measured = []
    for b in sizes:
        if measured and time.perf_counter() - started > BUDGET_S:
            break
        measured.append(_measure_batch(engine, b, context, lengths))
    engine.blocks.enable_prefix_caching = prefix_caching
    engine.scheduler.num_preemptions = preemptions
    engine.counters = type(engine.counters)()
    return DraftCosts(measured)

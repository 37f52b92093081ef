"""Scheduling rules on plain sequences (no model): budgets, chunk caps, parallel-prefill caps,
policies and preemption."""

from __future__ import annotations

from lab.engine.core.config import EngineConfig
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.core.scheduler import Scheduler
from lab.engine.core.sequence import Sequence
from lab.engine.kv.block_manager import BlockManager

BS = 16


def make(num_blocks: int = 256, **knobs) -> Scheduler:
    cfg = EngineConfig(block_size=BS, **knobs)
    return Scheduler(cfg, BlockManager(num_blocks, BS, cfg.enable_prefix_caching, cfg.prefix_cache_retention))


def seq(i: int, n: int) -> Sequence:
    return Sequence(i, f"r{i}", [1000 + i * 7 + j for j in range(n)], SamplingParams(max_tokens=64))


def advance(sched: Scheduler) -> list[tuple[int, int]]:
    """One step as the engine would run it, sampling token 5 wherever a token is due."""
    plan = sched.schedule()
    out = []
    for s in plan.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_tokens
        sched.blocks.register_full_blocks(s.seq)
        if samples:
            s.seq.token_ids.append(5)
        out.append((s.seq.seq_id, s.num_tokens))
    return out


def test_budget_and_chunking() -> None:
    sched = make(max_num_batched_tokens=100)
    sched.add(seq(0, 250))
    assert advance(sched) == [(0, 100)]
    assert advance(sched) == [(0, 100)]
    assert advance(sched) == [(0, 50)]
    assert advance(sched) == [(0, 1)]  # decoding now


def test_long_prefill_threshold_caps_one_request() -> None:
    sched = make(max_num_batched_tokens=100, long_prefill_token_threshold=30)
    sched.add(seq(0, 80))
    sched.add(seq(1, 80))
    assert advance(sched) == [(0, 30), (1, 30)]


def test_max_parallel_prefills() -> None:
    sched = make(max_num_batched_tokens=1000, max_parallel_prefills=1)
    for i in range(3):
        sched.add(seq(i, 20))
    assert advance(sched) == [(0, 20)]
    assert advance(sched) == [(0, 1), (1, 20)]  # decodes first in the batch, then one prefill


def test_decode_first_vs_prefill_first() -> None:
    for policy, expected in (("decode-first", [(0, 1), (1, 9)]), ("prefill-first", [(1, 10)])):
        sched = make(max_num_batched_tokens=10, schedule_policy=policy)
        sched.add(seq(0, 10))
        advance(sched)
        sched.add(seq(1, 40))
        assert advance(sched) == expected, policy


def test_max_num_seqs() -> None:
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(i, 5))
    assert [s for s, _ in advance(sched)] == [0, 1]
    assert len(sched.waiting) == 1


def test_preemption_recomputes_the_newest() -> None:
    sched = make(num_blocks=4, max_num_batched_tokens=1000)
    sched.add(seq(0, 30))  # 2 blocks
    sched.add(seq(1, 30))  # 2 blocks: pool full
    advance(sched)
    for _ in range(2):
        advance(sched)  # the K/V of tokens 31 and 32 fit in the second block
    plan_ids = advance(sched)  # token 33's K/V needs a third block for each: seq 1 is preempted
    assert sched.num_preemptions == 1
    assert plan_ids == [(0, 1)]
    preempted = sched.waiting[0]
    assert preempted.seq_id == 1 and preempted.num_computed_tokens == 0 and preempted.block_table == []
    assert preempted.num_tokens == 33  # keeps the tokens it generated, recomputed on re-admission


def test_prefix_hits_counted_once() -> None:
    sched = make()
    a = seq(0, 40)
    sched.add(a)
    advance(sched)
    b = Sequence(1, "r1", list(a.prompt_token_ids), SamplingParams())
    sched.add(b)
    advance(sched)
    assert b.num_cached_tokens == 32
    assert (sched.blocks.prefix_queries, sched.blocks.prefix_hits) == (80, 32)


def test_lone_prompt_takes_the_larger_budget() -> None:
    sched = make(max_num_batched_tokens=100, lone_prefill_tokens=300)
    sched.add(seq(0, 700))
    assert advance(sched) == [(0, 300)]  # admitted alone
    assert advance(sched) == [(0, 300)]  # running alone, still prefilling
    sched.add(seq(1, 50))
    assert advance(sched) == [(0, 100)]  # someone waits: the step keeps the plain budget
    assert advance(sched) == [(0, 1), (1, 50)]  # 0's prompt is done: it decodes beside 1's prefill


def test_lone_budget_never_applies_beside_a_decode_or_past_the_per_request_cap() -> None:
    sched = make(max_num_batched_tokens=100, lone_prefill_tokens=400, long_prefill_token_threshold=250)
    sched.add(seq(0, 30))
    assert advance(sched) == [(0, 30)]
    sched.add(seq(1, 900))
    assert advance(sched) == [(0, 1), (1, 99)]  # a decode runs: plain budget
    sched.remove(sched.running[0])
    assert advance(sched) == [(1, 250)]  # alone now, capped per request
    smaller = make(max_num_batched_tokens=100, lone_prefill_tokens=60)
    smaller.add(seq(0, 500))
    assert advance(smaller) == [(0, 100)]  # a lone budget below the plain one changes nothing

"""Greedy output must not depend on how the engine batches, chunks, caches or preempts."""

from __future__ import annotations

import pytest

from lab.engine.core.sampling_params import SamplingParams
from lab.engine.serve.llm import LLM
from tests.engine.prompts import all_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return all_prompts(LLM("smollm2-135m").tokenizer)


@pytest.fixture(scope="module")
def alone(prompts: list[str]) -> list[list[int]]:
    """Each prompt on its own: batch of one, default knobs."""
    llm = LLM("smollm2-135m")
    return [llm.generate(p, GREEDY)[0].token_ids for p in prompts]


def run(prompts: list[str], **knobs) -> tuple[list[list[int]], LLM]:
    llm = LLM("smollm2-135m", **knobs)
    return [c.token_ids for c in llm.generate(prompts, GREEDY)], llm


def test_twenty_prompts(prompts: list[str]) -> None:
    assert len(prompts) == 20


@pytest.mark.parametrize("chunk", [64, 512, 4096])
def test_batched_and_chunked(prompts, alone, chunk: int) -> None:
    got, llm = run(prompts, max_num_batched_tokens=chunk)
    assert got == alone
    if chunk == 64:
        # Long prompts really were split across steps.
        assert llm.engine.counters.steps > 20 + max(len(llm.encode(p)) for p in prompts) // 64


def test_lone_prompts_in_larger_chunks(prompts, alone) -> None:
    """One prompt at a time with a small step budget and a larger lone-prompt budget: the long
    prompts go in fewer, larger chunks, and no token changes."""
    llm = LLM("smollm2-135m", max_num_batched_tokens=16, lone_prefill_tokens=64, enable_prefix_caching=False)
    got = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    assert got == alone
    lengths = [len(llm.encode(p)) for p in prompts]
    assert max(lengths) > 64
    # Each prompt's prefill took ceil(n / 64) steps instead of ceil(n / 16), then its 19 decode steps.
    assert llm.engine.counters.steps == sum(-(-n // 64) + 19 for n in lengths)


def test_prefix_caching_off(prompts, alone) -> None:
    got, llm = run(prompts, enable_prefix_caching=False)
    assert got == alone
    assert llm.engine.blocks.prefix_hits == 0


def test_prefix_caching_on_with_warm_cache(prompts, alone) -> None:
    llm = LLM("smollm2-135m")
    first = [c.token_ids for c in llm.generate(prompts, GREEDY)]
    again = llm.generate(prompts, GREEDY)
    assert first == alone
    assert [c.token_ids for c in again] == alone
    assert all(c.num_cached_tokens > 0 for c in again if len(c.prompt_token_ids) > 16)


def test_preemption_by_tiny_pool(prompts, alone) -> None:
    got, llm = run(prompts, max_model_len=512, num_kv_blocks=34)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == alone
    assert llm.engine.blocks.num_used_blocks == 0


def test_staggered_arrivals(prompts, alone) -> None:
    """Requests that join while others are mid-decode see a changing batch every step."""
    llm = LLM("smollm2-135m", max_num_batched_tokens=128, long_prefill_token_threshold=48, max_parallel_prefills=2)
    engine = llm.engine
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), llm.encode(p), GREEDY)
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [results[str(i)] for i in range(len(prompts))] == alone


def test_seeded_sampling_ignores_batch(prompts) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    llm = LLM("smollm2-135m")
    solo = llm.generate(prompts[0], params)[0].token_ids
    batched = llm.generate(prompts[:6], [params] + [SamplingParams(max_tokens=12, temperature=1.0)] * 5)
    assert batched[0].token_ids == solo


# -- overlapped decode: tokens read one step late, the next step queued first ------------------


def test_overlapped_decode_under_preemption(prompts, alone) -> None:
    got, llm = run(prompts, overlap_decode="on", max_model_len=512, num_kv_blocks=34)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == alone
    assert llm.engine.blocks.num_used_blocks == 0 and not llm.engine.has_unfinished()
    # Most decode steps really were queued behind a running step, preemptions notwithstanding.
    assert llm.engine.counters.overlapped_steps > 10


def test_overlapped_decode_with_staggered_arrivals_and_aborts(prompts, alone) -> None:
    """Arrivals turn overlapped steps back into synchronous ones and aborts land while a step is
    in flight: the surviving requests' outputs must not change and no block may leak."""
    llm = LLM("smollm2-135m", overlap_decode="on", max_num_batched_tokens=128, long_prefill_token_threshold=48)
    engine = llm.engine
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    aborted: set[str] = set()
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), llm.encode(p), GREEDY)
        if step in (9, 17) and engine._inflight is not None:
            victim = next(s for s in engine._inflight.seqs if not s.is_finished)
            assert engine.abort(victim.request_id) is not None
            aborted.add(victim.request_id)
        for out in engine.step():
            assert out.request_id not in aborted, "an output arrived for an aborted request"
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    assert len(aborted) == 2
    for i in range(len(prompts)):
        if str(i) not in aborted:
            assert results[str(i)] == alone[i], i
    assert engine.blocks.num_used_blocks == 0


def test_overlapped_decode_stops_and_sampling(prompts) -> None:
    """Every way a request ends (EOS, stop string, stop token, max_tokens) and seeded sampling
    give the same tokens, text and finish reason with and without overlap."""
    params = [SamplingParams(max_tokens=40, temperature=0),
              SamplingParams(max_tokens=30, temperature=0, stop=[" the", "."]),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0, stop_token_ids=[13, 28], ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)]
    chosen = prompts[:12]
    per = [params[i % len(params)] for i in range(len(chosen))]

    def outcome(mode: str):
        done = LLM("smollm2-135m", overlap_decode=mode).generate(chosen, per)
        return [(c.token_ids, c.text, c.finish_reason, [lp.token_id for lp in c.logprobs]) for c in done]

    off, on = outcome("off"), outcome("on")
    assert on == off
    assert {r[2] for r in off} == {"stop", "length"}


def test_overlapped_decode_registers_generated_blocks_for_the_next_turn(prompts) -> None:
    """Blocks filled during overlapped decode hold tokens that were placeholders when their step
    was queued; they must be hashed with the real tokens, so a next turn that resends the answer
    hits them, and its output matches the engine without overlap."""
    first = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    outcomes = {}
    for mode in ("off", "on"):
        llm = LLM("smollm2-135m", overlap_decode=mode)
        prompt = llm.encode(prompts[3])
        answer = llm.generate([prompt], first)[0].token_ids
        follow_up = prompt + answer + llm.encode(" And then?")
        second = llm.generate([follow_up], GREEDY)[0]
        outcomes[mode] = (answer, second.token_ids, second.num_cached_tokens)
        # Every full block of prompt + answer but the last position's is reused.
        assert second.num_cached_tokens == (len(prompt) + len(answer) - 1) // 16 * 16
    assert outcomes["on"] == outcomes["off"]

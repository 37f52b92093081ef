"""Greedy output must not depend on how the engine batches, chunks, caches or preempts."""

from __future__ import annotations

import pytest

from lab.engine.llm import LLM
from lab.engine.sampling_params import SamplingParams
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

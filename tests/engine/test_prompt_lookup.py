"""Speculative decoding by prompt lookup: drafts found where the sequence repeats itself, greedy
output identical to plain decoding (batched, chunked, cached, under every stop rule), sampled
output distributed as the target's, and the counters the decode instrument reads."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from lab.engine.core.config import ConfigError, EngineConfig
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.core.sequence import Sequence
from lab.engine.serve.llm import LLM
from lab.engine.spec.prompt_lookup import FIRST_PAUSE, MAX_PAUSE, PATIENCE, Backoff, PromptLookup, find_draft
from lab.engine.spec.rejection_sampler import verify
from lab.instruments.decode import spec_cells, spec_counters
from tests.engine.prompts import SHARED_PREFIX
from tests.engine.server_process import engine_server

REPEATS = ("Copy this list exactly, twice: apples, pears, plums, cherries, figs, dates, limes. "
           "apples, pears, plums, cherries, figs, dates, limes. apples, pears,")
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
        "    return a * b\n\n\ndef div(a, b):\n")
PROMPTS = [REPEATS, CODE, "1, 1, 2, 3, 5, 8, 13,", SHARED_PREFIX + "Summarise the notes in one sentence."]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def test_find_draft_takes_the_longest_ngram_and_a_full_continuation() -> None:
    seq = [5, 1, 2, 3, 9, 7, 2, 3, 4, 8, 1, 2, 3]
    # The 3-gram (1, 2, 3) occurred at 1..3: what followed is drafted, up to k tokens.
    assert find_draft(seq, 3, 1, 3) == [9, 7, 2]
    assert find_draft(seq, 2, 1, 3) == [9, 7]
    # Only 2-grams allowed: (2, 3) last occurred at 6..7, followed by 4, 8, 1.
    assert find_draft(seq, 3, 1, 2) == [4, 8, 1]
    assert find_draft([1, 2, 3, 4], 3, 1, 3) == []  # nothing recurs
    assert find_draft([7], 3, 1, 3) == []
    assert find_draft([4, 4], 3, 1, 3) == [4]  # the continuation is cut at the sequence's end
    # Period 2: the latest (1, 2) is followed by two tokens only; the earlier one by four.
    assert find_draft([1, 2, 1, 2, 1, 2], 4, 2, 2) == [1, 2, 1, 2]
    assert find_draft([3, 9, 4, 9], 5, 1, 3) == [4, 9]  # only the 1-gram (9) recurs
    assert find_draft([3, 9, 4, 9], 5, 2, 3) == []


def test_knob_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^--prompt-lookup-max \(1\) must be >= --prompt-lookup-min \(2\)$"):
        EngineConfig(prompt_lookup=True, prompt_lookup_min=2, prompt_lookup_max=1)
    with pytest.raises(ConfigError, match="--num-speculative-tokens must be positive"):
        EngineConfig(num_speculative_tokens=0)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM("smollm2-135m")


def test_lookups_that_gain_nothing_pause_for_longer_each_time_until_a_token_is_accepted() -> None:
    # Pauses are counted in engine steps and end on a multiple of FIRST_PAUSE.
    backoff = Backoff()
    for _ in range(PATIENCE - 1):
        backoff.gained(0, step=10)
    assert backoff.resume_at == 0
    backoff.gained(0, step=10)
    assert backoff.resume_at == 32  # 10 + 16, on to the next multiple of 16
    backoff.gained(0, step=40)  # after a pause, one fruitless look pauses again
    assert backoff.resume_at == 80  # 40 + 2 x 16
    for _ in range(20):
        backoff.gained(0, step=100)
    assert backoff.resume_at == 1136  # 100 + MAX_PAUSE, rounded up
    assert MAX_PAUSE == 1024 and FIRST_PAUSE == 16
    backoff.gained(2, step=200)  # an accepted token: PATIENCE misses again before the next pause
    for _ in range(PATIENCE - 1):
        backoff.gained(0, step=300)
    assert backoff.resume_at == 1136
    backoff.gained(0, step=300)
    assert backoff.resume_at == 320


def test_sequences_that_start_on_different_steps_look_on_the_same_steps_after_their_first_pause() -> None:
    # Four sequences start decoding one step apart (a chunked prefill) and never find a draft:
    # every step on which one of them looks cannot overlap, so aligned pauses share those steps.
    drafter = PromptLookup(EngineConfig(model="dummy:tiny", prompt_lookup=True), max_model_len=4096)
    params = SamplingParams(max_tokens=1000, temperature=1.0)
    seqs = [Sequence(i, f"r{i}", list(range(100 * i + 5, 100 * i + 69)), params) for i in range(4)]
    looked: dict[int, list[int]] = {i: [] for i in range(4)}
    for _ in range(300):
        drafter.tick()
        for seq in seqs[:drafter.step]:  # sequence i starts on step i + 1
            if drafter.will_look(seq):
                assert drafter.propose(seq, 8) == []
                looked[seq.seq_id].append(drafter.step)
    first_rounds = {i: steps[:PATIENCE] for i, steps in looked.items()}
    assert first_rounds[0] == [1, 2, 3, 4] and first_rounds[3] == [4, 5, 6, 7]
    later = {i: steps[PATIENCE:] for i, steps in looked.items()}
    # After the first pause each round is one look, on the same step for all four.
    assert later[0] == later[1] == later[2] == later[3] == [32, 64, 128, 256]
    sync_steps = {step for steps in looked.values() for step in steps}
    assert len(sync_steps) == 7 + 4  # unaligned, every round would take 4 steps


def test_with_overlapped_decode_drafts_still_verify_and_a_pause_lets_steps_overlap() -> None:
    # Random weights decode greedily into a loop, which prompt lookup drafts in full; sampled at
    # temperature 1 they never repeat, so lookups gain nothing and back off.
    prompt = [int(t) for t in np.random.default_rng(0).integers(5, 400, 64)]
    knobs = {"device": "cpu", "overlap_decode": "on", "max_model_len": 512, "cpu_products": "linear"}
    plain, spec = LLM("dummy:tiny", **knobs), LLM("dummy:tiny", prompt_lookup=True, **knobs)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    [want], [got] = plain.generate(prompt, greedy), spec.generate(prompt, greedy)
    assert got.token_ids == want.token_ids
    assert spec.engine.drafter.counters.accepted_tokens > 0 and spec.engine.counters.steps < 32
    before = spec.engine.counters.steps, spec.engine.counters.overlapped_steps
    [sampled] = spec.generate(prompt, SamplingParams(max_tokens=160, temperature=1.0, seed=1, ignore_eos=True))
    steps, overlapped = (now - was for now, was in zip((spec.engine.counters.steps,
                                                         spec.engine.counters.overlapped_steps), before))
    assert len(sampled.token_ids) == 160 and steps == 160
    assert overlapped > 0.75 * steps
    assert spec.engine.drafter._backoff == {}  # forgotten when the request finished


@pytest.fixture(scope="module")
def spec() -> LLM:
    # A small step budget: long prompts are chunked, and drafts compete with prefill chunks.
    return LLM("smollm2-135m", prompt_lookup=True, num_speculative_tokens=4, max_num_batched_tokens=64)


@pytest.mark.slow
def test_greedy_output_is_plain_decodings(plain: LLM, spec: LLM) -> None:
    want = [c.token_ids for c in plain.generate(PROMPTS, GREEDY)]
    got = [c.token_ids for c in spec.generate(PROMPTS, GREEDY)]
    assert got == want
    counters = spec.engine.drafter.counters
    assert counters.drafts > 0 and 0 < counters.accepted_tokens <= counters.draft_tokens
    assert sum(counters.accepted_per_position) == counters.accepted_tokens
    # Fewer steps than tokens: accepted drafts really were emitted several per step.
    assert spec.engine.counters.steps < sum(len(t) for t in got)
    # Again, now from the prefix cache.
    again = spec.generate(PROMPTS[-1:], GREEDY)
    assert [c.token_ids for c in again] == want[-1:]
    assert all(c.num_cached_tokens > 0 for c in again)
    assert spec.engine.blocks.num_used_blocks == 0


@pytest.mark.slow
def test_every_stop_rule_holds_inside_an_accepted_draft(plain: LLM, spec: LLM) -> None:
    free = plain.generate(REPEATS, GREEDY)[0]
    text = free.text
    # A stop string and a stop id that the repeated list reaches only after several drafted tokens.
    stop_text = text[len(text) // 2:len(text) // 2 + 5]
    stop_id = free.token_ids[9]
    stop_at = free.token_ids.index(stop_id) + 1
    chat = plain.tokenizer.apply_chat_template([{"role": "user", "content": "Say yes."}], add_generation_prompt=True)
    params = [
        SamplingParams(max_tokens=20, temperature=0, stop=[stop_text]),
        SamplingParams(max_tokens=20, temperature=0, stop=[stop_text], include_stop_str_in_output=True),
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0),  # ends at EOS
        SamplingParams(max_tokens=20, temperature=0, min_tokens=12),  # EOS masked for 12 tokens
    ]
    prompts = [REPEATS] * 5 + [chat, chat]
    before = spec.engine.drafter.counters.accepted_tokens
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert spec.engine.drafter.counters.accepted_tokens > before
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert got[0].finish_reason == got[2].finish_reason == "stop" and got[3].finish_reason == "length"
    assert len(got[3].token_ids) == 7 and not got[0].text.endswith(stop_text) and got[1].text.endswith(stop_text)
    assert got[2].token_ids[-1] == stop_id and len(got[2].token_ids) == stop_at
    assert len(got[6].token_ids) >= 12
    lp_want, lp_got = want[4].logprobs, got[4].logprobs
    assert [lp.token_id for lp in lp_got] == got[4].token_ids
    np.testing.assert_allclose([lp.logprob for lp in lp_got], [lp.logprob for lp in lp_want], atol=1e-3)
    assert [[t for t, _ in lp.top] for lp in lp_got] == [[t for t, _ in lp.top] for lp in lp_want]


def test_sampled_tokens_follow_the_targets_distribution() -> None:
    """The emitted tokens' distribution is the target's, whatever the draft: chi-square on the
    first token, and on the second given the first was the drafted one. A verifier that kept every
    draft, or drew its correction from p without removing the draft, fails the same test."""
    torch.manual_seed(0)
    vocab, draws = 6, 4000
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.8)
    p = (logits / params.temperature).softmax(-1).double().numpy()
    p /= p.sum(axis=1, keepdims=True)
    draft = [int(np.argsort(p[0])[-2]), int(np.argsort(p[1])[-1])]  # a likely but not the likeliest first guess
    gen = torch.Generator().manual_seed(1234)
    first, second = np.zeros(vocab), np.zeros(vocab)
    for _ in range(draws):
        out = verify(logits, draft, params, gen, num_output=0)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    assert chisquare(first, draws * p[0]).pvalue > 1e-3
    assert chisquare(second, second.sum() * p[1]).pvalue > 1e-3
    # The same test rejects what a verifier that corrects from p itself, draft not removed, would
    # give: the drafted token p(x) + (1 - p(x)) p(x) of the time.
    px = p[0][draft[0]]
    wrong = (1 - px) * p[0]
    wrong[draft[0]] += px
    assert chisquare(first, draws * wrong).pvalue < 1e-6


@pytest.mark.slow
def test_counters_at_metrics_and_stats_fill_the_decode_cells(tmp_path) -> None:
    with engine_server(tmp_path, "--max-model-len", "1024", "--prompt-lookup", "--num-speculative-tokens", "3") as s:
        metrics_before = spec_counters(httpx.get(f"{s.url}/metrics", timeout=10).text)
        body = {"model": "smollm2-135m", "prompt": REPEATS, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"{s.url}/metrics", timeout=10).text
        stats = s.stats()["spec_decode"]
    assert metrics_before == {"accepted": 0, "drafted": 0, "drafts": 0}
    assert f"vllm:spec_decode_num_accepted_tokens_total{{engine=\"0\",model_name=\"smollm2-135m\"}} " \
           f"{float(stats['accepted_tokens'])}" in metrics
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2-135m",position="2"}' \
        in metrics
    after = spec_counters(metrics)
    assert after == {"accepted": stats["accepted_tokens"], "drafted": stats["draft_tokens"], "drafts": stats["drafts"]}
    assert 0 < stats["accepted_tokens"] <= stats["draft_tokens"] <= 3 * stats["drafts"]
    cells = {c.metric: c for c in spec_cells(1, 0, metrics_before, after)}
    assert cells["spec_acceptance"].value == pytest.approx(stats["acceptance"])
    assert cells["spec_tokens_per_step"].value == pytest.approx(stats["tokens_per_step"]) and stats["tokens_per_step"] > 1

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
from lab.engine.serve.engine_stats import engine_stats
from lab.engine.spec.acceptance import HitRates
from lab.engine.spec.draft_costs import DraftCosts, StepTimes
from lab.engine.spec.ngram_index import NgramIndex
from lab.engine.spec.prompt_lookup import PromptLookup
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


def draft_of(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    index = NgramIndex(n_min, n_max)
    index.start(tokens, len(tokens))
    return index.draft(tokens, k)


def test_the_draft_follows_the_longest_recurring_ngram_and_continues_a_short_period() -> None:
    seq = [5, 1, 2, 3, 9, 7, 2, 3, 4, 8, 1, 2, 3]
    # The 3-gram (1, 2, 3) occurred at 1..3: what followed is drafted, up to k tokens.
    assert draft_of(seq, 3, 1, 3) == [9, 7, 2]
    assert draft_of(seq, 2, 1, 3) == [9, 7]
    # Only 2-grams allowed: (2, 3) last occurred at 6..7, followed by 4, 8, 1.
    assert draft_of(seq, 3, 1, 2) == [4, 8, 1]
    assert draft_of([1, 2, 3, 4], 3, 1, 3) == []  # nothing recurs
    assert draft_of([7], 3, 1, 3) == []
    # A source within the last k tokens: the text repeats with that period, and so does the draft.
    assert draft_of([4, 4], 3, 1, 3) == [4, 4, 4]
    assert draft_of([1, 2, 1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]
    assert draft_of([3, 9, 4, 9], 3, 1, 3) == [4, 9, 4]  # only the 1-gram (9) recurs
    assert draft_of([3, 9, 4, 9], 5, 2, 3) == []


def test_the_index_scores_its_predictions_token_by_token() -> None:
    tokens = [10, 11, 12, 13, 50, 10, 11, 12, 99]
    index = NgramIndex(1, 3)
    index.start(tokens, 5)  # the "prompt": nothing in it recurs
    assert index.source == -1
    # 10 recurs and predicts 11 (a hit); 10 11 predicts 12 (a hit); 10 11 12 predicts 13, but 99 comes.
    assert index.advance(tokens, 9) == [False, True, True, False]
    tokens.append(10)
    assert index.advance(tokens, 10) == [False] and index.draft(tokens, 2) == [11, 12]


def test_knob_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^--prompt-lookup-max \(1\) must be >= --prompt-lookup-min \(2\)$"):
        EngineConfig(prompt_lookup=True, prompt_lookup_min=2, prompt_lookup_max=1)
    with pytest.raises(ConfigError, match="--num-speculative-tokens must be positive"):
        EngineConfig(num_speculative_tokens=0)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM("smollm2-135m")


MS = 1e-3
# A device where a step that cannot overlap costs 20 % more at batch 1 and 30 % at batch 32, and
# verifying drafts costs a little at batch 1 and much more at 32.
COSTS = DraftCosts([StepTimes(1, overlapped=10 * MS, plain=12 * MS, verify={1: 13 * MS, 3: 15 * MS}),
                    StepTimes(32, overlapped=20 * MS, plain=26 * MS, verify={1: 30 * MS, 3: 40 * MS})])


def test_the_break_even_is_the_verify_step_against_the_overlapped_one() -> None:
    assert COSTS.break_even(1, 3) == pytest.approx(15 / 10 - 1)
    assert COSTS.break_even(1, 1) == pytest.approx(13 / 10 - 1)
    assert COSTS.break_even(32, 3) == pytest.approx(40 / 20 - 1)
    # Between measured sizes the step times are interpolated; beyond the largest, its figures hold.
    mid = COSTS.times(16)
    assert mid.overlapped == pytest.approx(10 * MS + 10 * MS * 15 / 31)
    assert COSTS.break_even(16, 3) == pytest.approx(mid.verify[3] / mid.overlapped - 1)
    assert COSTS.break_even(64, 3) == pytest.approx(COSTS.break_even(32, 3))
    price = COSTS.price(32)
    assert (price.sync, price.first, price.extra) == pytest.approx((32 * 0.3, 0.2, 0.25))
    [one, many] = COSTS.to_dict()
    assert one["break_even_acceptance"] == pytest.approx(0.5 / 3)
    assert many["verify_step_ms"] == {"1": pytest.approx(30), "3": pytest.approx(40)}
    # On the CPU nothing overlaps: giving up overlap is free, verification is all a draft costs.
    cpu = DraftCosts([StepTimes(1, overlapped=40 * MS, plain=40 * MS, verify={1: 44 * MS, 3: 52 * MS})])
    assert cpu.price(1).sync == 0 and cpu.break_even(1, 3) == pytest.approx(0.3)


def test_a_sequence_drafts_the_length_that_gains_it_most() -> None:
    price = COSTS.price(1)  # M(1) = 0.1, each further token 0.1
    assert price.best(HitRates(), 3) == (0, 0.0)  # no hit seen yet: nothing expected
    copying = HitRates(after_hit=0.95, after_miss=0.3, last_hit=True)
    d, net = price.best(copying, 3)
    assert d == 3 and net == pytest.approx(0.95 * (1 + 0.95 + 0.95 ** 2) - 0.3)
    assert price.best(copying, 2)[0] == 2  # the room caps it
    # Right after a miss the first token is a 30 % chance: worth three at batch 1 ...
    after_miss = HitRates(after_hit=0.8, after_miss=0.3, last_hit=False)
    assert price.best(after_miss, 3)[0] == 3
    # ... and one at batch 32, where the first token's verification costs 0.2 and each further
    # 0.25, more than the second's 0.3 x 0.8.
    assert COSTS.price(32).best(after_miss, 3) == (1, pytest.approx(0.1))
    assert COSTS.price(32).best(HitRates(after_hit=0.2, after_miss=0.1), 3) == (0, 0.0)


def test_text_that_never_repeats_never_drafts_and_a_quoted_passage_drafts_at_once() -> None:
    drafter = PromptLookup(EngineConfig(model="dummy:tiny", prompt_lookup=True), 8192, COSTS)
    rng = np.random.default_rng(0)
    passage = [int(t) for t in rng.integers(1000, 2000, 40)]
    prompt = passage + [int(t) for t in rng.integers(2000, 100_000, 200)]
    seq = Sequence(0, "r", prompt, SamplingParams(max_tokens=4000, temperature=0))
    drafter.admit(seq)
    for token in rng.integers(100_000, 200_000, 300):  # output that repeats nothing
        assert not drafter.pays_to_sync([seq]) and drafter.propose(seq, 1, 8) == []
        seq.token_ids.append(int(token))
    assert drafter.counters.sync_steps == 0
    # The output starts quoting the passage: after a hit or two the drafts pay, even at batch 32
    # where every sequence copies alike, and they are the passage's next tokens.
    first_sync = None
    for i, token in enumerate(passage[:30]):
        seq.token_ids.append(token)
        if first_sync is None and drafter.pays_to_sync([seq] * 32):
            first_sync = i
    assert first_sync is not None and first_sync <= 3
    assert drafter.propose(seq, 32, 8) == passage[30:33]
    # When the quote ends the hits stop, and so do the drafts.
    seq.token_ids += [int(t) for t in rng.integers(100_000, 200_000, 2)]
    assert not drafter.pays_to_sync([seq]) and drafter.propose(seq, 1, 8) == []


def test_the_probe_measures_the_batch_sizes_the_engine_can_hold_and_leaves_nothing_behind() -> None:
    small = LLM("dummy:tiny", prompt_lookup=True, device="cpu", max_model_len=512, num_kv_blocks=40,
                cpu_products="linear")
    # A sequence of the probe holds 11 blocks (128 tokens of context and what it decodes): 8 do not fit.
    assert [t.batch for t in small.engine.drafter.costs.measured] == [1]
    roomy = LLM("dummy:tiny", prompt_lookup=True, device="cpu", max_model_len=512, max_num_seqs=8,
                cpu_products="linear", enable_prefix_caching=True)
    assert [t.batch for t in roomy.engine.drafter.costs.measured] == [1, 8]  # --max-num-seqs 8
    engine = roomy.engine
    assert engine.counters.steps == engine.counters.generation_tokens == engine.counters.requests_aborted == 0
    assert engine.blocks.num_used_blocks == 0 and not engine.blocks.hash_to_block and engine.blocks.prefix_queries == 0
    assert engine.requests == {} and engine.outputs.states == {} and engine.blocks.enable_prefix_caching


def test_with_overlapped_decode_text_that_repeats_drafts_and_text_that_does_not_overlaps() -> None:
    # Random weights decode greedily into a loop, which prompt lookup drafts in full; sampled at
    # temperature 1 they never repeat, so no step gives up overlapping.
    prompt = [int(t) for t in np.random.default_rng(0).integers(5, 400, 64)]
    knobs = {"device": "cpu", "overlap_decode": "on", "max_model_len": 512, "cpu_products": "linear"}
    plain, spec = LLM("dummy:tiny", **knobs), LLM("dummy:tiny", prompt_lookup=True, **knobs)
    assert spec.engine.counters.steps == 0 and spec.engine.blocks.num_used_blocks == 0  # the probe left nothing
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    [want], [got] = plain.generate(prompt, greedy), spec.generate(prompt, greedy)
    assert got.token_ids == want.token_ids
    counters = spec.engine.drafter.counters
    assert counters.accepted_tokens > 0 and counters.sync_steps > 0 and spec.engine.counters.steps < 32
    before = spec.engine.counters.steps, spec.engine.counters.overlapped_steps, counters.drafts, counters.sync_steps
    [sampled] = spec.generate(prompt, SamplingParams(max_tokens=160, temperature=1.0, seed=1, ignore_eos=True))
    steps, overlapped, drafts, syncs = (now - was for now, was in zip(
        (spec.engine.counters.steps, spec.engine.counters.overlapped_steps, counters.drafts, counters.sync_steps),
        before))
    assert len(sampled.token_ids) == 160 and steps == 160
    assert drafts == syncs == 0 and overlapped == steps - 2  # all but the prefill and the first decode step
    assert spec.engine.drafter._tracked == {}  # forgotten when the request finished
    stats = engine_stats(spec.engine, "tiny", 0.0)["spec_decode"]
    assert stats["sync_steps"] == counters.sync_steps and stats["costs"][0]["batch"] == 1


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
def test_greedy_output_is_plain_decodings_with_overlapped_decode(plain: LLM) -> None:
    """With overlap, a step that drafts first collects the step in flight: the drafts start after
    a token that was still on the device when the step was planned."""
    spec = LLM("smollm2-135m", prompt_lookup=True, overlap_decode="on")
    chat = plain.tokenizer.apply_chat_template([{"role": "user", "content": "Name three fruits."}],
                                               add_generation_prompt=True)
    prompts = PROMPTS + [chat]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    assert [c.token_ids for c in spec.generate(prompts, params)] == want
    counters = spec.engine.drafter.counters
    assert counters.accepted_tokens > 0 and counters.sync_steps > 0 and spec.engine.counters.overlapped_steps > 0


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


def test_a_verify_step_as_decode_rows_gives_the_causal_verify_logits(monkeypatch) -> None:
    """What a CUDA graph replays for a verify step, each draft token one more decode row of its
    sequence (the same block table, the next position), computes the logits of the eager verify
    step's causal attention over the draft; here both run eagerly on the CPU."""
    from types import SimpleNamespace

    from lab.engine.core import draft_probe
    from lab.engine.core.scheduler import ScheduledSeq

    llm = LLM("dummy:smollm2-135m", dtype="float32", max_model_len=512)
    engine, runner = llm.engine, llm.engine.runner
    seqs = draft_probe._place(engine, 2, 100)  # decoding, 99 tokens of K/V in the cache
    drafts = [[11, 12, 13], [21, 22]]
    for seq, draft in zip(seqs, drafts):
        engine.blocks.allocate(seq, 1 + len(draft))
    verify_step = [ScheduledSeq(seq, 1 + len(draft), draft) for seq, draft in zip(seqs, drafts)]
    rows = []
    for seq, draft in zip(seqs, drafts):
        start = seq.num_computed_tokens
        for j in range(1 + len(draft)):
            row = Sequence(seq.seq_id, seq.request_id, seq.token_ids[:start + 1] + draft[:j], seq.params)
            row.num_computed_tokens, row.block_table = start + j, seq.block_table
            rows.append(ScheduledSeq(row, 1))
    with torch.inference_mode():
        ids, pos, meta, logit_rows = runner.prepare(verify_step)
        hidden = runner.model.forward(ids, pos, meta, runner.kv_layers)
        causal = runner.model.logits(hidden.index_select(0, torch.tensor(logit_rows)))
        row_ids, row_pos, row_meta, _ = runner.prepare(rows)
        assert row_meta.num_decodes == len(rows) == len(logit_rows) == 7
        as_rows = runner.model.logits(runner.model.forward(row_ids, row_pos, row_meta, runner.kv_layers))
    torch.testing.assert_close(as_rows, causal, rtol=1e-4, atol=1e-4)
    assert torch.equal(as_rows.argmax(-1), causal.argmax(-1))
    # The rows the graph path builds are those: the ids and positions the eager step computes.
    monkeypatch.setattr(runner, "graphs", SimpleNamespace(max_batch=8))
    graph_ids, graph_pos, tables = runner._decode_rows(verify_step)
    assert graph_ids == ids.tolist() and graph_pos == pos.tolist() and tables == [r.seq.block_table for r in rows]
    monkeypatch.setattr(runner, "graphs", SimpleNamespace(max_batch=6))  # 7 rows do not fit: eager
    assert runner._decode_rows(verify_step) is None

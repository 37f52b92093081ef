"""decode on the real engine: each level keeps that many streams in flight, C1 runs twice, every
category is measured at every level, and speculative counters are read when an engine has them."""

from __future__ import annotations

import statistics

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from lab.instruments.decode import DecodeInstrument, DecodeParams, spec_cells, spec_counters, steady_agg_tok_s
from lab.instruments.decode_prompts import CATEGORIES
from lab.instruments.receipt import Receipt
from tests.engine.server_process import engine_server
from tests.instruments.speed_boot import ENGINE_FLAGS, SpeedBench, dead_url

MAX_TOKENS = 8


@pytest.mark.slow
def in_flight_at_most(requests) -> int:
    """The most requests that were between sent and done at one moment."""
    edges = sorted([(r.t_sent_ns, 1) for r in requests] + [(r.t_done_ns, -1) for r in requests])
    most = now = 0
    for _, change in edges:  # at a tie the end sorts first: back-to-back requests never overlap
        now += change
        most = max(most, now)
    return most


def test_each_level_keeps_that_many_streams_in_flight_with_every_category_measured(bench) -> None:
    stored = bench.measure(DecodeInstrument(), {"levels": [1, 4], "max_tokens": MAX_TOKENS}, salt="decode-a")
    assert [(s.key, s.status) for s in stored.steps] == [("C1", "ok"), ("C4", "ok")]
    c1 = [stored.cell("agg_tok_s", run, level=1) for run in (0, 1)]  # C1 twice: the KEEP median is their mean
    c4 = stored.cell("agg_tok_s", level=4)
    assert [c.repeat for c in stored.of("agg_tok_s")] == [0, 1, 0]
    assert all(c.valid for c in stored.cells), [c.note for c in stored.cells if not c.valid]
    # Concurrency is what the level promises (how much faster C4 runs is the engine's business, and a
    # benchmark's): one stream at a time at C1, four at once at C4.
    assert [in_flight_at_most(stored.requests_of(c)) for c in (*c1, c4)] == [1, 1, 4]

    for cell in (*c1, c4):
        requests = stored.requests_of(cell)
        assert len(requests) == 8 and len(set(r.payload["messages"][0]["content"] for r in requests)) == 8
        assert all(r.payload["temperature"] == 0 and r.payload["ignore_eos"] is True for r in requests)
        assert all(r.completion_tokens == MAX_TOKENS and r.cached_tokens == 0 for r in requests)
        span = max(r.t_done_ns for r in requests) - min(r.t_queued_ns for r in requests)
        assert cell.value == pytest.approx(8 * MAX_TOKENS * 1e9 / span)
        level, run = cell.params["level"], cell.repeat
        streams = [(r.completion_tokens - 1) * 1e9 / (r.t_last_ns - r.t_first_ns) for r in requests]
        assert stored.cell("stream_tok_s", run, level=level).value == pytest.approx(statistics.fmean(streams))
        ttft = statistics.median((r.t_first_ns - r.t_sent_ns) / 1e9 for r in requests)
        assert stored.cell("ttft_s", run, level=level).value == pytest.approx(ttft)
        categories = {c.params["category"] for c in stored.of("category_stream_tok_s")
                      if c.params["level"] == level and c.repeat == run}
        assert categories == set(CATEGORIES)
    # at C4 the client keeps four requests in flight: the fifth waits for a free slot, and says so
    waves = stored.requests_of(c4)
    assert max(r.t_sent_ns - r.t_queued_ns for r in waves[4:]) > 0.1e9
    assert stored.of("spec_acceptance") == []  # the bundled engine does not speculate


@pytest.mark.slow
def test_context_tokens_give_every_stream_its_own_long_prompt(bench) -> None:
    stored = bench.measure(DecodeInstrument(), {"levels": [2], "max_tokens": 4, "context_tokens": 150},
                           salt="decode-context")
    cell = stored.cell("agg_tok_s", level=2)
    assert cell.valid, cell.note
    requests = stored.requests_of(cell)
    # About 150 tokens of filler before each question (which adds up to about 250 more), and no
    # two streams share more than the chat template's opening.
    assert all(150 <= r.prompt_tokens <= 150 * 1.1 + 250 for r in requests), [r.prompt_tokens for r in requests]
    assert all(r.cached_tokens == 0 for r in requests)
    texts = [r.payload["messages"][1]["content"] for r in requests]
    assert len({t[:200] for t in texts}) == len(texts)


@pytest.mark.slow
def test_a_dead_engine_is_a_step_error(bench) -> None:
    stored = bench.measure(DecodeInstrument(), {"levels": [2]}, salt="decode-dead", base_url=dead_url())
    (step,) = stored.steps
    assert step.status == "error" and "Connect" in step.error


@pytest.mark.slow
def test_at_c1_each_category_gets_its_own_acceptance(bench, tmp_path) -> None:
    with engine_server(tmp_path, *ENGINE_FLAGS, "--prompt-lookup") as server:
        stored = SpeedBench(bench.store, server).measure(DecodeInstrument(), {"levels": [1, 2], "max_tokens": 32},
                                                         salt="decode-spec")
    for run in (0, 1):
        level = stored.cell("spec_acceptance", run, level=1)
        by_category = [c for c in stored.of("category_spec_acceptance") if c.repeat == run]
        assert by_category and all(c.params["level"] == 1 for c in by_category)
        # Each cell is one stream's, of its category; the level's acceptance is their weighted mean.
        for cell in by_category:
            [stream] = stored.requests_of(cell)
            assert CATEGORIES[cell.params["category"]][0] in stream.payload["messages"][1]["content"]
        values = [c.value for c in by_category]
        assert min(values) - 1e-9 <= level.value <= max(values) + 1e-9
    assert not [c for c in stored.of("category_spec_acceptance") if c.params["level"] == 2]


def test_speculative_counters_are_summed_over_label_sets() -> None:
    text = "\n".join([
        "# HELP vllm:spec_decode_num_accepted_tokens_total Accepted.",
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 300.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 100.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 90.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0"} 500.0',
        "vllm:spec_decode_num_drafts_total 100",
        "vllm:num_requests_running 3",
    ])
    assert spec_counters(text) == {"accepted": 400.0, "drafted": 500.0, "drafts": 100.0}
    assert spec_counters("lab:generation_tokens_total 12") == {} and spec_counters(None) == {}
    assert spec_counters("vllm:spec_decode_num_drafts_total twelve") == {}


def test_speculative_counters_leave_out_a_typed_counters_created_sample() -> None:
    registry = CollectorRegistry()
    accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Accepted.", ["engine"], registry=registry)
    accepted.labels("0").inc(7)
    accepted.labels("1").inc(3)
    assert spec_counters(generate_latest(registry).decode()) == {"accepted": 10.0}


def test_speculative_acceptance_is_the_change_over_the_level() -> None:
    before = {"accepted": 1000.0, "drafted": 2000.0, "drafts": 400.0}
    after = {"accepted": 1300.0, "drafted": 2400.0, "drafts": 480.0}
    acceptance, per_step = spec_cells(4, 0, before, after)
    assert (acceptance.metric, acceptance.value, acceptance.params) == ("spec_acceptance", 0.75, {"level": 4})
    assert (per_step.metric, per_step.value) == ("spec_tokens_per_step", 1 + 300 / 80)
    assert spec_cells(4, 0, {}, {}) == [] and spec_cells(4, 0, before, before) == []


def test_levels_up_to_c16_on_a_gpu_and_refused_values() -> None:
    assert DecodeParams(preset="gpu").levels == list(range(1, 17))
    with pytest.raises(ValueError, match="listed twice"):
        DecodeParams(levels=[1, 2, 2])
    with pytest.raises(ValueError, match="greater than or equal to 2"):
        DecodeParams(max_tokens=1)


def _stream(times_ms: list[float]) -> Receipt:
    return Receipt(request_id="r", endpoint="/v1/chat/completions", payload={}, t_queued_ns=0,
                   token_times_ns=[int(t * 1e6) for t in times_ms])


def test_steady_aggregate_counts_only_the_span_with_every_stream_decoding() -> None:
    # Two streams at 100 tok/s each (a token every 10 ms); the second starts 50 ms late, the first
    # ends 50 ms early: both decode from 50 to 100 ms, where 10 tokens arrive, 200 tok/s.
    a = _stream([0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100])
    b = _stream([50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150])
    rate, note = steady_agg_tok_s([a, b], 2)
    assert rate == pytest.approx(200.0)
    assert note == "10 tokens in 0.050 s with all 2 streams decoding"


def test_steady_aggregate_of_one_stream_at_a_time_is_its_decode_rate() -> None:
    waves = [_stream([0, 10, 20, 30]), _stream([40, 60, 80])]  # 100 then 50 tok/s, one after the other
    rate, _ = steady_agg_tok_s(waves, 1)
    assert rate == pytest.approx(5 / 0.070)


def test_steady_aggregate_is_none_when_streams_never_all_overlap() -> None:
    rate, note = steady_agg_tok_s([_stream([0, 10]), _stream([20, 30])], 2)
    assert rate is None and note == "no moment had all 2 streams decoding at once"

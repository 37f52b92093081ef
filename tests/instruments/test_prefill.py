"""prefill on the real engine: exact cold prompts, the cache check, and failures stored as reasons."""

from __future__ import annotations

import httpx
import pytest

from lab.instruments.prefill import PrefillInstrument, PrefillParams
from lab.ladder.errors import LadderError
from lab.ladder.validate import parse_ladder
from tests.instruments.speed_boot import LADDER, MODEL, dead_url

pytestmark = pytest.mark.slow


def test_cold_prompts_of_exact_length_and_a_resent_prompt_is_served_from_cache(bench) -> None:
    stored = bench.measure(PrefillInstrument(), {"lengths": [128, 512], "reps": 2}, salt="prefill-a")
    assert [(s.key, s.status) for s in stored.steps] == [("length=128", "ok"), ("length=512", "ok")]
    for length in (128, 512):
        rates = []
        for rep in (0, 1):
            cell = stored.cell("prefill_tok_s", rep, length=length)
            (request,) = stored.requests_of(cell)
            assert cell.valid, cell.note
            assert request.prompt_tokens == length and request.cached_tokens == 0
            assert request.payload["max_tokens"] == 1 and request.payload["stream"] is True
            assert request.payload["prompt"].startswith("Session ")  # the salt opens the prompt
            ttft = stored.cell("ttft_s", rep, length=length)
            assert ttft.value == pytest.approx((request.t_first_ns - request.t_sent_ns) / 1e9)
            assert cell.value == pytest.approx(length / ttft.value)
            rates.append(cell.value)
        assert stored.cell("prefill_tok_s_median", length=length).value == pytest.approx(sum(rates) / 2)
    prompts = [r.payload["prompt"] for r in stored.requests.values()]
    assert len(set(prompts)) == 4 and len({p.split()[1] for p in prompts}) == 4  # a fresh salt per repeat

    again = httpx.post(f"{bench.server.url}/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": prompts[-1], "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens"] == 512
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_another_boot_salts_its_prompts_differently(bench) -> None:
    first = bench.measure(PrefillInstrument(), {"lengths": [64], "reps": 1}, salt="boot-1")
    second = bench.measure(PrefillInstrument(), {"lengths": [64], "reps": 1}, salt="boot-2")
    (a,), (b,) = first.requests.values(), second.requests.values()
    assert a.payload["prompt"].split()[:2] != b.payload["prompt"].split()[:2]


def test_a_length_over_the_context_and_a_failed_request_are_invalid_cells_with_reasons(bench) -> None:
    over = bench.measure(PrefillInstrument(), {"lengths": [5000]}, salt="prefill-over")
    assert [s.status for s in over.steps] == ["ok"]
    cell = over.cell("prefill_tok_s", length=5000)
    assert not cell.valid and "exceed the engine's context of 4096" in cell.note
    assert not over.cell("prefill_tok_s_median", length=5000).valid

    refused = bench.measure(PrefillInstrument(), {"lengths": [64]}, salt="prefill-404", model="no-such-model")
    cell = refused.cell("prefill_tok_s", length=64)
    (request,) = refused.requests_of(cell)
    assert not cell.valid and cell.note.startswith("HTTP 404") and request.error == cell.note


def test_a_dead_engine_is_a_step_error_not_a_crash(bench) -> None:
    stored = bench.measure(PrefillInstrument(), {"lengths": [64]}, salt="prefill-dead", base_url=dead_url())
    (step,) = stored.steps
    assert step.status == "error" and "Connect" in step.error and stored.cells == []


def test_presets_fill_what_the_ladder_leaves_out_and_bad_values_point_at_their_line() -> None:
    gpu = PrefillParams(preset="gpu")
    assert gpu.lengths == [2000, 8000, 32000, 64000, 131072, 300000] and gpu.reps == 3
    assert PrefillParams(preset="gpu", reps=5).lengths == gpu.lengths
    assert PrefillParams(preset="gpu", reps=5).reps == 5
    text = LADDER + "instruments:\n  prefill: {preset: gpu, lengths: [2000, 8]}\n"
    with pytest.raises(LadderError, match=r"speed.yaml:8: instruments.prefill.lengths\[1\]: .*greater than or equal"):
        parse_ladder(text, "speed.yaml")


def test_a_decode_tail_times_the_tokens_after_the_first_at_that_context(bench) -> None:
    stored = bench.measure(PrefillInstrument(), {"lengths": [256], "reps": 1, "tail_tokens": 12}, salt="prefill-tail")
    cell = stored.cell("tail_tok_s", 0, length=256)
    (request,) = stored.requests_of(cell)
    assert cell.valid, cell.note
    assert request.payload["max_tokens"] == 13 and request.payload["ignore_eos"] is True
    assert request.completion_tokens == 13 and request.prompt_tokens == 256
    assert cell.value == pytest.approx(12 / ((request.t_last_ns - request.t_first_ns) / 1e9))
    assert stored.cell("prefill_tok_s", 0, length=256).valid  # the tail does not spoil the prefill figure

    over = bench.measure(PrefillInstrument(), {"lengths": [4090], "tail_tokens": 12}, salt="prefill-tail-over")
    tail = over.cell("tail_tok_s", length=4090)
    assert not tail.valid and "13 output tokens exceed the engine's context of 4096" in tail.note


def test_warm_up_requests_are_sent_and_kept_as_receipts_but_enter_no_cell(bench) -> None:
    stored = bench.measure(PrefillInstrument(), {"lengths": [64], "reps": 2, "warmup_reps": 1}, salt="warm")
    requests = sorted(stored.requests.values(), key=lambda r: r.t_sent_ns)
    assert len(requests) == 3 and all(r.status == 200 and r.prompt_tokens == 64 for r in requests)
    warm_up = requests[0]
    cells = [c for c in stored.cells if c.metric in ("prefill_tok_s", "ttft_s", "prefill_tok_s_median")]
    assert len(cells) == 5 and all(c.valid for c in cells)  # two repeats x two metrics, and the median
    assert all(warm_up.id not in c.request_ids for c in cells)
    median = stored.cell("prefill_tok_s_median", length=64)
    assert median.note == "median of 2 valid of 2 repeats after 1 warm-up request"
    assert len({r.payload["prompt"] for r in requests}) == 3  # the warm-up is cold too: its own salt

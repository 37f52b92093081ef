"""mixed on the real engine: a short chat behind a long cold prefill waits longer for its first
token than alone, and a probe where nothing overlapped says so instead of reporting a stall."""

from __future__ import annotations

import pytest

from lab.instruments.mixed import MixedInstrument, MixedParams

pytestmark = pytest.mark.slow


def test_the_short_chat_waits_longer_behind_a_long_prefill_than_alone(bench) -> None:
    stored = bench.measure(MixedInstrument(), {"long_tokens": 2000, "delay_s": 0.3}, salt="mixed-a")
    assert [(s.key, s.status) for s in stored.steps] == [("rep=0", "ok")]
    assert all(c.valid for c in stored.cells), [c.note for c in stored.cells if not c.valid]
    alone, behind = stored.cell("short_ttft_alone_s"), stored.cell("short_ttft_behind_s")
    assert behind.value > alone.value
    assert stored.cell("stall_ratio").value == pytest.approx(behind.value / alone.value)

    (long,) = stored.requests_of(stored.cell("long_prefill_s"))
    (short_alone,) = stored.requests_of(alone)
    (short_behind,) = stored.requests_of(behind)
    assert long.prompt_tokens == 2000 and long.cached_tokens == 0 and long.payload["max_tokens"] == 1
    assert stored.cell("long_prefill_s").value == pytest.approx((long.t_first_ns - long.t_sent_ns) / 1e9)
    # the short chat left `delay_s` after the long prompt was handed over, before its prefill ended
    assert short_behind.t_queued_ns - long.t_queued_ns == pytest.approx(0.3e9, abs=1e6)
    assert long.t_sent_ns < short_behind.t_sent_ns < long.t_first_ns
    assert short_alone.payload["messages"][1] == short_behind.payload["messages"][1]
    assert short_alone.payload["messages"][0] != short_behind.payload["messages"][0]  # each its own salt
    assert stored.cell("short_e2e_behind_s").value == pytest.approx(
        (short_behind.t_done_ns - short_behind.t_sent_ns) / 1e9)


def test_a_delay_past_the_long_prefill_measures_no_stall(bench) -> None:
    # A 64-token prefill is over long before 5 s, even on a loaded 2-core host.
    stored = bench.measure(MixedInstrument(), {"long_tokens": 64, "delay_s": 5.0}, salt="mixed-b")
    assert stored.cell("long_prefill_s").valid and stored.cell("short_ttft_alone_s").valid
    for metric in ("short_ttft_behind_s", "short_e2e_behind_s", "stall_ratio"):
        cell = stored.cell(metric)
        assert not cell.valid and cell.value is None and "over before the short chat was sent" in cell.note


def test_the_gpu_preset_is_the_93k_probe() -> None:
    params = MixedParams(preset="gpu", reps=2)
    assert (params.long_tokens, params.delay_s, params.short_max_tokens, params.reps) == (93000, 1.0, 32, 2)
    assert [s.key for s in MixedInstrument().plan(params)] == ["rep=0", "rep=1"]

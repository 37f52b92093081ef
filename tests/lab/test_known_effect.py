"""The bundled engine's known-effect knob: `--inject-step-delay-ms` adds a documented cost to every
engine step with work, so a ladder can carry an arm with a true slowdown and measure its power."""

from __future__ import annotations

import time

import pytest

from lab.engine.config import ConfigError, from_sources
from lab.engine.llm import LLM
from lab.engine.sampling_params import SamplingParams

TOKENS = 12
DELAY_MS = 40.0


def decode_seconds(llm: LLM) -> tuple[float, int]:
    """Wall time of a 12-token greedy decode and the engine steps it took."""
    before = llm.engine.counters.steps
    start = time.perf_counter()
    [done] = llm.generate([1, 2, 3, 4], SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0))
    seconds = time.perf_counter() - start
    assert len(done.token_ids) == TOKENS
    return seconds, llm.engine.counters.steps - before


def test_the_injected_delay_shows_up_in_every_step_of_a_decode() -> None:
    llm = LLM("dummy:tiny", device="cpu", inject_step_delay_ms=DELAY_MS, max_model_len=256)
    seconds, steps = decode_seconds(llm)
    # One step prefills and makes the first token, then one step per token: each sleeps the delay.
    assert steps >= TOKENS
    assert seconds >= steps * DELAY_MS / 1000
    # Decode tok/s as the lab measures it cannot exceed 1 / delay.
    assert (TOKENS - 1) / seconds < 1000 / DELAY_MS


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_an_impossible_delay_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="--inject-step-delay-ms"):
        from_sources({"inject_step_delay_ms": value}, environ={})


@pytest.mark.gpu
def test_on_a_gpu_the_delay_lands_on_the_device_even_with_overlapped_decode() -> None:
    # A host sleep would hide behind the device while overlapped decode keeps a step queued;
    # the spin kernel cannot, so each step costs at least the delay.
    delay_ms = 2.0
    plain = LLM("dummy:tiny", device="cuda", overlap_decode="on", max_model_len=256)
    slowed = LLM("dummy:tiny", device="cuda", overlap_decode="on", inject_step_delay_ms=delay_ms, max_model_len=256)
    decode_seconds(plain), decode_seconds(slowed)  # compile and capture first
    base, _ = decode_seconds(plain)
    seconds, steps = decode_seconds(slowed)
    assert slowed.engine.counters.overlapped_steps > 0
    assert seconds - base >= 0.9 * (steps - 1) * delay_ms / 1000

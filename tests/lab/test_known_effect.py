"""The bundled engine's known-effect knob: `--inject-step-delay-ms` adds a documented cost to every
engine step with work, so a ladder can carry an arm with a true slowdown and measure its power."""

from __future__ import annotations

import time

import pytest
import torch

from lab.engine.core.config import ConfigError, from_sources
from lab.engine.core.known_cost import KnownCost
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.serve.llm import LLM

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
def test_on_a_gpu_the_delay_lands_on_the_device_where_a_host_sleep_would_hide() -> None:
    # Batch-1 decode of an 8B shape, overlapped: the device's step (about 4 ms) and the host's are
    # close, and which one sets the pace depends on the host's CPU. A host sleep alone hides in the
    # device's time; the knob's spin plus sleep adds the delay whichever is longer.
    delay_ms, tokens = 1.0, 64
    llm = LLM("dummy:llama3-8b", device="cuda", dtype="bfloat16", overlap_decode="on", max_model_len=512,
              cuda_graph_max_batch_size=1)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    def seconds(cost: KnownCost) -> float:
        llm.engine.known_cost = cost
        start = time.perf_counter()
        llm.generate([1, 2, 3, 4], params)
        return time.perf_counter() - start

    seconds(KnownCost(0, torch.device("cuda")))  # warm-up
    base = min(seconds(KnownCost(0, torch.device("cuda"))) for _ in range(3))
    spin = KnownCost(delay_ms, torch.device("cuda"))
    assert spin.cycles > 0
    spun = min(seconds(spin) for _ in range(3))
    slept = min(seconds(KnownCost(delay_ms, torch.device("cpu"))) for _ in range(3))
    assert llm.engine.counters.overlapped_steps > 0
    assert spun - base >= 0.9 * (tokens - 1) * delay_ms / 1000
    assert slept - base < 0.5 * (tokens - 1) * delay_ms / 1000

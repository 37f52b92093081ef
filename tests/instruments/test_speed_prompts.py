"""Prompts of the speed instruments: the exact-length search, salts and filler, and the estimate an
engine without `/tokenize` gets."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lab.instruments.base import BootContext
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.prefill import PrefillParams
from lab.instruments.prompts import (PromptTooShort, estimated_tokens, filler_words, fit, fit_prompt, request_salt,
                                     salt_line)
from lab.runner.mem_sampler import MemSampler
from lab.store.db import open_store
from lab.store.stored_rows import StoredRows
from tests.engine.server_process import free_port

STUB = Path(__file__).resolve().parents[1] / "lab" / "stub_engine.py"


def word_tokens(text: str) -> int:
    """A tokenizer with words of one to three tokens, so no word count lands on every target."""
    return sum(1 + len(word) // 5 for word in text.split())


@pytest.mark.parametrize("target", [20, 333, 1000, 4097])
def test_the_search_reaches_the_exact_count_in_a_few_probes(target: int) -> None:
    words = filler_words("seed", target)
    probes = []

    async def count(text: str) -> int:
        probes.append(text)
        return word_tokens(text)

    def render(k: int, tail: str) -> str:
        return f"{salt_line('0123456789ab')} {' '.join(words[:k])}{tail}"

    text, n = asyncio.run(fit(target, render, count, len(words)))
    assert n == word_tokens(text) == target
    assert text.startswith("Session 0123456789ab.")
    assert len(probes) <= 16


def test_a_target_below_the_fixed_part_is_refused() -> None:
    async def count(text: str) -> int:
        return word_tokens(text)

    with pytest.raises(PromptTooShort, match="holds 5 tokens before any filler, more than 3"):
        asyncio.run(fit(3, lambda k, tail: "Session 0123456789ab." + tail, count, 10))


def test_salts_and_filler_are_reproducible_and_differ_per_request() -> None:
    assert request_salt("boot", "prefill", 512, 0) == request_salt("boot", "prefill", 512, 0)
    salts = {request_salt("boot", "prefill", 512, r) for r in range(3)} | {request_salt("boot2", "prefill", 512, 0)}
    assert len(salts) == 4
    assert filler_words("a", 500) == filler_words("a", 500) != filler_words("b", 500)
    assert len(filler_words("a", 500)) == 500


@pytest.fixture
def stub_engine(tmp_path: Path) -> Iterator[str]:
    """An OpenAI server with no `/tokenize` and no context length in `/v1/models`."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(STUB), "--port", str(port), "--model", "stub"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{url}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(5)


def test_an_engine_without_tokenize_gets_an_estimated_length(stub_engine: str, tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "lab.db"))
    ctx = BootContext(base_url=stub_engine, api_base=f"{stub_engine}/v1", model="stub", api_key=None, run_id=1,
                      run_name="r", slot_id=1, boot_id=1, arm="A1", window="W1", role="arm", position="arm",
                      salt="s", engine_kind="command", params=PrefillParams(), stored=StoredRows(store),
                      control_boot_ids=[], mem=MemSampler(), log=logging.getLogger("test"))
    words = filler_words("seed", 1000)

    async def sized() -> tuple[object, int | None, bool]:
        async with EngineExtras(ctx) as extras:
            fitted = await fit_prompt(extras, 1000, lambda k, tail: " ".join(words[:k]) + tail, len(words))
            return fitted, await extras.max_model_len(), await extras.reset_prefix_cache()

    fitted, limit, reset = asyncio.run(sized())
    assert not fitted.exact and fitted.tokens == estimated_tokens(fitted.form) == 1000
    assert limit is None and reset is False
    store.close()

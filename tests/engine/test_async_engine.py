"""The engine thread behind the server: a request that fails in an unforeseen way is that
request's error, and the loop goes on serving the others."""

from __future__ import annotations

import asyncio

import pytest

from lab.engine.core.config import EngineConfig
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.serve.async_engine import AsyncEngine, build_engine


@pytest.fixture(scope="module")
def engine():
    return build_engine(EngineConfig(model="dummy:tiny", device="cpu", max_model_len=256, num_kv_blocks=64))


async def _collect(ae: AsyncEngine, rid: str, ids: list, params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in ae.generate(rid, ids, params):
        tokens += out.new_token_ids
    return tokens


def test_unexpected_error_in_one_request_leaves_the_loop_serving(engine) -> None:
    async def scenario() -> tuple[BaseException, list[int]]:
        ae = AsyncEngine(engine)
        ae.start(asyncio.get_running_loop())
        try:
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            # A token that is not an int fails a comparison inside the engine: a TypeError, which
            # is neither a bad-request nor a busy error.
            with pytest.raises(TypeError) as bad:
                await asyncio.wait_for(_collect(ae, "bad", [3, "x", 4], params), timeout=60)
            good = await asyncio.wait_for(_collect(ae, "good", [3, 4, 5], params), timeout=60)
            assert ae.alive
            return bad.value, good
        finally:
            ae.shutdown()

    _, good = asyncio.run(scenario())
    assert len(good) == 5
    assert engine.num_running == 0 and engine.num_waiting == 0
